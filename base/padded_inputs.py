"""Graph inputs padded where a replay copies them in, not before.

A batch whose size changes every step is padded to one of a few sizes (``graphs.padded_size``) so that its
launches replay a few CUDA graphs. Padded first (``torch.cat`` of the batch and a tail) and then copied into
the graph's static tensor, each array crosses HBM twice and costs the host two ops more (the tail and the
``cat``); a ragged step pads ~11 arrays (kernels/grouping.py ``pad_batch``, the prefetch's rows, the unlocks).
A :class:`PaddedInput` names the padded array instead: a replay copies the batch's entries into the head of
the static tensor and the tail from a constant buffer (:meth:`PaddedInput.copy_pairs`), in the one
multi-tensor copy that moves every input (``StepGraphs._replay``). Eager runs and captures see the padded
tensor itself (:meth:`PaddedInput.materialize`), the same values. Other layouts implement
:class:`LaidOutInput` where they belong (kernels/grouping.py ``PaddedBags``: offsets at more bags a feature).
"""

from __future__ import annotations

import threading

import torch

from .streams import current_stream_handle

POSITIONS = "positions"  # a PaddedInput's fill: each padding entry holds its own position (N .. size - 1)


class LaidOutInput:
    """A graph input that a replay lays out in its static tensor from parts (:meth:`copy_pairs`), where an
    eager run or a capture gets the laid-out tensor itself (:meth:`materialize`). 1-D, ``size`` entries."""

    __slots__ = ()
    size: int

    def data(self) -> torch.Tensor:
        """The batch's tensor the layout reads (its dtype and device are the laid-out tensor's)."""
        raise NotImplementedError

    @property
    def dtype(self) -> torch.dtype:
        return self.data().dtype

    @property
    def device(self) -> torch.device:
        return self.data().device

    @property
    def shape(self) -> tuple[int]:
        return (self.size,)

    def numel(self) -> int:
        return self.size

    def materialize(self) -> torch.Tensor:
        """The laid-out tensor, [size] (a new tensor)."""
        raise NotImplementedError

    def copy_pairs(self, static: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``(targets, sources)``: copying each source into its target (one ``torch._foreach_copy_``) leaves
        ``static`` [size] equal to :meth:`materialize`."""
        raise NotImplementedError


class PaddedInput(LaidOutInput):
    """A 1-D device tensor laid out at ``size`` entries: ``tensor`` [N], then ``size - N`` entries of
    ``fill`` (a number, or :data:`POSITIONS`). ``N < size`` (:func:`padded_input` returns the tensor
    itself otherwise)."""

    __slots__ = ("tensor", "size", "fill")

    def __init__(self, tensor: torch.Tensor, size: int, fill: int | float | str):
        self.tensor = tensor  # [N] the batch's entries, on the device
        self.size = size  # the padded length
        self.fill = fill  # the padding's value, or POSITIONS

    def data(self) -> torch.Tensor:
        return self.tensor

    def materialize(self) -> torch.Tensor:
        extra = self.size - self.tensor.numel()
        if self.fill == POSITIONS:
            tail = torch.arange(self.tensor.numel(), self.size, dtype=self.dtype, device=self.device)
        else:
            tail = self.tensor.new_full((extra,), self.fill)
        return torch.cat([self.tensor, tail])

    def copy_pairs(self, static: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The head from the batch, the tail from a kept buffer of the padding."""
        count = self.tensor.numel()
        return [static[:count], static[count:]], [self.tensor, _padding(self)]


def padded_input(tensor: torch.Tensor | None, size: int, fill: int | float | str
                 ) -> torch.Tensor | PaddedInput | None:
    """``tensor`` [N] to be laid out at ``size`` entries of which the last ``size - N`` hold ``fill``: a
    :class:`PaddedInput`, or ``tensor`` itself when ``size <= N`` (or it is None)."""
    if tensor is None or size <= tensor.numel():
        return tensor
    return PaddedInput(tensor, size, fill)


def materialized(value):
    """``value`` as a tensor: a :class:`LaidOutInput` laid out, anything else as it is."""
    return value.materialize() if isinstance(value, LaidOutInput) else value


_LOCK = threading.Lock()  # the forward's replays run on the caller's thread, the backward's on autograd's
# Constant padding, by (device, stream, dtype, fill): read by later replays' copies and never written again.
# Per stream, so that a buffer's own fill kernel runs before every copy that reads it without an event.
_TAILS: dict[tuple, torch.Tensor] = {}
# Buffers a larger one replaced: kept, since a copy enqueued on another stream may still read them and the
# allocator would hand their memory out again (each at most half its successor: the total stays within 2x).
_RETIRED: list[torch.Tensor] = []


def _padding(padded: PaddedInput) -> torch.Tensor:
    """A view of ``size - N`` entries holding ``padded``'s padding, from a buffer kept for later replays."""
    count = padded.tensor.numel()
    positions = padded.fill == POSITIONS
    start, need = (count, padded.size) if positions else (0, padded.size - count)
    stream = current_stream_handle(padded.device) if padded.device.type == "cuda" else 0
    key = (padded.device, stream, padded.dtype, padded.fill)
    with _LOCK:
        buffer = _TAILS.get(key)
        if buffer is None or buffer.numel() < need:
            length = max(need, 2 * (0 if buffer is None else buffer.numel()))
            if buffer is not None:
                _RETIRED.append(buffer)
            buffer = (torch.arange(length, dtype=padded.dtype, device=padded.device) if positions
                      else torch.full((length,), padded.fill, dtype=padded.dtype, device=padded.device))
            _TAILS[key] = buffer
    return buffer[start:start + padded.size - count]
