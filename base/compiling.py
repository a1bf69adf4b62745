"""What a process compiled: a count of kernel compiles and disk-cache loads, and one line to stderr.

The first steps of a new model shape compile the Triton kernels of that shape (and, in a process,
the slot cache's Numba kernels): seconds where a step takes milliseconds. Both compilers keep
what they compiled on disk (Triton under ``TRITON_CACHE_DIR``, default ``~/.triton/cache``; the
Numba kernels under ``cache/launch.py``'s folder), so a second process loads instead of compiling.
When a kernel is really compiled (not loaded), this module prints, once a process::

    tiered-tbe: compiling kernels for this shape (first steps are slow)...

Triton tells through its compilation listener (``triton.knobs.compilation.listener``, called
with ``cache_hit``), which :func:`watch_triton_compiles` installs beside any listener already
there; the cache's launcher reports Numba compiles (:func:`count`).
"""

from __future__ import annotations

import os
import sys
from collections import Counter

MESSAGE = "tiered-tbe: compiling kernels for this shape (first steps are slow)..."

# Kernels compiled and loaded from disk in this process: "triton compiled", "triton loaded",
# "numba compiled", "numba loaded", "cub compiled", "cub loaded" (the sorts).
COUNTS: Counter = Counter()
_announced = False


def count(compiler: str, compiled: int = 0, loaded: int = 0) -> None:
    """Record ``compiled`` kernels compiled and ``loaded`` loaded from the disk cache by
    ``compiler`` (``"triton"``, ``"numba"`` or ``"cub"``: ``base/sorting.py``); the first real
    compile prints :data:`MESSAGE` (unless ``TIERED_TBE_QUIET_COMPILE=1``)."""
    global _announced
    COUNTS[f"{compiler} compiled"] += compiled
    COUNTS[f"{compiler} loaded"] += loaded
    if compiled and not _announced:
        _announced = True
        if os.environ.get("TIERED_TBE_QUIET_COMPILE", "0") != "1":
            print(MESSAGE, file=sys.stderr, flush=True)


def watch_triton_compiles() -> bool:
    """Count Triton's compiles and disk-cache loads (chaining a listener set before); False
    where this Triton has no compilation listener (before 3.4: then nothing is counted)."""
    try:
        from triton import knobs
    except ImportError:
        return False
    compilation = getattr(knobs, "compilation", None)
    if compilation is None or not hasattr(compilation, "listener"):
        return False
    previous = compilation.listener
    if getattr(previous, "counts_for_tiered_tbe", False):
        return True

    def listener(*args, **kwargs):
        hit = kwargs.get("cache_hit", False)
        count("triton", compiled=0 if hit else 1, loaded=1 if hit else 0)
        if previous is not None:
            previous(*args, **kwargs)

    listener.counts_for_tiered_tbe = True
    compilation.listener = listener
    return True
