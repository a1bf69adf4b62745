"""What a new user meets first: every public name imports from the top, hyper-parameters and
per-sample weights that cannot train are refused with a clear error, and errors name tables a
user can find (by name, or by index when unnamed)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from broken_fbgemm import MESSAGE, BrokenFbgemmFinder

import tiered_tbe
from tiered_tbe import TableSpec
from tiered_tbe.module import TieredEmbeddingBags
from tiered_tbe.optimizers import OPTIMIZERS


def test_every_registered_optimizer_imports_from_the_top():
    for cls in OPTIMIZERS.values():
        assert getattr(tiered_tbe, cls.__name__) is cls
        assert cls.__name__ in tiered_tbe.__all__ and cls.__name__ in dir(tiered_tbe)
    # The names a user writes, in a fresh interpreter (the names load on first use).
    names = "SGD, RowwiseAdagrad, Adagrad, Adam, PartialRowwiseAdam, LAMB"
    code = f"from tiered_tbe import {names}; from tiered_tbe import *; print(LAMB.name, TieredEmbeddingBags.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["lamb", "TieredEmbeddingBags"]
    with pytest.raises(AttributeError, match="has no attribute 'Lion'"):
        tiered_tbe.Lion  # noqa: B018


def _adam_family(name: str) -> bool:
    return "betas" in OPTIMIZERS[name].__dataclass_fields__


# (field, bad value, what the message says)
BAD_HYPER_PARAMETERS = [
    ("lr", -1.0, "lr must be a finite number >= 0, got -1.0"),
    ("lr", math.nan, "lr must be a finite number >= 0, got nan"),
    ("lr", math.inf, "lr must be a finite number >= 0, got inf"),
    ("lr", "0.1", "lr must be a finite number >= 0, got '0.1'"),
    ("lr", True, "lr must be a finite number >= 0, got True"),
    ("eps", -1e-8, "eps must be a finite number >= 0, got -1e-08"),
    ("initial_accumulator_value", -0.5, "initial_accumulator_value must be a finite number >= 0, got -0.5"),
    ("weight_decay", -0.01, "weight_decay must be a finite number >= 0, got -0.01"),
    ("betas", (1.0, 0.999), r"betas\[0\] must be a finite number in \[0, 1\), got 1.0"),
    ("betas", (0.9, -0.1), r"betas\[1\] must be a finite number in \[0, 1\), got -0.1"),
    ("betas", (0.9,), r"betas must be a pair \(beta1, beta2\), got \(0.9,\)"),
    ("betas", 0.9, r"betas must be a pair \(beta1, beta2\), got 0.9"),
]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_hyper_parameters_that_cannot_train_are_refused_at_construction(name):
    cls = OPTIMIZERS[name]
    fields = cls.__dataclass_fields__
    tried = 0
    for field, value, message in BAD_HYPER_PARAMETERS:
        if field not in fields:
            continue
        with pytest.raises(ValueError, match=rf"^{cls.__name__}: {message}"):
            cls(**{field: value})
        tried += 1
    assert tried >= 5  # lr's four, and each optimizer's own
    cls()  # the defaults train
    cls(lr=0)  # a frozen step is allowed, as in torch.optim
    if _adam_family(name):
        cls(betas=(0.0, 0.0))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_per_sample_weights_of_another_float_dtype_are_refused(dtype, device):
    module = TieredEmbeddingBags([TableSpec(10, 4), TableSpec(6, 4)], optimizer=tiered_tbe.SGD(lr=0.1),
                                 device=device)
    indices, offsets = torch.tensor([1, 2, 3, 4], device=device), torch.tensor([0, 1, 2, 3, 4], device=device)
    before = module.table(0).clone()
    with pytest.raises(ValueError, match=rf"per_sample_weights must be float32, got {dtype}"):
        module(indices, offsets, torch.ones(4, dtype=dtype, device=device))
    module(indices, offsets, torch.ones(4, device=device)).sum().backward()  # float32 trains
    assert not torch.equal(module.table(0), before)


def test_errors_name_unnamed_tables_by_index(device):
    with pytest.raises(ValueError) as error:
        TableSpec(0, 4)
    assert "None" not in str(error.value) and "num_embeddings must be a whole number >= 1, got 0" in str(error.value)
    with pytest.raises(ValueError, match=r"^table 'ads': embedding_dim must be"):
        TableSpec(5, 0, name="ads")

    module = TieredEmbeddingBags([TableSpec(10, 4, name="user"), TableSpec(10, 4), TableSpec(3, 4)], device=device)
    offsets = torch.tensor([0, 1, 2, 3], device=device)
    for indices, message in (([0, 1, 7], r"^table 2: index 7 at position 2 is out of range \[0, 3\)"),
                             ([0, 10, 1], r"^table 1: index 10 at position 1"),
                             ([10, 0, 1], r"^table 0 \('user'\): index 10 at position 0")):
        with pytest.raises(ValueError, match=message) as error:
            module(torch.tensor(indices, device=device), offsets)
        assert "None" not in str(error.value)


@pytest.mark.parametrize("failure", ["missing", "built for another torch"])
def test_torchrec_names_without_a_loadable_fbgemm_say_what_to_install(failure, monkeypatch):
    """TorchRec's entry points raise ImportError naming the installed torch and where the release pairs are,
    whether FBGEMM_GPU is absent or installed for another torch (an OSError from its libraries)."""
    import tiered_tbe.torchrec as tiered_torchrec

    if failure == "missing":
        monkeypatch.setitem(sys.modules, "fbgemm_gpu", None)  # what an absent package imports as
    else:
        monkeypatch.delitem(sys.modules, "fbgemm_gpu", raising=False)
        monkeypatch.setattr(sys, "meta_path", [BrokenFbgemmFinder(), *sys.meta_path])
    # A name an earlier test loaded is cached in the package: drop it so the lookup runs again.
    if "TieredEmbeddingBagCollectionSharder" in vars(tiered_torchrec):
        monkeypatch.delattr(tiered_torchrec, "TieredEmbeddingBagCollectionSharder")
    with pytest.raises(ImportError) as error:
        tiered_torchrec.TieredEmbeddingBagCollectionSharder  # noqa: B018 - the lookup is the test
    message = str(error.value)
    assert f"built for torch {torch.__version__}" in message and "docs/TORCHREC.md" in message
    expected = MESSAGE if failure != "missing" else "fbgemm_gpu"
    assert expected in message


_RUN_PYTEST_BESIDE_A_BROKEN_FBGEMM = """
import sys
import pytest
sys.path.insert(0, "tests")
from broken_fbgemm import BrokenFbgemmFinder
sys.meta_path.insert(0, BrokenFbgemmFinder())
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider",
                      "tests/test_public_api.py::test_errors_name_unnamed_tables_by_index"]))
"""


def test_the_suite_stops_at_once_beside_an_fbgemm_built_for_another_torch():
    """tests/conftest.py: an installed FBGEMM_GPU whose libraries fail to load stops the run before any test,
    with the message of require_torchrec, instead of failing each FBGEMM and TorchRec test on a symbol."""
    from pathlib import Path

    result = subprocess.run([sys.executable, "-c", _RUN_PYTEST_BESIDE_A_BROKEN_FBGEMM], capture_output=True,
                            text=True, timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, result.stdout + result.stderr
    assert f"built for torch {torch.__version__}" in result.stderr and MESSAGE in result.stderr
    assert "passed" not in result.stdout
