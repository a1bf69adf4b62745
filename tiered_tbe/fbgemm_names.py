"""FBGEMM's names for our optimizers, their hyper-parameters and their state: one table.

FBGEMM's TBE (``SplitTableBatchedEmbeddingBagsCodegen``) and TorchRec's ``fused_params`` name an
optimizer by an ``EmbOptimType`` member (``EXACT_ROWWISE_ADAGRAD``) and its hyper-parameters by
keyword (``learning_rate``, ``eps``, ``beta1``, ``beta2``, ``weight_decay``; FBGEMM's defaults
below). ``get_optimizer_state()`` names each table's state (``sum``, ``exp_avg``, ...). Nothing
here imports FBGEMM: members are matched by name.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from tiered_tbe.optimizers import OPTIMIZERS, FusedOptimizer


@dataclass(frozen=True)
class FbgemmOptimizer:
    """How one of our optimizers looks from FBGEMM."""

    ours: str  # name in tiered_tbe.optimizers.OPTIMIZERS
    fbgemm_names: tuple[str, ...]  # EmbOptimType members that mean it
    state_names: tuple[str, ...]  # get_optimizer_state() keys, in our state's column order


FBGEMM_OPTIMIZERS = (
    FbgemmOptimizer("sgd", ("EXACT_SGD", "SGD"), ()),
    FbgemmOptimizer("rowwise_adagrad", ("EXACT_ROWWISE_ADAGRAD",), ("sum",)),
    FbgemmOptimizer("adagrad", ("EXACT_ADAGRAD",), ("sum",)),
    FbgemmOptimizer("adam", ("ADAM",), ("exp_avg", "exp_avg_sq")),
    FbgemmOptimizer("partial_rowwise_adam", ("PARTIAL_ROWWISE_ADAM",), ("exp_avg", "exp_avg_sq")),
    FbgemmOptimizer("lamb", ("LAMB",), ("exp_avg", "exp_avg_sq")),
)
_BY_OURS = {entry.ours: entry for entry in FBGEMM_OPTIMIZERS}
_BY_FBGEMM = {name: entry for entry in FBGEMM_OPTIMIZERS for name in entry.fbgemm_names}
# EmbOptimType's values spell "rowwise" as "row_wise" ("exact_row_wise_adagrad").
_BY_ENUM_VALUE = {name.lower().replace("rowwise", "row_wise"): name for name in _BY_FBGEMM}

# FBGEMM's TBE defaults for the keywords it shares with our optimizers.
FBGEMM_DEFAULTS = dict(learning_rate=0.01, eps=1.0e-8, beta1=0.9, beta2=0.999, weight_decay=0.0)
# update_hyper_parameters() keys (FBGEMM's) -> how each sets our optimizer's fields.
HYPER_PARAMETERS = ("lr", "eps", "beta1", "beta2", "weight_decay")


def fbgemm_entry(optimizer: FusedOptimizer) -> FbgemmOptimizer:
    return _BY_OURS[optimizer.name]


def fbgemm_member_name(optimizer_type) -> str:
    """``EmbOptimType.EXACT_ROWWISE_ADAGRAD``, the string ``"EXACT_ROWWISE_ADAGRAD"`` or its enum value
    ``"exact_row_wise_adagrad"`` -> ``"EXACT_ROWWISE_ADAGRAD"``; ValueError naming the choices."""
    name = getattr(optimizer_type, "name", optimizer_type)
    if isinstance(name, str) and name.upper() in _BY_FBGEMM:
        return name.upper()
    if isinstance(name, str) and name in _BY_ENUM_VALUE:
        return _BY_ENUM_VALUE[name]
    raise ValueError(f"optimizer {optimizer_type!r} has no tiered-tbe counterpart; FBGEMM names we take: "
                     f"{sorted(_BY_FBGEMM)}")


def optimizer_from_fbgemm(optimizer_type, learning_rate: float = FBGEMM_DEFAULTS["learning_rate"],
                          eps: float = FBGEMM_DEFAULTS["eps"], beta1: float = FBGEMM_DEFAULTS["beta1"],
                          beta2: float = FBGEMM_DEFAULTS["beta2"],
                          weight_decay: float = FBGEMM_DEFAULTS["weight_decay"]) -> FusedOptimizer:
    """Our optimizer for an FBGEMM ``EmbOptimType`` and FBGEMM's keywords (its defaults where not given).

    Raises:
        ValueError: an optimizer we do not have, or a keyword ours cannot honour (a weight decay for
            the Adagrad types and SGD, which have none).
    """
    entry = _BY_FBGEMM[fbgemm_member_name(optimizer_type)]
    cls = OPTIMIZERS[entry.ours]
    fields = {f.name for f in dataclasses.fields(cls)}
    values = dict(lr=float(learning_rate))
    if "eps" in fields:
        values["eps"] = float(eps)
    if "betas" in fields:
        values["betas"] = (float(beta1), float(beta2))
    if "weight_decay" in fields:
        values["weight_decay"] = float(weight_decay)
    elif weight_decay:
        raise ValueError(f"{entry.fbgemm_names[0]}: weight_decay={weight_decay} is not supported by tiered-tbe's "
                         f"{cls.__name__} (only Adam, PartialRowwiseAdam and LAMB have a weight decay)")
    return cls(**values)


def with_hyper_parameters(optimizer: FusedOptimizer, params: dict) -> FusedOptimizer:
    """A copy of ``optimizer`` with FBGEMM-named hyper-parameters changed (``update_hyper_parameters``).

    Raises:
        ValueError: naming a key FBGEMM does not take, one this optimizer has no field for, or a value
            that is not a finite number >= 0 (a learning rate, eps, weight decay) or in ``[0, 1)`` (betas).
    """
    fields = {f.name for f in dataclasses.fields(optimizer)}
    changes = {}
    for key, value in params.items():
        if key not in HYPER_PARAMETERS:
            raise ValueError(f"update_hyper_parameters: {key!r} is not one of FBGEMM's {HYPER_PARAMETERS}")
        field_name = "betas" if key in ("beta1", "beta2") else key
        if field_name not in fields:
            raise ValueError(f"update_hyper_parameters: {type(optimizer).__name__} has no {key!r}")
        value = float(value)
        in_range = 0 <= value < 1 if field_name == "betas" else value >= 0
        if not (math.isfinite(value) and in_range):
            raise ValueError(f"update_hyper_parameters: {key}={value} is out of range")
        if field_name == "betas":
            betas = list(changes.get("betas", optimizer.betas))
            betas[key == "beta2"] = value
            changes["betas"] = tuple(betas)
        else:
            changes[field_name] = value
    return dataclasses.replace(optimizer, **changes)
