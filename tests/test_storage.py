"""The backing stores' layouts (tiered_tbe/storage.py): each row's optimizer state in a buffer of
its own beside the weights (``state_layout="separate"``), in device memory (``"device"``), or right
after the row's weights (``"with_rows"``); ``"auto"`` picks one."""

from __future__ import annotations

import pytest
import torch

from tiered_tbe import SGD, Adagrad, Adam, CacheConfig, PartialRowwiseAdam, Placement, RowwiseAdagrad, TableSpec
from tiered_tbe.module import TieredEmbeddingBags
from tiered_tbe.storage import lay_out, resolve_state_layout, tier_bytes


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


@pytest.mark.parametrize("optimizer, layout", [(Adam(lr=0.05), "with_rows"), (Adam(lr=0.05), "device"),
                                               (RowwiseAdagrad(lr=0.1), "device"), (RowwiseAdagrad(lr=0.1), "auto")],
                         ids=["adam-with_rows", "adam-device", "rowwise-device", "rowwise-auto"])
def test_triton_training_is_the_same_in_every_layout(optimizer, layout, device):
    """The Triton kernels read and update rows and state wherever the layout puts them (longer
    strides, or the state in another memory): outputs, tables and optimizer state after a few
    cached steps equal the separate layout's, bit for bit."""
    specs = [TableSpec(20, 6, name="a", placement=Placement.HOST_CACHED), TableSpec(9, 6, name="b"),
             TableSpec(13, 6, name="c", placement=Placement.MANAGED)]
    modules = [TieredEmbeddingBags(specs, optimizer=optimizer, cache=CacheConfig(slots=4, associativity=2),
                                   device=device, bounds_check="off", state_layout=chosen)
               for chosen in ("separate", layout)]
    assert modules[1].state_layout == ("device" if layout == "auto" else layout)
    generator = torch.Generator().manual_seed(3)
    for _ in range(3):
        indices = torch.cat([torch.randint(0, 20, (9,), generator=generator),
                             torch.randint(0, 9, (5,), generator=generator),
                             torch.randint(0, 13, (4,), generator=generator)]).to(device)
        offsets = torch.tensor([0, 3, 6, 9, 11, 12, 14, 15, 17, 18], device=device)
        grad = torch.randn(3, 18, generator=generator).to(device)
        outputs = [m(indices, offsets) for m in modules]
        assert torch.equal(outputs[0], outputs[1])
        for out in outputs:
            out.backward(grad)
    states = [m.state_dict() for m in modules]
    assert states[0].keys() == states[1].keys()
    for key in states[0]:
        assert torch.equal(states[0][key], states[1][key]), key


def test_device_layout_puts_the_state_of_host_tiers_in_device_memory(device):
    """``"device"``: the weights stay in their tier, every tier's state buffer is a DEVICE buffer,
    and the memory check counts it there."""
    tables = [TableSpec(10, 4, name="m", placement=Placement.MANAGED_CACHED),
              TableSpec(6, 8, name="h", placement=Placement.HOST), TableSpec(3, 4, name="d")]
    storage = lay_out(tables, [1, 1, 1], torch.float32, device, torch.Generator(device).manual_seed(0), 0.25,
                      state_layout="device")
    placements = [buffer.placement for buffer in storage.buffers]
    assert placements.count(Placement.DEVICE) == 4  # the DEVICE tier's two buffers, the others' state
    assert Placement.MANAGED in placements and Placement.HOST in placements
    for t in range(3):
        assert bool((storage.table_state[t] == 0.25).all())
    counted = tier_bytes(tables, [1, 1, 1], torch.float32, "device")
    assert counted[Placement.MANAGED][1] == 10 * 4 * 4 and counted[Placement.HOST][1] == 6 * 8 * 4
    assert counted[Placement.DEVICE][1] == 3 * 4 * 4 + 4 * (10 + 6 + 3)
    assert "optimizer state of the MANAGED tables" in counted[Placement.DEVICE][0]
    separate = tier_bytes(tables, [1, 1, 1], torch.float32, "separate")
    assert separate[Placement.MANAGED][1] == 10 * 4 * 4 + 10 * 4


@pytest.mark.parametrize("optimizer, mover, free, expected", [
    (RowwiseAdagrad(), "zero_copy", None, "device"),
    (RowwiseAdagrad(), None, 10**9, "device"),  # no cache: a MANAGED table's state in HBM too
    (RowwiseAdagrad(), "zero_copy", 4 * 1000 * 4 - 1, "separate"),  # more than a quarter of what is free
    (RowwiseAdagrad(), "staged", None, "separate"),  # its host threads read the state
    (Adam(), "zero_copy", None, "separate"), (Adagrad(), "zero_copy", None, "separate"),
    (PartialRowwiseAdam(), "zero_copy", None, "separate"), (SGD(), "zero_copy", None, "separate"),
], ids=["rowwise", "uncached", "too-large", "staged", "adam", "adagrad", "partial-rowwise-adam", "sgd"])
def test_auto_layout_keeps_a_row_wise_state_in_device_memory(optimizer, mover, free, expected):
    tables = [TableSpec(1000, 16, placement=Placement.MANAGED_CACHED), TableSpec(50, 16)]
    widths = [optimizer.state_width(16)] * 2
    row_wise = optimizer.state_is_row_wise()
    assert resolve_state_layout("auto", row_wise, tables, widths, mover, free) == expected
    assert resolve_state_layout("separate", row_wise, tables, widths, mover, free) == "separate"


def test_device_layout_with_the_staged_mover_is_refused(device):
    with pytest.raises(ValueError, match="state_layout='device' needs the zero-copy mover"):
        TieredEmbeddingBags([TableSpec(8, 4, placement=Placement.HOST_CACHED)], optimizer=RowwiseAdagrad(),
                            cache=CacheConfig(slots=4, mover="staged"), device=device, state_layout="device")
    module = TieredEmbeddingBags([TableSpec(8, 4, placement=Placement.HOST_CACHED)], optimizer=RowwiseAdagrad(),
                                 cache=CacheConfig(slots=4, mover="staged"), device=device)
    assert module.state_layout == "separate"
