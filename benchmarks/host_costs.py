"""Host microseconds per call of the operations a training step is made of, on this machine (GPU only).

A step bound by the host gets faster only by issuing fewer or cheaper calls; this prints what each
costs here: a Triton launch (3 and 19 arguments), a CUDA graph's replay, copies, events, stream
queries. On the lent H200's host (RESULTS.md, 2026-12-03): a Triton launch 17-34 us, a graph replay 4,
an event record 8, ``torch.cuda.current_stream()`` 7.

    python benchmarks/host_costs.py
"""

from __future__ import annotations

import sys
import threading
import time

import torch
import triton
import triton.language as tl

from tiered_tbe.base.mode import SIMULATION, describe_mode  # first: picks GPU / simulation mode


@triton.jit
def tiny(
    x_ptr,  # int32 [n]: incremented in place
    n,  # its length
    BLOCK: tl.constexpr,  # elements a program
):
    """A launch of three arguments: what the host pays for the smallest Triton kernel."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)


@triton.jit
def many(
    a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15,  # int32 [n]: a1 copied to a0
    n, m, k,  # n: the length; m, k: scalars a TBE kernel also passes (unused)
    BLOCK: tl.constexpr, P: tl.constexpr, Q: tl.constexpr,  # elements a program; constexprs (unused)
):
    """A launch of nineteen arguments, as many as the forward kernel's: the host's cost grows with them."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(a0 + i, tl.load(a1 + i, mask=i < n), mask=i < n)


def per_call(fn, calls=2000) -> tuple[float, float]:
    """Best and median host us per call of ``fn`` over five runs of ``calls / 5`` calls."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        begin = time.perf_counter()
        for _ in range(calls // 5):
            fn()
        times.append((time.perf_counter() - begin) / (calls // 5) * 1e6)
        torch.cuda.synchronize()
    return min(times), sorted(times)[2]


class _Nothing(torch.autograd.Function):
    """An autograd Function whose backward does nothing: ``.backward()`` through it costs the engine's
    hand-over to its device thread and back, the floor of any custom backward on a CUDA tensor."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def on_another_thread(fn):
    """``fn`` timed on a fresh thread, as autograd's device thread runs a backward."""
    result = []
    worker = threading.Thread(target=lambda: result.append(per_call(fn)))
    worker.start()
    worker.join()
    return result[0]


def main() -> int:
    print(describe_mode())
    if SIMULATION or not torch.cuda.is_available():
        print("host_costs measures the host's CUDA calls: it runs on a GPU machine only")
        return 0
    print("| operation | host us a call (best of 5) | median of 5 |")
    print("| --- | ---: | ---: |")
    x = torch.zeros(1 << 20, device="cuda", dtype=torch.int32)
    y = torch.zeros(1 << 20, device="cuda", dtype=torch.int32)
    small = torch.zeros(1024, device="cuda", dtype=torch.int32)
    pinned = torch.zeros(64, dtype=torch.uint8, pin_memory=True)
    dev = torch.zeros(64, dtype=torch.uint8, device="cuda")
    cpu = torch.zeros(8, dtype=torch.float32)
    event = torch.cuda.Event()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        tiny[(1,)](small, 1024, BLOCK=1024)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        tiny[(1,)](small, 1024, BLOCK=1024)
    args = [small] * 16
    x2, y2 = x.clone(), y.clone()
    leaf = torch.zeros(4, device="cuda", requires_grad=True)
    ones = torch.ones(4, device="cuda")
    cases = {
        "torch.empty(1M int32, cuda)": lambda: torch.empty(1 << 20, dtype=torch.int32, device="cuda"),
        "y.copy_(x) 4 MB d2d": lambda: y.copy_(x),
        "small.copy_ 4 KB d2d": lambda: small.copy_(small),
        "dev.copy_(pinned, non_blocking)": lambda: dev.copy_(pinned, non_blocking=True),
        "event.record()": lambda: event.record(),
        "event.query()": lambda: event.query(),
        "torch.tensor(8 floats) cpu": lambda: torch.tensor([1.0] * 8),
        "cpu.numpy().tobytes()": lambda: cpu.numpy().tobytes(),
        "x + 1 (elementwise kernel)": lambda: x.add_(1),
        "triton tiny[(1,)] 3 args": lambda: tiny[(1,)](small, 1024, BLOCK=1024),
        "triton many[(1,)] 19 args": lambda: many[(1,)](*args, 1024, 7, 3, BLOCK=1024, P=1, Q=2),
        "graph.replay() 1 kernel": lambda: g.replay(),
        "torch.cuda.current_stream()": lambda: torch.cuda.current_stream(),
        "torch.is_grad_enabled()": lambda: torch.is_grad_enabled(),
        "two y.copy_(x) 4 MB d2d": lambda: (y.copy_(x), y2.copy_(x2)),
        "torch._foreach_copy_ of two 4 MB d2d": lambda: torch._foreach_copy_([y, y2], [x, x2]),
        "autograd backward through a Function doing nothing": lambda: _Nothing.apply(leaf).backward(ones),
    }
    for name, fn in cases.items():
        best, mid = per_call(fn)
        print(f"| {name} | {best:.1f} | {mid:.1f} |")
    for name in ("y.copy_(x) 4 MB d2d", "two y.copy_(x) 4 MB d2d", "torch._foreach_copy_ of two 4 MB d2d",
                 "dev.copy_(pinned, non_blocking)", "graph.replay() 1 kernel"):
        best, mid = on_another_thread(cases[name])
        print(f"| {name}, on another thread | {best:.1f} | {mid:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
