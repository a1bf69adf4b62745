"""CUDA graphs of a step's launches, one per batch shape: the host enqueues a step in one call.

A training step of the TBE launches ~8 Triton kernels and ~15 torch ops; on the lent H200 the
host takes longer to enqueue them (0.8-1.3 ms for the backward) than the GPU takes to run them
(~0.7 ms), so the GPU waits (benchmarks/RESULTS.md). A CUDA graph replays the whole sequence
from one host call.

A graph bakes in every launch's arguments, so what changes from batch to batch reaches it
through tensors whose addresses do not change:

- device inputs (``indices``, ``offsets``, slots, ...) are copied into static tensors of the
  graph before each replay (device-to-device, a few microseconds);
- host inputs (a small CPU tensor of scalars: the address of this step's ``grad_output``, the
  step, the optimizer's hyper-parameters) are copied to a static device tensor, only when their
  values changed, through pinned memory (torch's host allocator keeps a pinned block until its
  copy has run, so a later step never overwrites values an earlier copy has not read yet).

A key (the batch shape and everything the launches bake in) is captured on its second use (the
first runs eagerly, so every Triton kernel is compiled before the capture) and replayed from its
third. Batches whose shapes never repeat run eagerly. Graphs live per key, least recently used
first out beyond ``capacity``, each with its own memory pool (its sort buffers and outputs).
Capture synchronizes the device once per key.

Safe because every replay of a key runs on the stream it was captured for (part of the key),
and everything a replay writes is consumed by the launches of the same replay: nothing it
returns outlives the step.
"""

from __future__ import annotations

import os
import warnings
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence

import torch

from .addressing import INTERPRETING

Inputs = Sequence[torch.Tensor | None]


def graphs_enabled() -> bool:
    """CUDA graphs need a GPU and the compiled kernels; ``TIERED_TBE_CUDA_GRAPHS=0`` turns them off."""
    return (not INTERPRETING and torch.cuda.is_available()
            and os.environ.get("TIERED_TBE_CUDA_GRAPHS", "1") != "0")


def to_device(inputs: Inputs, device: torch.device) -> list[torch.Tensor | None]:
    """``inputs`` with host tensors copied to ``device`` without a host sync (through pinned memory)."""
    moved = []
    for tensor in inputs:
        if tensor is not None and tensor.device != device:
            tensor = _pinned_copy(tensor).to(device, non_blocking=True)
        moved.append(tensor)
    return moved


class _Captured:
    """One key's graph and its static inputs (device tensors the graph reads)."""

    def __init__(self, graph, statics: list[torch.Tensor | None], host_values: list[torch.Tensor | None]):
        self.graph = graph
        self.statics = statics
        self.host_values = host_values  # the values last copied into each static of a host input


class StepGraphs:
    """CUDA graphs of one enqueue function, keyed by batch shape.

    ``run(key, inputs, enqueue, device)`` calls ``enqueue(device_inputs)``: eagerly, or by
    replaying the key's graph of it. ``enqueue`` must read the batch only through ``inputs``
    (every other tensor it reads must keep its address and be updated in place), must not
    synchronize with the host, and must not return anything the caller keeps.
    """

    def __init__(self, capacity: int = 4, capture_after: int = 1, enabled: bool | None = None):
        self.capacity = capacity
        self.capture_after = capture_after  # eager uses of a key before its capture
        self.enabled = graphs_enabled() if enabled is None else enabled
        self._graphs: OrderedDict[Hashable, _Captured] = OrderedDict()
        self._uses: OrderedDict[Hashable, int] = OrderedDict()  # eager uses of keys not captured yet
        self._refused: set[Hashable] = set()  # keys whose capture failed: always eager
        self.captures = 0
        self.replays = 0

    def run(self, key: Hashable, inputs: Inputs, enqueue: Callable[[list], None], device: torch.device) -> None:
        if not self.enabled or device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            enqueue(to_device(inputs, device))
            return
        key = (key, tuple(_signature(tensor) for tensor in inputs), torch.cuda.current_stream(device).cuda_stream)
        captured = self._graphs.get(key)
        if captured is not None:
            self._graphs.move_to_end(key)
            self._replay(captured, inputs)
            return
        uses = self._uses.pop(key, 0)
        if key in self._refused or uses < self.capture_after:
            self._uses[key] = uses + 1
            while len(self._uses) > 64 * self.capacity:  # forget shapes seen long ago
                self._uses.popitem(last=False)
            enqueue(to_device(inputs, device))
            return
        captured = self._capture(key, inputs, enqueue, device)
        if captured is None:
            enqueue(to_device(inputs, device))
            return
        self._graphs[key] = captured
        while len(self._graphs) > self.capacity:
            self._graphs.popitem(last=False)
        self._replay(captured, inputs)

    def clear(self) -> None:
        """Drop every graph (their memory pools go with them)."""
        self._graphs.clear()
        self._uses.clear()

    def _capture(self, key, inputs: Inputs, enqueue, device: torch.device) -> _Captured | None:
        statics = [None if tensor is None else torch.empty_like(tensor, device=device) for tensor in inputs]
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(current)
        try:
            with torch.cuda.stream(side):
                # thread_local: another thread's CUDA calls (the staged mover's worker) do not break it.
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    enqueue(statics)
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
        return _Captured(graph, statics, [None] * len(inputs))

    def _replay(self, captured: _Captured, inputs: Inputs) -> None:
        for index, (static, tensor) in enumerate(zip(captured.statics, inputs)):
            if tensor is None:
                continue
            if tensor.device.type == "cpu":
                last = captured.host_values[index]
                if last is not None and torch.equal(last, tensor):
                    continue  # the static already holds these values
                static.copy_(_pinned_copy(tensor), non_blocking=True)
                captured.host_values[index] = tensor.clone()
            else:
                static.copy_(tensor)
        captured.graph.replay()
        self.replays += 1


def _pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A pinned copy of a host tensor, from torch's host allocator (which keeps the block until
    the copies issued from it have run)."""
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True).copy_(tensor)


def _signature(tensor: torch.Tensor | None) -> tuple | None:
    if tensor is None:
        return None
    return tuple(tensor.shape), tensor.dtype, tensor.device.type
