"""CUDA graphs of a step's launches, one per batch shape: the host enqueues a step in one call.

A training step launches ~8 Triton kernels and ~15 torch ops in the backward, and a cache's
prefetch launched ~60 torch ops and 7 Numba kernels (~12 launches since ``cache/batch_kernels.py``);
on an H200 the host took longer to enqueue them (0.8-1.3 ms for the backward, 3-5 ms for
the prefetch) than the GPU took to run them (~0.7 ms, ~1.3 ms), so the GPU waited
(results/measurements.jsonl). A CUDA graph replays the whole sequence
from one host call. The backward (``kernels/backward.py``) and the slot cache's prefetch
(``cache/slot_cache.py``) use it, and the forward (``kernels/forward.py``): a launch or a few (one
per column group), but Triton's launch path cost the host 2-3 times what a replay does (its
output's address is a host input, below).

A graph bakes in every launch's arguments, so what changes from batch to batch reaches it
through tensors whose addresses do not change:

- device inputs (``indices``, ``offsets``, slots, ...) are copied into static tensors of the
  graph before each replay (device-to-device, a few microseconds);
- a laid-out device input (``padded_inputs.LaidOutInput``: a batch at a padded size, offsets at more bags
  a feature) is copied into its static tensor in parts (the batch, the padding), in the same multi-tensor copy;
- host inputs (a small CPU tensor of scalars: the address of this step's ``grad_output`` or of
  the forward's output, the step, the optimizer's hyper-parameters) are copied to a static
  device tensor, only when their values changed, through a ring of pinned slots (``PinnedRing``:
  a slot is reused only after its copy has run, so a later step never overwrites values an
  earlier copy has not read yet).

A key (the batch shape and everything the launches bake in) is captured on its second use (the
first runs eagerly, so every Triton kernel is compiled before the capture) and replayed from its
third. Batches whose shapes never repeat run eagerly. Graphs live per key, least recently used
first out beyond ``capacity``, each with its own memory pool (its sort buffers and outputs).
Capture runs on a side stream ordered after the current one; nothing waits for the device.

Safe because every replay of a key runs on the stream it was captured for (part of the key),
and what a replay returns is a copy of the graph's outputs (the next replay overwrites them).
"""

from __future__ import annotations

import os
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import NamedTuple

import numpy as np
import torch

from .mode import SIMULATION
from .padded_inputs import LaidOutInput, materialized
from .streams import current_stream, current_stream_handle

Inputs = Sequence[torch.Tensor | LaidOutInput | None]  # LaidOutInput: base/padded_inputs.py
Outputs = tuple[torch.Tensor, ...] | None


# Sizes per doubling that padded batches take (padded_size): at most 1/4 of padding (~1/8 on average), 4 graph
# shapes an octave. 16 an octave (at most 1/16) kept a batch whose size is drawn anew every step (8K-16K samples,
# 1-30 lookups a bag: ~100 sizes) capturing graphs all the time on the H200 (5.2 ms of host a prefetch).
SIZES_PER_DOUBLING = 4
# Graphs a StepGraphs of padded sizes keeps: every size of 6 doublings of the batch.
PADDED_GRAPHS = 6 * SIZES_PER_DOUBLING


def padded_size(n: int) -> int:
    """The size a batch of ``n`` entries is padded to, so that batches whose size changes every step
    (variable bag lengths, batch sizes) share a few graph shapes: ``n`` rounded up to the next multiple
    of ``2 ** (bit_length(n) - 1 - log2(SIZES_PER_DOUBLING))`` (at most 1/SIZES_PER_DOUBLING more
    entries; sizes up to ``SIZES_PER_DOUBLING`` as they are). A key of a size never seen twice is never captured
    (``StepGraphs``): a prefetch of a variable-length batch cost ~3.5 ms of host time eager, or a
    capture of ~6 ms, against a replay's tens of microseconds (docs/performance.md)."""
    granule = 1 << max(n.bit_length() - SIZES_PER_DOUBLING.bit_length(), 0)
    return -(-n // granule) * granule


def graphs_enabled() -> bool:
    """CUDA graphs need a GPU and the compiled kernels; ``TIERED_TBE_CUDA_GRAPHS=0`` turns them off."""
    return (not SIMULATION and torch.cuda.is_available()
            and os.environ.get("TIERED_TBE_CUDA_GRAPHS", "1") != "0")


def to_device(inputs: Inputs, device: torch.device) -> list[torch.Tensor | None]:
    """``inputs`` with (small) host tensors copied to ``device`` without a host sync, padded inputs padded."""
    moved = []
    for tensor in map(materialized, inputs):
        if tensor is not None and tensor.device.type == "cpu" and device.type != "cpu":
            target = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
            copy_to_device(target, tensor)
            tensor = target
        moved.append(tensor)
    return moved


def copy_to_device(target: torch.Tensor, source: torch.Tensor, values: bytes | None = None) -> None:
    """Copy a small host tensor into ``target`` on the current stream, without a host sync
    (``values``: the bytes of ``source``, where the caller has them). One that outgrows a slot of the
    pinned ring goes in slot-sized parts."""
    if target.device.type != "cuda":
        target.copy_(source)
        return
    ring = staging(target.device)
    if source.numel() * source.element_size() <= ring.slot_bytes:
        ring.copy(target, source, values)
        return
    flat_source, flat_target = source.contiguous().reshape(-1), target.view(-1)
    step = ring.slot_bytes // source.element_size()
    for start in range(0, flat_source.numel(), step):
        ring.copy(flat_target[start:start + step], flat_source[start:start + step])


class PinnedRing:
    """Pinned host slots for the step's small host-to-device copies (a step's scalars).

    A copy from pageable memory may wait for the device, and allocating pinned memory counts as
    a synchronizing call; so the values go through one of ``slots`` pinned slots allocated once,
    each reused only after the copy that last read it has run (its event; the host waits there
    only if it is ``slots`` copies ahead of the device).

    The values reach a slot through numpy (the slots' host view) and the slot's typed tensor view is
    made once: one torch op a copy (the host-to-device copy), where slicing, viewing and copying with
    torch ops took ~0.1 ms of host time a step on the H200 machine (``tools/dmp_host_time.py``).
    """

    def __init__(self, slots: int = 64, slot_bytes: int = 16384):  # 1 MiB: a variable batch's sizes fit a slot
        self.slot_bytes = slot_bytes
        self._buffer = torch.empty(slots, slot_bytes, dtype=torch.uint8, pin_memory=True)
        self._host = self._buffer.numpy()  # the same pinned bytes
        self._views: dict[tuple[int, torch.dtype, tuple[int, ...]], torch.Tensor] = {}
        self._events = [torch.cuda.Event() for _ in range(slots)]
        self._next = 0
        self._lock = threading.Lock()

    def copy(self, target: torch.Tensor, source: torch.Tensor, values: bytes | None = None) -> None:
        """Copy the host tensor ``source`` into ``target`` (on the current stream); ``values``: its bytes,
        where the caller has them already."""
        nbytes = source.numel() * source.element_size()
        if nbytes > self.slot_bytes or not source.is_contiguous():
            raise ValueError(f"PinnedRing copies contiguous tensors of at most {self.slot_bytes} bytes, got "
                             f"{tuple(source.shape)} {source.dtype}")
        if values is None:
            values = source.reshape(-1).view(torch.uint8).numpy().tobytes()
        with self._lock:  # the forward's replays run on the caller's thread, the backward's on autograd's
            slot = self._next
            self._next = (slot + 1) % len(self._events)
        event = self._events[slot]
        if not event.query():
            event.synchronize()  # back-pressure: this slot's last copy has not run yet
        key = (slot, source.dtype, tuple(source.shape))
        pinned = self._views.get(key)
        if pinned is None:
            pinned = self._views[key] = self._buffer[slot, :nbytes].view(source.dtype).view(source.shape)
        self._host[slot, :nbytes] = np.frombuffer(values, dtype=np.uint8)
        target.copy_(pinned, non_blocking=True)
        event.record(current_stream(target.device))


_RINGS: dict[torch.device, PinnedRing] = {}


def staging(device: torch.device) -> PinnedRing:
    """The pinned ring of ``device`` (made on first use: constructors call it, so that the
    pinned allocation happens there and not on the training path)."""
    ring = _RINGS.get(device)  # as asked: on the path to every replay that copies its arguments
    if ring is not None:
        return ring
    indexed = torch.device(device.type, device.index if device.index is not None else torch.cuda.current_device())
    ring = _RINGS.get(indexed)
    if ring is None:
        with torch.cuda.device(indexed):  # its events belong to that device
            ring = _RINGS[indexed] = PinnedRing()
    if device.index is not None:  # "cuda" alone names whichever device is current: not kept under it
        _RINGS[device] = ring
    return ring


class GraphLaunches(NamedTuple):
    """Launches that one module hands another to enqueue in its CUDA graph (the slot cache's unlock in
    the backward's): they read the batch only through ``inputs`` (as ``StepGraphs.run``'s enqueue), and
    ``key`` is everything they bake in (part of the graph's key)."""

    key: Hashable
    inputs: Inputs
    enqueue: Callable[[list], None]


class OutputLoan:
    """A replay's outputs lent to one borrower as they are, not copied (``StepGraphs.run(..., loan=)``): the
    graph is not replayed again until :meth:`give_back`. The borrower gives them back once every use of them
    is enqueued, ordered before any later work on the stream the key replays on."""

    __slots__ = ("returned",)

    def __init__(self):
        self.returned = False

    def give_back(self) -> None:
        self.returned = True


class _Captured:
    """One key's graph and its static inputs (device tensors the graph reads)."""

    def __init__(self, graph, statics: list[torch.Tensor | None], host_values: list[bytes | None],
                 outputs: Outputs):
        self.graph = graph
        self.statics = statics
        self.outputs = outputs  # the graph's outputs (its pool's memory), overwritten by each replay
        self.host_values = host_values  # the bytes last copied into each static of a host input
        self.loan: OutputLoan | None = None  # who holds the outputs of the last replay, uncopied

    def free(self) -> bool:
        """Whether a replay may overwrite the outputs: none lent, or given back."""
        return self.loan is None or self.loan.returned


class StepGraphs:
    """CUDA graphs of one enqueue function, keyed by batch shape.

    ``run(key, inputs, enqueue, device)`` returns ``enqueue(device_inputs)``: run eagerly, or
    by replaying the key's graph of it. ``enqueue`` must read the batch only through ``inputs``
    (every other tensor it reads must keep its address and be updated in place), must not
    synchronize with the host, and returns ``None`` or a tuple of tensors (a replay returns
    copies of them, or lends them as they are: ``run(..., loan=)``).

    ``replicas``: most graphs of one key, so that outputs lent to several borrowers at once (a pipeline's
    batches in flight) need no copies: a replay takes a replica whose outputs are free, and one more is
    captured where none is. Each replica has a memory pool of its own: in a shared pool a later capture may
    place its outputs where an earlier one keeps its scratch, and the earlier one's replay would overwrite
    them while they are lent. Where every replica is lent, the key runs eagerly.
    """

    def __init__(self, capacity: int = 4, capture_after: int = 1, enabled: bool | None = None, replicas: int = 1):
        self.capacity = capacity
        self.capture_after = capture_after  # eager uses of a key before its capture
        self.enabled = graphs_enabled() if enabled is None else enabled
        self.replicas = replicas  # most graphs a key keeps (each lent to one borrower at a time)
        self._graphs: OrderedDict[Hashable, list[_Captured]] = OrderedDict()
        self._uses: OrderedDict[Hashable, int] = OrderedDict()  # eager uses of keys not captured yet
        self._refused: set[Hashable] = set()  # keys whose capture failed: always eager
        self._last_size: Hashable | None = None  # size_changed's last size
        if not SIMULATION and torch.cuda.is_available():
            staging(torch.device("cuda"))  # the pinned slots, allocated here rather than in a step
        # Counts so far (a benchmark reads them around its timed steps): each capture or eager run in a
        # steady state is host time a replay would not cost.
        self.captures = 0
        self.replays = 0
        self.eager = 0

    def size_changed(self, size: Hashable) -> bool:
        """Whether ``size`` (a batch's lookup count and batch size) differs from the size asked about last,
        which it then replaces; the first size asked about counts as unchanged. A batch padded to a few sizes
        (``padded_size``) replays their graphs whatever its size, but the padding copies each of its arrays
        first (~0.07 ms of a 0.6 ms backward of 1.7M lookups on the H200, docs/performance.md): a batch the
        size of the one before it replays its own size's graph, and a model of one batch shape pads none."""
        changed = self._last_size is not None and size != self._last_size
        self._last_size = size
        return changed

    def run(self, key: Hashable, inputs: Inputs, enqueue: Callable[[list], Outputs], device: torch.device,
            advance: Callable[[bytes], bytes] | None = None, loan: OutputLoan | None = None) -> Outputs:
        """``advance``: what ``enqueue`` leaves in a host input's static, from the bytes it held (an
        enqueue that advances its step in place): after a replay the next step's values are known to
        be there, and equal ones are not copied again. ``loan``: a replay returns the graph's outputs
        themselves, lent until ``loan.give_back()`` (an eager run returns tensors of its own either way)."""
        if not self.enabled or device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            self.eager += 1
            return enqueue(to_device(inputs, device))
        key = (key, tuple(_signature(tensor) for tensor in inputs), current_stream_handle(device))
        replicas = self._graphs.get(key)
        if replicas is not None:
            self._graphs.move_to_end(key)
            captured = self._free_replica(key, replicas, inputs, enqueue, device)
            if captured is None:  # every replica's outputs are lent, and the key has all it may have
                self.eager += 1
                return enqueue(to_device(inputs, device))
            return self._replay(captured, inputs, advance, loan)
        uses = self._uses.pop(key, 0)
        if key in self._refused or uses < self.capture_after:
            self._uses[key] = uses + 1
            while len(self._uses) > 64 * self.capacity:  # forget shapes seen long ago
                self._uses.popitem(last=False)
            self.eager += 1
            return enqueue(to_device(inputs, device))
        captured = self._capture(key, inputs, enqueue, device)
        if captured is None:
            self.eager += 1
            return enqueue(to_device(inputs, device))
        self._graphs[key] = [captured]
        while len(self._graphs) > self.capacity:
            # A lent replica's outputs stay allocated while the borrower holds them (a graph's pool frees
            # only the blocks no tensor uses).
            self._graphs.popitem(last=False)
        return self._replay(captured, inputs, advance, loan)

    def _free_replica(self, key, replicas: list[_Captured], inputs: Inputs, enqueue, device: torch.device
                      ) -> _Captured | None:
        """A replica of ``key`` whose outputs a replay may overwrite: a free one, else one more captured
        while the key has fewer than ``replicas``; else None."""
        for captured in replicas:
            if captured.free():
                return captured
        if len(replicas) >= self.replicas:
            return None
        captured = self._capture(key, inputs, enqueue, device)
        if captured is not None:
            replicas.append(captured)
        return captured

    def _capture(self, key, inputs: Inputs, enqueue, device: torch.device) -> _Captured | None:
        statics = [_static_for(tensor, device) for tensor in inputs]
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(current)
        try:
            with torch.cuda.stream(side):
                # thread_local: another thread's CUDA calls (the staged mover's worker) do not break it.
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    outputs = enqueue(statics)
                finally:
                    graph.capture_end()
        except RuntimeError as error:  # an op that cannot be captured: this key stays eager
            self._refused.add(key)
            warnings.warn(f"tiered_tbe: a CUDA graph capture failed, running this batch shape eagerly: {error}",
                          RuntimeWarning, stacklevel=3)
            current.wait_stream(side)
            return None
        current.wait_stream(side)
        self.captures += 1
        return _Captured(graph, statics, [None] * len(inputs), outputs)

    def _replay(self, captured: _Captured, inputs: Inputs, advance: Callable[[bytes], bytes] | None = None,
                loan: OutputLoan | None = None) -> Outputs:
        targets, sources = [], []
        for index, (static, tensor) in enumerate(zip(captured.statics, inputs)):
            if tensor is None:
                continue
            if isinstance(tensor, LaidOutInput):  # the batch and its padding, each into its part
                part_targets, part_sources = tensor.copy_pairs(static)
                targets += part_targets
                sources += part_sources
            elif tensor.device.type == "cpu":
                # Compared as bytes: a host tensor here is a handful of scalars, and torch.equal and
                # clone were two more op dispatches on the path to the replay (the GPU idles until it).
                values = tensor.numpy().tobytes()
                if captured.host_values[index] == values:
                    continue  # the static already holds these values
                copy_to_device(static, tensor, values)
                captured.host_values[index] = values
            else:
                targets.append(static)
                sources.append(tensor)
        if len(targets) > 1:
            # One op for the device inputs (the backward's indices, offsets, ...): 8.7 us of host against 41
            # for six copies on the H200 machine (tools/host_costs.py), on autograd's thread before the replay.
            torch._foreach_copy_(targets, sources)
        elif targets:
            targets[0].copy_(sources[0])
        captured.graph.replay()
        self.replays += 1
        if advance is not None:
            captured.host_values = [None if values is None else advance(values) for values in captured.host_values]
        captured.loan = loan
        if captured.outputs is None:
            return None
        if loan is not None:  # lent as they are until given back: no replay of this replica before then
            return captured.outputs
        # Clones: one multi-tensor copy into five new tensors took twice the host time of five clones on
        # the H200 machine (0.14 against 0.07 ms a prefetch; tools/dmp_host_time.py, 0a0fe96).
        return tuple(output.clone() for output in captured.outputs)


def next_int64(values: bytes) -> bytes:
    """``advance`` of an int64 [1] input that the graph adds one to (a prefetch's step)."""
    step = (int.from_bytes(values, "little", signed=True) + 1 + 2**63) % 2**64 - 2**63  # wraps as int64 does
    return step.to_bytes(8, "little", signed=True)


def _static_for(tensor: torch.Tensor | LaidOutInput | None, device: torch.device) -> torch.Tensor | None:
    """An uninitialized device tensor shaped as ``tensor`` (a laid-out input: as the tensor it lays out)."""
    if tensor is None:
        return None
    if isinstance(tensor, LaidOutInput):
        return torch.empty(tensor.size, dtype=tensor.dtype, device=device)
    return torch.empty_like(tensor, device=device)


def _signature(tensor: torch.Tensor | LaidOutInput | None) -> tuple | None:
    if tensor is None:
        return None
    if isinstance(tensor, LaidOutInput):  # the laid-out tensor's
        return (tensor.size,), tensor.dtype, tensor.device.type
    return tuple(tensor.shape), tensor.dtype, tensor.device.type
