"""PrefetchPipeline: pipelined training equals serial training, and no lock outlives a batch (issue 4).

These tests are about the cache and the schedule, not the row math, so most run the module's
plain-torch backend (``backend="torch"``: far faster than the Triton interpreter); one runs the
Triton kernels. In CPU simulation the side stream is the main stream: what is checked here is
the cache state (locks, deferred unlocks, rows kept out of the cache while a batch in flight
reads them from the backing store), in the issue order the GPU streams would enforce.
"""

from __future__ import annotations

import gc
import random
import time

import pytest
import torch
from fake_step_timer import FakeStepTimer
from torch import nn

from tiered_tbe import SGD, Adam, CacheConfig, Placement, PrefetchPipeline, RowwiseAdagrad, TableSpec
from tiered_tbe.cache import SlotCache
from tiered_tbe.cache.mover import MOVERS
from tiered_tbe.cache.policy import POLICIES
from tiered_tbe.module import TieredEmbeddingBags

OPTIMIZERS = {"sgd": SGD(lr=0.3), "adagrad": RowwiseAdagrad(lr=0.2), "adam": Adam(lr=0.05)}
BATCH_SIZE = 2
LFU_DECAY_INTERVAL = 3  # use counts halve every 3rd prefetch: a 30-step test ages them 10 times


def make_model(policy: str, backend: str = "torch", slots: int = 8, mover: str = "zero_copy",
               stressed: bool = False) -> nn.Module:
    """Three tiered modules (one per optimizer) over the same tables, each with a tiny cache.

    ``stressed`` (staged mover): one-row staging buffers, one intra-op thread, and random sleeps
    before the mover's host copies, write-backs slower than fills."""
    model = nn.Module()
    staging = dict(staging_rows=1, mover_threads=1) if stressed else {}
    for name, optimizer in OPTIMIZERS.items():
        tables = [TableSpec(60, 4, name="big", placement=Placement.HOST_CACHED),
                  TableSpec(1, 3, name="one_row", placement=Placement.MANAGED_CACHED),
                  TableSpec(20, 5, name="dense")]
        module = TieredEmbeddingBags(
            tables, optimizer=optimizer, backend=backend, seed=1,
            cache=CacheConfig(slots=slots, associativity=4, policy=policy, lfu_decay_interval=LFU_DECAY_INTERVAL,
                              mover=mover,
                              **staging))
        if stressed:
            rng = random.Random(name)
            module.cache.mover.delay = lambda where, rng=rng: time.sleep(
                rng.choice([0, 0, 0, 0.0003, 0.001]) * (3 if where == "write_back" else 1))
        model.add_module(name, module)
    return model


def make_batches(steps: int, seed: int = 0):
    """(indices, offsets, grad) in TBE layout; every 7th batch repeats a few hot rows."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for step in range(steps):
        lengths = torch.randint(0, 5, (3 * BATCH_SIZE,), generator=generator)
        high = [3 if step % 7 == 0 else 60, 1, 20]
        indices = torch.cat([torch.randint(0, high[b // BATCH_SIZE], (int(n),), generator=generator)
                             for b, n in enumerate(lengths)])
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        grad = torch.randn(BATCH_SIZE, 12, generator=generator)
        batches.append((indices, offsets, grad))
    return batches


def train_step(model: nn.Module, batch) -> None:
    indices, offsets, grad = batch
    for module in model.children():
        module(indices, offsets).backward(grad)


def lookups(batch):
    return {name: (batch[0], batch[1]) for name in OPTIMIZERS}


def tables_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_no_locks(model: nn.Module) -> None:
    for name, module in model.named_children():
        assert module.cache.num_locked() == 0, f"{name}: {module.cache.num_locked()} slots still locked"
        assert not module._prefetched, f"{name}: prefetched batches left queued"


@pytest.mark.parametrize("policy", list(POLICIES))
def test_pipelined_training_equals_serial(policy, one_simulated_thread, monkeypatch):
    """Both movers, depths 1 to 4; the staged mover's threads slowed at random (sleeps, one
    thread, many chunks): bitwise the tables of serial training (30 steps: LFU ages 10 times,
    and the cache is under heavy pressure, as asserted). The deferred unlocks reach the next
    prefetch (``unlock_first``: in its graph on a GPU)."""
    unlocked_first = []
    prefetch = SlotCache.prefetch
    monkeypatch.setattr(SlotCache, "prefetch", lambda cache, rows, unlock_first=(): (
        unlocked_first.append(len(unlock_first)), prefetch(cache, rows, unlock_first))[1])
    steps = 30
    batches = make_batches(steps)
    serial = make_model(policy)
    for batch in batches:
        train_step(serial, batch)
    expected = tables_of(serial)
    for mover, depth in [("zero_copy", 1), ("zero_copy", 4), ("staged", 2), ("staged", 4)]:
        pipelined = make_model(policy, mover=mover, stressed=mover == "staged")
        seen = 0
        for batch in PrefetchPipeline(pipelined, batches, depth=depth, lookups=lookups):
            train_step(pipelined, batch)
            seen += 1
        assert seen == steps
        assert_no_locks(pipelined)
        stats = pipelined.sgd.cache_stats()
        # Heavy eviction: at least one eviction or miss without a slot every other unique row.
        assert stats.evictions > 0 and stats.misses_no_slot > 0, "the cache must be under pressure"
        assert stats.evictions + stats.misses_no_slot >= stats.unique_rows // 2, stats
        assert pipelined.sgd.cache.step // LFU_DECAY_INTERVAL >= 10, "LFU ages at least 10 times"
        got = tables_of(pipelined)
        for key in expected:  # fp32 rows, same math in the same order: bitwise
            assert torch.equal(got[key], expected[key]), f"{mover}, depth {depth}: {key} differs"
    assert sum(unlocked_first) >= 4 * (steps - 4), "each pipeline's prefetches unlock the batches released before"


@pytest.mark.parametrize("mover", list(MOVERS))
@pytest.mark.parametrize("policy", ["lru", "lookahead"])
def test_evaluating_held_out_batches_inside_a_pipelined_loop_changes_no_training(policy, mover, one_simulated_thread):
    """Issue 12: every 4th step the loop evaluates a held-out batch under no_grad, a batch the
    pipeline never prefetched. It prefetches itself, beside the batches in flight (their locks
    stay), reads what serial training would read, and training stays bitwise what it is without it
    (24 steps: 6 evaluations, all but the last beside batches in flight, as asserted)."""
    steps = 24
    batches = make_batches(steps)
    held_out = [(indices, offsets) for indices, offsets, _ in make_batches(steps // 4, seed=7)]

    def run(pipelined: bool, evaluate: bool):
        model = make_model(policy, mover=mover)
        source = PrefetchPipeline(model, batches, depth=2, lookups=lookups) if pipelined else batches
        outputs, evaluations_beside_held_rows = [], 0
        for step, batch in enumerate(source):
            train_step(model, batch)
            if evaluate and step % 4 == 3:
                indices, offsets = held_out[step // 4]
                in_flight = {name: held_rows(m) for name, m in model.named_children()}
                with torch.no_grad():
                    outputs.append([m(indices.clone(), offsets.clone()) for m in model.children()])
                held = 0
                for name, m in model.named_children():  # the batches in flight kept their rows, locked
                    slots, rows = in_flight[name]
                    held += slots.numel()
                    assert torch.equal(m.cache.tags[slots], rows) and (m.cache.locks[slots] > 0).all(), name
                evaluations_beside_held_rows += held > 0
        assert_no_locks(model)
        if pipelined and evaluate:  # every evaluation but the last, which follows the last batch
            assert evaluations_beside_held_rows == steps // 4 - 1, "an evaluation had no batch in flight holding rows"
        return tables_of(model), outputs

    expected, _ = run(pipelined=True, evaluate=False)
    got, outputs = run(pipelined=True, evaluate=True)
    assert len(outputs) == steps // 4
    for key in expected:
        assert torch.equal(got[key], expected[key]), key
    serial_tables, serial_outputs = run(pipelined=False, evaluate=True)
    for key in expected:
        assert torch.equal(serial_tables[key], expected[key]), key
    for step, (a, b) in enumerate(zip(outputs, serial_outputs)):  # the evaluation read what serial training reads
        assert all(torch.equal(x, y) for x, y in zip(a, b)), step


def test_pipelined_triton_kernels_equal_serial(one_simulated_thread):
    """The Triton kernels behind a depth-2 pipeline, both movers: bitwise serial training. Five
    batches (the Triton interpreter takes ~1 s a step of the three modules) reach every path of
    the kernels' slot remap, as asserted: hits, fills, dirty evictions, rows read in place."""
    batches = make_batches(5, seed=3)
    serial = make_model("lru", backend="triton")
    for batch in batches:
        train_step(serial, batch)
    expected = tables_of(serial)
    for mover in MOVERS:
        pipelined = make_model("lru", backend="triton", mover=mover)
        for batch in PrefetchPipeline(pipelined, batches, depth=2, lookups=lookups):
            train_step(pipelined, batch)
        assert_no_locks(pipelined)
        stats = pipelined.sgd.cache_stats()
        assert stats.unique_hits > 0 and stats.write_backs > 0 and stats.misses_no_slot > 0, stats
        got = tables_of(pipelined)
        assert all(torch.equal(got[k], expected[k]) for k in expected), mover


def held_rows(module) -> tuple[torch.Tensor, torch.Tensor]:
    """The slots the batches prefetched and not yet trained hold, and their rows."""
    slots = [b.cache_batch.locked_slots for _, _, b in module._prefetched]
    slots = torch.cat(slots).long() if slots else torch.zeros(0, dtype=torch.long)
    slots = slots[slots >= 0]
    return slots, module.cache.tags[slots].clone()


def test_a_batch_prefetched_out_of_order_is_refused():
    module = make_model("lru").sgd
    first, second = [(i, o) for i, o, _ in make_batches(2)]
    module.prefetch(*first)
    module.prefetch(*second)
    with pytest.raises(ValueError, match="prefetched after the one prefetched next"):
        module(*second)
    module.cancel_prefetched()
    assert module.cache.num_locked() == 0


@pytest.mark.parametrize("defer_unlock", [False, True])
def test_a_row_left_in_the_backing_store_stays_there_while_its_batch_is_in_flight(defer_unlock, mover):
    """B reads row 0 from the backing store (its one set is full of A's locked rows). C's
    prefetch, while B is in flight, must not copy row 0 into a slot: B's update would land in
    the backing store after the copy and be lost to C. Once B is released, D's prefetch caches
    row 0, with B's update."""
    module = make_model("lru", slots=4, mover=mover).sgd  # one set of 4 ways, SGD lr 0.3
    def batch(rows):  # every lookup in table "big", bag 0
        return torch.tensor(rows), torch.tensor([0, len(rows)] + [len(rows)] * 5)
    a, b, c, d = batch([10, 11, 12, 13]), batch([0]), batch([0]), batch([0])
    module.prefetch(*a, defer_unlock=defer_unlock)
    module.prefetch(*b, defer_unlock=defer_unlock)
    assert module._prefetched[1][2].slot_of_index.tolist() == [-1]
    module(*a).backward(torch.ones(2, 12))
    module.prefetch(*c, defer_unlock=defer_unlock)  # A's rows are free now, but B is in flight
    assert module._prefetched[1][2].slot_of_index.tolist() == [-1], "row 0 must stay in the backing store"
    row_before = module.storage.table_weights[0][0].clone()
    out_b = module(*b)
    torch.testing.assert_close(out_b[0, :4], row_before)
    out_b.backward(torch.ones(2, 12))
    updated = row_before - 0.3
    torch.testing.assert_close(module.storage.table_weights[0][0], updated)
    out_c = module(*c)  # reads the backing store, updated
    torch.testing.assert_close(out_c[0, :4], updated)
    out_c.backward(torch.zeros(2, 12))
    module.prefetch(*d, defer_unlock=defer_unlock)  # B and C are done: row 0 comes in
    assert module._prefetched[0][2].slot_of_index.tolist() != [-1]
    with torch.no_grad():
        torch.testing.assert_close(module(*d)[0, :4], updated)
    module.cancel_prefetched()  # runs the deferred unlocks
    assert module.cache.num_locked() == 0
    assert module.cache.stats().misses_no_slot == 2  # B's and C's row 0


def test_no_locks_after_eval_exception_and_early_exit(mover, one_simulated_thread):
    model = make_model("lru", mover=mover)
    batches = make_batches(12)
    with torch.no_grad():
        for batch in PrefetchPipeline(model, batches, depth=3, lookups=lookups):
            for module in model.children():
                module(batch[0], batch[1])
    assert_no_locks(model)

    with pytest.raises(RuntimeError, match="boom"):
        with PrefetchPipeline(model, batches, depth=4, lookups=lookups) as pipe:
            for step, batch in enumerate(pipe):
                outs = [module(batch[0], batch[1]) for module in model.children()]
                if step == 5:
                    raise RuntimeError("boom")
                for out in outs:
                    out.backward(batch[2])
    del outs
    gc.collect()  # the graph of the failed step goes, and its finalizer releases the locks
    assert_no_locks(model)

    for step, batch in enumerate(PrefetchPipeline(model, batches, depth=2, lookups=lookups)):
        train_step(model, batch)
        if step == 3:
            break  # the generator is closed when dropped: queued prefetches are released
    gc.collect()
    assert_no_locks(model)


def test_single_module_and_default_lookups(mover):
    module = make_model("lfu", mover=mover).adam
    batches = [(i, o) for i, o, _ in make_batches(6)]
    for indices, offsets in PrefetchPipeline(module, batches, depth=8):
        module(indices, offsets).sum().backward()
    assert module.cache.num_locked() == 0
    with pytest.raises(ValueError, match="depth must be between 1 and 8"):
        PrefetchPipeline(module, batches, depth=9)
    with pytest.raises(ValueError, match="lookahead must be between 0 and MAX_LOOKAHEAD = 64, got 65"):
        PrefetchPipeline(module, batches, lookahead=65)
    with pytest.raises(ValueError, match="holds no TieredEmbeddingBags"):
        PrefetchPipeline(nn.Linear(2, 2), batches)


@pytest.mark.parametrize("policy", ["lru", "lookahead", "lookahead-admit"])
def test_a_pipeline_fitted_to_the_cache_holds_fewer_batches_while_it_is_full(policy, one_simulated_thread,
                                                                             monkeypatch):
    """8-slot caches are too small for 5 batches in flight: with fit_cache the pipeline holds fewer ahead
    by the no-room rule alone (no step timer; the rule's unit tests: tests/test_ahead.py), with the
    policies that rank by recency and by the window (the lookahead pipeline at Zipf 0.6 must still go to
    none ahead), trains bit for bit as the serial loop, leaves no lock, and leaves fewer rows finding their
    set full than depth 4 throughout."""
    from tiered_tbe import pipeline as pipeline_module

    monkeypatch.setattr(pipeline_module, "StepTimer", lambda stream=None: None)
    steps = 30
    batches = make_batches(steps)
    serial = make_model(policy)
    for batch in batches:
        train_step(serial, batch)
    fixed = make_model(policy)
    for batch in PrefetchPipeline(fixed, batches, depth=4, lookups=lookups):
        train_step(fixed, batch)
    fitted = make_model(policy)
    pipeline = PrefetchPipeline(fitted, batches, depth=4, lookups=lookups, fit_cache=True)
    aheads = []
    for batch in pipeline:
        aheads.append(pipeline.ahead_control.ahead)
        train_step(fitted, batch)
    assert len(aheads) == steps
    assert pipeline.ahead_control.lowered >= 2 and min(aheads) == 0, aheads
    assert_no_locks(fitted)
    got, expected = tables_of(fitted), tables_of(serial)
    for key in expected:
        assert torch.equal(got[key], expected[key]), key
    assert fitted.sgd.cache_stats().misses_set_full < fixed.sgd.cache_stats().misses_set_full


def test_a_pipeline_fitted_to_the_cache_keeps_its_depth_when_admission_refuses_rows(one_simulated_thread,
                                                                                     monkeypatch):
    """lfu-admit reads rows named less than their victims in place by choice: with fit_cache, a table of 400
    rows whose 8 hot rows every batch names beside 8 cold ones, and sets with ways for every batch in
    flight, the pipeline holds its depth (it lowered to none on the H200 when refused rows counted as a
    full cache), and trains bit for bit as the serial loop."""
    from tiered_tbe import pipeline as pipeline_module

    def make_module():
        return TieredEmbeddingBags([TableSpec(400, 4, name="wide", placement=Placement.HOST_CACHED)],
                                   optimizer=SGD(lr=0.3), backend="torch", seed=1,
                                   cache=CacheConfig(slots=64, associativity=8, policy="lfu-admit",
                                                     lfu_decay_interval=1000))

    monkeypatch.setattr(pipeline_module, "StepTimer", lambda stream=None: None)  # the no-room rule alone
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(40):  # 4 bags: hot rows b and b + 4, then 2 cold rows of 8..399
        indices = torch.cat([torch.cat([torch.tensor([b, b + 4]), torch.randint(8, 400, (2,), generator=generator)])
                             for b in range(4)])
        batches.append((indices, torch.arange(0, 17, 4), torch.randn(4, 4, generator=generator)))
    serial = make_module()
    for indices, offsets, grad in batches:
        serial(indices, offsets).backward(grad)
    fitted = make_module()
    pipeline = PrefetchPipeline(fitted, batches, depth=2, fit_cache=True)
    aheads = []
    for indices, offsets, grad in pipeline:
        aheads.append(pipeline.ahead_control.ahead)
        fitted(indices, offsets).backward(grad)
    stats = fitted.cache_stats()
    assert stats.misses_no_slot > 100 and stats.misses_set_full == 0, stats  # refused, never a full set
    assert aheads == [2] * len(batches) and pipeline.ahead_control.lowered == 0, aheads
    assert fitted.cache.num_locked() == 0
    got, expected = fitted.state_dict(), serial.state_dict()
    for key in expected:
        assert torch.equal(got[key], expected[key]), key


def test_a_fitted_pipeline_holds_the_depth_whose_steps_time_fastest(one_simulated_thread, monkeypatch):
    """Where every row finds a slot (a cache of 64 slots), fit_cache still holds fewer batches ahead when
    fewer step faster, as its timer reads them (here a timer whose steps cost more the more are ahead), and
    trains bit for bit as the serial loop at every depth it passes through."""
    from tiered_tbe import ahead as ahead_module
    from tiered_tbe import pipeline as pipeline_module

    made = []

    def timer(stream=None):  # steps cost more the more batches are ahead
        made.append(FakeStepTimer({0: 10.0, 1: 11.0, 2: 12.0}))
        made[-1].control = pipeline.ahead_control
        return made[-1]

    monkeypatch.setattr(pipeline_module, "StepTimer", timer)
    steps = 3 * (ahead_module.SETTLE + ahead_module.SAMPLES + 1) + 4
    batches = make_batches(steps)
    serial = make_model("lru", slots=64)
    for batch in batches:
        train_step(serial, batch)
    fitted = make_model("lru", slots=64)
    pipeline = PrefetchPipeline(fitted, batches, depth=2, lookups=lookups, fit_cache=True)
    aheads = []
    for batch in pipeline:
        aheads.append(pipeline.ahead_control.ahead)
        train_step(fitted, batch)
    assert len(made) == 1 and aheads[0] == 2 and aheads[-1] == 0 and sorted(set(aheads)) == [0, 1, 2], aheads
    assert all(module.cache_stats().misses_no_slot == 0 for module in fitted.children())  # room throughout
    assert_no_locks(fitted)
    got, expected = tables_of(fitted), tables_of(serial)
    for key in expected:
        assert torch.equal(got[key], expected[key]), key
