"""Triton's interpreter (CPU simulation) without its repeated patches of ``triton.language``.

The interpreter runs a kernel by patching ``triton.language`` (``tl``, ``tl.core``: their builtins made
to run on numpy) for the launch and restoring it after. Triton 3.9 patches again at every call of a
``@triton.jit`` helper inside the kernel, the same modules with the same wrappers (a patched builtin is
not wrapped twice), and never restores those nested patches: they change nothing, but they cost. They took ~40% of an
interpreted kernel's time in this project's kernels (profiled with Triton 3.9), which call
helpers (``kernels/addressing.py``, ``kernels/update_rows.py``) in every loop step; skipping them took a
simulated ``bench fbgemm`` run from 26.6 to 8.6 s and the forward and backward tests from 120 to 70 s.

:func:`skip_repeated_language_patches` wraps the interpreter's patch function: a nested call whose
function sees only modules the launch has patched already does nothing; any other call patches as
before. Only where the interpreter has the function this wraps; ``TIERED_TBE_INTERPRETER_PATCHES=all``
keeps every patch (to bisect).
"""

from __future__ import annotations

import inspect
import os

_installed = False


def skip_repeated_language_patches() -> bool:
    """Install the wrapper (once); False where this Triton's interpreter has no ``_patch_lang`` to wrap."""
    global _installed
    if _installed:
        return True
    if os.environ.get("TIERED_TBE_INTERPRETER_PATCHES", "") == "all":
        return False
    import triton.language as tl
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang", None)
    if patch is None or getattr(patch, "__tiered_tbe__", False):
        return False
    patched: list[set[int]] = []  # the modules the launch running now has patched (empty: no launch)

    def languages(fn) -> set[int]:
        return {id(value) for value in fn.__globals__.values() if inspect.ismodule(value) and value in (tl, tl.core)}

    def patch_once(fn):
        wanted = languages(fn)
        if patched:  # a helper called inside a launch
            if wanted <= patched[0]:
                return _NothingToRestore()
            patched[0] |= wanted
            return patch(fn)
        scope = patch(fn)  # a launch: restored when it ends (its finally)
        patched.append(wanted)
        restore = scope.restore

        def restore_and_end():
            patched.clear()
            restore()

        scope.restore = restore_and_end
        return scope

    patch_once.__tiered_tbe__ = True
    interpreter._patch_lang = patch_once
    _installed = True
    return True


class _NothingToRestore:
    def restore(self) -> None:
        pass
