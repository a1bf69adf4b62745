"""The layers import downwards only: kernels and cache load without the public API.

Each statement runs in a fresh interpreter, started as this module is collected (tests/background.py)."""

import sys

from background import run_in_background

STATEMENTS = {
    "kernels and cache": "import tiered_tbe.kernels.forward, tiered_tbe.kernels.backward, tiered_tbe.cache",
    "base": "import tiered_tbe.base.mode, tiered_tbe.base.sorting, tiered_tbe.base.codes",
    "public name": "import tiered_tbe; tiered_tbe.TieredEmbeddingBags",
    "hit-rate planner": "import tiered_tbe.hit_rate.runs, tiered_tbe.hit_rate.capacity, tiered_tbe.cache.bounds",
}
_RUNS = {
    name: run_in_background([sys.executable, "-c", f"import sys; {statement}; "
                             "print(' '.join(m for m in sys.modules if m.startswith(('tiered_tbe', 'triton'))))"],
                            check=True, timeout=300)
    for name, statement in STATEMENTS.items()
}


def _modules_loaded_by(name: str) -> set[str]:
    """The tiered_tbe modules that ``STATEMENTS[name]`` loads in a fresh interpreter."""
    return set(_RUNS[name].result().stdout.split())


def test_kernels_and_cache_load_without_the_public_api():
    loaded = _modules_loaded_by("kernels and cache")
    api = {"tiered_tbe.module", "tiered_tbe.pipeline", "tiered_tbe.optimizers", "tiered_tbe.specs",
           "tiered_tbe.function", "tiered_tbe.storage", "tiered_tbe.benchmarks"}
    assert not loaded & api, sorted(loaded & api)


def test_base_imports_nothing_above_it():
    loaded = _modules_loaded_by("base")
    assert all(m == "tiered_tbe" or m.startswith("tiered_tbe.base") for m in loaded), sorted(loaded)


def test_public_names_load_on_first_use():
    loaded = _modules_loaded_by("public name")
    assert "tiered_tbe.module" in loaded


def test_the_hit_rate_planner_loads_neither_triton_nor_the_module():
    """It simulates caches on the CPU: the kernels and the training API are no part of it."""
    loaded = _modules_loaded_by("hit-rate planner")
    assert not {m for m in loaded if m == "triton" or m.startswith(("tiered_tbe.kernels", "tiered_tbe.module",
                                                                     "tiered_tbe.pipeline"))}, sorted(loaded)
