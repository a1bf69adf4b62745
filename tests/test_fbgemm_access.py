"""What a TorchRec kernel needs from TieredEmbeddingBags, checked against FBGEMM's own CPU TBE where it
has the feature and against the plain fp64 reference (tests/reference_model.py) everywhere:
variable batch size per feature (VBE), prefetch in TorchRec's calling convention, FBGEMM-shaped
access to weights, optimizer state, learning rate, hyper-parameters and the optimizer step."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from reference_model import ReferenceBags

from tiered_tbe import CacheConfig, Placement, TableSpec
from tiered_tbe.fbgemm_names import FBGEMM_OPTIMIZERS, optimizer_from_fbgemm
from tiered_tbe.module import TieredEmbeddingBags
from tiered_tbe.optimizers import LAMB, OPTIMIZERS, SGD, Adagrad, Adam, PartialRowwiseAdam, RowwiseAdagrad

TABLES = [(13, 4), (9, 8), (5, 4)]  # rows, dim: the dims share 4, one table twice as wide


def specs(placement=Placement.DEVICE):
    return [TableSpec(n, d, name=f"t{i}", placement=placement) for i, (n, d) in enumerate(TABLES)]


def vbe_batch(batch_sizes, generator, max_bag=3):
    """Feature-major, rank-minor bags (TorchRec's VBE input): indices, offsets."""
    indices, lengths = [], []
    for (rows, _), per_rank in zip(TABLES, batch_sizes):
        for _ in range(sum(per_rank)):
            n = int(torch.randint(0, max_bag + 1, (1,), generator=generator))
            indices.append(torch.randint(0, rows, (n,), generator=generator))
            lengths.append(n)
    return torch.cat(indices).long(), torch.tensor([0] + lengths).cumsum(0)


def vbe_reference(reference, indices, offsets, batch_sizes):
    """FBGEMM's VBE output from fixed-batch reference forwards: rank-major, then feature, sample, column."""
    starts = [0]
    for per_rank in batch_sizes:
        starts.append(starts[-1] + sum(per_rank))
    pieces = []
    for r in range(len(batch_sizes[0])):
        for f, per_rank in enumerate(batch_sizes):
            first_bag = starts[f] + sum(per_rank[:r])
            for b in range(per_rank[r]):
                start, end = int(offsets[first_bag + b]), int(offsets[first_bag + b + 1])
                rows = reference.weights[f][indices[start:end]]
                pooled = rows.sum(0) if reference.pooling == "sum" or end == start else rows.mean(0)
                pieces.append(pooled.reshape(-1))
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.float64)


def vbe_reference_backward(reference, indices, offsets, batch_sizes, grad):
    """The reference's update for a VBE batch: each bag a sample of its own in a fixed batch."""
    dims = [d for _, d in TABLES]
    starts = [0]
    for per_rank in batch_sizes:
        starts.append(starts[-1] + sum(per_rank))
    num_bags = starts[-1]
    fixed_offsets, fixed_grad = [0], torch.zeros(num_bags, sum(dims), dtype=torch.float64)
    position = 0
    for r in range(len(batch_sizes[0])):
        for f, per_rank in enumerate(batch_sizes):
            first_bag = starts[f] + sum(per_rank[:r])
            for b in range(per_rank[r]):
                sample = first_bag + b
                fixed_grad[sample, sum(dims[:f]):sum(dims[: f + 1])] = grad[position:position + dims[f]]
                position += dims[f]
    # Sample k of table t is bag k of feature t if k falls in feature t's bags, else empty.
    lengths = []
    for f in range(len(TABLES)):
        for k in range(num_bags):
            inside = starts[f] <= k < starts[f + 1]
            lengths.append(int(offsets[k + 1] - offsets[k]) if inside else 0)
    order = torch.cat([indices[int(offsets[k]):int(offsets[k + 1])] for f in range(len(TABLES))
                       for k in range(starts[f], starts[f + 1])]) if indices.numel() else indices
    fixed_offsets = torch.tensor([0] + lengths).cumsum(0)
    reference.backward(order, fixed_offsets, fixed_grad)


BATCH_SIZES = [[[2, 1], [1, 3], [0, 2]], [[1], [4], [2]], [[0, 0, 1], [3, 0, 0], [1, 1, 1]]]


@pytest.mark.parametrize("batch_sizes", BATCH_SIZES, ids=["2ranks", "1rank", "3ranks-with-empty"])
@pytest.mark.parametrize("placement", [Placement.DEVICE, Placement.MANAGED_CACHED], ids=lambda p: p.value)
def test_variable_batch_trains_like_the_reference(batch_sizes, placement, device):
    generator = torch.Generator().manual_seed(3)
    optimizer = RowwiseAdagrad(lr=0.2, eps=1e-6)
    cache = CacheConfig(slots=4, associativity=2) if placement.is_cached else None
    module = TieredEmbeddingBags(specs(placement), optimizer=optimizer, device=device, cache=cache, backend="torch")
    reference = ReferenceBags([module.table(t).float() for t in range(len(TABLES))], "sum", optimizer)
    for _ in range(3):
        indices, offsets = vbe_batch(batch_sizes, generator)
        out = module(indices.to(device), offsets.to(device), batch_size_per_feature_per_rank=batch_sizes)
        expected = vbe_reference(reference, indices, offsets, batch_sizes)
        torch.testing.assert_close(out.double().cpu(), expected, rtol=1e-5, atol=1e-6)
        grad = torch.randn(out.shape, generator=generator)
        out.backward(grad.to(device))
        vbe_reference_backward(reference, indices, offsets, batch_sizes, grad.double())
    for t in range(len(TABLES)):
        torch.testing.assert_close(module.table(t).double().cpu(), reference.weights[t], rtol=1e-5, atol=1e-6)
    if module.cache is not None:
        assert module.cache.num_locked() == 0


def test_variable_batch_triton_kernels_and_mean_pooling(device):
    generator = torch.Generator().manual_seed(4)
    optimizer = SGD(lr=0.5)
    module = TieredEmbeddingBags(specs(), pooling="mean", optimizer=optimizer, device=device)
    reference = ReferenceBags([module.table(t).float() for t in range(len(TABLES))], "mean", optimizer)
    batch_sizes = BATCH_SIZES[0]
    indices, offsets = vbe_batch(batch_sizes, generator)
    out = module(indices.to(device), offsets.to(device), batch_size_per_feature_per_rank=batch_sizes)
    torch.testing.assert_close(out.double().cpu(), vbe_reference(reference, indices, offsets, batch_sizes),
                               rtol=1e-5, atol=1e-6)


def test_variable_batch_bad_input_raises_and_locks_nothing(device):
    module = TieredEmbeddingBags(specs(Placement.MANAGED_CACHED), optimizer=SGD(), device=device,
                                 cache=CacheConfig(slots=4, associativity=2), backend="torch")
    indices, offsets = vbe_batch(BATCH_SIZES[0], torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="one list per feature"):
        module(indices, offsets, batch_size_per_feature_per_rank=[[1, 1]])
    with pytest.raises(ValueError, match="one batch size per rank"):
        module(indices, offsets, batch_size_per_feature_per_rank=[[1, 1], [1], [1, 1]])
    with pytest.raises(ValueError, match="sum of the batch sizes"):
        module(indices, offsets[:-1], batch_size_per_feature_per_rank=BATCH_SIZES[0])
    with pytest.raises(ValueError, match="negative"):
        module(indices, offsets, batch_size_per_feature_per_rank=[[2, 1], [5, -1], [0, 2]])
    sequence = TieredEmbeddingBags([TableSpec(5, 4), TableSpec(6, 4)], pooling="none", optimizer=SGD(), device=device)
    with pytest.raises(ValueError, match="pooled outputs"):
        sequence(indices, offsets, batch_size_per_feature_per_rank=[[1], [1]])
    # Prefetched without VBE, forwarded with it: refused, and the batch's locks go.
    fixed_offsets = torch.cat([offsets[:6], offsets[-1:]])  # B = 2
    zeros = torch.zeros_like(indices)  # in range of every table, whichever bag a lookup falls in
    module.prefetch(zeros, fixed_offsets)
    with pytest.raises(ValueError, match="different batch_size_per_feature_per_rank"):
        module(zeros, fixed_offsets, batch_size_per_feature_per_rank=[[2, 1], [1, 1], [0, 1]])
    assert module.cache.num_locked() == 0


def _fbgemm():
    return pytest.importorskip("fbgemm_gpu.split_table_batched_embeddings_ops_training")


def fbgemm_tbe(optimizer_name: str, learning_rate: float, weights: list[torch.Tensor], **kwargs):
    """FBGEMM's CPU TBE over copies of ``weights``."""
    training = _fbgemm()
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation

    tbe = training.SplitTableBatchedEmbeddingBagsCodegen(
        [(w.shape[0], w.shape[1], EmbeddingLocation.HOST, training.ComputeDevice.CPU) for w in weights],
        optimizer=EmbOptimType[optimizer_name], learning_rate=learning_rate, eps=1e-6, **kwargs)
    for theirs, ours in zip(tbe.split_embedding_weights(), weights):
        theirs.copy_(ours)
    return tbe


@pytest.mark.parametrize("fbgemm_name", ["EXACT_SGD", "EXACT_ROWWISE_ADAGRAD"])
def test_variable_batch_equals_fbgemms_cpu_tbe(fbgemm_name):
    """The VBE output layout and the fused update, against FBGEMM's own VBE (its CPU TBE runs it for
    EXACT_SGD and EXACT_ROWWISE_ADAGRAD)."""
    generator = torch.Generator().manual_seed(5)
    optimizer = optimizer_from_fbgemm(fbgemm_name, learning_rate=0.3, eps=1e-6)
    module = TieredEmbeddingBags(specs(), optimizer=optimizer, device="cpu")
    tbe = fbgemm_tbe(fbgemm_name, 0.3, module.split_embedding_weights())
    for batch_sizes in BATCH_SIZES[:2]:
        indices, offsets = vbe_batch(batch_sizes, generator)
        step_both(module, tbe, indices, offsets, generator, batch_size_per_feature_per_rank=batch_sizes)
    for mine, fbgemms in zip(module.split_embedding_weights(), tbe.split_embedding_weights()):
        torch.testing.assert_close(mine, fbgemms, rtol=1e-5, atol=1e-6)
    if fbgemm_name == "EXACT_ROWWISE_ADAGRAD":
        for mine, fbgemms in zip(module.get_optimizer_state(), tbe.get_optimizer_state()):
            assert mine.keys() == fbgemms.keys()
            torch.testing.assert_close(mine["sum"], fbgemms["sum"], rtol=1e-5, atol=1e-7)


def step_both(module, tbe, indices, offsets, generator, **kwargs):
    """One training step of ours and FBGEMM's on the same batch and gradient; the outputs must agree."""
    ours, theirs = module(indices, offsets, **kwargs), tbe(indices, offsets, **kwargs)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    grad = torch.randn(ours.shape, generator=generator)
    ours.backward(grad)
    theirs.backward(grad)


@pytest.mark.parametrize("fbgemm_name", ["EXACT_SGD", "EXACT_ROWWISE_ADAGRAD", "EXACT_ADAGRAD"])
def test_state_shapes_and_learning_rate_schedule_equal_fbgemms(fbgemm_name):
    """get_optimizer_state() keys and shapes, and set_learning_rate() between steps, as FBGEMM's CPU TBE."""
    generator = torch.Generator().manual_seed(6)
    module = TieredEmbeddingBags(specs(), optimizer=optimizer_from_fbgemm(fbgemm_name, 0.2, eps=1e-6), device="cpu")
    tbe = fbgemm_tbe(fbgemm_name, 0.2, module.split_embedding_weights())
    ours_state, theirs_state = module.get_optimizer_state(), tbe.get_optimizer_state()
    assert [{k: tuple(v.shape) for k, v in s.items()} for s in ours_state] == \
        [{k: tuple(v.shape) for k, v in s.items()} for s in theirs_state]
    for lr in [0.2, 0.05, 0.5, 0.0]:
        module.set_learning_rate(lr)
        tbe.set_learning_rate(lr)
        assert module.get_learning_rate() == pytest.approx(tbe.get_learning_rate())
        lengths = torch.randint(0, 4, (len(TABLES) * 3,), generator=generator)
        indices = torch.cat([torch.randint(0, TABLES[i // 3][0], (int(n),), generator=generator)
                             for i, n in enumerate(lengths)])
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        step_both(module, tbe, indices, offsets, generator)
    for mine, fbgemms in zip(module.split_embedding_weights(), tbe.split_embedding_weights()):
        torch.testing.assert_close(mine, fbgemms, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("optimizer", [Adam(lr=0.05, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.01),
                                       PartialRowwiseAdam(lr=0.05, betas=(0.8, 0.95), eps=1e-6),
                                       LAMB(lr=0.05, betas=(0.8, 0.95), eps=1e-6), Adagrad(lr=0.1, eps=1e-6)],
                         ids=lambda o: type(o).__name__)
def test_hyper_parameters_and_optimizer_step_change_training_as_the_reference(optimizer, device):
    """update_hyper_parameters / set_learning_rate between steps and set_optimizer_step (a resumed Adam)
    equal the reference trained with the same changes by hand."""
    generator = torch.Generator().manual_seed(7)
    module = TieredEmbeddingBags(specs(Placement.MANAGED_CACHED), optimizer=optimizer, device=device,
                                 cache=CacheConfig(slots=4, associativity=2), backend="torch")
    reference = ReferenceBags([module.table(t).float() for t in range(len(TABLES))], "sum", optimizer)
    changes = [{}, {"lr": 0.02}, {"eps": 1e-4, "beta1": 0.5}, {"weight_decay": 0.1, "beta2": 0.9}]
    for step, change in enumerate(changes):
        fields = {f.name for f in dataclasses.fields(optimizer)}
        change = {k: v for k, v in change.items() if (k if k not in ("beta1", "beta2") else "betas") in fields}
        module.update_hyper_parameters(change)
        if "betas" in fields:
            old = reference.optimizer.betas
            betas = (change.get("beta1", old[0]), change.get("beta2", old[1]))
            change = {k: v for k, v in change.items() if k not in ("beta1", "beta2")} | {"betas": betas}
        reference.optimizer = dataclasses.replace(reference.optimizer, **change)
        if step == 2:  # as a resumed run sets it: the step counts on from there
            module.set_optimizer_step(10)
            reference.step = 10
        indices, offsets = vbe_batch([[2], [2], [2]], generator)
        out = module(indices.to(device), offsets.to(device))
        grad = torch.randn(out.shape, generator=generator)
        out.backward(grad.to(device))
        reference.backward(indices, offsets, grad.double())
    assert module.get_optimizer_step() == 12  # set to 10 before the third step, then two steps
    for t in range(len(TABLES)):
        torch.testing.assert_close(module.table(t).double().cpu(), reference.weights[t], rtol=1e-5, atol=1e-6)


def test_accessors_are_flushed_views_and_reset_cache_states_keeps_updates(device):
    optimizer = PartialRowwiseAdam(lr=0.1)
    module = TieredEmbeddingBags(specs(Placement.MANAGED_CACHED), optimizer=optimizer, device=device,
                                 cache=CacheConfig(slots=8, associativity=2), backend="torch")
    indices, offsets = vbe_batch([[3], [3], [3]], torch.Generator().manual_seed(8))
    module(indices.to(device), offsets.to(device)).sum().backward()
    assert int(module.cache.dirty.sum()) > 0
    weights, state = module.split_embedding_weights(), module.get_optimizer_state()
    assert int(module.cache.dirty.sum()) == 0  # flushed
    assert [tuple(w.shape) for w in weights] == [(n, d) for n, d in TABLES]
    assert [(tuple(s["exp_avg"].shape), tuple(s["exp_avg_sq"].shape)) for s in state] == \
        [((n, d), (n,)) for n, d in TABLES]
    assert weights[0].data_ptr() == module.storage.table_weights[0].data_ptr()  # views, not copies
    before = [w.clone() for w in weights]
    module.reset_cache_states()
    assert int((module.cache.tags >= 0).sum()) == 0
    for w, b in zip(module.split_embedding_weights(), before):
        torch.testing.assert_close(w, b, rtol=0, atol=0)
    module.prefetch(indices.to(device), offsets.to(device))
    with pytest.raises(RuntimeError, match="in flight"):
        module.reset_cache_states()
    module.cancel_prefetched()


def test_accessor_errors(device):
    frozen = TieredEmbeddingBags(specs(), optimizer=None, device=device)
    for call in (frozen.get_learning_rate, frozen.get_optimizer_state, lambda: frozen.set_learning_rate(0.1)):
        with pytest.raises(RuntimeError, match="no optimizer"):
            call()
    module = TieredEmbeddingBags(specs(), optimizer=RowwiseAdagrad(lr=0.1), device=device)
    assert module.get_optimizer_state()[1]["sum"].shape == (TABLES[1][0],)
    with pytest.raises(ValueError, match="finite"):
        module.set_learning_rate(float("nan"))
    with pytest.raises(ValueError, match="has no 'beta1'"):
        module.update_hyper_parameters({"lr": 0.5, "beta1": 0.5})
    assert module.get_learning_rate() == pytest.approx(0.1)  # all or nothing
    with pytest.raises(ValueError, match="not one of FBGEMM's"):
        module.update_hyper_parameters({"momentum": 0.5})
    with pytest.raises(ValueError, match="whole number"):
        module.set_optimizer_step(-1)
    assert TieredEmbeddingBags(specs(), optimizer=SGD(), device=device).get_optimizer_state() == []


def test_one_fbgemm_name_per_optimizer_of_the_registry():
    assert sorted(entry.ours for entry in FBGEMM_OPTIMIZERS) == sorted(OPTIMIZERS)
    for entry in FBGEMM_OPTIMIZERS:
        optimizer = optimizer_from_fbgemm(entry.fbgemm_names[0], learning_rate=0.5)
        assert optimizer.name == entry.ours and optimizer.lr == 0.5
        assert len(entry.state_names) == len(optimizer.state_columns(4))
    assert optimizer_from_fbgemm("exact_row_wise_adagrad").eps == 1e-8  # FBGEMM's enum value, its defaults
    assert optimizer_from_fbgemm("ADAM").lr == 0.01  # FBGEMM's default learning rate, not ours
    with pytest.raises(ValueError, match="no tiered-tbe counterpart"):
        optimizer_from_fbgemm("LARS_SGD")
    with pytest.raises(ValueError, match="weight_decay"):
        optimizer_from_fbgemm("EXACT_ROWWISE_ADAGRAD", weight_decay=0.1)


def test_forward_takes_a_prefetched_batch_through_views_of_its_memory(device):
    """TorchRec splits its KeyedJaggedTensor anew for the forward: new tensor objects over the same
    values, offsets recomputed. The forward still takes the prefetched batch (its locks go with it)."""
    module = TieredEmbeddingBags(specs(Placement.MANAGED_CACHED), optimizer=SGD(lr=0.1), device=device,
                                 cache=CacheConfig(slots=8, associativity=2), backend="torch")
    indices, offsets = vbe_batch([[2, 1], [1, 2], [0, 3]], torch.Generator().manual_seed(9))
    indices, offsets = indices.to(device), offsets.to(device)
    buffer = torch.cat([indices, indices])
    module.prefetch(buffer[: indices.numel()], offsets, forward_stream=None,
                    batch_size_per_feature_per_rank=[[2, 1], [1, 2], [0, 3]])
    out = module(buffer[: indices.numel()], offsets.clone(), batch_size_per_feature_per_rank=[[2, 1], [1, 2], [0, 3]])
    assert not module._prefetched
    out.sum().backward()
    assert module.cache.num_locked() == 0


def test_a_batch_prefetched_for_a_forward_stream_and_never_forwarded_is_released(device):
    """TorchRec's prefetch pipeline prefetches each batch a step ahead, with ``forward_stream``; stopped early
    (training over, evaluation next), it leaves one prefetched. The next pipeline's first forward releases it
    (TorchRec passes its stream; on the CPU any value stands for one). Prefetched without a forward stream,
    the same forward is refused (the caller's order is wrong)."""
    stream = torch.cuda.current_stream() if device.type == "cuda" else object()
    generator = torch.Generator().manual_seed(10)
    for forward_stream in (stream, None):
        module = TieredEmbeddingBags(specs(Placement.MANAGED_CACHED), optimizer=SGD(lr=0.1), device=device,
                                     cache=CacheConfig(slots=16, associativity=4), backend="torch")
        left, evaluated = (tuple(t.to(device) for t in vbe_batch([[3], [3], [3]], generator)) for _ in range(2))
        module.prefetch(*left, forward_stream=forward_stream, defer_unlock=True)
        module.prefetch(*evaluated, forward_stream=forward_stream, defer_unlock=True)
        if forward_stream is None:
            with pytest.raises(ValueError, match="prefetched after the one prefetched next"):
                module(*evaluated)
            module.cancel_prefetched()
        else:
            with torch.no_grad():
                module(*evaluated)
            assert not module._prefetched
        module.run_deferred_unlocks()
        assert module.cache.num_locked() == 0
