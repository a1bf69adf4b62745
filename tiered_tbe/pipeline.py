"""``PrefetchPipeline``: fill the slot cache for the next batches while this one trains.

Schedule, per module, with ``k = depth`` (``P`` = prefetch, ``F``/``B`` = the module's
forward/backward, all ``B`` and ``F`` on the training stream, all ``P`` on a side stream):

1. When batch ``i`` is handed to the loop, ``P(i+k)`` is issued on the side stream, after the
   training stream's work so far: it starts once ``B(i-1)`` has run, and first unlocks the
   batches released since the last prefetch (``B(i-1)``'s), so their rows may be evicted.
2. ``F(i)`` waits only for ``P(i)`` (issued k steps earlier), so ``P(i+k)`` overlaps ``F(i)``,
   ``B(i)`` and the dense work of step ``i`` and beyond: nothing on the training stream waits
   for it until ``F(i+k)``.
3. ``B(i)`` waits for no prefetch. Its rows are where ``P(i)`` put them: a slot locked until its
   unlock, or (no free way) the backing store, and a later prefetch copies none of those rows
   into a slot until batch ``i`` is unlocked (``tiered_tbe.cache.policy``, "Rows left in the
   backing store"). So training equals serial training, bitwise.
4. With ``fit_cache``, ``k`` falls while prefetches find the cache full or a smaller ``k`` steps faster
   (``tiered_tbe/ahead.py``); at ``k = 0`` ``P(i+1)`` is issued after step ``i``, which the serial loop does.

Rows of every batch in flight stay locked from its prefetch until its backward (or its
forward, under no_grad; or when the pipeline closes) has run and the next prefetch has
unlocked them, on the side stream, so a prefetch never evicts them, and unlocks never run beside a
prefetch.

With the staged row mover (``CacheConfig(mover="staged")``) ``P(i+k)`` on the side stream only
decides and lists what moves; host threads and the mover's copy streams carry the rows while
steps ``i .. i+k-1`` train, and ``F(i+k)`` waits for that batch's fill alone (on the host until
the mover has issued it, then on the device). The training stream is left with the lookup
kernels. A forward inside the loop of a batch the pipeline never prefetched (an evaluation batch)
prefetches itself on the training stream, ordered after the side stream's prefetches by events.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from tiered_tbe.ahead import AheadControl, StepTimer
from tiered_tbe.base.streams import loop_stream
from tiered_tbe.cache.hints import DEFAULT_LOOKAHEAD, MAX_LOOKAHEAD
from tiered_tbe.module import TieredEmbeddingBags

LookupsOf = Callable[[Any], Mapping[str, tuple[torch.Tensor, torch.Tensor]] | tuple[torch.Tensor, torch.Tensor]]


def _same_device(a: torch.device, b: torch.device) -> bool:
    """Whether ``a`` and ``b`` name one device: ``cuda`` means the current CUDA device, so it
    equals ``cuda:0`` when that is current (``torch.device`` equality says they differ)."""
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    current = torch.cuda.current_device()
    return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)


def _move(obj: Any, device: torch.device) -> Any:
    """Tensors anywhere in tuples, lists, dicts and dataclasses, moved to ``device``.

    On CUDA the copies are non-blocking, from pinned memory, on the current stream (the caller
    records every moved tensor on the training stream, ``record_stream``, before it is used there).
    """
    if isinstance(obj, torch.Tensor):
        if _same_device(obj.device, device):
            return obj
        if device.type == "cuda" and obj.device.type == "cpu" and not obj.is_pinned():
            obj = obj.pin_memory()
        return obj.to(device, non_blocking=device.type == "cuda")
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_move(x, device) for x in obj)
    if isinstance(obj, tuple):  # NamedTuple
        return type(obj)(*(_move(x, device) for x in obj))
    if isinstance(obj, dict):
        return {k: _move(v, device) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(
            obj, **{f.name: _move(getattr(obj, f.name), device) for f in dataclasses.fields(obj) if f.init}
        )
    return obj


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, f.name))


class PrefetchPipeline:
    """Iterate over ``batches`` with the cache of every tiered module filled ``depth`` batches ahead.

    Args:
        model: an ``nn.Module`` holding one or more :class:`TieredEmbeddingBags` (or one itself).
        batches: any iterable of batches (tensors in tuples, dicts, dataclasses; on the CPU or
            already on the device).
        depth: batches prefetched ahead of the one training, 1 to 8. With depth 1 the next
            batch's prefetch still overlaps this step's dense work.
        lookups: ``batch -> {module name: (indices, offsets)}`` (names as in
            ``model.named_modules()``), or ``batch -> (indices, offsets)`` when the model has
            one tiered module. Default: ``(batch[0], batch[1])`` for a tuple batch, or the
            ``indices`` / ``offsets`` attributes.
        lookahead: batches beyond the one being prefetched whose rows tell a ``"lookahead"``
            cache which rows are needed soonest (pulled from ``batches`` early and kept on the
            device; default ``DEFAULT_LOOKAHEAD`` when a module uses the lookahead policy, else
            0; at most ``MAX_LOOKAHEAD`` = 64). Longer windows move fewer rows (see
            docs/hit_rates.md); each batch's rows are recorded once, when it enters the
            window, so the window's length costs device memory for its batches, not time.
        high_priority: on CUDA, run the loop's steps on a stream of the device's highest
            priority (made to wait for the work queued before the loop; the stream current at
            the end waits for it). The GPU then schedules the training kernels' blocks before
            the prefetch's pending copy blocks, which otherwise hold every SM while they move
            rows over the bus (results/measurements.jsonl). False keeps the steps on the current stream.
        fit_cache: hold fewer batches ahead (down to none: each batch prefetched after the step before it)
            while the batches in flight hold more rows than the cache has room for, seen as prefetches that
            leave rows without a slot, or while fewer ahead step faster, timed on the training stream
            (``tiered_tbe/ahead.py``: both read without a host sync; other depths are tried again every
            ``PROBE_STEPS`` steps). The training is the same, bit for bit, at any depth.

    Use it as a plain iterator or a context manager; ``close()`` (also on exceptions, and at the
    end of iteration) releases the locks of batches prefetched but never trained.

    Errors: an exception met while reading or prefetching ahead (``batches`` raising, ``lookups``
    raising, a batch refused by a module's checks) is raised where a serial loop would meet it:
    after the batches before it have been handed out. A batch whose step never reached the
    module's forward (the step raised, and the loop went on) is dropped, its locks released, when
    the next batch is asked for.
    """

    def __init__(self, model: nn.Module, batches: Iterable, depth: int = 2, lookups: LookupsOf | None = None,
                 lookahead: int | None = None, high_priority: bool = True, fit_cache: bool = False):
        if not 1 <= depth <= 8:
            raise ValueError(f"depth must be between 1 and 8, got {depth}")
        if lookahead is not None and not 0 <= lookahead <= MAX_LOOKAHEAD:
            raise ValueError(f"lookahead must be between 0 and MAX_LOOKAHEAD = {MAX_LOOKAHEAD}, got {lookahead}")
        self.modules = {name: m for name, m in model.named_modules() if isinstance(m, TieredEmbeddingBags)}
        if not self.modules:
            raise ValueError("PrefetchPipeline: the model holds no TieredEmbeddingBags")
        self.depth = depth
        self.lookups_of = lookups or _default_lookups
        self.batches = iter(batches)
        self.device = next(iter(self.modules.values())).device
        self.is_cuda = self.device.type == "cuda"
        # The streams of every pipeline on this device (base/streams.loop_stream): a pipeline per epoch
        # replays the graphs the one before captured.
        self.side_stream = loop_stream(self.device, "prefetch") if self.is_cuda else None
        # Where the loop's steps run: a stream of the device's highest priority, or the stream
        # current when iteration starts (set then).
        self.high_priority_stream = (loop_stream(self.device, "training", priority=-100)  # clamped to the highest
                                     if self.is_cuda and high_priority else None)
        self.training_stream: torch.cuda.Stream | None = None
        # Prefetched, not yet trained: (batch, lookups by module, event after its prefetch).
        self.queue: deque[tuple[Any, dict, torch.cuda.Event | None]] = deque()
        # Moved to the device, not yet prefetched: (batch, lookups by module, hint rows by module).
        self.upcoming: deque[tuple[Any, dict, dict]] = deque()
        uses_lookahead = any(m.uses_lookahead for m in self.modules.values())
        self.lookahead = lookahead if lookahead is not None else (DEFAULT_LOOKAHEAD if uses_lookahead else 0)
        # Met while reading or prefetching ahead: raised once the batches queued before it are handed out;
        # nothing is read or prefetched after it.
        self.error: Exception | None = None
        self.closed = False
        # fit_cache: fewer batches ahead while prefetches find the cache's sets full (tiered_tbe/ahead.py).
        self.ahead_control = AheadControl(depth, [m.cache for m in self.modules.values() if m.cache is not None]) \
            if fit_cache else None

    # --------------------------------------------------------------- plumbing
    def _lookups_by_module(self, batch) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        found = self.lookups_of(batch)
        if isinstance(found, tuple):
            if len(self.modules) != 1:
                raise ValueError("lookups returned one (indices, offsets) pair but the model has several "
                                 f"tiered modules: {list(self.modules)}; return a dict keyed by module name")
            return {next(iter(self.modules)): found}
        unknown = set(found) - set(self.modules)
        if unknown:
            raise ValueError(f"lookups named {sorted(unknown)}, not tiered modules of the model {list(self.modules)}")
        return dict(found)

    def _pull(self) -> bool:
        """Take the next batch from the user's iterable and start moving it to the device; False
        when none is left, or it failed (``self.error``)."""
        if self.error is not None:
            return False
        try:
            batch = next(self.batches)
            with self._on_side_stream():
                batch = _move(batch, self.device)
            lookups = self._lookups_by_module(batch)
            # Rows a lookahead cache is told about, once per batch, when it enters the window: in the
            # prefetch that pulled it, so their count (rows_for_hint) cannot have reached the host and the
            # cache records the padded rows, whose padding it ignores.
            with self._on_side_stream():
                hint_rows = {name: self.modules[name].rows_for_hint(indices, offsets)[0]
                             for name, (indices, offsets) in lookups.items() if self.modules[name].uses_lookahead}
        except StopIteration:
            return False
        except Exception as error:  # raised after the batches pulled before it (KeyboardInterrupt: at once)
            self.error = error
            return False
        self.upcoming.append((batch, lookups, hint_rows))
        return True

    def _prefetch_next(self) -> bool:
        """Prefetch the oldest upcoming batch on the side stream; False when none is left.

        For lookahead caches the ``lookahead`` batches after it (pulled now if need be) tell
        the cache when each cached row is needed next, so it evicts the row needed latest.
        """
        while len(self.upcoming) < 1 + self.lookahead and self._pull():
            pass
        if not self.upcoming:  # (after an error: the batches pulled before it are still prefetched)
            return False
        batch, lookups, _ = self.upcoming.popleft()
        window = [hint_rows for _, _, hint_rows in list(self.upcoming)[: self.lookahead]]
        if self.is_cuda:
            # The prefetch may evict rows that earlier backwards wrote: start after them.
            self.side_stream.wait_stream(self.training_stream)
        try:
            with self._on_side_stream():
                for name, (indices, offsets) in lookups.items():
                    module = self.modules[name]
                    if module.uses_lookahead:
                        module.hint_upcoming([hint_rows[name] for hint_rows in window])
                    module.prefetch(indices, offsets, defer_unlock=True)
                if self.ahead_control is not None:
                    self.ahead_control.record()
                ready = None
                if self.is_cuda:
                    ready = torch.cuda.Event()
                    ready.record(self.side_stream)
        except Exception as error:
            # Refused (a module's checks): raised in its turn. The modules that prefetched it already
            # hold it at the end of their queues, and release it when the pipeline closes.
            self.error = error
            self.upcoming.clear()
            return False
        self.queue.append((batch, lookups, ready))
        return True

    # --------------------------------------------------------------- iteration
    def __iter__(self) -> Iterator:
        if self.is_cuda:
            self.training_stream = torch.cuda.current_stream(self.device)
            if self.high_priority_stream is not None:
                self.high_priority_stream.wait_stream(self.training_stream)  # the work before the loop
                self.training_stream = self.high_priority_stream
        if self.ahead_control is not None:  # steps timed where they run (on the CPU: by the host's clock)
            self.ahead_control.timer = StepTimer(self.training_stream)
        try:
            while len(self.queue) < self.depth and self._prefetch_next():
                pass
            while self.queue and not self.closed:
                batch, lookups, ready = self.queue.popleft()
                ahead = self.depth if self.ahead_control is None else self.ahead_control.update()
                while len(self.queue) < ahead and self._prefetch_next():  # P(i + ahead), overlapping this step
                    pass
                if ready is not None:
                    self.training_stream.wait_event(ready)
                    for tensor in _tensors(batch):
                        if tensor.is_cuda:
                            tensor.record_stream(self.training_stream)
                with self._step_context():
                    yield batch
                # The step is over: a module whose forward it never reached still holds the batch first in
                # its queue (the next forward would find it in the way).
                for name, (indices, offsets) in lookups.items():
                    self.modules[name].drop_prefetched(indices, offsets)
                if not self.queue:  # none ahead (fit_cache): the next batch's prefetch follows this step
                    self._prefetch_next()
            if self.error is not None and not self.closed:
                raise self.error
        finally:
            self.close()

    def _step_context(self) -> contextlib.AbstractContextManager:
        """The user's step runs on the high-priority stream, when there is one."""
        if self.high_priority_stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.high_priority_stream)

    def _on_side_stream(self) -> contextlib.AbstractContextManager:
        """Work issued inside runs on the side stream (on the CPU: in order, as it comes)."""
        return torch.cuda.stream(self.side_stream) if self.is_cuda else contextlib.nullcontext()

    def close(self) -> None:
        """Release every lock still held by batches prefetched but not trained."""
        if self.closed:
            return
        self.closed = True
        self.queue.clear()
        self.upcoming.clear()
        if self.is_cuda:  # the unlocks below run here, after the prefetches they release
            torch.cuda.current_stream(self.device).wait_stream(self.side_stream)
        for module in self.modules.values():
            module.cancel_prefetched()
            if module.uses_lookahead:  # hints of batches this pipeline pulled but will not prefetch
                module.cache.clear_upcoming()
        if self.high_priority_stream is not None and self.training_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.high_priority_stream)  # the loop's steps

    def __enter__(self) -> PrefetchPipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _default_lookups(batch) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        return batch[0], batch[1]
    if hasattr(batch, "indices") and hasattr(batch, "offsets"):
        return batch.indices, batch.offsets
    raise ValueError("PrefetchPipeline cannot find (indices, offsets) in a batch: pass lookups=")
