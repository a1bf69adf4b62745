"""CUDA graphs of the forward and the backward (base/graphs.py): what the kernels read of a step,
and graphed training bitwise equal to the launches run one by one (GPU)."""

from __future__ import annotations

import pytest
import torch

import tiered_tbe
from tiered_tbe import SGD, Adam, CacheConfig, Placement, RowwiseAdagrad, TableSpec
from tiered_tbe.base import graphs as graphs_module
from tiered_tbe.base.graphs import StepGraphs
from tiered_tbe.batch import CopyRows
from tiered_tbe.kernels.update_rows import (
    MAX_HYPER,
    STEP_ARGS,
    advance_step_arguments,
    advance_step_kernel,
    hyper_view,
    step_arguments,
)
from tiered_tbe.module import TieredEmbeddingBags


def test_step_arguments_hold_the_grad_address_seed_step_and_hyper():
    grad = torch.randn(3, 5)
    hyper = (0.125, 1e-8, 0.9, 0.999, 0.0, 0.1, 0.001)
    arguments = step_arguments(grad, hyper, seed=(1 << 40) + 7, step=12)
    assert arguments.dtype == torch.int64 and arguments.shape == (STEP_ARGS,)
    assert arguments[0].item() == grad.data_ptr()
    assert arguments[1].item() == 7  # the philox key is 31 bits
    assert arguments[2].item() == 12
    expected = torch.tensor(hyper, dtype=torch.float32)
    assert torch.equal(hyper_view(arguments, len(hyper)), expected)
    with pytest.raises(ValueError, match="hyper-parameters"):
        step_arguments(grad, (0.1,) * (MAX_HYPER + 1), 0, 1)
    with pytest.raises(ValueError, match="hyper-parameters"):
        step_arguments(grad, (), 0, 1)


@pytest.mark.parametrize("step", [1, 12, 0x7FFFFFFF])
def test_the_step_advances_on_the_device_as_on_the_host(step):
    """Stochastic rounding's step, advanced in place after a step's kernels (advance_step_kernel),
    equals the next step's arguments, and so does the host's prediction of it (wrapped to 31 bits)."""
    grad = torch.randn(3, 5)
    hyper = (0.125, 1e-8)
    arguments = step_arguments(grad, hyper, seed=9, step=step)
    following = step_arguments(grad, hyper, seed=9, step=step + 1)
    assert advance_step_arguments(arguments.numpy().tobytes()) == following.numpy().tobytes()
    on_device = arguments.to(tiered_tbe.default_device())
    advance_step_kernel[(1,)](on_device)
    assert torch.equal(on_device.cpu(), following)


def test_a_replay_skips_the_copy_of_host_inputs_it_advanced(monkeypatch):
    """After a replay whose graph advances its step in place, the next step's arguments are known to
    be on the device: not copied again. Arguments that differ otherwise (a new grad_output) are."""
    copies = []
    monkeypatch.setattr(graphs_module, "copy_to_device", lambda target, source, _=None: copies.append(source.clone()))

    class Graph:
        def replay(self):
            pass

    graphs = StepGraphs(enabled=False)
    static = torch.empty(STEP_ARGS, dtype=torch.int64)
    captured = graphs_module._Captured(Graph(), [static], [None], None)
    grad, other_grad = torch.randn(3, 5), torch.randn(3, 5)
    for step in (1, 2, 3):
        graphs._replay(captured, [step_arguments(grad, (0.1,), 7, step)], advance=advance_step_arguments)
    graphs._replay(captured, [step_arguments(other_grad, (0.1,), 7, 4)], advance=advance_step_arguments)
    graphs._replay(captured, [step_arguments(other_grad, (0.1,), 7, 9)], advance=advance_step_arguments)
    assert [int(copy[2]) for copy in copies] == [1, 4, 9]
    assert graphs.replays == 5


def test_a_prefetch_replay_skips_the_copy_of_its_next_step(monkeypatch):
    """The slot cache's prefetch graph adds one to its step input after its kernels (next_int64 says
    so): consecutive prefetches copy no step; a step that jumps (another shape's graph ran between) is copied."""
    copies = []
    monkeypatch.setattr(graphs_module, "copy_to_device", lambda target, source, _=None: copies.append(int(source[0])))

    class Graph:
        def replay(self):
            pass

    graphs = StepGraphs(enabled=False)
    captured = graphs_module._Captured(Graph(), [torch.empty(1, dtype=torch.int64)], [None], None)
    for step in (5, 6, 7, 12, 13, -1, 0, 2**63 - 1):
        graphs._replay(captured, [torch.tensor([step], dtype=torch.int64)], advance=graphs_module.next_int64)
    assert copies == [5, 12, -1, 2**63 - 1]


def test_step_graphs_run_eagerly_off_the_gpu():
    calls = []
    graphs = StepGraphs(enabled=True)
    host = torch.arange(4)
    device_input = torch.ones(3)
    for _ in range(3):
        graphs.run("key", (device_input, None, host), calls.append, torch.device("cpu"))
    assert len(calls) == 3 and graphs.captures == 0 and graphs.replays == 0 and graphs.eager == 3
    assert calls[0][0] is device_input and calls[0][1] is None and calls[0][2] is host


ROWS, DIM = 5000, 40  # dim 40: not a power of two


def _batches(steps: int, num_tables: int, shapes: list[tuple[int, int]], seed: int = 0):
    """Batches cycling through (batch size, bag length) shapes, each with its own gradient
    tensor (a new address every step), hot rows repeated thousands of times."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    batches = []
    for step in range(steps):
        batch, bag = shapes[step % len(shapes)]
        n = num_tables * batch * bag
        hot = torch.randint(0, 4, (n,), generator=generator, device="cuda")
        cold = torch.randint(0, ROWS, (n,), generator=generator, device="cuda")
        pick = torch.rand(n, generator=generator, device="cuda") < 0.5
        indices = torch.where(pick, hot, cold)
        offsets = torch.arange(0, n + 1, bag, device="cuda")
        weights = torch.rand(n, generator=generator, device="cuda")
        grad = torch.randn(batch, num_tables * DIM, generator=generator, device="cuda")
        batches.append((indices, offsets, weights, grad))
    return batches


def _train(graphs: bool, batches, optimizer, placement=Placement.DEVICE, dtype=torch.float32,
           stochastic_rounding=False, pooling="sum", weighted=False, mover=None):
    tables = [TableSpec(ROWS, DIM, name=f"t{i}", placement=placement) for i in range(3)]
    cache = CacheConfig(fraction=0.05, mover=mover) if placement.is_cached else None
    module = TieredEmbeddingBags(tables, pooling=pooling, optimizer=optimizer, weights_dtype=dtype, device="cuda",
                                 cache=cache, bounds_check="off", seed=5, stochastic_rounding=stochastic_rounding,
                                 cuda_graphs=graphs)
    outputs = {}
    for step, (indices, offsets, weights, grad) in enumerate(batches):
        output = module(indices, offsets, weights if weighted else None)
        output.backward(grad)
        outputs[f"output {step}"] = output  # every output kept: a later replay must not write over it
    torch.cuda.synchronize()
    return module, {**outputs, **{key: value.clone() for key, value in module.state_dict().items()}}


CASES = {
    "sgd": dict(optimizer=SGD(lr=0.1)),
    "rowwise_adagrad_mean_weighted": dict(optimizer=RowwiseAdagrad(lr=0.05), pooling="mean", weighted=True),
    "adam": dict(optimizer=Adam(lr=0.01)),  # bias corrections change every step
    "fp16_stochastic_rounding": dict(optimizer=RowwiseAdagrad(lr=0.05), dtype=torch.float16,
                                     stochastic_rounding=True),  # the philox counter changes every step
    "cached": dict(optimizer=RowwiseAdagrad(lr=0.05), placement=Placement.HOST_CACHED),
    # The staged mover's device part (its lists) replays with the prefetch; its hand-off to the threads does not.
    "cached_staged": dict(optimizer=RowwiseAdagrad(lr=0.05), placement=Placement.HOST_CACHED, mover="staged"),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_graphed_training_equals_eager_bitwise(case):
    shapes = [(64, 3), (32, 1)]
    batches = _batches(12, 3, shapes)
    # Fewer forwards than the quiet readings after which a cached forward stops keeping copies of rows read
    # in place, which would be a graph key of its own (tiered_tbe/batch.py): each shape has one key.
    assert len(batches) < CopyRows.QUIET_READINGS
    _, expected = _train(False, batches, **CASES[case])
    module, got = _train(True, batches, **CASES[case])
    every_graphs = [module._forward_graphs, module._backward_graphs]
    if module.cache:
        every_graphs.append(module.cache._prefetch_graphs)
        # The unlock (with mark_dirty) runs in the backward's graph, not in one of its own.
        assert module.cache._release_graphs.captures == module.cache._release_graphs.replays == 0
    for graphs in every_graphs:
        # The backward and the prefetch pad a batch only where its size changed (StepGraphs.size_changed): the
        # first batch runs unpadded, eagerly, and its unpadded shape never comes back (the shapes alternate).
        first_unpadded = int(graphs is module._backward_graphs
                             or (module.cache is not None and graphs is module.cache._prefetch_graphs))
        assert graphs.captures == len(shapes), "each repeating shape is captured once"
        assert graphs.replays == len(batches) - len(shapes) - first_unpadded, \
            "every later batch of a shape replays its graph"
    for key in expected:
        assert torch.equal(got[key], expected[key]), f"{case}: {key}"
    if module.cache:
        module.cache.close()


@pytest.mark.gpu
def test_graphed_forwards_of_micro_batches_keep_their_outputs():
    """Two micro-batches' forwards before their backwards (gradient accumulation's order), one shape:
    the second forward's replay writes its own output, and each backward updates from its own batch,
    bit for bit as run eagerly."""
    batches = _batches(8, 3, [(64, 3)])

    def train(graphs: bool):
        tables = [TableSpec(ROWS, DIM, name=f"t{i}") for i in range(3)]
        module = TieredEmbeddingBags(tables, optimizer=RowwiseAdagrad(lr=0.05), device="cuda", bounds_check="off",
                                     cuda_graphs=graphs)
        outputs = []
        for first, second in zip(batches[::2], batches[1::2]):
            pair = [module(indices, offsets) for indices, offsets, _, _ in (first, second)]
            for output, (_, _, _, grad) in zip(pair, (first, second)):
                output.backward(grad)
            outputs += pair
        torch.cuda.synchronize()
        return module, outputs, module.state_dict()

    _, expected_outputs, expected = train(False)
    module, outputs, got = train(True)
    assert module._forward_graphs.replays == len(batches) - 1
    for step, (output, expected_output) in enumerate(zip(outputs, expected_outputs)):
        assert torch.equal(output, expected_output), f"output {step}"
    for key in expected:
        assert torch.equal(got[key], expected[key]), key


@pytest.mark.gpu
def test_shapes_that_never_repeat_run_eagerly():
    """Batches whose padded shapes never repeat (each batch size a power of two apart, so that padding
    gives each its own bags and lookup count) run eagerly: a key is captured on its second use only."""
    sizes = (16, 40, 100, 250, 600)
    batches = [_batches(1, 3, [(size, 2)], seed=step)[0] for step, size in enumerate(sizes)]
    _, expected = _train(False, batches, optimizer=SGD(lr=0.1))
    module, got = _train(True, batches, optimizer=SGD(lr=0.1))
    for graphs in (module._forward_graphs, module._backward_graphs):
        assert graphs.captures == 0 and graphs.replays == 0 and graphs.eager == 5
    for key in expected:
        assert torch.equal(got[key], expected[key]), key


@pytest.mark.gpu
@pytest.mark.parametrize("placement", [Placement.DEVICE, Placement.HOST_CACHED], ids=lambda p: p.value)
def test_graphed_steps_never_wait_for_the_device(placement):
    """Capture and replays included, a training step issues no synchronizing CUDA call (after a
    first step, whose forward autotuning times kernels)."""
    batches = _batches(4, 3, [(64, 3)])
    tables = [TableSpec(ROWS, DIM, name=f"t{i}", placement=placement) for i in range(3)]
    cache = CacheConfig(fraction=0.05) if placement.is_cached else None
    module = TieredEmbeddingBags(tables, optimizer=RowwiseAdagrad(lr=0.05), device="cuda", cache=cache,
                                 bounds_check="off")
    indices, offsets, _, grad = batches[0]
    module(indices, offsets).backward(grad)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for indices, offsets, _, grad in batches[1:]:
            module(indices, offsets).backward(grad)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for graphs in (module._forward_graphs, module._backward_graphs):
        assert graphs.captures == 1 and graphs.replays == 3 and graphs.eager == 1
    if module.cache is not None:  # each batch's unlock ran in its backward's graph
        assert module.cache._release_graphs.replays == 0 and module.cache.num_locked() == 0


@pytest.mark.gpu
def test_pinned_ring_copies_every_value_in_order_and_waits_for_nothing():
    """Three rounds of the ring's slots: each copy lands its own values (int64, fp32, 2-D, empty), a
    slot's typed view made once is rewritten through numpy before each of its copies, and a ring that
    is not ahead of the device issues no synchronizing call."""
    ring = graphs_module.PinnedRing(slots=4, slot_bytes=64)
    generator = torch.Generator().manual_seed(3)
    sources = []
    for i in range(12):
        shape, dtype = [((5,), torch.int64), ((2, 3), torch.float32), ((0,), torch.int64), ((8,), torch.float64)][i % 4]
        sources.append(torch.randint(-2**40, 2**40, shape, generator=generator).to(dtype))
    targets = [torch.full(s.shape, -7, dtype=s.dtype, device="cuda") for s in sources]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i, (target, source) in enumerate(zip(targets[:4], sources[:4])):
            ring.copy(target, source, source.reshape(-1).view(torch.uint8).numpy().tobytes() if i % 2 else None)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for target, source in zip(targets[4:], sources[4:]):  # the slots again: each waits for its last copy
        ring.copy(target, source)
    torch.cuda.synchronize()
    for target, source in zip(targets, sources):
        assert torch.equal(target.cpu(), source)
    with pytest.raises(ValueError, match="at most 64 bytes"):
        ring.copy(torch.empty(9, dtype=torch.int64, device="cuda"), torch.zeros(9, dtype=torch.int64))


@pytest.mark.gpu
def test_host_tensors_larger_than_a_ring_slot_reach_the_device_in_parts_without_a_sync():
    """copy_to_device of host tensors of one slot (a variable batch's sizes of 26 features on 8 ranks) and of
    several slots' bytes: every value lands, 2-D and of odd sizes, and no copy waits for the device."""
    slot_bytes = graphs_module.staging(torch.device("cuda")).slot_bytes
    generator = torch.Generator().manual_seed(5)
    sources = [torch.randint(-2**40, 2**40, shape, generator=generator)
               for shape in [(5, 26 * 8), (2, slot_bytes // 8 + 3), (3 * slot_bytes // 8 + 1,), (7,)]]
    targets = [torch.full(source.shape, -1, dtype=source.dtype, device="cuda") for source in sources]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for target, source in zip(targets, sources):
            graphs_module.copy_to_device(target, source)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for target, source in zip(targets, sources):
        assert torch.equal(target.cpu(), source)


@pytest.mark.gpu
def test_the_cached_current_stream_follows_the_current_stream():
    from tiered_tbe.base import streams

    side = torch.cuda.Stream()
    assert streams.current_stream(torch.device("cuda")) == torch.cuda.current_stream()
    with torch.cuda.stream(side):
        assert streams.current_stream(torch.device("cuda:0")) == side
        assert streams.current_stream_handle(torch.device("cuda")) == side.cuda_stream
        event = streams.record(torch.cuda.Event(), torch.device("cuda"))
    torch.cuda.current_stream().wait_event(event)
    assert streams.current_stream(torch.device("cuda")) == torch.cuda.current_stream()


@pytest.mark.gpu
def test_graphed_hint_rows_equal_eager_and_never_wait_for_the_device():
    """rows_for_hint (a lookahead pipeline's per-batch hint) replays a graph from a shape's third
    batch: the same rows and count as its launches one by one, and no host sync once captured."""
    tables = [TableSpec(ROWS, DIM, name=f"t{i}", placement=Placement.HOST_CACHED) for i in range(3)]

    def module(graphs: bool) -> TieredEmbeddingBags:
        return TieredEmbeddingBags(tables, optimizer=SGD(lr=0.1), device="cuda", bounds_check="off",
                                   cache=CacheConfig(fraction=0.05, policy="lookahead"), cuda_graphs=graphs)

    eager, graphed = module(False), module(True)
    batches = _batches(6, 3, [(64, 3), (32, 1)])
    for step, (indices, offsets, _, _) in enumerate(batches):
        want_rows, want_count = eager.rows_for_hint(indices, offsets)
        if step >= 4:  # both shapes captured: replays only
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            got_rows, got_count = graphed.rows_for_hint(indices, offsets)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(got_rows, want_rows) and torch.equal(got_count, want_count), step
    assert graphed._hint_graphs.captures == 2 and graphed._hint_graphs.replays == 4


@pytest.mark.gpu
def test_hint_rows_of_batches_changing_size_every_step_replay_a_few_graphs():
    """A ragged batch (batch size and bag lengths drawn anew each step) is hinted through a graph of its
    padded size: the same rows and count as eager, and far fewer captures than batches."""
    tables = [TableSpec(ROWS, DIM, name=f"t{i}", placement=Placement.HOST_CACHED) for i in range(3)]

    def module(graphs: bool) -> TieredEmbeddingBags:
        return TieredEmbeddingBags(tables, optimizer=SGD(lr=0.1), device="cuda", bounds_check="off",
                                   cache=CacheConfig(fraction=0.05, policy="lookahead"), cuda_graphs=graphs)

    eager, graphed = module(False), module(True)
    generator = torch.Generator(device="cuda").manual_seed(3)
    steps = 40
    for step in range(steps):
        batch_size = int(torch.randint(48, 65, (), generator=generator, device="cuda"))
        lengths = torch.randint(0, 9, (3 * batch_size,), generator=generator, device="cuda")
        offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
        indices = torch.randint(0, ROWS, (int(offsets[-1]),), generator=generator, device="cuda")
        want_rows, want_count = eager.rows_for_hint(indices, offsets)
        got_rows, got_count = graphed.rows_for_hint(indices, offsets)
        assert torch.equal(got_rows, want_rows) and torch.equal(got_count, want_count), step
    assert graphed._hint_graphs.replays >= steps // 2 and graphed._hint_graphs.captures <= 8
