"""From TorchRec's plan and ``fused_params`` to the arguments of one ``TieredEmbeddingBags``.

A plan's compute kernel picks where a table's rows live: ``fused`` in HBM (``DEVICE``),
``fused_uvm`` in CUDA managed memory read in place (``MANAGED``), ``fused_uvm_caching`` in
managed memory behind the slot cache (``MANAGED_CACHED``), sized by the plan's
``cache_load_factor`` (a fraction of the cached rows, FBGEMM's meaning; its default 0.2).

``fused_params`` takes FBGEMM's names, with FBGEMM's defaults where absent:

- ``optimizer``: an ``EmbOptimType`` (``EXACT_SGD``, ``EXACT_ROWWISE_ADAGRAD``, ``EXACT_ADAGRAD``,
  ``ADAM``, ``PARTIAL_ROWWISE_ADAM``, ``LAMB``; default ``EXACT_SGD``) with ``learning_rate``
  (0.01), ``eps``, ``beta1``, ``beta2``, ``weight_decay``; or one of our optimizer objects
  (``RowwiseAdagrad(lr=0.01)``), which then carries every hyper-parameter itself;
- ``stochastic_rounding`` (default True, as FBGEMM; fp16 and bf16 weights only),
  ``weights_precision`` (default: the table's ``data_type``), ``cache_algorithm`` (``LRU``,
  ``LFU``: our ``lfu-admit``, which admits misses by use counts as FBGEMM's LFU does),
  ``cache_precision`` (the weights' precision: the cache holds rows as stored),
  ``output_dtype`` (fp32), ``bounds_check_mode`` (FBGEMM's default ``WARNING``, and ``IGNORE``:
  a bad batch is repaired on the device, no host sync (``bounds_check="warn"``); ``FATAL`` raises
  on a bad index (one host sync a forward); ``NONE`` turns the checks off);
- accepted and without effect here: ``cache_reserved_memory``, ``prefetch_pipeline`` (a
  prefetched batch is always safe to train beside the next prefetch), ``enforce_hbm``,
  ``multipass_prefetch_config``, ``weight_decay_mode`` ``NONE``.

and these of tiered-tbe: ``cache_config`` (a :class:`~tiered_tbe.CacheConfig`: its policy,
associativity, mover, ...; its size, when it gives one, instead of ``cache_load_factor``),
``backend``, ``cuda_graphs``, ``nan_check``, ``seed`` (the module's arguments; ``state_layout`` stays
``"separate"``: TorchRec's sharded tensors want each table's weights contiguous).
Other FBGEMM options (momentum, gradient clipping, counter-based regularization, ...) have no
counterpart: they raise ``ValueError``, as does any other key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.modules.embedding_configs import data_type_to_dtype

from tiered_tbe.cache.policy import policy_named
from tiered_tbe.fbgemm_names import FBGEMM_DEFAULTS, optimizer_from_fbgemm
from tiered_tbe.optimizers import FusedOptimizer
from tiered_tbe.specs import CacheConfig, Placement

PLACEMENT_OF_KERNEL = {
    EmbeddingComputeKernel.FUSED.value: Placement.DEVICE,
    EmbeddingComputeKernel.FUSED_UVM.value: Placement.MANAGED,
    EmbeddingComputeKernel.FUSED_UVM_CACHING.value: Placement.MANAGED_CACHED,
}
DEFAULT_CACHE_LOAD_FACTOR = 0.2  # FBGEMM's
# FBGEMM's LFU admits a missed row only when it was used at least as often as its victim: lfu-admit's rule.
_POLICY_OF_ALGORITHM = {"LRU": "lru", "LFU": "lfu-admit"}
_POOLING = {PoolingMode.SUM: "sum", PoolingMode.MEAN: "mean", PoolingMode.NONE: "none"}
_HYPER = tuple(FBGEMM_DEFAULTS)
_NO_EFFECT = ("cache_reserved_memory", "prefetch_pipeline", "enforce_hbm", "multipass_prefetch_config")
_OURS = ("cache_config", "backend", "cuda_graphs", "nan_check", "seed")
_HANDLED = ("optimizer", *_HYPER, "stochastic_rounding", "weights_precision", "cache_algorithm", "cache_load_factor",
            "cache_precision", "output_dtype", "bounds_check_mode", "weight_decay_mode", *_NO_EFFECT, *_OURS)


def placement_of(compute_kernel) -> Placement:
    """The placement of a table the plan gives ``compute_kernel``; ValueError for kernels we do not run."""
    value = getattr(compute_kernel, "value", compute_kernel)
    if value not in PLACEMENT_OF_KERNEL:
        raise ValueError(f"compute kernel {value!r} is not one of tiered-tbe's: {sorted(PLACEMENT_OF_KERNEL)}")
    return PLACEMENT_OF_KERNEL[value]


def pooling_of(pooling_mode: PoolingMode) -> str:
    return _POOLING[pooling_mode]


def _member_name(value) -> str | None:
    return None if value is None else str(getattr(value, "name", value)).upper()


@dataclass(frozen=True)
class ModuleArguments:
    """The keyword arguments of one ``TieredEmbeddingBags`` but its tables and pooling."""

    optimizer: FusedOptimizer
    weights_dtype: torch.dtype
    stochastic_rounding: bool
    cache: CacheConfig | None
    bounds_check: str
    extra: dict  # backend, cuda_graphs, nan_check, seed, when given

    def as_kwargs(self) -> dict[str, Any]:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        return fields | self.extra


def module_arguments(fused_params: dict | None, data_type, cached: bool) -> ModuleArguments:
    """``TieredEmbeddingBags`` arguments from a group's ``fused_params`` and its tables' ``data_type``.

    ``cached``: the group holds ``fused_uvm_caching`` tables (then the cache is configured).

    Raises:
        ValueError: naming a key we cannot honour, or a value out of what we take.
    """
    params = dict(fused_params or {})
    unknown = sorted(set(params) - set(_HANDLED))
    if unknown:
        raise ValueError(f"fused_params {unknown}: tiered-tbe has no counterpart (it takes {sorted(_HANDLED)})")

    if _member_name(params.get("weight_decay_mode")) not in (None, "NONE"):
        raise ValueError(f"fused_params: weight_decay_mode={params['weight_decay_mode']} has no tiered-tbe "
                         "counterpart (Adam, PartialRowwiseAdam and LAMB take weight_decay as FBGEMM's ADAM does)")
    optimizer = params.get("optimizer", "EXACT_SGD")
    if isinstance(optimizer, FusedOptimizer):
        given = [k for k in _HYPER if k in params]
        if given:
            raise ValueError(f"fused_params: optimizer={optimizer} carries its hyper-parameters; drop {given}")
    else:
        optimizer = optimizer_from_fbgemm(optimizer, **{k: params[k] for k in _HYPER if k in params})

    weights_dtype = data_type_to_dtype(data_type)
    if params.get("weights_precision") is not None:
        weights_dtype = _dtype_of(params["weights_precision"], "weights_precision")
    for key in ("cache_precision", "output_dtype"):
        if params.get(key) is not None:
            wanted = weights_dtype if key == "cache_precision" else torch.float32
            if _dtype_of(params[key], key) != wanted:
                raise ValueError(f"fused_params: {key}={params[key]} is not supported: tiered-tbe "
                                 + ("caches rows in their weights precision" if key == "cache_precision"
                                    else "returns fp32 pooled embeddings"))

    # FBGEMM's modes: FATAL raises (ours: one host sync a forward); WARNING (its default) and IGNORE repair a
    # bad batch on the device (ours "warn": no sync); NONE checks nothing. V2_* variants by their suffix.
    bounds = (_member_name(params.get("bounds_check_mode")) or "WARNING").removeprefix("V2_")
    bounds_check = {"NONE": "off", "FATAL": "raise"}.get(bounds, "warn")
    stochastic_rounding = bool(params.get("stochastic_rounding", True)) and weights_dtype != torch.float32

    cache = None
    if cached:
        cache = params.get("cache_config") or CacheConfig()
        if not isinstance(cache, CacheConfig):
            raise ValueError(f"fused_params: cache_config must be a tiered_tbe.CacheConfig, got {type(cache).__name__}")
        if cache.slots is None and cache.memory is None and cache.fraction is None:
            load_factor = params.get("cache_load_factor")
            cache = dataclasses.replace(cache, fraction=float(DEFAULT_CACHE_LOAD_FACTOR if load_factor is None
                                                              else load_factor))
        algorithm = _member_name(params.get("cache_algorithm"))
        if algorithm is not None and "cache_config" not in params:
            if algorithm not in _POLICY_OF_ALGORITHM:
                raise ValueError(f"fused_params: cache_algorithm={params['cache_algorithm']} has no tiered-tbe policy")
            cache = dataclasses.replace(cache, policy=_POLICY_OF_ALGORITHM[algorithm])
        if policy_named(cache.policy).needs_window:
            # TorchRec's pipelines tell a cache no batches ahead: every next use would be unknown, and such a
            # policy would let no row into a full set (lookahead without hints is LRU, which still works).
            raise ValueError(f"fused_params: cache_config policy={cache.policy!r} needs the lookahead window, which "
                             "TorchRec's train pipelines do not give a cache; use 'lfu-admit' or 'lookahead'")
    extra = {key: params[key] for key in _OURS if key != "cache_config" and key in params}
    return ModuleArguments(optimizer, weights_dtype, stochastic_rounding, cache, bounds_check, extra)


def _dtype_of(sparse_type, key: str) -> torch.dtype:
    """SparseType / DataType / torch.dtype -> torch.dtype (fp32, fp16, bf16 only)."""
    if isinstance(sparse_type, torch.dtype):
        dtype = sparse_type
    else:
        dtype = {"FP32": torch.float32, "FP16": torch.float16, "BF16": torch.bfloat16}.get(_member_name(sparse_type))
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"fused_params: {key}={sparse_type} is not supported (fp32, fp16 or bf16)")
    return dtype
