"""base/interpreter.py: the Triton interpreter patches triton.language once a launch, not again at every
helper call inside it, and the kernels give the same bits as with every patch (a fresh process with
TIERED_TBE_INTERPRETER_PATCHES=all)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import triton
import triton.language as tl
from background import run_in_background

from tiered_tbe.base.mode import SIMULATION

pytestmark = pytest.mark.skipif(not SIMULATION, reason="the interpreter runs in CPU simulation only")

# The forward and backward of a small mixed-dim batch, printed as the bytes of their results.
_PROGRAM = f"""
import hashlib, sys, torch
sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
from kernel_inputs import ALL_OPTIMIZERS, STEP, make_batch
from tiered_tbe.kernels.backward import backward_update
from tiered_tbe.kernels.forward import pooled_forward
torch.manual_seed(0)
optimizer = ALL_OPTIMIZERS["adam"]
stores, lookups, slots = make_batch(batch_size=6, weighted=True, optimizer=optimizer)
output = pooled_forward(stores, lookups, slots, "mean")
backward_update(torch.linspace(-1, 1, output.numel()).view(output.shape), stores, lookups, slots, "mean", optimizer,
                STEP)
digest = hashlib.sha256(output.numpy().tobytes())
for tensor in (*stores.table_weights, *[s for s in stores.table_state if s is not None], stores.cache_weights,
               stores.cache_state):
    digest.update(tensor.numpy().tobytes())
print(digest.hexdigest())
"""
_EVERY_PATCH = run_in_background([sys.executable, "-c", _PROGRAM], timeout=300,
                                 env={**os.environ, "TIERED_TBE_INTERPRETER_PATCHES": "all"})


@triton.jit
def _twice(x):
    return x * 2


@triton.jit
def _helpers_kernel(out_ptr, CALLS: tl.constexpr):
    values = tl.arange(0, 8)
    for _ in tl.static_range(CALLS):
        values = _twice(values)
    tl.store(out_ptr + tl.arange(0, 8), values)


def test_a_launch_patches_the_language_once_whatever_its_helper_calls(monkeypatch):
    from triton.runtime import interpreter

    import tiered_tbe.kernels.addressing  # noqa: F401  (installs the wrapper in simulation)

    assert getattr(interpreter._patch_lang, "__tiered_tbe__", False)
    patched = []
    builtin = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda *args: (patched.append(1), builtin(*args))[1])
    counts = []
    for calls in (0, 5):
        out = torch.empty(8, dtype=torch.int32)
        patched.clear()
        _helpers_kernel[(1,)](out, CALLS=calls)
        counts.append(len(patched))
        assert out.tolist() == [v * 2**calls for v in range(8)]
    assert counts[0] == counts[1] > 0


def test_the_kernels_give_the_bits_of_every_patch(capsys):
    exec(_PROGRAM, {})  # here, with the repeated patches skipped
    here = capsys.readouterr().out
    expected = _EVERY_PATCH.result()
    assert expected.returncode == 0, expected.stderr
    assert len(here.strip()) == 64 and here == expected.stdout
