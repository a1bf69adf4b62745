"""Run every kernel in CPU simulation unless a CUDA device is present.

``tiered_tbe`` sets TRITON_INTERPRET / NUMBA_ENABLE_CUDASIM itself when there is no CUDA
device; importing it here, before any test module imports triton or numba, makes sure of it.
"""

import pytest
import torch

import tiered_tbe  # noqa: F401  (chooses the mode before triton / numba load)
from tiered_tbe.base.mode import SIMULATION
from tiered_tbe.cache.mover import MOVERS


def pytest_configure(config):
    """Stop at once, saying what to install, when FBGEMM_GPU is installed but cannot load (a release built for
    another torch): the TorchRec and FBGEMM comparison tests would each fail on an undefined symbol. Absent,
    those tests skip. Checked once, in the process that starts the workers."""
    import importlib.util

    if hasattr(config, "workerinput") or importlib.util.find_spec("fbgemm_gpu") is None:
        return
    from tiered_tbe.torchrec import require_torchrec

    try:
        require_torchrec()
    except ImportError as error:
        if isinstance(error.__cause__, OSError):
            raise pytest.UsageError(str(error)) from error


def pytest_sessionfinish(session, exitstatus):
    import background

    background.cancel_pending()  # subprocess checks of modules collected but not run


def pytest_collection_modifyitems(config, items):
    if SIMULATION:
        skip = pytest.mark.skip(reason="needs a CUDA device (gpu marker)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture
def device() -> torch.device:
    return tiered_tbe.default_device()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def one_simulated_thread(monkeypatch):
    """One CUDA-simulator thread per cache-kernel launch, for long training tests.

    The cache kernels are grid-stride loops, so the result is the same with any thread count,
    and each simulated thread is a Python thread: a 200-step test takes seconds instead of
    minutes. tests/test_cache_*.py keep several threads per launch so that threads interleave.
    """
    from tiered_tbe.cache import launch

    monkeypatch.setattr(launch, "SIMULATED_THREADS", 1)


@pytest.fixture(params=list(MOVERS))
def mover(request) -> str:
    """Each row mover of the registry (tiered_tbe.cache.mover.MOVERS): cache tests run with every one."""
    return request.param
