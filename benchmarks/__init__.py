"""The benchmarks of ``tiered-tbe bench``, importable as ``tiered_tbe.benchmarks`` (this folder is mapped there).

The benchmarks, each run as ``tiered-tbe bench NAME`` (an installed package) or ``python
benchmarks/bench_NAME.py`` (a checkout, with the package installed: ``pip install -e .``):

- :mod:`~tiered_tbe.benchmarks.bench_fbgemm`: ours beside FBGEMM_GPU's TBE on the same batches,
  in HBM and cached (:mod:`~tiered_tbe.benchmarks.fbgemm_configs` names the configurations);
- :mod:`~tiered_tbe.benchmarks.bench_kernels`: the Triton TBE kernels against torch's embedding bags;
- :mod:`~tiered_tbe.benchmarks.bench_cache`: the slot cache (prefetch, forward, backward) against all-HBM;
- :mod:`~tiered_tbe.benchmarks.bench_pipeline`: the prefetch pipeline against serial prefetch,
  all-HBM and managed memory.

What they share (no benchmark imports another):

- :mod:`~tiered_tbe.benchmarks.common`: timing, Zipf batches on the device, flags, reporting;
- :mod:`~tiered_tbe.benchmarks.models`: the models ``bench cache`` and ``bench pipeline`` train;
- :mod:`~tiered_tbe.benchmarks.fbgemm_sides`, :mod:`~tiered_tbe.benchmarks.fbgemm_timing`,
  :mod:`~tiered_tbe.benchmarks.fbgemm_tables`: ``bench fbgemm``'s two sides, its timing of them,
  its tables and records; :mod:`~tiered_tbe.benchmarks.kernel_profile`: kernels of a step.

Each prints the baseline it measured in the same run beside its own figures and their ratio,
writes ``--json PATH`` and, with ``--record PATH``, appends one JSON line per measurement to
``PATH`` (:mod:`tiered_tbe.records`; the project's own are in ``results/measurements.jsonl``).
``tiered-tbe bench hit-rate`` (:mod:`tiered_tbe.hit_rate`) records the same way. Developer
tools (traces, profiles, compile reports, the GPU suite) are in ``tools/`` of a checkout.
"""
