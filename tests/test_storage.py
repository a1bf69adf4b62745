"""The backing stores' layouts (tiered_tbe/storage.py): each row's optimizer state in a buffer of
its own (``state_layout="separate"``) or right after the row's weights (``"with_rows"``)."""

from __future__ import annotations

import pytest
import torch

from tiered_tbe import Adam, CacheConfig, Placement, RowwiseAdagrad, TableSpec
from tiered_tbe.module import TieredEmbeddingBags
from tiered_tbe.storage import lay_out


@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_state_beside_rows_layout(weights_dtype, device):
    tables = [TableSpec(7, 5, placement=Placement.DEVICE), TableSpec(1, 3, placement=Placement.DEVICE),
              TableSpec(4, 16, placement=Placement.DEVICE)]
    widths = [1, 0, 2]
    storage = lay_out(tables, widths, weights_dtype, device, torch.Generator(device).manual_seed(0), 0.5,
                      state_layout="with_rows")
    element = torch.empty(0, dtype=weights_dtype).element_size()
    ends = []
    for t, (spec, width) in enumerate(zip(tables, widths)):
        weights, state = storage.table_weights[t], storage.table_state[t]
        assert weights.shape == (spec.num_embeddings, spec.embedding_dim) and weights.dtype == weights_dtype
        row_bytes = weights.stride(0) * element
        assert row_bytes % 16 == 0 and weights.data_ptr() % 16 == 0 and weights.stride(1) == 1
        bound = 1.0 / spec.num_embeddings ** 0.5
        assert bool((weights.float().abs() <= bound).all())
        if width == 0:
            assert state is None
        else:
            assert state.shape == (spec.num_embeddings, width) and state.dtype == torch.float32
            assert state.stride(0) * 4 == row_bytes  # one row of bytes holds both
            offset = state.data_ptr() - weights.data_ptr()
            assert spec.embedding_dim * element <= offset < spec.embedding_dim * element + 4
            assert bool((state == 0.5).all())
            ends.append(state.data_ptr() + state.shape[0] * row_bytes)
    # Writing a row's state leaves its weights (and every other row) as they were.
    before = [storage.table_weights[t].clone() for t in range(3)]
    storage.table_state[0].fill_(-7.0)
    storage.table_state[2].fill_(3.0)
    assert all(torch.equal(storage.table_weights[t], before[t]) for t in range(3))


def test_bad_state_layout_is_refused(device):
    with pytest.raises(ValueError, match="state_layout.*'beside'"):
        TieredEmbeddingBags([TableSpec(4, 4)], optimizer=RowwiseAdagrad(), device=device, state_layout="beside")


def test_triton_training_is_the_same_in_either_layout(device):
    """The Triton kernels read and update rows and state through the longer strides: outputs,
    tables and optimizer state after a few cached steps equal the separate layout's, bit for bit."""
    specs = [TableSpec(20, 6, name="a", placement=Placement.HOST_CACHED), TableSpec(9, 6, name="b")]
    modules = [TieredEmbeddingBags(specs, optimizer=Adam(lr=0.05), cache=CacheConfig(slots=4, associativity=2),
                                   device=device, bounds_check="off", state_layout=layout)
               for layout in ("separate", "with_rows")]
    generator = torch.Generator().manual_seed(3)
    for _ in range(3):
        indices = torch.cat([torch.randint(0, 20, (9,), generator=generator),
                             torch.randint(0, 9, (5,), generator=generator)]).to(device)
        offsets = torch.tensor([0, 3, 6, 9, 11, 12, 14], device=device)
        grad = torch.randn(3, 12, generator=generator).to(device)
        outputs = [m(indices, offsets) for m in modules]
        assert torch.equal(outputs[0], outputs[1])
        for out in outputs:
            out.backward(grad)
    states = [m.state_dict() for m in modules]
    assert states[0].keys() == states[1].keys()
    for key in states[0]:
        assert torch.equal(states[0][key], states[1][key]), key
