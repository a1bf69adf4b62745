"""Several features looking up one table (``feature_table_map``, FBGEMM's convention).

``TieredEmbeddingBags(tables, feature_table_map=[0, 0, 1])`` takes offsets of ``F*B+1`` entries,
feature-major, and pools ``[B, sum over features of their tables' dims]``. A row named by two
features is one row: its gradients from both are summed before its one fused update, and a
cache holds it once. Checked against the plain fp64 model (tests/reference_model.py) for every
optimizer of the registry, HBM and cached tables, and against FBGEMM's CPU TBE for the
optimizers its CPU build has.
"""

from __future__ import annotations

import pytest
import torch
from reference_model import ReferenceBags

from tiered_tbe import CacheConfig, Placement, TableSpec
from tiered_tbe.module import TieredEmbeddingBags
from tiered_tbe.optimizers import LAMB, OPTIMIZERS, SGD, Adagrad, Adam, PartialRowwiseAdam, RowwiseAdagrad

# Every optimizer of the registry, with hyper-parameters that make each term matter.
EVERY_OPTIMIZER = [SGD(lr=0.3), RowwiseAdagrad(lr=0.2, eps=1e-6), Adagrad(lr=0.1, eps=1e-6),
                   Adam(lr=0.05, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.01),
                   PartialRowwiseAdam(lr=0.05, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.01),
                   LAMB(lr=0.05, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.01)]
assert {o.name for o in EVERY_OPTIMIZER} == set(OPTIMIZERS), "a registered optimizer is not tested here"

# Two features of table 0; three of table 1 (not in a row), one of table 0.
MAPS = {"two_share": [0, 0, 1], "three_share": [1, 0, 1, 1]}


def shared_batch(specs, feature_table_map, batch_size, max_bag, generator):
    """A feature-major batch whose features of one table draw from the same few rows, so rows
    repeat across features (and within bags); every feature's first bag names its table's row 0."""
    indices, lengths = [], []
    for t in feature_table_map:
        for b in range(batch_size):
            n = int(torch.randint(1 if b == 0 else 0, max_bag + 1, (1,), generator=generator))
            rows = torch.randint(0, min(specs[t].num_embeddings, 4), (n,), generator=generator)
            if b == 0:
                rows[0] = 0
            indices.append(rows)
            lengths.append(n)
    return torch.cat(indices).long(), torch.tensor([0] + lengths).cumsum(0)


def make_pair(specs, feature_table_map, optimizer, device, **kwargs):
    module = TieredEmbeddingBags(specs, optimizer=optimizer, device=device, feature_table_map=feature_table_map,
                                 **kwargs)
    reference = ReferenceBags([module.table(t).float() for t in range(len(specs))], kwargs.get("pooling", "sum"),
                              optimizer, feature_table_map)
    return module, reference


def assert_shared_row_in_batch(indices, offsets, feature_table_map, batch_size):
    """The batch names some row of a table from two of its features (the case under test)."""
    features = torch.arange(len(feature_table_map)).repeat_interleave(batch_size).repeat_interleave(offsets.diff())
    seen = {}
    for feature, row in zip(features.tolist(), indices.tolist()):
        seen.setdefault((feature_table_map[feature], row), set()).add(feature)
    assert any(len(names) > 1 for names in seen.values()), "no row is named by two features"


@pytest.mark.parametrize("optimizer", EVERY_OPTIMIZER, ids=lambda o: o.name)
@pytest.mark.parametrize("map_name", sorted(MAPS))
def test_features_sharing_a_table_train_as_the_reference(map_name, optimizer, device, one_simulated_thread):
    """Forward and four fused updates against the fp64 model; with ``three_share`` the tables are
    cached in a cache of 4 slots (fewer than a batch's rows: evictions, and rows read in place),
    with ``two_share`` they are in HBM. Batch sizes change every step; the last step is weighted."""
    feature_table_map = MAPS[map_name]
    cached = map_name == "three_share"
    placement = Placement.MANAGED_CACHED if cached else Placement.DEVICE
    specs = [TableSpec(30, 8, name="ids", placement=placement), TableSpec(20, 4, name="small", placement=placement)]
    cache = CacheConfig(slots=4, associativity=2) if cached else None
    module, reference = make_pair(specs, feature_table_map, optimizer, device, cache=cache)
    generator = torch.Generator().manual_seed(7)
    for step, batch_size in enumerate((3, 2, 4, 3)):
        indices, offsets = shared_batch(specs, feature_table_map, batch_size, 3, generator)
        assert_shared_row_in_batch(indices, offsets, feature_table_map, batch_size)
        weights = torch.rand(indices.numel(), generator=generator) + 0.5 if step == 3 else None
        out = module(indices.to(device), offsets.to(device),
                     None if weights is None else weights.to(device))
        expected = reference.forward(indices, offsets, weights)
        assert out.shape == (batch_size, sum(specs[t].embedding_dim for t in feature_table_map))
        torch.testing.assert_close(out.double().cpu(), expected, rtol=1e-5, atol=1e-6)
        grad = torch.randn(out.shape, generator=generator)
        out.backward(grad.to(device))
        reference.backward(indices, offsets, grad, weights)
    for t in range(len(specs)):
        torch.testing.assert_close(module.table(t).double().cpu(), reference.weights[t], rtol=1e-5, atol=1e-6)
    if cached:
        stats = module.cache_stats()
        assert stats.evictions > 0 and stats.misses_no_slot > 0 and module.cache.num_locked() == 0


@pytest.mark.parametrize("pooling", ["mean", "none"])
def test_mean_and_unpooled_features_sharing_a_table(pooling, device):
    """Mean pooling divides each feature's bags by their own lengths; pooling "none" gives each
    lookup its row, whichever feature names it."""
    specs = [TableSpec(12, 4, name="a"), TableSpec(9, 4, name="b")]
    feature_table_map = [1, 0, 1]
    module, reference = make_pair(specs, feature_table_map, RowwiseAdagrad(lr=0.2, eps=1e-6), device,
                                  pooling=pooling)
    generator = torch.Generator().manual_seed(2)
    for batch_size in (3, 2, 3):
        indices, offsets = shared_batch(specs, feature_table_map, batch_size, 4, generator)
        out = module(indices.to(device), offsets.to(device))
        torch.testing.assert_close(out.double().cpu(), reference.forward(indices, offsets), rtol=1e-5, atol=1e-6)
        grad = torch.randn(out.shape, generator=generator)
        out.backward(grad.to(device))
        reference.backward(indices, offsets, grad)
    for t in range(len(specs)):
        torch.testing.assert_close(module.table(t).double().cpu(), reference.weights[t], rtol=1e-5, atol=1e-6)


def test_a_shared_row_is_cached_once(device, one_simulated_thread):
    """Two features naming the same rows prefetch one slot per row: the cache sees one row."""
    specs = [TableSpec(40, 4, name="ids", placement=Placement.MANAGED_CACHED)]
    module = TieredEmbeddingBags(specs, feature_table_map=[0, 0], optimizer=SGD(lr=0.1), device=device,
                                 cache=CacheConfig(slots=16, associativity=4))
    indices = torch.tensor([5, 6, 7, 5, 6, 7], device=device)  # B = 3: feature 0 and feature 1 name rows 5, 6, 7
    offsets = torch.arange(7, device=device)
    module(indices, offsets).sum().backward()
    stats = module.cache_stats()
    assert stats.unique_misses == 3 and stats.unique_rows == 3 and stats.lookups == 6
    assert sorted(int(r) for r in module.cache.tags if r >= 0) == [5, 6, 7]


def test_docstring_example_runs():
    emb = TieredEmbeddingBags([TableSpec(1000, 16, name="ids"), TableSpec(50, 8, name="country")],
                              feature_table_map=[0, 0, 1], optimizer=SGD(lr=0.1))
    out = emb(torch.tensor([3, 4, 3, 7, 999, 1]), torch.tensor([0, 1, 2, 3, 5, 5, 6]))
    assert out.shape == (2, 16 + 16 + 8)
    table = emb.table(0).clone()
    torch.testing.assert_close(out[1, 16:32], table[7] + table[999])
    out.sum().backward()
    # Row 3 is named by features 0 and 1: one update with both gradients.
    torch.testing.assert_close(emb.table(0)[3], table[3] - 0.1 * 2)


def test_bad_batches_name_the_feature_and_its_table(device):
    specs = [TableSpec(10, 4, name="ids"), TableSpec(5, 4, name="country")]
    module = TieredEmbeddingBags(specs, feature_table_map=[0, 1, 0], optimizer=SGD(lr=0.1), device=device)
    offsets = torch.tensor([0, 1, 2, 3, 4, 5, 6], device=device)  # B = 2
    with pytest.raises(ValueError, match=r"feature 2 \(table 0 \('ids'\)\): index 10 at position 4 is out of range "
                                         r"\[0, 10\)"):
        module(torch.tensor([1, 2, 3, 4, 10, 0], device=device), offsets)
    with pytest.raises(ValueError, match=r"feature 1 \(table 1 \('country'\)\): index 5 at position 3"):
        module(torch.tensor([1, 2, 3, 5, 9, 0], device=device), offsets)
    bad = torch.tensor([1, 2, 3, 5, 9, 0], device=device)
    module.prefetch(bad, offsets)  # checked at its forward
    with pytest.raises(ValueError, match=r"feature 1 \(table 1 \('country'\)\): index 5 at position 3"):
        module(bad, offsets)
    with pytest.raises(ValueError, match="F\\*B\\+1 with F=3 features"):
        module(torch.tensor([1, 2, 3, 4], device=device), offsets[:5])
    assert module.table(0).equal(module.table(0))  # nothing was locked or written
    with pytest.raises(ValueError, match=r"feature_table_map\[2\] = 2 names no table"):
        TieredEmbeddingBags(specs, feature_table_map=[0, 1, 2])
    with pytest.raises(ValueError, match=r"table 1 \('country'\) has no feature"):
        TieredEmbeddingBags(specs, feature_table_map=[0, 0])
    with pytest.raises(ValueError, match="empty"):
        TieredEmbeddingBags(specs, feature_table_map=[])


def test_refused_update_names_the_feature_and_its_table(device):
    """nan_check="raise": a NaN in a feature's columns of the output's gradient is named by feature and table."""
    specs = [TableSpec(10, 4, name="ids"), TableSpec(5, 2, name="country")]
    module = TieredEmbeddingBags(specs, feature_table_map=[0, 1, 0], optimizer=SGD(lr=0.1), device=device,
                                 nan_check="raise")
    out = module(torch.tensor([1, 2, 3, 4, 5, 6], device=device) % 5, torch.arange(7, device=device))
    grad = torch.zeros(out.shape, device=device)
    grad[1, 7] = float("nan")  # columns: feature 0 at 0-3, feature 1 at 4-5, feature 2 at 6-9
    with pytest.raises(ValueError, match=r"at \[1, 7\] \(feature 2 \(table 0 \('ids'\)\), sample 1\)"):
        out.backward(grad)


def test_state_dict_stays_per_table(device):
    """Checkpoints hold each table once, under its name, whatever features look it up; a module with
    another feature map loads them."""
    specs = [TableSpec(10, 4, name="ids"), TableSpec(5, 4, name="country")]
    shared = TieredEmbeddingBags(specs, feature_table_map=[0, 1, 0, 0], optimizer=RowwiseAdagrad(), device=device)
    indices = torch.tensor([1, 2, 3, 1, 4, 1, 2, 2], device=device)
    shared(indices, torch.arange(9, device=device)).sum().backward()
    state = shared.state_dict()
    assert sorted(state) == ["country.momentum1", "country.weight", "ids.momentum1", "ids.weight", "optimizer_step"]
    assert state["ids.weight"].shape == (10, 4)
    plain = TieredEmbeddingBags(specs, optimizer=RowwiseAdagrad(), device=device, seed=5)
    plain.load_state_dict(state)
    for t in range(2):
        assert torch.equal(plain.table(t), shared.table(t))


# ---------------------------------------------------------------------------------------------
# Against FBGEMM's CPU TBE
# ---------------------------------------------------------------------------------------------

# Features of one table next to each other, tables ascending, as TorchRec groups them: FBGEMM's CPU
# Adagrad and row-wise Adagrad refuse other orders ([1, 0], [0, 1, 0], [1, 0, 1, 1]: "num of rows
# processed by adagrad: 0 does not match c_block size") or update wrong rows; its SGD takes any.
FBGEMM_MAPS = {"two_share": [0, 0, 1], "three_share": [0, 1, 1, 1]}
# Ours, FBGEMM's name and its keyword arguments: the optimizers FBGEMM's CPU build runs.
FBGEMM_CPU_OPTIMIZERS = {
    "sgd": (SGD(lr=0.3), "EXACT_SGD", dict(learning_rate=0.3)),
    "rowwise_adagrad": (RowwiseAdagrad(lr=0.2, eps=1e-6), "EXACT_ROWWISE_ADAGRAD", dict(learning_rate=0.2, eps=1e-6)),
    "adagrad": (Adagrad(lr=0.1, eps=1e-6), "EXACT_ADAGRAD", dict(learning_rate=0.1, eps=1e-6)),
}


@pytest.mark.parametrize("pooling", ["sum", "mean"])
@pytest.mark.parametrize("name", sorted(FBGEMM_CPU_OPTIMIZERS))
@pytest.mark.parametrize("map_name", sorted(FBGEMM_MAPS))
def test_features_sharing_a_table_match_fbgemm_cpu(map_name, name, pooling, device):
    """Forward and four fused updates equal FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen(...,
    feature_table_map=...)`` on the CPU within 1e-5, from the same weights."""
    tbe_ops = pytest.importorskip("fbgemm_gpu.split_table_batched_embeddings_ops_training")
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode

    feature_table_map = FBGEMM_MAPS[map_name]
    optimizer, fbgemm_name, fbgemm_kwargs = FBGEMM_CPU_OPTIMIZERS[name]
    specs = [TableSpec(30, 8, name="ids"), TableSpec(20, 4, name="small")]
    ours = TieredEmbeddingBags(specs, pooling=pooling, optimizer=optimizer, device=device,
                               feature_table_map=feature_table_map)
    theirs = tbe_ops.SplitTableBatchedEmbeddingBagsCodegen(
        [(s.num_embeddings, s.embedding_dim, EmbeddingLocation.HOST, tbe_ops.ComputeDevice.CPU) for s in specs],
        feature_table_map=feature_table_map, optimizer=getattr(EmbOptimType, fbgemm_name),
        pooling_mode=PoolingMode.SUM if pooling == "sum" else PoolingMode.MEAN, device="cpu", **fbgemm_kwargs)
    with torch.no_grad():
        for t, view in enumerate(theirs.split_embedding_weights()):
            view.copy_(ours.table(t).cpu())
    generator = torch.Generator().manual_seed(11)
    for batch_size in (3, 2, 4, 3):
        indices, offsets = shared_batch(specs, feature_table_map, batch_size, 3, generator)
        assert_shared_row_in_batch(indices, offsets, feature_table_map, batch_size)
        out = ours(indices.to(device), offsets.to(device))
        expected = theirs(indices, offsets)
        torch.testing.assert_close(out.cpu(), expected.detach(), rtol=1e-5, atol=1e-5)
        grad = torch.randn(out.shape, generator=generator)
        out.backward(grad.to(device))
        expected.backward(grad)
    for t, view in enumerate(theirs.split_embedding_weights()):
        torch.testing.assert_close(ours.table(t).cpu(), view, rtol=1e-5, atol=1e-5)
