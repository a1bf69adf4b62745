"""Launch a Triton kernel again without Triton's per-call Python work: ``launch(kernel, grid, ...)``.

Why: ``kernel[grid](*args)`` binds and specializes every argument, builds a cache key, looks up
the device and stream and assembles launch metadata in Python on every call. For kernels of 30-45
arguments that came to ~40-50 us a launch on the lent H200's host (benchmarks/RESULTS.md,
``profile_step.py --python``): the 8 launches of a training step cost more host time than their
GPU time, so the step waited for Python.

How: the first call of a kernel with arguments of a given *class* goes through Triton as usual
(compiling, or autotuning, if needed) and keeps the compiled kernel it returns. The class of a
call is everything Triton specializes a compiled kernel on: each tensor's dtype and 16-byte
alignment, each integer's size and whether it is 1 or a multiple of 16, each constexpr's value,
the launch options (``num_warps``), and for an autotuned kernel the values of its tuning keys.
Later calls of the same class hand the arguments, in signature order, straight to that compiled
kernel's launcher, as torch Inductor's generated launchers do. The class is at least as fine as
Triton's key, so a call never runs a kernel compiled for other arguments.

Not used (Triton's own path runs) in CPU simulation, in compile-only mode, when a Triton launch
hook is set (a profiler such as Proton), and for grids given as functions of anything but the
kernel's keyword arguments (``grid(meta)`` sees the keyword arguments and the tuned config only).
"""

from __future__ import annotations

import os

import torch
import triton
from triton.runtime import driver
from triton.runtime.autotuner import Autotuner

from tiered_tbe.base.mode import COMPILE_ONLY

from .addressing import INTERPRETING

ENABLED = not (INTERPRETING or COMPILE_ONLY or os.environ.get("TIERED_TBE_TRITON_LAUNCH") == "triton")


def _arg_class(value):
    """What Triton specializes a compiled kernel on for one argument (hashable)."""
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() & 15 == 0
    if isinstance(value, bool):
        return bool, value
    if isinstance(value, int):
        return int, value == 1, value & 15 == 0, -(1 << 31) <= value < (1 << 31), value >= (1 << 63)
    if isinstance(value, float):
        return float
    if isinstance(value, tuple):
        return tuple(_arg_class(item) for item in value)
    return value  # None, constexpr values, Triton functions passed as constexprs


class _Launcher:
    """The compiled kernels of one Triton function, by argument class (see the module docstring)."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.tuned = isinstance(kernel, Autotuner)
        self.function = kernel.fn if self.tuned else kernel
        self.arg_names = self.function.arg_names
        self.defaults = {param.name: param.default for param in self.function.params if param.has_default}
        self.tuning_keys = tuple(kernel.keys) if self.tuned else ()
        self.compiled: dict = {}

    def class_of(self, device: int, args: tuple, kwargs: dict) -> tuple:
        key = (device, tuple(_arg_class(arg) for arg in args), tuple(kwargs.items()))
        if self.tuning_keys:
            named = dict(zip(self.arg_names, args))
            key += tuple(named.get(name, kwargs.get(name)) for name in self.tuning_keys)
        return key

    def rest_of(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """After a launch through Triton: the values of the parameters that follow ``args``, in
        signature order (keyword arguments, the tuned config's, defaults), and the keyword
        arguments a grid function sees."""
        meta = dict(kwargs)
        if self.tuned:
            meta.update(self.kernel.best_config.all_kwargs())
        rest = tuple(meta[name] if name in meta else self.defaults[name] for name in self.arg_names[len(args):])
        return rest, meta

    def __call__(self, grid, args: tuple, kwargs: dict) -> None:
        device = driver.active.get_current_device()
        key = self.class_of(device, args, kwargs)
        entry = self.compiled.get(key)
        if entry is None or triton.knobs.runtime.launch_enter_hook is not None:
            compiled = self.kernel[grid](*args, **kwargs)  # Triton's own path: compiles or tunes if needed
            if getattr(compiled, "function", None) is not None:
                self.compiled[key] = (compiled, *self.rest_of(args, kwargs))
            return
        compiled, rest, meta = entry
        if callable(grid):
            grid = grid(meta)
        grid_y = grid[1] if len(grid) > 1 else 1
        grid_z = grid[2] if len(grid) > 2 else 1
        compiled.run(grid[0], grid_y, grid_z, driver.active.get_current_stream(device), compiled.function,
                     compiled.packed_metadata, None, None, None, *args, *rest)


_LAUNCHERS: dict[int, _Launcher] = {}


def launch(kernel, grid, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``, without Triton's per-call work once a call of the same
    argument class has run (module docstring). ``kernel``: a ``@triton.jit`` function or an
    ``@triton.autotune`` one; ``grid``: a tuple, or ``grid(meta)`` of the keyword arguments (and
    the tuned config's); ``args``: the leading arguments by position, ``kwargs`` the rest by name."""
    if not ENABLED:
        kernel[grid](*args, **kwargs)
        return
    launcher = _LAUNCHERS.get(id(kernel))
    if launcher is None:
        launcher = _LAUNCHERS[id(kernel)] = _Launcher(kernel)
    launcher(grid, args, kwargs)
