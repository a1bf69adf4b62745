"""Timing the training steps of several sides on the same batches (``bench fbgemm``).

- :func:`step_times` / :func:`time_steps`: each phase of each step (prefetch, forward, backward,
  the whole step) between CUDA events on the current stream, and the host's time to enqueue it;
- :func:`time_interleaved`: the sides taking turns, a few steps each, so that a host whose speed
  wanders slows every side alike;
- :func:`host_profile`: cProfile of steps, the autograd thread's backward included.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import threading
import time

from tiered_tbe.benchmarks import common, kernel_profile, sampling

ROUND_STEPS = 4  # timed steps a side takes in a row when the sides take turns (time_interleaved)


def time_steps(step, batches, grad, warmup: int, before=None, after_warmup=None,
               count: int | None = None, counters=None) -> dict[str, float]:
    """Median ms of forward, backward and the whole step over the batches after the first ``warmup``
    (CUDA events on the current stream), the timed steps' count (``steps``) and, with a prefetch,
    its total ms (``prefetch_total``); the arguments are :func:`step_times`'."""
    times = step_times(step, batches, grad, warmup, before, after_warmup, count, counters)
    result = medians(times)
    result["steps"] = len(times.get("step", []))
    if "prefetch" in times:
        result["prefetch_total"] = sum(times["prefetch"])
    return result


def medians(times: dict[str, list[float]]) -> dict[str, float]:
    return {phase: common.median(values) for phase, values in times.items()}


def step_times(step, batches, grad, warmup: int, before=None, after_warmup=None,
               count: int | None = None, counters=None) -> dict[str, list[float]]:
    """Ms of each phase (forward, backward, the whole step; ``prefetch`` with one) of each step after
    the first ``warmup`` (CUDA events on the current stream), and the host's ms to enqueue each
    (``host_*``).

    ``batches`` yields ``(indices, offsets, per_sample_weights or None)`` (taking the next one is
    part of the step: a PrefetchPipeline prefetches the batches ahead then); ``step(i, indices,
    offsets, weights) -> output [B, total dim]``, whose backward takes the first ``B`` rows of
    ``grad``; ``before(i, indices, offsets, weights)`` runs first each step, outside the forward (a
    prefetch), and is timed as ``prefetch``; ``after_warmup()`` runs once, before the first timed
    step; ``count`` steps at most (default: every batch); ``counters() -> {name: count so far}``
    (:func:`~tiered_tbe.benchmarks.common.step_counters`): each count's growth over the timed steps,
    per step, as ``{name}_per_step`` (one value)."""
    timer = common.StepTimer()
    host: dict[str, list[float]] = {}
    prefetching = before is not None or not isinstance(batches, list)  # a prefetch, or a pipeline's
    batches = iter(batches)
    counted_from = None
    for i in itertools.count() if count is None else range(count):
        timed = i >= warmup
        if i == warmup and after_warmup is not None:
            after_warmup()
        if i == warmup and counters is not None:
            counted_from = counters()
        if timed:
            timer.start()
        begin = time.perf_counter()
        # Inside the step: a PrefetchPipeline prefetches the batches ahead when it hands one over.
        # (kernel_profile.phase marks each phase for a kernel profile only; nothing otherwise.)
        with kernel_profile.phase("prefetch"):
            batch = next(batches, None)
            if batch is not None and before is not None:
                before(i, *batch)
        if batch is None:
            if timed:
                timer.discard()
            break
        indices, offsets, weights = batch
        if timed and prefetching:
            timer.mark("prefetch")
        enqueued = time.perf_counter()
        with kernel_profile.phase("forward"):
            out = step(i, indices, offsets, weights)
        if timed:
            timer.mark("forward")
        forwarded = time.perf_counter()
        with kernel_profile.phase("backward"):
            out.backward(grad[: out.shape[0]])
        if timed:
            timer.mark("backward")
            done = time.perf_counter()
            for phase, ms in (("prefetch", enqueued - begin), ("forward", forwarded - enqueued),
                              ("backward", done - forwarded)):
                host.setdefault(f"host_{phase}", []).append(ms * 1e3)
        del out
    counted = counters() if counted_from is not None else {}
    result = timer.phases()
    steps = len(result.get("step", []))
    if steps:
        result.update({f"{name}_per_step": [(value - counted_from[name]) / steps] for name, value in counted.items()})
    # Host ms to enqueue each phase: where it nears the device ms, the phase is launch-bound.
    result.update({phase: times for phase, times in host.items() if prefetching or phase != "host_prefetch"})
    return result


def time_interleaved(steps: dict, batches: list, grad, warmup: int, count: int, round_steps: int = ROUND_STEPS,
                     environments: dict[str, dict[str, str]] | None = None) -> dict[str, dict[str, float]]:
    """Median ms per phase of each side's steps (``steps``: name -> ``step(i, indices, offsets,
    weights)``, as in :func:`time_steps`), the sides taking turns: ``warmup`` untimed steps each,
    then rounds of ``round_steps`` timed steps each, in turn (the order reversed every other round),
    until each has ``count``. A host that slows down for a while (a shared one did, by up to 50%)
    then slows every side alike, where timing one side after the other skewed their ratio. ``environments``:
    variables set during a side's steps only (a tuning variant's tile)."""
    environments = environments or {}
    times: dict[str, dict[str, list[float]]] = {name: {} for name in steps}

    def take_turn(name: str, turn: list, warm: int) -> None:
        with environment(environments.get(name, {})):
            for phase, values in step_times(steps[name], turn, grad, warmup=warm).items():
                times[name].setdefault(phase, []).extend(values)

    for name in steps:
        take_turn(name, sampling.cycle(batches, warmup), warmup)
    order = list(steps)
    for round_number in range(-(-count // round_steps)):
        first = warmup + round_number * round_steps
        for name in order if round_number % 2 == 0 else order[::-1]:
            take_turn(name, sampling.cycle(batches, min(round_steps, count - round_number * round_steps), first), 0)
    return {name: medians(phase_times) for name, phase_times in times.items()}


@contextlib.contextmanager
def environment(variables: dict[str, str]):
    """``variables`` set in os.environ inside, restored after."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def host_profile(run, top: int) -> str:
    """cProfile of ``run()`` (our steps): the ``top`` functions by their own host time, then by
    cumulative time (where a launch-bound step's host time goes)."""
    import cProfile
    import io
    import pstats

    from tiered_tbe.function import TieredEmbeddingBagsFunction

    # On a GPU autograd runs backward on its own device thread, which a profiler enabled on this
    # thread does not see before Python 3.12 (from 3.12 cProfile, built on sys.monitoring, sees
    # every thread): there the backward gets a profiler of its own, enabled in its thread.
    profiler, backward_profiler = cProfile.Profile(), cProfile.Profile()
    backward = TieredEmbeddingBagsFunction.backward
    profiled_thread = threading.get_ident()

    def profiled_backward(ctx, grad_output):
        if threading.get_ident() == profiled_thread:  # a CPU run: this thread's profiler sees it
            return backward(ctx, grad_output)
        backward_profiler.enable()
        try:
            return backward(ctx, grad_output)
        finally:
            backward_profiler.disable()

    patch = sys.version_info < (3, 12)
    if patch:
        TieredEmbeddingBagsFunction.backward = staticmethod(profiled_backward)
    try:
        profiler.enable()
        run()
        common.synchronize()
        profiler.disable()
    finally:
        if patch:
            TieredEmbeddingBagsFunction.backward = staticmethod(backward)
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    if backward_profiler.getstats():
        stats.add(backward_profiler)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return text.getvalue()


def stepper(emb):
    """``step(i, indices, offsets, weights)`` of a module without a cache: its forward."""
    return lambda i, indices, offsets, weights: emb(indices, offsets, per_sample_weights=weights)
