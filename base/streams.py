"""The current CUDA stream and events on it, at a few microseconds of host time each.

``torch.cuda.current_stream()`` builds a new Python ``Stream`` object on every call (4.7 us of host time
on the H200 machine, ``tools/host_costs.py``), and ``torch.cuda.Event.record()`` and
``Stream.record_event()`` call it (the latter also makes an event). A training step with a cache does a
handful of these on the path between a batch's kernels, where the GPU waits for the host
(``docs/performance.md``, "Host time of a cached DMP step"). Here the raw handle of the current stream
keys a cache of its ``Stream`` object (0.6 us a lookup).
"""

from __future__ import annotations

import functools

import torch

# (device index, raw stream handle) -> its Stream. Torch's streams (its pools and torch.cuda.Stream) are
# never destroyed, so a handle names one stream for the life of the process; an external stream whose
# handle is reused after it was destroyed is, for recording and waiting, the stream behind that handle.
_STREAMS: dict[tuple[int, int], torch.cuda.Stream] = {}


def device_index(device: torch.device) -> int:
    """The CUDA device index of ``device`` (``cuda`` alone: the current device)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def on_own_device(method):
    """Run a method of an object that has a ``device`` with that GPU current: Triton launches on the current
    device (and its stream), so a module on ``cuda:1`` called while GPU 0 is current would launch on GPU 0
    (FBGEMM's ops guard their device the same way). A no-op on the CPU, for ``cuda`` without an index, and
    where that GPU is current already (a torchrun rank's), at ~1 us of host time."""

    @functools.wraps(method)
    def on_device(self, *args, **kwargs):
        device = self.device
        if device.type != "cuda" or device.index is None or torch.cuda.current_device() == device.index:
            return method(self, *args, **kwargs)
        with torch.cuda.device(device.index):
            return method(self, *args, **kwargs)

    return on_device


def current_stream_handle(device: torch.device) -> int:
    """``torch.cuda.current_stream(device).cuda_stream`` without building a Stream object (Triton's
    launcher reads it so)."""
    return torch._C._cuda_getCurrentRawStream(device_index(device))


def current_stream(device: torch.device) -> torch.cuda.Stream:
    """``torch.cuda.current_stream(device)``, the same object for as long as the stream is current."""
    index = device_index(device)
    key = (index, torch._C._cuda_getCurrentRawStream(index))  # current_stream_handle's, index known
    stream = _STREAMS.get(key)
    if stream is None:
        stream = _STREAMS[key] = torch.cuda.current_stream(index)
    return stream


def record(event: torch.cuda.Event, device: torch.device) -> torch.cuda.Event:
    """Record ``event`` on the current stream of ``device``; returns it."""
    event.record(current_stream(device))
    return event


# (device index, role) -> the stream every loop of that role uses on that device.
_LOOP_STREAMS: dict[tuple[int, str], torch.cuda.Stream] = {}


def loop_stream(device: torch.device, role: str, priority: int = 0) -> torch.cuda.Stream:
    """The one stream of ``role`` (``"prefetch"``, ``"training"``, ...) on ``device`` for the process, made
    on first use with ``priority``. A CUDA graph is keyed by the stream it was captured on
    (``base/graphs.py``): a loop made anew each epoch with streams of its own captured every graph again,
    each epoch (a ragged pipeline's third pass: 16 captures in 12 steps on the H100, e6a65a5). Two loops
    running at once on one device share the streams, which orders their work; events order it anyway."""
    key = (device_index(device), role)
    stream = _LOOP_STREAMS.get(key)
    if stream is None:
        stream = _LOOP_STREAMS[key] = torch.cuda.Stream(device=device, priority=priority)
    return stream
