"""What every layer shares: the simulation/GPU mode, sorting helpers, sentinels and tier codes.

``tiered_tbe.base`` imports nothing of ``tiered_tbe.cache``, ``tiered_tbe.kernels`` or the public
API: every other module may import it, it imports none of them.

- :mod:`~tiered_tbe.base.mode`: picks CPU simulation or GPU mode before triton / numba load.
- :mod:`~tiered_tbe.base.sorting`: ``stable_sort`` and ``sort_ids``, stable sorts of row ids (CUB's radix
  sort where ``cuda.compute`` imports, else ``torch.sort``), on int32 keys when they fit.
- :mod:`~tiered_tbe.base.codes`: ``Placement`` (the memory tiers) and the shared sentinels.
- :mod:`~tiered_tbe.base.graphs`: ``StepGraphs``, CUDA graphs of a step's launches per batch shape;
  ``GraphLaunches``, launches one module hands another's graph.
- :mod:`~tiered_tbe.base.streams`: the current CUDA stream and events on it, cheaply (host time).
- :mod:`~tiered_tbe.base.descriptors`: the columns of the int64 table descriptor the TBE kernels and the
  cache's copy kernel read (row-0 addresses, strides, dims, global row and output column offsets).
"""
