"""``SparseBatch``: the batch TorchRec's train pipelines move, split and feed to a model.

TorchRec's pipelines take any ``Pipelineable`` (``to``, ``record_stream``): dense features, a
``KeyedJaggedTensor`` of the sparse features and labels, as ``torchrec.datasets.utils.Batch`` holds
them (this one needs neither torchrec's data sets nor their file I/O library).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable


@dataclass
class SparseBatch(Pipelineable):
    dense_features: torch.Tensor  # fp32 [B, num_dense]
    sparse_features: KeyedJaggedTensor  # one key per feature, B bags each
    labels: torch.Tensor  # fp32 [B]

    def to(self, device: torch.device, non_blocking: bool = False) -> SparseBatch:
        return SparseBatch(self.dense_features.to(device, non_blocking=non_blocking),
                           self.sparse_features.to(device, non_blocking=non_blocking),
                           self.labels.to(device, non_blocking=non_blocking))

    def record_stream(self, stream) -> None:
        self.dense_features.record_stream(stream)
        self.sparse_features.record_stream(stream)
        self.labels.record_stream(stream)

    def pin_memory(self) -> SparseBatch:
        return SparseBatch(self.dense_features.pin_memory(), self.sparse_features.pin_memory(),
                           self.labels.pin_memory())
