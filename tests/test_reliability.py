"""Every failure path leaves the cache clean.

Bad per-sample weights, malformed batches prefetched ahead and non-finite gradients each raise a
ValueError that names what was wrong, and leave no lock held, no row changed and no queued batch
lost; earlier good batches still train. The cache math is not under test here, so the modules run
the plain-torch backend on a tiny cache (one simulated thread per cache kernel).
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from torch import nn

from tiered_tbe import CacheConfig, Placement, PrefetchPipeline, RowwiseAdagrad, TableSpec, default_device
from tiered_tbe.cache.policy import POLICIES
from tiered_tbe.module import TieredEmbeddingBags

BATCH_SIZE = 2
DEVICE = default_device()  # the module's: cuda on a GPU, cpu in simulation


def make_module(policy: str = "lru", **kwargs) -> TieredEmbeddingBags:
    tables = [TableSpec(40, 4, name="big", placement=Placement.HOST_CACHED), TableSpec(6, 3, name="small")]
    return TieredEmbeddingBags(tables, optimizer=RowwiseAdagrad(lr=0.2), backend="torch", seed=3,
                               cache=CacheConfig(slots=8, associativity=4, policy=policy), **kwargs)


def batch(seed: int, lookups_per_bag: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """A good batch: every bag holds ``lookups_per_bag`` rows, repeats allowed."""
    generator = torch.Generator().manual_seed(seed)
    big = torch.randint(0, 40, (BATCH_SIZE * lookups_per_bag,), generator=generator)
    small = torch.randint(0, 6, (BATCH_SIZE * lookups_per_bag,), generator=generator)
    offsets = torch.arange(0, 2 * BATCH_SIZE * lookups_per_bag + 1, lookups_per_bag)
    return torch.cat([big, small]).to(DEVICE), offsets.to(DEVICE)


def grad_of(seed: int) -> torch.Tensor:
    return torch.randn(BATCH_SIZE, 7, generator=torch.Generator().manual_seed(100 + seed)).to(DEVICE)


def state(module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.state_dict().items()}


def assert_clean(module) -> None:
    """No slot locked, no row barred from the cache, no batch queued."""
    assert module.cache.num_locked() == 0, f"{module.cache.num_locked()} slots still locked"
    assert int(module.cache.bypass_count.sum()) == 0, "rows still barred from the cache"
    assert not module._prefetched


BAD_WEIGHTS = {
    "too short": (lambda n: torch.ones(n - 1, device=DEVICE), r"per_sample_weights has shape \(7,\), expected \(8,\)"),
    "integers": (lambda n: torch.ones(n, dtype=torch.int64, device=DEVICE), "must be a floating-point tensor"),
    "2-D": (lambda n: torch.ones(n, 1, device=DEVICE), r"per_sample_weights has shape \(8, 1\)"),
    "other device": (lambda n: torch.ones(n, device="meta"), "per_sample_weights is on meta"),
}


@pytest.mark.parametrize("kind", BAD_WEIGHTS)
def test_bad_per_sample_weights_lock_nothing(kind, one_simulated_thread):
    make_weights, message = BAD_WEIGHTS[kind]
    module = make_module()
    indices, offsets = batch(0)
    before = state(module)
    for _ in range(2):  # two bad calls used to lock every slot of the cache
        with pytest.raises(ValueError, match=message):
            module(indices, offsets, make_weights(indices.numel()))
        assert_clean(module)
    after = state(module)
    assert all(torch.equal(before[k], after[k]) for k in before)
    module.load_state_dict(after)  # refused while batches were in flight
    for step in range(3):  # later batches get hits again
        module(indices, offsets, torch.rand(indices.numel(), device=DEVICE)).backward(grad_of(step))
    assert module.cache_stats().unique_hits > 0
    assert_clean(module)


def train(module, batches, start: int = 0) -> None:
    for step, (indices, offsets) in enumerate(batches, start):
        module(indices, offsets).backward(grad_of(step))


# A batch whose forward fails after its prefetch: (make the forward's arguments from a good batch, message).
FAILED_FORWARDS = {
    "offsets end short": (lambda i, o: (i, torch.tensor(MALFORMED_OFFSETS, device=DEVICE), None),
                          r"offsets\[-1\] must equal len\(indices\) = 8, got 6"),
    "index out of range": (lambda i, o: (torch.cat([i[:-1], i[-1:] + 6]), o, None),
                           r"table 1 \('small'\): index \d+ at position 7 is out of range \[0, 6\)"),
    "weights too short": (lambda i, o: (i, o, torch.ones(i.numel() - 1, device=DEVICE)),
                          r"per_sample_weights has shape \(7,\), expected \(8,\)"),
    "weights float64": (lambda i, o: (i, o, torch.ones(i.numel(), dtype=torch.float64, device=DEVICE)),
                        "per_sample_weights must be float32, got torch.float64"),
}
MALFORMED_OFFSETS = [0, 2, 4, 5, 6]


@pytest.mark.parametrize("kind", FAILED_FORWARDS)
def test_a_prefetched_batch_whose_forward_fails_releases_its_slots(kind, one_simulated_thread):
    """The forward raises, and its prefetch is gone with it: no slot stays locked, later batches
    hit, load_state_dict works, and training ends as if the bad batch had never come."""
    make_arguments, message = FAILED_FORWARDS[kind]
    good = [batch(seed) for seed in range(4)]
    never_saw_it, saw_it = make_module(), make_module()
    train(never_saw_it, good)

    train(saw_it, good[:1])
    indices, offsets, weights = make_arguments(*batch(7))
    saw_it.prefetch(indices, offsets)
    assert saw_it.cache.num_locked() > 0
    with pytest.raises(ValueError, match=message):
        saw_it(indices, offsets, weights)
    assert_clean(saw_it)
    saw_it.load_state_dict(state(saw_it))  # refused for good before
    hits = saw_it.cache_stats().unique_hits
    for step, (indices, offsets) in enumerate(good[1:], 1):
        saw_it.prefetch(indices, offsets)
        saw_it(indices, offsets).backward(grad_of(step))
    assert saw_it.cache_stats().unique_hits > hits, "later batches hit"
    assert_clean(saw_it)
    expected, got = state(never_saw_it), state(saw_it)
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_load_state_dict_with_batches_in_flight_names_the_remedy(one_simulated_thread):
    module = make_module()
    for seed in (0, 1):
        module.prefetch(*batch(seed))
    locked = module.cache.num_locked()
    with pytest.raises(RuntimeError, match=rf"2 batches prefetched and not forwarded, {locked} cache slots locked"
                                           r".*cancel_prefetched\(\)"):
        module.load_state_dict(state(module))
    module.cancel_prefetched()
    module.load_state_dict(state(module))

    out = module(*batch(2))  # forwarded, its backward to come
    with pytest.raises(RuntimeError, match=r"0 batches prefetched and not forwarded, \d+ cache slots locked.*backward"):
        module.load_state_dict(state(module))
    out.backward(grad_of(2))
    module.load_state_dict(state(module))
    assert_clean(module)


def test_bad_per_sample_weights_inside_a_pipeline_leave_no_lock(one_simulated_thread):
    module = make_module()
    batches = [batch(seed) for seed in range(5)]
    with pytest.raises(ValueError, match="per_sample_weights has shape"):
        for step, (indices, offsets) in enumerate(PrefetchPipeline(module, batches, depth=2)):
            weights = torch.rand(indices.numel() - (step == 2), device=DEVICE)  # step 2's: one short
            module(indices, offsets, weights).backward(grad_of(step))
    assert_clean(module)
    module.load_state_dict(state(module))


MALFORMED = {  # (offsets of a batch of 8 lookups, 2 tables x 2 bags, message at its forward)
    "ends short": ([0, 2, 4, 5, 6], r"offsets\[-1\] must equal len\(indices\) = 8, got 6"),
    "ends past": ([0, 2, 4, 6, 9], r"offsets\[-1\] must equal len\(indices\) = 8, got 9"),
    "starts late": ([3, 4, 5, 6, 8], r"offsets\[0\] must be 0, got 3"),
    "decreasing": ([0, 5, 2, 6, 8], r"offsets\[2\] = 2 < offsets\[1\] = 5 \(table 0 \('big'\), bag 1\)"),
}


@pytest.mark.parametrize("kind", MALFORMED)
def test_a_malformed_prefetched_batch_raises_at_its_forward(kind, one_simulated_thread):
    offsets, message = MALFORMED[kind]
    module = make_module()
    indices = batch(2)[0]
    before = state(module)
    module.prefetch(indices, torch.tensor(offsets, device=DEVICE))  # used to raise IndexError here
    with pytest.raises(ValueError, match=message):
        module(indices, module._prefetched[0][1])
    assert_clean(module)
    after = state(module)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_malformed_batch_in_a_pipeline_raises_after_the_good_ones_trained(one_simulated_thread):
    good = [batch(seed) for seed in range(3)]
    bad = (batch(9)[0], torch.tensor(MALFORMED["ends short"][0], device=DEVICE))
    serial = make_module()
    for step, (indices, offsets) in enumerate(good):
        serial(indices, offsets).backward(grad_of(step))

    pipelined = make_module()
    trained = 0
    with pytest.raises(ValueError, match=MALFORMED["ends short"][1]):
        for step, (indices, offsets) in enumerate(PrefetchPipeline(pipelined, [*good, bad, batch(4)], depth=2)):
            pipelined(indices, offsets).backward(grad_of(step))
            trained += 1
    assert trained == len(good)
    assert_clean(pipelined)
    expected, got = state(serial), state(pipelined)
    assert all(torch.equal(got[k], expected[k]) for k in expected), "the good batches trained as in serial"


def two_modules(policy: str = "lru") -> nn.Module:
    model = nn.Module()
    model.first, model.second = make_module(policy=policy), make_module(policy=policy)
    return model


def lookups_of_both(batch):
    return {"first": batch, "second": batch}


def serial_without(skipped: set[int], batches) -> nn.Module:
    model = two_modules()
    for step, (indices, offsets) in enumerate(batches):
        if step not in skipped:
            for module in model.children():
                module(indices, offsets).backward(grad_of(step))
    return model


def assert_same_tables(a: nn.Module, b: nn.Module) -> None:
    expected, got = state(a), state(b)
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_a_pipeline_step_that_fails_before_its_forward_drops_the_batch(one_simulated_thread):
    """The user's step raises before the tiered forward (a dense part, a data check) and the loop
    goes on: the batch prefetched for it is dropped at the next step, its slots released, and
    the next batches train as if it had never come."""
    batches = [batch(seed) for seed in range(6)]
    model = two_modules()
    pipeline = PrefetchPipeline(model, batches, depth=2, lookups=lookups_of_both)
    for step, (indices, offsets) in enumerate(pipeline):
        try:
            if step in (1, 2):
                raise RuntimeError("the dense part failed")
            for module in model.children():
                module(indices, offsets).backward(grad_of(step))
        except RuntimeError:
            continue
    for module in model.children():
        assert_clean(module)
    assert_same_tables(model, serial_without({1, 2}, batches))


def raise_at(position: int, batches, error: Exception):
    for i, item in enumerate(batches):
        if i == position:
            raise error
        yield item


# An error met while the pipeline reads or prefetches ahead, at batch 3 of 6: (batches, lookups, message).
def _raise(error: Exception):
    raise error


def _third(batches):
    return lambda x: x[0] is batches[3][0]


AHEAD = {
    "the batches raise": (lambda b: raise_at(3, b, OSError("disk gone")), lambda b: lookups_of_both, "disk gone"),
    "lookups raise": (lambda b: b, lambda b: lambda x: lookups_of_both(x) if not _third(b)(x) else _raise(
        KeyError("no lookups")), "no lookups"),
    "offsets of a wrong length": (
        lambda b: b, lambda b: lambda x: {"first": x, "second": (x[0], x[1][:-1]) if _third(b)(x) else x},
        r"offsets has 4 entries; FBGEMM's TBE layout needs T\*B\+1"),
}


@pytest.mark.parametrize("kind", AHEAD)
@pytest.mark.parametrize("policy", ["lru", "lookahead"])
def test_an_error_met_ahead_is_raised_after_the_batches_before_it_trained(kind, policy, one_simulated_thread):
    """A serial loop would train batches 0..2 and then fail at batch 3: so does the pipeline,
    though it met the error up to ``depth`` (and the lookahead window) batches early; every lock of
    the batches prefetched ahead is released."""
    make_batches, make_lookups, message = AHEAD[kind]
    batches = [batch(seed) for seed in range(6)]
    model = two_modules(policy)
    trained = []
    with pytest.raises(Exception, match=message):
        pipeline = PrefetchPipeline(model, make_batches(batches), depth=2, lookups=make_lookups(batches))
        for step, (indices, offsets) in enumerate(pipeline):
            for module in model.children():
                module(indices, offsets).backward(grad_of(step))
            trained.append(step)
    assert trained == [0, 1, 2]
    for module in model.children():
        assert_clean(module)
        module.load_state_dict(state(module))
    assert_same_tables(model, serial_without({3, 4, 5}, batches))


def test_a_consumer_that_raises_out_of_a_bare_loop_leaves_no_lock(one_simulated_thread):
    model = two_modules()
    batches = [batch(seed) for seed in range(6)]
    with pytest.raises(RuntimeError, match="boom"):
        for step, (indices, offsets) in enumerate(PrefetchPipeline(model, batches, depth=3, lookups=lookups_of_both)):
            if step == 1:
                raise RuntimeError("boom")
            for module in model.children():
                module(indices, offsets).backward(grad_of(step))
    gc.collect()  # the loop's generator is closed when dropped (at once in CPython)
    for module in model.children():
        assert_clean(module)
    assert_same_tables(model, serial_without({1, 2, 3, 4, 5}, batches))


@pytest.mark.parametrize("where", ["gradient", "per_sample_weights"])
@pytest.mark.parametrize("bad_value", [float("nan"), float("inf")])
def test_nan_check_refuses_the_update_and_names_the_culprit(where, bad_value, one_simulated_thread):
    module = make_module(nan_check="raise")
    indices, offsets = batch(5)
    module(indices, offsets).backward(grad_of(0))  # a good step first: rows cached and dirty
    before = state(module)
    weights, grad = torch.rand(indices.numel(), device=DEVICE), grad_of(1)
    if where == "gradient":
        grad[1, 5] = bad_value  # column 5: table 'small' (columns 4..6)
        message = (r"gradient of the output has 1 NaN/inf values, "
                   r"the first at \[1, 5\] \(table 1 \('small'\), sample 1\)")
    else:
        weights[2] = bad_value  # lookup 2: table 'big'
        message = r"per_sample_weights has 1 NaN/inf values, the first at position 2 \(table 0 \('big'\)\)"
    out = module(indices, offsets, weights)
    with pytest.raises(ValueError, match=message):
        out.backward(grad)
    assert_clean(module)
    after = state(module)
    assert all(torch.equal(before[k], after[k]) for k in before), "a refused update changes no row"
    module(indices, offsets).backward(grad_of(2))  # training goes on
    assert all(torch.isfinite(v).all() for v in state(module).values())
    assert_clean(module)


def test_without_nan_check_a_nan_reaches_the_rows_it_touches(one_simulated_thread):
    module = make_module()
    indices, offsets = batch(6)
    grad = grad_of(0)
    grad[0, 0] = float("nan")
    module(indices, offsets).backward(grad)
    assert not torch.isfinite(module.table(0)).all()  # the documented cost of nan_check="off"
    with pytest.raises(ValueError, match="nan_check must be one of"):
        make_module(nan_check="warn")


@pytest.mark.parametrize("config, message", [
    (dict(slots=0), "slots must be a whole number >= 1, got 0"),
    (dict(slots=-5), "slots must be a whole number >= 1, got -5"),
    (dict(slots=2.5), "slots must be a whole number >= 1, got 2.5"),
    (dict(memory="0B"), "memory must be at least one slot's worth of bytes, got '0B'"),
    (dict(memory=-1), "memory must be at least one slot's worth"),
    (dict(memory="lots"), "cannot read 'lots' as a size in bytes"),
    (dict(fraction=0), r"fraction must be in \(0, 1\], got 0"),
    (dict(policy="mru"), f"policy must be one of {', '.join(map(repr, POLICIES))}, got 'mru'"),
    (dict(associativity=0), "associativity must be a whole number >= 1, got 0"),
    (dict(associativity=65), "associativity must be at most 64 ways a set, got 65"),
])
def test_cache_configs_that_hold_nothing_are_refused(config, message):
    with pytest.raises(ValueError, match=message):
        CacheConfig(**config)


def test_a_memory_smaller_than_one_slot_is_refused_at_construction():
    tables = [TableSpec(40, 4, placement=Placement.HOST_CACHED)]
    with pytest.raises(ValueError, match=r"memory='20B' holds no slot: a slot takes 54 bytes"):
        TieredEmbeddingBags(tables, optimizer=RowwiseAdagrad(), cache=CacheConfig(memory="20B"))
    # One slot's worth is a cache: rounded up to one whole set.
    module = TieredEmbeddingBags(tables, optimizer=RowwiseAdagrad(), cache=CacheConfig(memory=54, associativity=4))
    assert module.cache.num_slots == 4


@pytest.mark.parametrize("rows, dim", [(2.5, 4), (4, 2.0), (True, 4), ("8", 4), (0, 4), (4, -1)])
def test_table_sizes_must_be_whole_numbers(rows, dim):
    with pytest.raises(ValueError, match="must be a whole number >= 1"):
        TableSpec(rows, dim, name="t")
    assert TableSpec(np.int64(5), 3).num_embeddings == 5  # numpy integers are whole numbers


def test_repair_batch_puts_offsets_in_order_and_bad_indices_on_row_zero():
    """bounds_check="warn"'s repair (FBGEMM's WARNING): offsets clamped into [0, N], starting at 0, ending
    at N, never decreasing; an index outside its feature's table becomes 0; each change counted."""
    from tiered_tbe.validation import repair_indices, repair_offsets

    module = make_module(bounds_check="warn")  # tables of 40 and 6 rows
    indices = torch.tensor([5, -1, 2, 40, 0, 3], device=DEVICE)
    offsets = torch.tensor([2, 1, 4, 3, 9], device=DEVICE)  # F=2 features, B=2 bags each
    fixed_offsets, offset_repairs = repair_offsets(offsets, indices.numel())
    bag = module._bag_of_index(indices, fixed_offsets)
    feature = module._feature_of_index(bag, batch_size=2)
    fixed_indices, index_repairs = repair_indices(indices, feature, module._num_rows_of_feature)
    repairs = offset_repairs + index_repairs
    assert fixed_offsets.tolist() == [0, 1, 4, 4, 6]  # 2 -> 0, 3 -> 4 (order), 9 -> 6: three offsets
    assert bag.tolist() == [0, 1, 1, 1, 3, 3] and feature.tolist() == [0, 0, 0, 0, 1, 1]
    assert fixed_indices.tolist() == [5, 0, 2, 0, 0, 3]  # -1 and 40 (table 0 has 40 rows) -> 0
    assert int(repairs) == 3 + 2


@pytest.mark.parametrize("ahead", [False, True], ids=["serial", "prefetched ahead"])
def test_bounds_check_warn_trains_the_repaired_batch_without_raising(ahead, one_simulated_thread):
    """bounds_check="warn" (FBGEMM's default mode, what the TorchRec sharder maps it to) trains a malformed
    batch as its repair, exactly as a checked module trains the repaired batch; counts the repairs;
    leaves no lock; good batches are untouched."""
    warned, checked = make_module(bounds_check="warn"), make_module()
    good_indices, good_offsets = batch(4)
    bad_indices = good_indices.clone()
    bad_indices[1], bad_indices[6] = 40, -3  # out of table 0 ("big", 40 rows) and of table 1
    bad_offsets = torch.tensor([0, 5, 4, 6, 8], device=DEVICE)  # decreasing: repaired to [0, 5, 5, 6, 8]
    repaired_indices = bad_indices.clone()
    repaired_indices[1], repaired_indices[6] = 0, 0
    repaired_offsets = torch.tensor([0, 5, 5, 6, 8], device=DEVICE)
    outputs = []
    for step, (module, indices, offsets) in enumerate(((warned, good_indices, good_offsets),
                                                       (checked, good_indices, good_offsets),
                                                       (warned, bad_indices, bad_offsets),
                                                       (checked, repaired_indices, repaired_offsets))):
        if ahead:
            module.prefetch(indices, offsets)
        out = module(indices, offsets)
        out.backward(grad_of(step // 2))
        outputs.append(out.detach())
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[2], outputs[3])
    assert warned.bounds_check_repairs() == 3 and checked.bounds_check_repairs() == 0
    after_warned, after_checked = state(warned), state(checked)
    assert all(torch.equal(after_warned[k], after_checked[k]) for k in after_checked)
    assert_clean(warned)
