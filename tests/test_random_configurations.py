"""Configurations drawn at random: every placement, policy, mover and optimizer (from their
registries), weights dtype, state layout, pooling, the pipeline's depth, window and fit, tables shared
by several features, tables of one row, odd dims, a row repeated hundreds of times in a bag, batch
sizes that change every step and, in some draws, a batch with an index out of range in the middle of
training. Each draw trains the same batches in HBM and as drawn, and the two must agree bit for bit:
every output, the state_dict every few steps (a flush of every dirty slot) and at the end; no slot
stays locked. The bad batch must be refused at its forward by both, leaving everything as it was, and
training goes on with the next batch (with the same pipeline, or a new one).

A draw is a seed: a failure names it, and ``draw(seed)`` rebuilds it. The plain-torch backend keeps a draw
to a second or so in simulation; the Triton kernels are drawn too, on fewer seeds.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from tiered_tbe import CacheConfig, Placement, PrefetchPipeline, TableSpec, TieredEmbeddingBags
from tiered_tbe.cache.mover import MOVERS
from tiered_tbe.cache.policy import POLICIES
from tiered_tbe.kernels.optimizers import OPTIMIZERS, optimizer_named
from tiered_tbe.storage import STATE_LAYOUTS

STEPS = 10


@dataclasses.dataclass
class Draw:
    rows: list[int]  # rows of each table
    dims: list[int]
    placements: list[Placement]
    feature_table_map: list[int]  # the table of each feature (some tables looked up by several)
    optimizer: str  # a name of the registry OPTIMIZERS
    pooling: str
    weights_dtype: torch.dtype
    stochastic_rounding: bool
    state_layout: str
    policy: str
    associativity: int
    slots: int
    mover: str | None
    depth: int  # 0: serial
    lookahead: int | None  # the pipeline's window of hinted batches (None: its default)
    fit_cache: bool  # the pipeline holds fewer batches ahead when they do not fit
    same_pipeline_after_error: bool  # after the bad batch the loop goes on with its pipeline (else a new one)
    backend: str
    bad_step: int | None  # the step whose batch holds an index out of its table's range


def draw(seed: int, backend: str) -> Draw:
    rng = random.Random(seed)
    num_tables = rng.randint(1, 3)
    rows = [rng.choice([1, 3, 40, 300]) for _ in range(num_tables)]
    pooling = rng.choice(["sum", "mean", "none"])
    dims = [rng.choice([1, 3, 4, 8])] * num_tables if pooling == "none" else \
        [rng.choice([1, 2, 3, 5, 8, 16]) for _ in range(num_tables)]
    features = list(range(num_tables)) + [rng.randrange(num_tables) for _ in range(rng.randint(0, 2))]
    rng.shuffle(features)
    weights_dtype = rng.choice([torch.float32, torch.float16, torch.bfloat16])
    mover = rng.choice([*sorted(MOVERS), None])  # None: the placement's default
    state_layout = rng.choice([layout for layout in STATE_LAYOUTS if not (mover == "staged" and layout == "device")])
    return Draw(rows, dims, [rng.choice(list(Placement)) for _ in range(num_tables)], features,
                rng.choice(sorted(OPTIMIZERS)), pooling, weights_dtype,
                weights_dtype != torch.float32 and backend == "triton" and rng.random() < 0.5, state_layout,
                rng.choice(sorted(POLICIES)), rng.choice([1, 2, 4]), rng.choice([1, 4, 8]), mover,
                rng.choice([0, 1, 2, 3]), rng.choice([None, 0, 1, 5]), rng.random() < 0.3, rng.random() < 0.5, backend,
                rng.randrange(STEPS) if rng.random() < 0.5 else None)


def batches_of(seed: int, d: Draw) -> list[tuple]:
    """``(indices, offsets, per_sample_weights or None, grad_output)`` per step."""
    rng = random.Random(seed + 1)
    generator = torch.Generator().manual_seed(seed)
    feature_rows = [d.rows[t] for t in d.feature_table_map]
    found = []
    for step in range(STEPS):
        batch_size = rng.randint(1, 4)
        indices, lengths = [], []
        for rows in feature_rows:
            for _ in range(batch_size):
                if rng.random() < 0.04:  # one row, hundreds of times
                    bag = [rng.randrange(rows)] * 200
                else:
                    bag = [rng.randrange(rows) for _ in range(rng.choice([0, 1, 2, 3, 5]))]
                indices += bag
                lengths.append(len(bag))
        if step == d.bad_step:  # the last bag (of the last feature) gets a row past its table's end
            indices.append(feature_rows[-1] + rng.randint(0, 3))
            lengths[-1] += 1
        indices = torch.tensor(indices, dtype=torch.int64)
        offsets = torch.tensor([0, *lengths]).cumsum(0)
        weights = torch.rand(indices.numel(), generator=generator) if rng.random() < 0.4 else None
        columns = d.dims[0] if d.pooling == "none" else sum(d.dims[t] for t in d.feature_table_map)
        grad = torch.randn(indices.numel() if d.pooling == "none" else batch_size, columns, generator=generator)
        found.append((indices, offsets, weights, grad))
    return found


def module_of(d: Draw, in_hbm: bool, device) -> TieredEmbeddingBags:
    placements = [Placement.DEVICE] * len(d.rows) if in_hbm else d.placements
    tables = [TableSpec(n, dim, name=f"t{t}", placement=p) for t, (n, dim, p) in enumerate(zip(d.rows, d.dims,
                                                                                                 placements))]
    cache = None
    if any(p.is_cached for p in placements):
        cache = CacheConfig(slots=max(d.slots, d.associativity), associativity=d.associativity, policy=d.policy,
                            mover=d.mover)
    return TieredEmbeddingBags(tables, pooling=d.pooling, optimizer=optimizer_named(d.optimizer, lr=0.05),
                               weights_dtype=d.weights_dtype, stochastic_rounding=d.stochastic_rounding, cache=cache,
                               device=device, seed=3, backend=d.backend, feature_table_map=d.feature_table_map,
                               state_layout="auto" if in_hbm else d.state_layout)


def train(module: TieredEmbeddingBags, batches: list[tuple], d: Draw, serial: bool = False):
    """Every step's output (the string "refused" for the bad batch), the state_dict after every 4th step, and
    at the end: serially, or as ``d`` draws it."""
    depth = 0 if serial else d.depth
    bad_step = d.bad_step
    outputs, states = [], []
    step = 0
    while step < len(batches):
        rest = batches[step:]
        source = PrefetchPipeline(module, rest, depth=depth, lookups=lambda b: (b[0], b[1]), lookahead=d.lookahead,
                                  fit_cache=d.fit_cache) if depth else rest
        try:
            for indices, offsets, weights, grad in source:
                if step == bad_step:
                    before = {k: v.clone() for k, v in module.state_dict().items()}
                    with pytest.raises(ValueError, match="out of range"):
                        module(indices, offsets, per_sample_weights=weights)
                    after = module.state_dict()
                    assert all(torch.equal(before[k], after[k]) for k in before), "the bad batch changed a table"
                    outputs.append("refused")
                    step += 1
                    if depth and d.same_pipeline_after_error:
                        continue  # the pipeline drops the refused batch when the next one is asked for
                    break  # the next batches go through a new pipeline
                output = module(indices, offsets, per_sample_weights=weights)
                outputs.append(output.detach().clone())
                output.backward(grad)
                step += 1
                if step % 4 == 0:
                    states.append({k: v.clone() for k, v in module.state_dict().items()})
        finally:
            if depth:
                source.close()
    states.append({k: v.clone() for k, v in module.state_dict().items()})
    return outputs, states


def check_draw(seed: int, backend: str, device) -> None:
    d = draw(seed, backend)
    batches = [tuple(t if t is None else t.to(device) for t in batch) for batch in batches_of(seed, d)]
    expected_outputs, expected_states = train(module_of(d, True, device), batches, d, serial=True)
    module = module_of(d, False, device)
    outputs, states = train(module, batches, d)
    for step, (want, got) in enumerate(zip(expected_outputs, outputs)):
        assert type(want) is type(got) and (isinstance(want, str) or torch.equal(want, got)), \
            f"seed {seed}, {d}: output of step {step}"
    for number, (want, got) in enumerate(zip(expected_states, states)):
        for key in want:
            assert torch.equal(want[key], got[key]), f"seed {seed}, {d}: {key} of state_dict {number}"
    if module.cache is not None:
        assert module.cache.num_locked() == 0, f"seed {seed}, {d}"


@pytest.mark.parametrize("seed", range(16))
def test_a_random_configuration_trains_as_in_hbm(seed, device, one_simulated_thread):
    check_draw(seed, "torch", device)


@pytest.mark.parametrize("seed", range(100, 102))
def test_a_random_configuration_on_the_triton_kernels_trains_as_in_hbm(seed, device, one_simulated_thread):
    check_draw(seed, "triton", device)
