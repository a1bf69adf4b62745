"""Module-level GPU checks (run on the lent H200 by benchmarks/gpu_suite.sh): every placement
trains identically, runs repeat bitwise, and the side-stream pipeline equals serial training at
a size where streams really overlap."""

from __future__ import annotations

import pytest
import torch

from tiered_tbe import SGD, Adam, CacheConfig, Placement, PrefetchPipeline, RowwiseAdagrad, TableSpec
from tiered_tbe.module import TieredEmbeddingBags

pytestmark = pytest.mark.gpu

ROWS, DIM, BATCH, BAG = 200_000, 64, 4096, 8


def zipf_batches(steps: int, num_tables: int, seed: int = 0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    ranks = torch.arange(1, ROWS + 1, device="cuda", dtype=torch.float64)
    cdf = (ranks ** -1.05).cumsum(0)
    cdf /= cdf[-1].clone()
    batches = []
    for _ in range(steps):
        uniform = torch.rand(num_tables * BATCH * BAG, generator=generator, device="cuda", dtype=torch.float64)
        indices = torch.searchsorted(cdf, uniform).clamp_(max=ROWS - 1)
        offsets = torch.arange(0, num_tables * BATCH * BAG + 1, BAG, device="cuda")
        grad = torch.randn(BATCH, num_tables * DIM, generator=generator, device="cuda")
        batches.append((indices, offsets, grad))
    return batches


def make(placement: Placement, optimizer, policy: str = "lru") -> TieredEmbeddingBags:
    tables = [TableSpec(ROWS, DIM, name=f"t{i}", placement=placement) for i in range(2)]
    cache = CacheConfig(fraction=0.02, policy=policy) if placement.is_cached else None
    return TieredEmbeddingBags(tables, optimizer=optimizer, cache=cache, device="cuda", seed=3, bounds_check="off")


def train(module, batches, depth: int = 0):
    source = PrefetchPipeline(module, batches, depth=depth) if depth else batches
    for indices, offsets, grad in source:
        module(indices, offsets).backward(grad)
    torch.cuda.synchronize()
    return {k: v.clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("optimizer", [SGD(lr=0.1), RowwiseAdagrad(lr=0.05), Adam(lr=0.01)],
                         ids=lambda o: type(o).__name__)
def test_every_placement_trains_identically(optimizer):
    batches = zipf_batches(20, 2)
    expected = train(make(Placement.DEVICE, optimizer), batches)
    for placement in (Placement.HOST, Placement.MANAGED, Placement.HOST_CACHED, Placement.MANAGED_CACHED):
        got = train(make(placement, optimizer), batches)
        for key in expected:
            assert torch.equal(got[key], expected[key]), f"{placement.value}: {key}"


@pytest.mark.parametrize("policy", ["lru", "lookahead"])
def test_pipelined_equals_serial_on_side_stream(policy):
    batches = zipf_batches(40, 2, seed=1)
    expected = train(make(Placement.HOST_CACHED, SGD(lr=0.1), policy), batches)
    for depth in (1, 2, 4):
        module = make(Placement.HOST_CACHED, SGD(lr=0.1), policy)
        got = train(module, batches, depth)
        assert module.cache.num_locked() == 0
        stats = module.cache_stats()
        # ~40K distinct rows a batch against 8K slots: sets fill with locked rows, and rows left
        # in the backing store must stay out of the cache while their batch is in flight.
        assert stats.evictions > 0 and stats.misses_no_slot > 0
        for key in expected:
            assert torch.equal(got[key], expected[key]), f"depth {depth}: {key}"


@pytest.mark.parametrize("policy", ["lru", "lookahead"])
def test_pipelined_equals_serial_at_benchmark_size(policy):
    """The benchmark's tables (26 Criteo Kaggle tables, 33.8M rows x 128 fp32 in pinned memory,
    row-wise Adagrad, B = 65536, a cache of 5% of the rows), 12 steps at Zipf 1.05: the
    pipeline (depth 2, side stream, high-priority steps) trains bitwise like serial training."""
    from tiered_tbe.benchmarks.common import ZipfBatches
    from tiered_tbe.traces import CRITEO_KAGGLE_TABLE_ROWS

    def build():
        tables = [TableSpec(n, 128, name=f"C{t + 1}", placement=Placement.HOST_CACHED)
                  for t, n in enumerate(CRITEO_KAGGLE_TABLE_ROWS)]
        return TieredEmbeddingBags(tables, optimizer=RowwiseAdagrad(lr=0.05), device="cuda", seed=3,
                                   cache=CacheConfig(fraction=0.05, policy=policy), bounds_check="off")

    lookups = ZipfBatches(CRITEO_KAGGLE_TABLE_ROWS, 1.05, 65536, 1, "cuda", seed=7)
    generator = torch.Generator(device="cuda").manual_seed(8)
    batches = [(*lookups.next(), torch.randn(65536, 26 * 128, device="cuda", generator=generator))
               for _ in range(12)]
    serial = build()
    for indices, offsets, grad in batches:
        serial(indices, offsets).backward(grad)
    pipelined = build()
    for indices, offsets, grad in PrefetchPipeline(pipelined, batches, depth=2):
        pipelined(indices, offsets).backward(grad)
    torch.cuda.synchronize()
    assert pipelined.cache.num_locked() == 0 and pipelined.cache_stats().evictions > 0
    for t in range(len(CRITEO_KAGGLE_TABLE_ROWS)):
        assert torch.equal(pipelined.table(t), serial.table(t)), f"table {t}"
        assert torch.equal(pipelined.storage.state(t), serial.storage.state(t)), f"table {t} state"
