"""Subprocess checks started as their test module is collected, run one at a time on a thread.

The suite's own process keeps one core busy (the CUDA simulator and the Triton interpreter run
Python, one thread at a time), and a subprocess check spends ~5 s starting Python and importing
torch, triton and numba: on the 2-core CI machine the checks run on the other core while the
suite goes on, and each test waits for its own check's outcome (most are done by then). Every
check is still a fresh process with the test's own command, environment and working directory.

Under pytest-xdist (``-n``, the README's command) every worker collects every module, so checks started
at collection would run once per worker, each worker's copy taking a core from the other worker's tests.
There a module's checks start when one of its tests first asks for one (all of that module's, in the
order they were made: a later check may rely on an earlier one), on the worker that runs it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor

_checks = ThreadPoolExecutor(max_workers=1, thread_name_prefix="subprocess-checks")
# Under pytest-xdist: each module's checks, in the order they were made, started when first asked for.
_DEFERRED = "PYTEST_XDIST_WORKER" in os.environ
_by_module: dict[str, list[Check]] = {}


class Check:
    """A subprocess check: ``result()`` is its ``CompletedProcess``, or raises what it raised."""

    def __init__(self, module: str, command: list[str], kwargs: dict):
        self.module, self.command, self.kwargs = module, command, kwargs
        self.future: Future | None = None

    def start(self) -> None:
        if self.future is None:
            # The environment is copied here, on the thread that runs the tests. Without ``env``, the child
            # execs with the C library's ``environ``. On Linux, subprocess starts the child with vfork(), so
            # the child shares the parent's memory until it execs. A test's ``monkeypatch.setenv`` at that
            # moment can reallocate and free ``environ`` under the child, which then fails with
            # "OSError: [Errno 14] Bad address". With ``env`` given, the child execs an array of its own.
            kwargs = {"env": dict(os.environ), **self.kwargs}
            self.future = _checks.submit(subprocess.run, self.command, capture_output=True, text=True, **kwargs)

    def result(self, timeout: float | None = None) -> subprocess.CompletedProcess:
        for check in _by_module.get(self.module, [self]):  # this module's checks, in their order
            check.start()
        return self.future.result(timeout)


def run_in_background(command: list[str], **kwargs) -> Check:
    """``subprocess.run(command, capture_output=True, text=True, **kwargs)``, queued now (under pytest-xdist:
    when a test of the calling module first asks): ``result()`` is its ``CompletedProcess``, or raises what
    it raised (a ``CalledProcessError`` with ``check=True``, a ``TimeoutExpired``). Give a ``timeout``."""
    module = sys._getframe(1).f_globals.get("__name__", "")
    check = Check(module, command, kwargs)
    if _DEFERRED:
        _by_module.setdefault(module, []).append(check)
    else:
        check.start()
    return check


def cancel_pending() -> None:
    """Drop the checks not started yet (their tests were not selected, or the session ends)."""
    _checks.shutdown(wait=False, cancel_futures=True)
