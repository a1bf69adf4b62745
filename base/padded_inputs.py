"""Graph inputs padded where a replay copies them in, not before.

A batch whose size changes every step is padded to one of a few sizes (``graphs.padded_size``) so that its
launches replay a few CUDA graphs. Padded first (``torch.cat`` of the batch and a tail) and then copied into
the graph's static tensor, each array crosses HBM twice and costs the host two ops more (the tail and the
``cat``); a ragged step pads ~11 arrays (kernels/grouping.py ``pad_batch``, the prefetch's rows, the unlocks).
A :class:`PaddedInput` names the padded array instead: a replay copies the batch's entries into the head of
the static tensor and the tail from a constant buffer (:func:`copy_pairs`), in the one multi-tensor copy
that moves every input (``StepGraphs._replay``). Eager runs and captures see the padded tensor itself
(:meth:`PaddedInput.materialize`), the same values.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import torch

from .streams import current_stream_handle

POSITIONS = "positions"  # a PaddedInput's fill: each padding entry holds its own position (N .. size - 1)


class PaddedInput(NamedTuple):
    """A 1-D device tensor laid out at ``size`` entries: ``tensor`` [N], then ``size - N`` entries of
    ``fill`` (a number, or :data:`POSITIONS`). ``N < size`` (:func:`padded_input` returns the tensor
    itself otherwise)."""

    tensor: torch.Tensor  # [N] the batch's entries, on the device
    size: int  # the padded length
    fill: int | float | str  # the padding's value, or POSITIONS

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    @property
    def shape(self) -> tuple[int]:
        return (self.size,)

    def numel(self) -> int:
        return self.size

    def materialize(self) -> torch.Tensor:
        """The padded tensor, [size] (a new tensor: one ``cat``)."""
        extra = self.size - self.tensor.numel()
        if self.fill == POSITIONS:
            tail = torch.arange(self.tensor.numel(), self.size, dtype=self.dtype, device=self.device)
        else:
            tail = self.tensor.new_full((extra,), self.fill)
        return torch.cat([self.tensor, tail])


def padded_input(tensor: torch.Tensor | None, size: int, fill: int | float | str
                 ) -> torch.Tensor | PaddedInput | None:
    """``tensor`` [N] to be laid out at ``size`` entries of which the last ``size - N`` hold ``fill``: a
    :class:`PaddedInput`, or ``tensor`` itself when ``size <= N`` (or it is None)."""
    if tensor is None or size <= tensor.numel():
        return tensor
    return PaddedInput(tensor, size, fill)


def materialized(value):
    """``value`` as a tensor: a :class:`PaddedInput` padded, anything else as it is."""
    return value.materialize() if isinstance(value, PaddedInput) else value


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


def copy_pairs(static: torch.Tensor, padded: PaddedInput) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(targets, sources)``: copying each source into its target leaves ``static`` [size] equal to
    ``padded.materialize()`` (the head from the batch, the tail from a kept buffer of the padding)."""
    count = padded.tensor.numel()
    return [static[:count], static[count:]], [padded.tensor, _padding(padded)]
