"""Where a step of ``bench torchrec`` goes (:mod:`tiered_tbe.benchmarks.bench_torchrec`): each step's
time between CUDA events (:func:`timed_steps`), the host time of TorchRec's kernel around the TBE
module (:func:`adapter_host_ms`), and a profile of a few steps by pipeline stage and by embedding
call (:func:`profile_steps`). Both sides (ours and TorchRec's FBGEMM kernels) are measured by the same
code.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch

from tiered_tbe.base.mode import SIMULATION


def _stamp():
    if SIMULATION:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _ms(before, after) -> float:
    return (after - before) * 1e3 if SIMULATION else before.elapsed_time(after)


def timed_steps(pipeline, batches, count: int) -> list[float]:
    """Milliseconds of each of ``count`` steps: between CUDA events recorded as each step starts."""
    stamps = [_stamp()]
    for _ in range(count):
        pipeline.progress(batches)
        stamps.append(_stamp())
    if not SIMULATION:
        torch.cuda.synchronize()
    return [_ms(a, b) for a, b in zip(stamps, stamps[1:])]


EMBEDDING_MARK = "bench_torchrec: embedding"  # the TBE module's forward and prefetch
KERNEL_MARK = "bench_torchrec: kernel"  # TorchRec's kernel around it (ours: the adapter)
# The stage of the kernels that the profiler links to no launching op: those a CUDA graph replays (our
# prefetch's). Counted apart, so that a side's stages still add up to its GPU time.
UNLINKED_STAGE = "not linked to an op (CUDA graph replays)"


def _hook_forwards(module, enter, leave) -> list:
    """Forward pre-hook ``enter(module)`` and forward hook ``leave(module)`` on ``module``; their handles."""
    return [module.register_forward_pre_hook(lambda mod, inputs: enter(mod)),
            module.register_forward_hook(lambda mod, inputs, output: leave(mod))]


def _kernels_and_modules(model):
    """Each TorchRec kernel of the model's lookups, with its TBE module."""
    for lookup in _lookups(model):
        for kernel in getattr(lookup, "_emb_modules", []):
            yield kernel, kernel.emb_module


@contextlib.contextmanager
def marked_embedding_calls(model):
    """Profiler ranges around each TorchRec kernel's forward, its TBE module's forward and its prefetch."""
    from torch.profiler import record_function

    def mark(module, name: str) -> list:
        def enter(mod):
            mod.__dict__.setdefault("_bench_ranges", []).append(record_function(name))
            mod._bench_ranges[-1].__enter__()

        return _hook_forwards(module, enter, lambda mod: mod._bench_ranges.pop().__exit__(None, None, None))

    handles, wrapped = [], []
    for kernel, module in _kernels_and_modules(model):
        handles += mark(kernel, KERNEL_MARK) + mark(module, f"{EMBEDDING_MARK} forward")
        if hasattr(module, "prefetch"):
            def prefetch(*a, original=module.prefetch, **k):
                with record_function(f"{EMBEDDING_MARK} prefetch"):
                    return original(*a, **k)

            module.prefetch = prefetch
            wrapped.append(module)
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for module in wrapped:
            del module.prefetch


@contextlib.contextmanager
def timed_embedding_calls(model, totals: dict[str, float]):
    """Adds to ``totals["kernel"]`` and ``totals["module"]`` the host seconds of each TorchRec kernel's
    forward and of its TBE module's forward inside it, read with ``time.perf_counter`` (no profiler:
    the profiler's own cost per op weighs on a forward of few, short ops, and more on the adapter's
    ops than on the module's CUDA-graph replay)."""

    def mark(module, key: str) -> list:
        def leave(mod):
            totals[key] += time.perf_counter() - mod._bench_starts.pop()

        return _hook_forwards(module, lambda mod: mod.__dict__.setdefault("_bench_starts", []).append(
            time.perf_counter()), leave)

    handles = []
    for kernel, module in _kernels_and_modules(model):
        handles += mark(kernel, "kernel") + mark(module, "module")
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def adapter_host_ms(pipeline, model, batches, count: int) -> dict[str, float]:
    """Host ms per step, unprofiled: TorchRec's kernel forward (``kernel``), the TBE module's forward in
    it (``module``) and the difference (``around``: what the kernel adds around the module)."""
    totals = defaultdict(float)
    with timed_embedding_calls(model, totals):
        for _ in range(count):
            pipeline.progress(batches)
    kernel, module = (1e3 * totals[key] / count for key in ("kernel", "module"))
    return dict(kernel=kernel, module=module, around=kernel - module)


def _lookups(model):
    return list(getattr(model.module.embeddings, "_lookups", []))


def profile_steps(pipeline, model, batches, count: int, trace: str | None = None) -> dict:
    """Per step: GPU ms of the embedding lookups (forward, fused backward, prefetch) and of the rest by
    TorchRec's pipeline stage (its ``## ... ##`` ranges), from ``torch.profiler``, by the op that launched
    each kernel (``UNLINKED_STAGE``: kernels of no known op, a CUDA graph's); host ms of TorchRec's
    kernel forward and of the TBE module's inside it (the difference: what the kernel adds around it),
    of the embedding backward's autograd node, of each pipeline stage, and of the CUDA runtime calls
    (a long ``cudaStreamSynchronize`` or ``cudaMemcpy`` is the host waiting for the device).
    ``trace``: a path to write the profile to as a Chrome trace."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if not SIMULATION:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    with marked_embedding_calls(model), torch.profiler.profile(activities=activities) as profile:
        for _ in range(count):
            pipeline.progress(batches)
        if not SIMULATION:
            torch.cuda.synchronize()
    if trace:
        profile.export_chrome_trace(trace)
    gpu: dict[str, float] = defaultdict(float)
    host: dict[str, float] = defaultdict(float)
    stages: dict[str, float] = defaultdict(float)
    runtime: dict[str, float] = defaultdict(float)
    collective = 0.0
    unlinked = 0.0  # us of kernels no op is known to have launched (a CUDA graph's, replayed)
    for event in profile.events():
        if event.device_type != torch.autograd.DeviceType.CPU:
            unlinked += event.time_range.elapsed_us()
            continue
        per_step = event.cpu_time_total / 1e3 / count
        if event.name in (KERNEL_MARK, f"{EMBEDDING_MARK} forward"):
            host["kernel" if event.name == KERNEL_MARK else "module"] += per_step
        elif _is_embedding_backward(event.name):
            host["backward"] += per_step
        elif event.name.startswith("## ") and event.name.endswith(" ##"):
            stages[event.name.strip("# ")] += per_step
        elif event.name.startswith("cuda") and event.cpu_parent is not None:
            runtime[event.name] += per_step
        launched = sum(kernel.duration for kernel in event.kernels)  # us, kernels this op launched itself
        unlinked -= launched
        if launched:
            gpu[_stage_of(event)] += launched / 1e3 / count
        # NCCL's kernels (the input and output all-to-alls, the dense gradients' all-reduce): with several
        # ranks, the communication's share of the step. Gloo (CPU) launches none.
        collective += sum(kernel.duration for kernel in event.kernels if "nccl" in kernel.name.lower()) / 1e3 / count
    if unlinked / 1e3 / count >= 0.001:
        gpu[UNLINKED_STAGE] = unlinked / 1e3 / count
    def by_time(values: dict[str, float], most: int | None = None) -> dict[str, float]:
        return dict(sorted(values.items(), key=lambda item: -item[1])[:most])

    return dict(gpu_ms=by_time(gpu), host_ms=dict(host), host_stage_ms=by_time(stages, 8),
                cuda_runtime_ms=by_time(runtime, 6), collective_gpu_ms=collective)


def _is_embedding_backward(name: str) -> bool:
    return "evaluate_function" in name and ("TieredEmbeddingBagsFunction" in name or "LookupFunction" in name)


def _stage_of(event) -> str:
    """What a CPU op that launched kernels belongs to: an embedding lookup (our marks, or the backward of
    a TBE's autograd function), TorchRec's kernel around it, else the outermost pipeline stage around it."""
    stage, node = "other", event
    while node is not None:
        name = node.name
        if name.startswith(EMBEDDING_MARK):
            return "embedding " + name.removeprefix(EMBEDDING_MARK).strip()
        if name == KERNEL_MARK:
            return "kernel around the module (adapter)"
        if _is_embedding_backward(name):
            return "embedding backward"
        if name.startswith("## ") and name.endswith(" ##"):
            stage = name.strip("# ")
        elif "evaluate_function" in name and stage == "other":
            stage = "backward (dense, communication)"
        node = node.cpu_parent
    return stage
