"""A plain-torch, fp64 model of TieredEmbeddingBags: one dense tensor per table, the
optimizers written out from their docstrings. The tests train it beside the real module.

Features look up tables by ``feature_table_map`` (default: feature t is table t): a pooled
output row holds the features side by side, and a table's gradient sums every feature's."""

from __future__ import annotations

import torch

from tiered_tbe.optimizers import LAMB, SGD, Adagrad, Adam, PartialRowwiseAdam, RowwiseAdagrad


class ReferenceBags:
    def __init__(self, weights: list[torch.Tensor], pooling: str, optimizer, feature_table_map=None):
        self.weights = [w.detach().double().clone() for w in weights]
        self.features = list(range(len(weights))) if feature_table_map is None else list(feature_table_map)
        self.pooling = pooling
        self.optimizer = optimizer
        self.step = 0
        if isinstance(optimizer, RowwiseAdagrad):
            self.state = [torch.full((w.shape[0],), optimizer.initial_accumulator_value, dtype=torch.float64)
                          for w in self.weights]
        elif isinstance(optimizer, Adagrad):
            self.state = [torch.full_like(w, optimizer.initial_accumulator_value) for w in self.weights]
        elif isinstance(optimizer, (Adam, LAMB)):
            self.state = [(torch.zeros_like(w), torch.zeros_like(w)) for w in self.weights]
        elif isinstance(optimizer, PartialRowwiseAdam):
            self.state = [(torch.zeros_like(w), torch.zeros(w.shape[0], dtype=torch.float64)) for w in self.weights]

    def _bags(self, indices, offsets):
        """``(table, first output column, sample, start, end)`` of every bag, feature by feature."""
        num_features = len(self.features)
        batch_size = (offsets.numel() - 1) // num_features
        column = 0
        for f, t in enumerate(self.features):
            for b in range(batch_size):
                start, end = int(offsets[f * batch_size + b]), int(offsets[f * batch_size + b + 1])
                yield t, column, b, start, end
            column += self.weights[t].shape[1]

    def forward(self, indices, offsets, per_sample_weights=None) -> torch.Tensor:
        indices, offsets = indices.cpu().long(), offsets.cpu().long()
        psw = None if per_sample_weights is None else per_sample_weights.detach().cpu().double()
        dims = [w.shape[1] for w in self.weights]
        batch_size = (offsets.numel() - 1) // len(self.features)
        if self.pooling == "none":
            out = torch.zeros(indices.numel(), dims[0], dtype=torch.float64)
        else:
            out = torch.zeros(batch_size, sum(dims[t] for t in self.features), dtype=torch.float64)
        for t, col, b, start, end in self._bags(indices, offsets):
            rows = self.weights[t][indices[start:end]]
            if psw is not None:
                rows = rows * psw[start:end, None]
            if self.pooling == "none":
                out[start:end] = rows
            else:
                pooled = rows.sum(0)
                if self.pooling == "mean" and end > start:
                    pooled = pooled / (end - start)
                out[b, col : col + dims[t]] = pooled
        return out

    def backward(self, indices, offsets, grad_output, per_sample_weights=None) -> None:
        indices, offsets = indices.cpu().long(), offsets.cpu().long()
        grad_output = grad_output.detach().cpu().double()
        psw = None if per_sample_weights is None else per_sample_weights.detach().cpu().double()
        dims = [w.shape[1] for w in self.weights]
        grads = [torch.zeros_like(w) for w in self.weights]
        touched = [torch.zeros(w.shape[0], dtype=torch.bool) for w in self.weights]
        for t, col, b, start, end in self._bags(indices, offsets):
            for i in range(start, end):
                if self.pooling == "none":
                    g = grad_output[i]
                else:
                    g = grad_output[b, col : col + dims[t]]
                    if self.pooling == "mean":
                        g = g / (end - start)
                if psw is not None:
                    g = g * psw[i]
                grads[t][indices[i]] += g
                touched[t][indices[i]] = True
        self.step += 1
        opt = self.optimizer
        for t, (w, g, rows) in enumerate(zip(self.weights, grads, touched)):
            rows = rows.nonzero().flatten()
            g = g[rows]
            if isinstance(opt, SGD):
                w[rows] -= opt.lr * g
            elif isinstance(opt, RowwiseAdagrad):
                s = self.state[t]
                s[rows] += (g * g).mean(1)
                w[rows] -= opt.lr * g / (s[rows].sqrt() + opt.eps)[:, None]
            elif isinstance(opt, Adam):
                m, v = self.state[t]
                b1, b2 = opt.betas
                m[rows] = b1 * m[rows] + (1 - b1) * g
                v[rows] = b2 * v[rows] + (1 - b2) * g * g
                m_hat = m[rows] / (1 - b1**self.step)
                v_hat = v[rows] / (1 - b2**self.step)
                w[rows] -= opt.lr * (m_hat / (v_hat.sqrt() + opt.eps) + opt.weight_decay * w[rows])
            elif isinstance(opt, Adagrad):
                s = self.state[t]
                s[rows] += g * g
                w[rows] -= opt.lr * g / (s[rows].sqrt() + opt.eps)
            elif isinstance(opt, PartialRowwiseAdam):
                m, v = self.state[t]
                b1, b2 = opt.betas
                m[rows] = b1 * m[rows] + (1 - b1) * g
                v[rows] = b2 * v[rows] + (1 - b2) * (g * g).mean(1)
                m_hat = m[rows] / (1 - b1**self.step)
                v_hat = v[rows] / (1 - b2**self.step)
                w[rows] -= opt.lr * (m_hat / (v_hat.sqrt() + opt.eps)[:, None] + opt.weight_decay * w[rows])
            elif isinstance(opt, LAMB):
                m, v = self.state[t]
                b1, b2 = opt.betas
                m[rows] = b1 * m[rows] + (1 - b1) * g
                v[rows] = b2 * v[rows] + (1 - b2) * g * g
                r = (m[rows] / (1 - b1**self.step)) / ((v[rows] / (1 - b2**self.step)).sqrt() + opt.eps)
                r = r + opt.weight_decay * w[rows]
                r_norm = r.norm(dim=1, keepdim=True)
                ratio = torch.where(r_norm > 0, w[rows].norm(dim=1, keepdim=True) / r_norm, torch.zeros_like(r_norm))
                w[rows] -= opt.lr * ratio * r
            else:
                raise TypeError(f"the reference model has no {type(opt).__name__}")
