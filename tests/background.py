"""Subprocess checks started as their test module is collected, run one at a time on a thread.

The suite's own process keeps one core busy (the CUDA simulator and the Triton interpreter run
Python, one thread at a time), and a subprocess check spends ~5 s starting Python and importing
torch, triton and numba: on the 2-core CI machine the checks run on the other core while the
suite goes on, and each test waits for its own check's outcome (most are done by then). Every
check is still a fresh process with the test's own command, environment and working directory.
"""

from __future__ import annotations

import subprocess
from concurrent.futures import Future, ThreadPoolExecutor

_checks = ThreadPoolExecutor(max_workers=1, thread_name_prefix="subprocess-checks")


def run_in_background(command: list[str], **kwargs) -> Future:
    """``subprocess.run(command, capture_output=True, text=True, **kwargs)``, queued now: the
    future's ``result()`` is its ``CompletedProcess``, or raises what it raised (a
    ``CalledProcessError`` with ``check=True``, a ``TimeoutExpired``). Give a ``timeout``."""
    return _checks.submit(subprocess.run, command, capture_output=True, text=True, **kwargs)


def cancel_pending() -> None:
    """Drop the checks not started yet (their tests were not selected, or the session ends)."""
    _checks.shutdown(wait=False, cancel_futures=True)
