"""TieredEmbeddingBags trained side by side with a plain fp64 reference (tests/reference_model.py)."""

from __future__ import annotations

import pytest
import torch
from reference_model import ReferenceBags

from tiered_tbe import Placement, TableSpec
from tiered_tbe.module import TieredEmbeddingBags
from tiered_tbe.optimizers import LAMB, SGD, Adagrad, Adam, PartialRowwiseAdam, RowwiseAdagrad

# Edge sizes: a table of one row, dims that are not powers of two.
EDGE_TABLES = [(1, 3), (50, 17), (7, 8)]


def random_batch(tables, batch_size, max_bag, generator, hot_rows=False):
    """TBE-layout batch with empty bags and repeated rows (in one bag and across bags)."""
    indices, lengths = [], []
    for spec in tables:
        for _ in range(batch_size):
            n = int(torch.randint(0, max_bag + 1, (1,), generator=generator))
            high = min(spec.num_embeddings, 3) if hot_rows else spec.num_embeddings
            indices.append(torch.randint(0, high, (n,), generator=generator))
            lengths.append(n)
    offsets = torch.tensor([0] + lengths).cumsum(0)
    return torch.cat(indices).long(), offsets


def make_pair(specs, optimizer, pooling="sum", weights_dtype=torch.float32, device="cpu", **kwargs):
    module = TieredEmbeddingBags(specs, pooling=pooling, optimizer=optimizer, weights_dtype=weights_dtype,
                                 device=device, **kwargs)
    reference = ReferenceBags([module.table(t).float() for t in range(len(specs))], pooling, optimizer)
    return module, reference


OPTIMIZERS = [SGD(lr=0.3), RowwiseAdagrad(lr=0.2, eps=1e-6), Adam(lr=0.05, betas=(0.8, 0.95), eps=1e-6,
                                                                  weight_decay=0.01)]
# Every optimizer of the registry, for the state round trips.
ALL_OPTIMIZERS = [*OPTIMIZERS, Adagrad(lr=0.1, eps=1e-6), PartialRowwiseAdam(lr=0.05, betas=(0.8, 0.95), eps=1e-6),
                  LAMB(lr=0.05, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.01)]


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: type(o).__name__)
@pytest.mark.parametrize("pooling", ["sum", "mean"])
@pytest.mark.parametrize("placement", [Placement.DEVICE, Placement.HOST, Placement.MANAGED], ids=lambda p: p.value)
def test_training_matches_reference(optimizer, pooling, placement, device):
    generator = torch.Generator().manual_seed(1)
    specs = [TableSpec(n, d, name=f"t{i}", placement=placement if i != 1 else Placement.DEVICE)
             for i, (n, d) in enumerate(EDGE_TABLES)]
    module, reference = make_pair(specs, optimizer, pooling, device=device)
    for step in range(3):
        indices, offsets = random_batch(specs, batch_size=3, max_bag=4, generator=generator, hot_rows=step == 1)
        out = module(indices.to(device), offsets.to(device))
        expected = reference.forward(indices, offsets)
        torch.testing.assert_close(out.double().cpu(), expected, rtol=1e-5, atol=1e-6)
        grad = torch.randn(out.shape, generator=generator)
        out.backward(grad.to(device))
        reference.backward(indices, offsets, grad)
    for t in range(len(specs)):
        torch.testing.assert_close(module.table(t).double().cpu(), reference.weights[t], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("optimizer", ALL_OPTIMIZERS[3:], ids=lambda o: type(o).__name__)
def test_new_optimizers_train_like_the_reference(optimizer, device):
    """Adagrad, PartialRowwiseAdam and LAMB through the module, five steps, against the model's
    written-out math (tests/reference_model.py), with hot rows and a cached table."""
    generator = torch.Generator().manual_seed(3)
    specs = [TableSpec(n, d, name=f"t{i}", placement=Placement.HOST_CACHED if i == 1 else Placement.DEVICE)
             for i, (n, d) in enumerate(EDGE_TABLES)]
    module, reference = make_pair(specs, optimizer, "sum", device=device)
    for step in range(5):
        indices, offsets = random_batch(specs, batch_size=3, max_bag=4, generator=generator, hot_rows=step % 2 == 1)
        out = module(indices.to(device), offsets.to(device))
        torch.testing.assert_close(out.double().cpu(), reference.forward(indices, offsets), rtol=1e-5, atol=1e-6)
        grad = torch.randn(out.shape, generator=generator)
        out.backward(grad.to(device))
        reference.backward(indices, offsets, grad)
    for t in range(len(specs)):
        torch.testing.assert_close(module.table(t).double().cpu(), reference.weights[t], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("weights_dtype", [torch.float16, torch.bfloat16])
def test_low_precision_weights_track_reference(weights_dtype, device):
    generator = torch.Generator().manual_seed(2)
    specs = [TableSpec(n, d) for n, d in EDGE_TABLES]
    module, reference = make_pair(specs, RowwiseAdagrad(lr=0.1), weights_dtype=weights_dtype, device=device)
    for _ in range(3):
        indices, offsets = random_batch(specs, 3, 3, generator)
        out = module(indices.to(device), offsets.to(device))
        torch.testing.assert_close(out.double().cpu(), reference.forward(indices, offsets), rtol=2e-2, atol=2e-2)
        grad = torch.randn(out.shape, generator=generator)
        out.backward(grad.to(device))
        reference.backward(indices, offsets, grad)
    for t in range(len(specs)):
        assert module.table(t).dtype == weights_dtype
        torch.testing.assert_close(module.table(t).double().cpu(), reference.weights[t], rtol=3e-2, atol=3e-2)


def test_pooling_none_and_per_sample_weights_gradient(device):
    generator = torch.Generator().manual_seed(3)
    specs = [TableSpec(5, 6), TableSpec(9, 6)]
    module, reference = make_pair(specs, SGD(lr=0.5), pooling="none", device=device)
    indices, offsets = random_batch(specs, 4, 3, generator)
    psw = torch.rand(indices.numel(), generator=generator, dtype=torch.float64)
    psw_module = psw.float().to(device).requires_grad_()
    out = module(indices.to(device), offsets.to(device), per_sample_weights=psw_module)
    assert out.shape == (indices.numel(), 6)
    psw_reference = psw.clone().requires_grad_()
    # The reference forward is linear in psw: differentiate it by autograd in fp64.
    rows = torch.cat([reference.weights[t][indices[offsets[t * 4]: offsets[t * 4 + 4]]] for t in range(2)])
    expected = rows * psw_reference[:, None]
    torch.testing.assert_close(out.double().cpu(), expected.detach(), rtol=1e-5, atol=1e-6)
    grad = torch.randn(out.shape, generator=generator, dtype=torch.float64)
    expected.backward(grad)
    out.backward(grad.float().to(device))
    torch.testing.assert_close(psw_module.grad.double().cpu(), psw_reference.grad, rtol=1e-5, atol=1e-6)
    reference.backward(indices, offsets, grad, per_sample_weights=psw)
    for t in range(2):
        torch.testing.assert_close(module.table(t).double().cpu(), reference.weights[t], rtol=1e-5, atol=1e-6)


def test_no_grad_and_frozen_tables_do_not_update(device):
    specs = [TableSpec(10, 4)]
    indices, offsets = torch.tensor([1, 2, 2]), torch.tensor([0, 2, 3])
    trained = TieredEmbeddingBags(specs, optimizer=SGD(lr=1.0), device=device)
    before = trained.table(0).clone()
    with torch.no_grad():
        trained(indices.to(device), offsets.to(device))
    assert torch.equal(trained.table(0), before)
    frozen = TieredEmbeddingBags(specs, optimizer=None, device=device)
    out = frozen(indices.to(device), offsets.to(device))
    assert not out.requires_grad


def test_int32_inputs_and_empty_batch(device):
    specs = [TableSpec(10, 4), TableSpec(3, 5)]
    module = TieredEmbeddingBags(specs, optimizer=SGD(lr=0.1), device=device)
    out = module(torch.tensor([], dtype=torch.int32, device=device), torch.zeros(5, dtype=torch.int32, device=device))
    assert out.shape == (2, 9) and torch.equal(out, torch.zeros_like(out))
    out.sum().backward()


def snapshot(module):
    return {k: v.clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize(
    "indices, offsets, psw, message",
    [
        ([0, 10, 1], [0, 1, 2, 3, 3], None, r"table 0 \('user'\): index 10 at position 1 is out of range \[0, 10\)"),
        ([0, 1, -1], [0, 1, 2, 3, 3], None, r"table 1 \('item'\): index -1 at position 2"),
        ([0, 1, 3], [0, 1, 2, 3, 3], None, r"table 1 \('item'\): index 3 at position 2 is out of range \[0, 3\)"),
        ([0, 1, 1], [0, 2, 1, 3, 3], None, r"non-decreasing: offsets\[2\] = 1 < offsets\[1\] = 2"),
        ([0, 1, 1], [0, 1, 2, 3], None, r"offsets has 4 entries.*T=2"),
        ([0, 1, 1], [1, 1, 2, 3, 3], None, r"offsets\[0\] must be 0, got 1"),
        ([0, 1, 1], [0, 1, 2, 3, 4], None, r"offsets\[-1\] must equal len\(indices\) = 3, got 4"),
        ([0, 1, 1], [0, 1, 2, 3, 3], [1.0, 2.0], r"per_sample_weights has shape \(2,\), expected \(3,\)"),
    ],
)
def test_bad_input_raises_and_touches_nothing(indices, offsets, psw, message, device):
    specs = [TableSpec(10, 4, name="user"), TableSpec(3, 2, name="item")]
    module = TieredEmbeddingBags(specs, optimizer=RowwiseAdagrad(lr=0.1), device=device)
    before = snapshot(module)
    with pytest.raises(ValueError, match=message):
        psw_tensor = None if psw is None else torch.tensor(psw, device=device)
        module(torch.tensor(indices, device=device), torch.tensor(offsets, device=device), psw_tensor)
    after = snapshot(module)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_bad_dtypes_and_construction_errors(device):
    module = TieredEmbeddingBags([TableSpec(4, 2)], device=device)
    with pytest.raises(ValueError, match="indices must be int32 or int64, got torch.float32"):
        module(torch.tensor([0.0], device=device), torch.tensor([0, 1], device=device))
    with pytest.raises(ValueError, match="pooling='none' needs one embedding_dim"):
        TieredEmbeddingBags([TableSpec(4, 2), TableSpec(4, 3)], pooling="none", device=device)
    with pytest.raises(ValueError, match="num_embeddings must be a whole number >= 1, got 0"):
        TableSpec(0, 4, name="empty")
    with pytest.raises(ValueError, match="names must be unique"):
        TieredEmbeddingBags([TableSpec(4, 2, name="a"), TableSpec(4, 2, name="a")], device=device)


def test_stochastic_rounding_the_backend_cannot_do_is_refused_when_the_module_is_made(device):
    """The plain-torch backend rounds to nearest: asked to round fp16 weights stochastically it is refused
    at construction (it once raised at the first backward, after a forward had run). fp32 weights round
    nothing, so there the flag changes nothing and is accepted."""
    with pytest.raises(ValueError, match="backend='torch' rounds to nearest only: .* stochastic rounding of float16"):
        TieredEmbeddingBags([TableSpec(4, 2)], weights_dtype=torch.float16, stochastic_rounding=True,
                            backend="torch", device=device)
    module = TieredEmbeddingBags([TableSpec(4, 2)], optimizer=SGD(lr=0.1), stochastic_rounding=True, backend="torch",
                                 device=device)
    assert not module.stochastic_rounding
    module(torch.tensor([1, 3], device=device), torch.tensor([0, 2], device=device)).sum().backward()


@pytest.mark.parametrize("optimizer", ALL_OPTIMIZERS, ids=lambda o: type(o).__name__)
def test_state_dict_round_trip(optimizer, device):
    generator = torch.Generator().manual_seed(4)
    specs = [TableSpec(6, 3, name="a"), TableSpec(4, 5)]
    module = TieredEmbeddingBags(specs, optimizer=optimizer, device=device, seed=1)
    indices, offsets = random_batch(specs, 2, 3, generator)
    module(indices.to(device), offsets.to(device)).sum().backward()
    state = module.state_dict()
    expected_keys = {"a.weight", "table_1.weight", "optimizer_step"}
    state_names = {RowwiseAdagrad: ["momentum1"], Adagrad: ["momentum1"], SGD: [],
                   Adam: ["exp_avg", "exp_avg_sq"], PartialRowwiseAdam: ["exp_avg", "exp_avg_sq"],
                   LAMB: ["exp_avg", "exp_avg_sq"]}[type(optimizer)]
    expected_keys |= {f"{table}.{name}" for table in ("a", "table_1") for name in state_names}
    assert set(state) == expected_keys
    assert state["table_1.weight"].shape == (4, 5)

    restored = TieredEmbeddingBags(specs, optimizer=optimizer, device=device, seed=2)
    restored.load_state_dict({k: v.clone() for k, v in state.items()})
    for _step in range(2):
        indices, offsets = random_batch(specs, 2, 3, generator)
        a = module(indices.to(device), offsets.to(device))
        b = restored(indices.to(device), offsets.to(device))
        assert torch.equal(a, b)
        a.sum().backward()
        b.sum().backward()
    assert all(torch.equal(v, restored.state_dict()[k]) for k, v in module.state_dict().items())

    bad = dict(state)
    bad["a.weight"] = torch.zeros(7, 3)
    before = snapshot(restored)
    with pytest.raises(RuntimeError, match=r"a.weight: shape \(7, 3\), expected \(6, 3\)"):
        restored.load_state_dict(bad)
    assert all(torch.equal(v, snapshot(restored)[k]) for k, v in before.items())
