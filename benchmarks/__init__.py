"""The GPU benchmark scripts, importable as ``tiered_tbe.benchmarks`` (this folder is mapped there).

- :mod:`~tiered_tbe.benchmarks.bench_kernels`: the Triton TBE kernels against torch's embedding bags.
- :mod:`~tiered_tbe.benchmarks.bench_cache`: the slot cache (prefetch, forward, backward) against all-HBM.
- :mod:`~tiered_tbe.benchmarks.bench_pipeline`: the prefetch pipeline against serial prefetch,
  all-HBM and managed memory.
- :mod:`~tiered_tbe.benchmarks.common`: timing, Zipf batches on the device, reporting.

Each runs as ``tiered-tbe bench kernels | cache | pipeline`` (an installed package) or as
``python benchmarks/bench_cache.py`` (a checkout, with the package installed: ``pip install -e .``),
with the same flags: ``--tables --rows --dim --batch-size --bag-size --alpha --dtype`` (and
``--cache-fraction --policy`` where there is a cache), ``--json`` and ``--record``. Each prints
the baseline measured in the same run beside its numbers, and appends to ``benchmarks/RESULTS.md``
only with ``--record``.
"""
