"""The layers import downwards only: kernels and cache load without the public API."""

import subprocess
import sys


def _modules_loaded_by(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(m for m in sys.modules if m.startswith('tiered_tbe')))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(result.stdout.split())


def test_kernels_and_cache_load_without_the_public_api():
    loaded = _modules_loaded_by("import tiered_tbe.kernels.forward, tiered_tbe.kernels.backward, tiered_tbe.cache")
    api = {"tiered_tbe.module", "tiered_tbe.pipeline", "tiered_tbe.optimizers", "tiered_tbe.specs",
           "tiered_tbe.function", "tiered_tbe.storage", "tiered_tbe.benchmarks"}
    assert not loaded & api, sorted(loaded & api)


def test_base_imports_nothing_above_it():
    loaded = _modules_loaded_by("import tiered_tbe.base.mode, tiered_tbe.base.sorting, tiered_tbe.base.codes")
    assert all(m == "tiered_tbe" or m.startswith("tiered_tbe.base") for m in loaded), sorted(loaded)


def test_public_names_load_on_first_use():
    loaded = _modules_loaded_by("import tiered_tbe; tiered_tbe.TieredEmbeddingBags")
    assert "tiered_tbe.module" in loaded
