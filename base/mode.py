"""Choose between GPU mode and CPU simulation mode, before triton or numba is imported.

Triton reads ``TRITON_INTERPRET`` when a kernel is decorated and numba reads
``NUMBA_ENABLE_CUDASIM`` when ``numba.cuda`` is first imported, so the choice must be made
before either happens. Importing :mod:`tiered_tbe` makes it: without a CUDA device (or with
``TIERED_TBE_SIMULATE=1``) both variables are set and the same Triton and Numba kernels run
on CPU tensors. Simulation proves logic, never speed or freedom from races.
"""

import os
import sys

import torch

_FORCED = os.environ.get("TIERED_TBE_SIMULATE", "") not in ("", "0")

SIMULATION: bool = _FORCED or not torch.cuda.is_available()
"""True when kernels run in CPU simulation (Triton interpreter + Numba CUDA simulator)."""

# tools/compile_kernels.py compiles the Triton kernels for a GPU on a machine without one:
# they are compiled, never run, so the interpreter is deliberately off.
COMPILE_ONLY: bool = os.environ.get("TIERED_TBE_COMPILE_ONLY", "") not in ("", "0")

if SIMULATION and not COMPILE_ONLY:
    late = [m for m in ("triton", "numba.cuda") if m in sys.modules]
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
    if late and os.environ.get("TRITON_INTERPRET") != "1":
        raise ImportError(
            f"tiered_tbe needs CPU simulation mode (no CUDA device), but {late} were imported before "
            "tiered_tbe without TRITON_INTERPRET=1 / NUMBA_ENABLE_CUDASIM=1. Import tiered_tbe first, "
            "or set both variables in the environment."
        )


def default_device() -> torch.device:
    """``cuda`` when kernels run on a GPU, else ``cpu`` (simulation)."""
    return torch.device("cpu" if SIMULATION else "cuda")


def describe_mode() -> str:
    """One line saying where the kernels run, for CLIs and logs."""
    if SIMULATION:
        return ("CPU simulation mode (TRITON_INTERPRET=1, NUMBA_ENABLE_CUDASIM=1): results are exact, "
                "speed is not meaningful")
    return f"GPU mode on {torch.cuda.get_device_name()}"
