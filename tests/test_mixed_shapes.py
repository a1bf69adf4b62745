"""Cached training on shapes no benchmark was tuned on: tables of mixed (and odd) dims, bags of lengths
that change every batch, per-sample weights, and batch sizes that change every step (so the prefetch's
padded sizes and its graphs change too). Cached and pipelined training equal serial training in HBM,
bit for bit, and leave no slot locked. The GPU tests run the benchmark's mixed shape at full size."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from tiered_tbe import CacheConfig, Placement, PrefetchPipeline, RowwiseAdagrad, TableSpec
from tiered_tbe.batch import CopyRows
from tiered_tbe.benchmarks.common import step_counters
from tiered_tbe.module import TieredEmbeddingBags


def ragged_batches(table_rows, dims, steps, batch_sizes, max_bag, device, seed=0):
    """``(indices, offsets, per_sample_weights, grad)`` per step: each step its own batch size, bags of
    0..max_bag lookups, rows skewed towards each table's first rows (a cubed uniform draw)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    batches = []
    for step in range(steps):
        batch_size = batch_sizes[step % len(batch_sizes)]
        lengths = torch.randint(0, max_bag + 1, (len(table_rows) * batch_size,), generator=generator, device=device)
        per_table = lengths.view(len(table_rows), batch_size).sum(1).tolist()
        indices = torch.cat([(torch.rand(n, generator=generator, device=device) ** 3 * rows).long()
                             for rows, n in zip(table_rows, per_table)])
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=device)
        offsets[1:] = lengths.cumsum(0)
        weights = torch.rand(indices.numel(), generator=generator, device=device)
        grad = torch.randn(batch_size, sum(dims), generator=generator, device=device)
        batches.append((indices, offsets, weights, grad))
    return batches


def train(module, batches, depth=0):
    source = PrefetchPipeline(module, batches, depth=depth, lookups=lambda b: (b[0], b[1])) if depth else batches
    for indices, offsets, weights, grad in source:
        module(indices, offsets, per_sample_weights=weights).backward(grad)
    if module.device.type == "cuda":
        torch.cuda.synchronize()
    # On the host: two runs of the GPU benchmark's shape hold 2 x 21 GiB of weights (managed tables clone
    # to device memory), beside the module training the second.
    return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}


def mixed_module(table_rows, dims, placements, device, cache=None, **kwargs):
    tables = [TableSpec(n, d, name=f"t{t}", placement=p)
              for t, (n, d, p) in enumerate(zip(table_rows, dims, placements))]
    return TieredEmbeddingBags(tables, optimizer=RowwiseAdagrad(lr=0.05), cache=cache, device=device, seed=1,
                               bounds_check="off", **kwargs)


@pytest.mark.parametrize("policy", ["lru", "lookahead"])
def test_mixed_dims_and_changing_batch_sizes_train_as_in_hbm(policy, device, one_simulated_thread):
    rows, dims = [50, 1, 37, 200], [3, 17, 8, 5]
    placements = [Placement.MANAGED_CACHED, Placement.MANAGED_CACHED, Placement.DEVICE, Placement.MANAGED_CACHED]
    batches = ragged_batches(rows, dims, steps=12, batch_sizes=[3, 1, 5, 2, 4], max_bag=6, device=device)
    expected = train(mixed_module(rows, dims, [Placement.DEVICE] * 4, device, backend="torch"), batches)
    for depth in (0, 2):
        cached = mixed_module(rows, dims, placements, device, backend="torch",
                              cache=CacheConfig(slots=8, associativity=4, policy=policy))
        got = train(cached, batches, depth)
        assert cached.cache.num_locked() == 0
        stats = cached.cache_stats()
        assert stats.evictions > 0 and stats.write_backs > 0
        for key in expected:
            assert torch.equal(got[key], expected[key]), f"depth {depth}: {key}"


# ---------------------------------------------------------------------------------------------- GPU

# The benchmark's mixed shape (tiered-tbe bench fbgemm's mixed configurations): 12 tables of dims 8 to 256,
# 64M rows in all, B = 16384, bags of 0-40 lookups with per-sample weights, 10% cache.
GPU_DIMS = [64, 8, 256, 32, 128, 16, 192, 48, 96, 24, 160, 128]
GPU_ROWS = [int(r * 1e6) for r in (15.5, 12, 9, 7, 5, 4, 3.5, 3, 2, 1.5, 1, 0.5)]


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["lru", "lfu-admit"])
def test_pipelined_equals_serial_on_the_mixed_benchmark_shape(policy):
    """Bit for bit, at the benchmark's size; `lfu-admit` reads most missed rows in place."""
    batches = ragged_batches(GPU_ROWS, GPU_DIMS, steps=10, batch_sizes=[16384, 16000, 16384, 15000], max_bag=40,
                             device="cuda")
    cache = CacheConfig(fraction=0.1, policy=policy)
    runs = []
    for depth in (0, 2):
        module = mixed_module(GPU_ROWS, GPU_DIMS, [Placement.MANAGED_CACHED] * 12, "cuda", cache=cache)
        runs.append(train(module, batches, depth))
        assert module.cache.num_locked() == 0
        del module
        torch.cuda.empty_cache()
    for key in runs[0]:
        assert torch.equal(runs[0][key], runs[1][key]), key


@pytest.mark.gpu
def test_no_slot_locked_after_an_exception_and_memory_flat_over_2000_steps():
    rows, dims = [r // 64 for r in GPU_ROWS], GPU_DIMS
    module = mixed_module(rows, dims, [Placement.MANAGED_CACHED] * 12, "cuda", cache=CacheConfig(fraction=0.1))
    batches = ragged_batches(rows, dims, steps=16, batch_sizes=[512, 480, 512, 300], max_bag=40, device="cuda")
    with pytest.raises(RuntimeError, match="stop"):
        for step, (indices, offsets, weights, grad) in enumerate(PrefetchPipeline(module, batches, depth=2,
                                                                                  lookups=lambda b: (b[0], b[1]))):
            module(indices, offsets, per_sample_weights=weights).backward(grad)
            if step == 5:
                raise RuntimeError("stop")
    torch.cuda.synchronize()
    assert module.cache.num_locked() == 0
    readings = {}
    for step in range(2000):
        indices, offsets, weights, grad = batches[step % len(batches)]
        module.prefetch(indices, offsets)
        module(indices, offsets, per_sample_weights=weights).backward(grad)
        if step in (199, 1999):
            torch.cuda.synchronize()
            with open("/proc/self/statm") as statm:  # resident pages now
                resident = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            readings[step] = (torch.cuda.memory_allocated(), resident)
    assert module.cache.num_locked() == 0
    (device_at_200, host_at_200), (device_at_2000, host_at_2000) = readings[199], readings[1999]
    assert device_at_2000 <= device_at_200 * 1.01 + (1 << 20), readings
    assert host_at_2000 <= host_at_200 * 1.02 + (64 << 20), readings


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["lru", "lookahead"])
def test_ragged_serial_steps_never_wait_for_the_device(policy):
    """The serial step of `bench fbgemm`'s ragged configurations (`cached-odd-dims-ragged`, its lookahead twin):
    8 tables of odd dims (several column groups), batch size and bag lengths drawn anew every step, per-sample
    weights, a prefetch before each forward (and, with lookahead, the hints of the next two batches). Once every
    batch's shapes have been seen, no step issues a synchronizing CUDA call (torch's sync debug mode): a sync
    would leave the GPU idle while the host enqueues the next step."""
    dims = [4, 12, 20, 36, 52, 76, 100, 132]
    rows = [r // 64 for r in GPU_ROWS[: len(dims)]]
    module = mixed_module(rows, dims, [Placement.MANAGED_CACHED] * len(dims), "cuda",
                          cache=CacheConfig(fraction=0.1, policy=policy))
    batches = ragged_batches(rows, dims, steps=12, batch_sizes=[512, 300, 448, 256], max_bag=30, device="cuda")

    def train_serially():
        for i, (indices, offsets, weights, grad) in enumerate(batches):
            if policy == "lookahead":
                module.hint_upcoming([module.rows_for_hint(*batch[:2])[0] for batch in batches[i + 1: i + 3]])
            module.prefetch(indices, offsets)
            module(indices, offsets, per_sample_weights=weights).backward(grad)

    # Every shape seen, the forward's tiles tuned (which times kernels), and more forwards than the readings
    # after which a cache that leaves no row in place stops keeping copies of them (a graph key of its own).
    for _ in range(-(-(CopyRows.QUIET_READINGS + 8) // len(batches))):
        train_serially()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        train_serially()  # every padded shape's graphs captured
        counters = step_counters(module, module.cache)
        before = counters()
        train_serially()  # the steady state: replays only, and no allocator call that waits for the device
        after = counters()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert module.cache.num_locked() == 0 and module.cache_stats().evictions > 0
    grew = {name: after[name] - before[name] for name in after}
    assert grew["graph_replays"] > 0, grew
    for name in ("graph_captures", "graph_eager_runs", "device_frees", "alloc_retries", "allocator_syncs"):
        assert grew[name] == 0, grew


@pytest.mark.gpu
def test_ragged_pipelined_steps_replay_graphs_only():
    """The pipelined step of `cached-odd-dims-ragged-pipelined` (depth 2): once every batch's shapes have been
    seen, every prefetch, forward and backward replays a graph. Its backward takes the dirty marks of the
    batch (its unlock is deferred) into its graph; they once read an array of the batch's own size, so on
    batches whose size changes every step the backward ran eagerly every step (H100, 5cdfaa5: one eager
    run a step, the pipelined step slower than the serial one).

    Three passes before the one counted: the first batch of the first pass is prefetched unpadded (the
    first size a prefetch is asked about counts as unchanged), and from the second pass on, after a batch of
    another size, padded: keys first seen in the second pass, captured in the third.

    No copies of rows read in place: a forward keeps them from a reading of the cache's counters that found
    rows left in place until ``CopyRows.QUIET_READINGS`` readings in a row found none, and when a reading
    lands on the host depends on the device's timing, so a batch may meet the other choice for the first
    time in any pass: a key of its own, run eagerly once (H100, aca1407: 2 eager runs in the fourth pass,
    no capture, when the choice was made reading by reading)."""
    dims = [4, 12, 20, 36, 52, 76, 100, 132]
    rows = [r // 64 for r in GPU_ROWS[: len(dims)]]
    module = mixed_module(rows, dims, [Placement.MANAGED_CACHED] * len(dims), "cuda",
                          cache=CacheConfig(fraction=0.1, in_place_copies=0))
    batches = ragged_batches(rows, dims, steps=12, batch_sizes=[512, 300, 448, 256], max_bag=30, device="cuda")
    for _ in range(3):  # every shape seen, its graphs captured, the first batch's padded ones too
        train(module, batches, depth=2)
    counters = step_counters(module, module.cache)
    before = counters()
    train(module, batches, depth=2)
    grew = {name: counters()[name] - before[name] for name in before}
    assert module.cache.num_locked() == 0
    assert grew["graph_replays"] > 0 and grew["graph_captures"] == 0 and grew["graph_eager_runs"] == 0, grew



@pytest.mark.gpu
@pytest.mark.parametrize("dims,max_bag", [([4, 12, 20, 36, 52, 76, 100, 132], 30), (GPU_DIMS, 40)],
                         ids=["odd-dims", "mixed-dims"])
def test_ragged_pipeline_stops_taking_memory(dims, max_bag):
    """2,000 pipelined steps (depth 2, ``lfu-admit``: rows read in place, and copies of them) on batches whose
    size and bag lengths change every step: once their shapes have been seen, the pipeline takes no more
    memory from CUDA and holds no more tensors. `bench fbgemm` counted 0.5 ``cudaMalloc`` a step over the 30
    timed steps of ``cached-odd-dims-ragged-lfu-admit-pipelined`` after its 60 warm-up steps (H100, c47ac55),
    and 3 a step for ``cached-mixed-weighted-lfu-admit-pipelined`` (68a8b37): were that for good, a long run
    would end out of memory. The odd dims of the first, and the 12 tables of dims 8-256 of the second."""
    rows = [r // 64 for r in GPU_ROWS[: len(dims)]]
    module = mixed_module(rows, dims, [Placement.MANAGED_CACHED] * len(dims), "cuda",
                          cache=CacheConfig(fraction=0.1, policy="lfu-admit"))
    sizes = torch.randint(256, 513, (64,), generator=torch.Generator().manual_seed(3)).tolist()
    batches = ragged_batches(rows, dims, steps=len(sizes), batch_sizes=sizes, max_bag=max_bag, device="cuda")
    readings = {}
    source = PrefetchPipeline(module, itertools.islice(itertools.cycle(batches), 2000), depth=2,
                              lookups=lambda batch: (batch[0], batch[1]))
    for step, (indices, offsets, weights, grad) in enumerate(source, start=1):
        module(indices, offsets, per_sample_weights=weights).backward(grad)
        if step in (1000, 2000):
            torch.cuda.synchronize()
            readings[step] = (torch.cuda.memory_reserved(), torch.cuda.memory_allocated())
    assert module.cache.num_locked() == 0
    (reserved_at_1000, allocated_at_1000), (reserved_at_2000, allocated_at_2000) = readings[1000], readings[2000]
    assert reserved_at_2000 <= reserved_at_1000 + (64 << 20), readings
    assert allocated_at_2000 <= allocated_at_1000 + (1 << 20), readings
