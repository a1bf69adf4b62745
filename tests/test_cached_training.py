"""Training through the slot cache equals training the same tables in place (issue 3).

Heavy eviction: a cache of 2 sets x 4 ways against batches with far more unique rows, and
some batches whose every lookup hashes into one set; two cached tables share the cache beside
an uncached one. Every optimizer, policy and row mover; the module's plain-torch backend
(the row math is not what is tested here, and the Triton interpreter would take minutes).
"""

from __future__ import annotations

import pytest
import torch

from tiered_tbe import SGD, Adam, CacheConfig, Placement, RowwiseAdagrad, TableSpec
from tiered_tbe.cache.policy import POLICIES, set_of_row_cpu
from tiered_tbe.module import TieredEmbeddingBags

STEPS = 50
BATCH_SIZE = 3
SPECS = [(40, 5, Placement.HOST_CACHED), (1, 3, Placement.MANAGED_CACHED), (30, 4, Placement.DEVICE)]


def tables(cached: bool):
    return [TableSpec(n, d, name=f"t{i}", placement=p if cached else Placement.DEVICE)
            for i, (n, d, p) in enumerate(SPECS)]


def batches(generator, num_sets):
    """Random TBE batches; every 5th puts every lookup of table 0 into one cache set."""
    same_set = [r for r in range(40) if set_of_row_cpu(r, num_sets) == 0]
    for step in range(STEPS):
        indices, lengths = [], []
        for t, (num_rows, _, _) in enumerate(SPECS):
            for _ in range(BATCH_SIZE):
                n = int(torch.randint(0, 5, (1,), generator=generator))
                if t == 0 and step % 5 == 0:
                    rows = torch.tensor(same_set)[torch.randint(0, len(same_set), (n,), generator=generator)]
                else:
                    rows = torch.randint(0, num_rows, (n,), generator=generator)
                indices.append(rows)
                lengths.append(n)
        yield torch.cat(indices).long(), torch.tensor([0] + lengths).cumsum(0)


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize(
    "optimizer, weights_dtype",
    [(SGD(lr=0.2), torch.float32), (RowwiseAdagrad(lr=0.1), torch.float32), (Adam(lr=0.02), torch.float32),
     (RowwiseAdagrad(lr=0.1), torch.float16)],
    ids=["sgd-fp32", "adagrad-fp32", "adam-fp32", "adagrad-fp16"],
)
def test_cached_training_equals_uncached(policy, optimizer, weights_dtype, mover, device, one_simulated_thread):
    _train_cached_and_plain(policy, optimizer, weights_dtype, mover, device, "raise")


def test_cached_training_without_bounds_checks_equals_uncached(mover, device, one_simulated_thread):
    """bounds_check="off" takes the global rows from the linearize kernel instead of torch ops."""
    _train_cached_and_plain("lru", RowwiseAdagrad(lr=0.1), torch.float32, mover, device, "off")


@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.float16], ids=str)
def test_cached_training_with_state_beside_rows_equals_uncached(weights_dtype, mover, device, one_simulated_thread):
    """The backing stores hold each row's state right after its weights (state_layout="with_rows"):
    the movers copy rows and state through the longer row strides."""
    _train_cached_and_plain("lru", Adam(lr=0.02), weights_dtype, mover, device, "off", state_layout="with_rows")


def _train_cached_and_plain(policy, optimizer, weights_dtype, mover, device, bounds_check, state_layout="separate",
                            expect=None):
    config = CacheConfig(slots=8, associativity=4, policy=policy, lfu_decay_interval=7, mover=mover, staging_rows=2)
    cached = TieredEmbeddingBags(tables(True), optimizer=optimizer, weights_dtype=weights_dtype, cache=config,
                                 device=device, backend="torch", bounds_check=bounds_check, state_layout=state_layout)
    plain = TieredEmbeddingBags(tables(False), optimizer=optimizer, weights_dtype=weights_dtype, device=device,
                                backend="torch")
    assert cached.cache.mover.name == mover
    assert expect is None or expect(cached)
    generator = torch.Generator().manual_seed(5)
    steps = [(i.to(device), o.to(device)) for i, o in batches(generator, cached.cache.num_sets)]
    for step, (indices, offsets) in enumerate(steps):
        if POLICIES[policy].reads_window:  # the next three batches' rows, as a pipeline would hint them
            cached.hint_upcoming([cached.rows_for_hint(*later)[0] for later in steps[step + 1: step + 4]])
        a, b = cached(indices, offsets), plain(indices, offsets)
        assert torch.equal(a, b)
        grad = torch.randn(a.shape, generator=generator).to(device)
        a.backward(grad)
        b.backward(grad)
    stats = cached.cache_stats()
    assert stats.evictions > 0 and stats.write_backs > 0 and stats.misses_no_slot > 0
    assert cached.cache.num_locked() == 0
    for t in range(len(SPECS)):
        assert torch.equal(cached.table(t), plain.table(t)), f"table {t}"
    cached_state, plain_state = cached.state_dict(), plain.state_dict()
    assert all(torch.equal(cached_state[k], plain_state[k]) for k in plain_state)


def test_bad_batch_prefetched_ahead_raises_at_its_forward_and_leaves_nothing_behind(device):
    """A prefetch queues the value checks without a host sync; the verdict is read at the
    batch's forward, which raises, releases the batch's locks and changes no table."""
    module = TieredEmbeddingBags(tables(True), optimizer=SGD(lr=0.5), device=device,
                                 cache=CacheConfig(slots=8, associativity=4))
    good = (torch.tensor([0, 1, 0]), torch.tensor([0, 1, 2, 2, 3, 3, 3, 3, 3, 3]))
    bad = (torch.tensor([0, 40, 0]), torch.tensor([0, 1, 2, 2, 3, 3, 3, 3, 3, 3]))
    before = {k: v.clone() for k, v in module.state_dict().items()}
    module.prefetch(*bad)
    module.prefetch(*good)
    with pytest.raises(ValueError, match=r"table 0 \('t0'\): index 40 at position 1 is out of range \[0, 40\)"):
        module(*bad)
    assert module.cache.num_locked() > 0  # only the good batch's rows
    with torch.no_grad():
        module(*good)
    assert module.cache.num_locked() == 0
    after = module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_the_mover_comes_from_the_config_or_the_placement_table(device, monkeypatch):
    from tiered_tbe.cache import mover

    with pytest.raises(ValueError, match="mover must be one of"):
        CacheConfig(mover="dma")
    with pytest.raises(ValueError, match="staging_rows must be a whole number >= 1"):
        CacheConfig(staging_rows=0)
    with pytest.raises(ValueError, match="mover_threads must be a whole number >= 1"):
        CacheConfig(mover_threads=True)

    def module(**config):
        return TieredEmbeddingBags(tables(True), optimizer=SGD(lr=0.1), device=device, backend="torch",
                                   cache=CacheConfig(slots=8, associativity=4, **config))

    assert module().cache.mover.name == "zero_copy"  # the table's default for HOST_CACHED and MANAGED_CACHED
    staged = module(mover="staged", staging_rows=3, mover_threads=1)
    assert (staged.cache.mover.name, staged.cache.mover.staging_rows, staged.cache.mover.threads) == ("staged", 3, 1)
    monkeypatch.setitem(mover.DEFAULT_MOVER, Placement.HOST_CACHED, "staged")
    assert module().cache.mover.name == "zero_copy"  # MANAGED_CACHED's default still says zero_copy
    monkeypatch.setitem(mover.DEFAULT_MOVER, Placement.MANAGED_CACHED, "staged")
    assert module().cache.mover.name == "staged"
    assert module(mover="zero_copy").cache.mover.name == "zero_copy"


@pytest.mark.parametrize("bounds_check", ["raise", "off"])
def test_every_table_cached_backward_takes_the_prefetch_sort(bounds_check, device, one_simulated_thread, monkeypatch):
    """With every table cached, the prefetch's stable sort of the lookups is the backward's: the
    backward groups the lookups from it instead of sorting again, and trains bit for bit as it
    does with its own sort (Triton kernels, heavy eviction, rows repeated within and across bags).
    With a table outside the cache, the prefetch's keys are not the rows, and the backward sorts."""
    from tiered_tbe.kernels import backward

    given = []
    sort_lookups = backward.sort_lookups

    def recording(stores, lookups, presorted=None, need_order=True, padded=False):
        given.append(presorted is not None)
        return sort_lookups(stores, lookups, presorted, need_order, padded)

    monkeypatch.setattr(backward, "sort_lookups", recording)
    specs = [TableSpec(40, 5, name="a", placement=Placement.HOST_CACHED),
             TableSpec(6, 3, name="b", placement=Placement.MANAGED_CACHED)]

    def module():
        return TieredEmbeddingBags(specs, optimizer=Adam(lr=0.05), device=device, bounds_check=bounds_check,
                                   cache=CacheConfig(slots=8, associativity=4, policy="lru"))

    reusing, sorting = module(), module()
    sorting._every_table_cached = False  # the backward's own sort
    generator = torch.Generator().manual_seed(3)
    for step in range(6):
        lengths = torch.randint(0, 7, (2 * BATCH_SIZE,), generator=generator)
        lengths[step % 6] = 0  # an empty bag
        indices = torch.cat([torch.randint(0, (40, 6)[bag // BATCH_SIZE], (int(n),), generator=generator)
                             for bag, n in enumerate(lengths)])
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        indices, offsets = indices.to(device), offsets.to(device)
        given.clear()
        a, b = reusing(indices, offsets), sorting(indices, offsets)
        assert torch.equal(a, b)
        grad = torch.randn(a.shape, generator=generator).to(device)
        a.backward(grad)
        b.backward(grad)
        assert given == [True, False]
    assert reusing.cache_stats().evictions > 0
    reusing_state, sorting_state = reusing.state_dict(), sorting.state_dict()
    assert all(torch.equal(reusing_state[k], sorting_state[k]) for k in sorting_state)

    mixed = TieredEmbeddingBags([specs[0], TableSpec(6, 3, name="b")], optimizer=SGD(lr=0.1), device=device,
                                bounds_check=bounds_check, cache=CacheConfig(slots=8, associativity=4))
    given.clear()
    mixed(torch.tensor([1, 2, 3], device=device), torch.tensor([0, 1, 2, 2, 3, 3, 3], device=device)).sum().backward()
    assert given == [False]


@pytest.mark.parametrize("fused", [True, False], ids=["one-launch", "two-launches"])
@pytest.mark.parametrize("optimizer", [RowwiseAdagrad(lr=0.1), Adam(lr=0.02)], ids=["adagrad", "adam"])
def test_cached_training_in_one_buffer_equals_uncached(fused, optimizer, device, one_simulated_thread, monkeypatch):
    """With the cached tables in one buffer (both in pinned memory) the zero-copy mover moves a prefetch's
    rows in one launch (each warp writes its slot's dirty victim back, then fills it:
    cache/_kernels.move_rows_kernel; the default) or two (TIERED_TBE_FUSED_MOVES=0): both train as
    uncached tables do. Tables in two buffers always take two launches (the tests above)."""
    from tiered_tbe.cache import zero_copy

    monkeypatch.setattr(zero_copy, "DEFAULT_FUSED_MOVES", fused)
    monkeypatch.setitem(globals(), "SPECS", [(40, 5, Placement.HOST_CACHED), (1, 3, Placement.HOST_CACHED),
                                             (30, 4, Placement.DEVICE)])
    _train_cached_and_plain("lru", optimizer, torch.float32, "zero_copy", device, "off",
                            expect=lambda cached: cached.cache.mover.fused_moves == fused
                            and len(cached.cache.mover._copy_groups) == 1)
