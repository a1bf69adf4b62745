"""Backing-store allocation in every tier: CPU tensors in simulation, device / pinned / managed on a GPU."""

import ctypes
import gc
import pathlib
import weakref

import pytest
import torch

from tiered_tbe.base.mode import SIMULATION
from tiered_tbe.cache import tiers
from tiered_tbe.cache.tiers import TierBuffer, allocate
from tiered_tbe.specs import Placement

ALL_PLACEMENTS = list(Placement)


@pytest.mark.parametrize("placement", ALL_PLACEMENTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cpu_tiers_are_plain_cpu_tensors(placement, dtype):
    buffer = allocate(placement, 1001, dtype, "cpu")
    assert isinstance(buffer, TierBuffer) and buffer.placement is placement.backing
    assert buffer.tensor.device.type == "cpu" and buffer.tensor.dtype == dtype
    assert buffer.tensor.shape == (1001,) and buffer.nbytes == 1001 * buffer.tensor.element_size()
    buffer.tensor.view(7, 143)[3] = 2.0  # writable, and viewable as table rows
    assert buffer.tensor[3 * 143 : 4 * 143].eq(2).all()
    buffer.release()
    assert buffer.tensor is None and buffer.nbytes == 0


@pytest.mark.skipif(not SIMULATION, reason="simulation mode only")
def test_simulation_mode_gives_cpu_tensors_for_the_default_device():
    for placement in (Placement.DEVICE, Placement.HOST, Placement.MANAGED):
        assert allocate(placement, 10, torch.float32).tensor.device.type == "cpu"


def test_sizes_checked():
    assert allocate(Placement.HOST, 0, torch.float32, "cpu").tensor.numel() == 0
    with pytest.raises(ValueError, match="numel"):
        allocate(Placement.HOST, -1, torch.float32, "cpu")


def test_clear_errors_without_cuda_bindings(monkeypatch):
    monkeypatch.setattr(tiers, "_runtime", lambda: None)
    monkeypatch.setattr(tiers, "_cupy", lambda: None)
    with pytest.raises(RuntimeError, match="Placement.HOST needs cuda-bindings"):
        tiers._pinned_host_memory(4096)
    with pytest.raises(RuntimeError, match="Placement.MANAGED needs cuda-bindings"):
        tiers._managed_memory(4096, 0)


def _smaps_entry(address: int) -> dict[str, str]:
    """This process's /proc/self/smaps fields of the mapping that starts at ``address``."""
    fields, inside = {}, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
                if inside:
                    break
                inside = int(head.split("-")[0], 16) == address
            elif inside:
                name, _, value = line.partition(":")
                fields[name] = value.strip()
    return fields


@pytest.mark.skipif(not pathlib.Path("/proc/self/smaps").exists(), reason="needs Linux's /proc")
@pytest.mark.parametrize("huge_pages", [True, False])
def test_host_memory_mapped_at_a_huge_page_boundary_and_advised(huge_pages):
    """The registered host memory kinds map their own memory: 2 MiB aligned and rounded, advised into
    transparent huge pages or out of them (the kernel's smaps says which), writable, and given back."""
    nbytes = 3 * tiers.HUGE_PAGE_BYTES + 12345
    address, length = tiers.map_host_memory(nbytes, huge_pages)
    try:
        assert address % tiers.HUGE_PAGE_BYTES == 0 and length == 4 * tiers.HUGE_PAGE_BYTES
        entry = _smaps_entry(address)
        assert int(entry["Size"].split()[0]) * 1024 == length  # the trimmed ends are gone
        if "THPeligible" in entry:
            assert entry["THPeligible"] == ("1" if huge_pages else "0")
        ctypes.memset(address, 7, length)
        assert (ctypes.c_uint8 * 16).from_address(address + length - 16)[:] == [7] * 16
    finally:
        tiers.unmap_host_memory(address, length)
    assert _smaps_entry(address) == {}


def test_host_memory_kind_is_checked(monkeypatch):
    assert tiers.host_memory_kind() == "host_alloc"
    monkeypatch.setenv("TIERED_TBE_HOST_MEMORY", "registered_huge_pages")
    assert tiers.host_memory_kind() == "registered_huge_pages"
    monkeypatch.setenv("TIERED_TBE_HOST_MEMORY", "huge")
    with pytest.raises(ValueError, match="TIERED_TBE_HOST_MEMORY='huge': choose one of host_alloc, registered"):
        tiers.host_memory_kind()
    with pytest.raises(ValueError, match="host memory kind 'huge'"):
        tiers._pinned_host_memory(4096, "huge")


def test_managed_first_touch_is_checked(monkeypatch):
    assert tiers.managed_first_touch() == "device"
    monkeypatch.setenv("TIERED_TBE_MANAGED_FIRST_TOUCH", "host")
    assert tiers.managed_first_touch() == "host"
    monkeypatch.setenv("TIERED_TBE_MANAGED_FIRST_TOUCH", "cpu")
    with pytest.raises(ValueError, match="TIERED_TBE_MANAGED_FIRST_TOUCH='cpu': choose one of device, host"):
        tiers.managed_first_touch()


# ---------------------------------------------------------------- GPU (an H200)

def _pointer_type(tensor):
    from cuda.bindings import runtime

    err, attributes = runtime.cudaPointerGetAttributes(tensor.data_ptr())
    assert err == runtime.cudaError_t.cudaSuccess
    return attributes.type


@pytest.mark.gpu
def test_gpu_device_tier():
    buffer = allocate(Placement.DEVICE, 1001, torch.float16, "cuda")
    assert buffer.tensor.is_cuda and buffer.tensor.numel() == 1001


@pytest.mark.gpu
@pytest.mark.parametrize("placement", [Placement.HOST, Placement.HOST_CACHED, Placement.MANAGED])
def test_gpu_host_and_managed_tiers_are_cuda_tensors_read_in_place(placement):
    from cuda.bindings import runtime

    numel = 3 * (1 << 20) + 7  # an odd size: allocated exactly, not rounded to a power of two
    buffer = allocate(placement, numel, torch.bfloat16, "cuda")
    tensor = buffer.tensor
    assert tensor.is_cuda and tensor.dtype == torch.bfloat16 and tensor.numel() == numel
    assert tensor.untyped_storage().nbytes() == numel * 2
    want = runtime.cudaMemoryType.cudaMemoryTypeHost if placement.backing is Placement.HOST \
        else runtime.cudaMemoryType.cudaMemoryTypeManaged
    assert _pointer_type(tensor) == want
    # GPU kernels write and read it in place.
    tensor.copy_(torch.arange(numel, device="cuda").remainder(251).to(torch.bfloat16))
    rows = tensor[: numel - 7].view(-1, 1024)
    torch.testing.assert_close(rows.float().sum(1)[:3].cpu(),
                               torch.arange(3 * 1024).remainder(251).view(3, 1024).float().sum(1))
    if placement.backing is Placement.MANAGED:
        attribute = runtime.cudaMemRangeAttribute
        preferred = _range_attribute(tensor, attribute.cudaMemRangeAttributePreferredLocation, 1)
        assert preferred == [runtime.cudaCpuDeviceId]
        accessed_by = _range_attribute(tensor, attribute.cudaMemRangeAttributeAccessedBy, 4)
        assert torch.cuda.current_device() in accessed_by


def _range_attribute(tensor, attribute, count):
    """cudaMemRangeGetAttribute of ``count`` int32 values over the whole tensor."""
    from cuda.bindings import runtime

    err, data = runtime.cudaMemRangeGetAttribute(4 * count, attribute, tensor.data_ptr(),
                                                 tensor.numel() * tensor.element_size())
    assert err == runtime.cudaError_t.cudaSuccess
    if isinstance(data, int):
        return [data]
    raw = bytes(data) if not isinstance(data, (list, tuple)) else None
    if raw is None:
        return [int(v) for v in data]
    return [int.from_bytes(raw[4 * i : 4 * i + 4], "little", signed=True) for i in range(count)]


@pytest.mark.gpu
@pytest.mark.parametrize("placement", [Placement.HOST, Placement.MANAGED])
def test_gpu_memory_lives_while_a_view_does_and_is_freed_after(placement):
    buffer = allocate(placement, 1 << 16, torch.float32, "cuda")
    owner = weakref.ref(buffer.owner)
    view = buffer.tensor[100:200]
    view.fill_(3.0)
    buffer.release()
    del buffer
    gc.collect()
    assert owner() is not None  # the view keeps the allocation
    assert view.sum().item() == 300.0
    del view
    gc.collect()
    assert owner() is None  # and nothing else does


@pytest.mark.gpu
def test_one_launch_moves_only_out_of_managed_memory():
    """The zero-copy mover writes victims back in the fill's warp (random row order) only into managed
    memory; into pinned memory, where random-order writes were ~4x slower, it keeps two launches."""
    from tiered_tbe import CacheConfig, Placement, TableSpec, TieredEmbeddingBags
    from tiered_tbe.cache.tiers import is_pinned_host_memory

    def mover_of(placement):
        module = TieredEmbeddingBags([TableSpec(1000, 16, placement=placement)], device="cuda",
                                     cache=CacheConfig(slots=64))
        return module.cache.mover, module.storage.table_weights[0]

    managed, managed_rows = mover_of(Placement.MANAGED_CACHED)
    pinned, pinned_rows = mover_of(Placement.HOST_CACHED)
    assert is_pinned_host_memory(pinned_rows) and not is_pinned_host_memory(managed_rows)
    assert managed.fused_moves and not pinned.fused_moves


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["registered", "registered_huge_pages"])
def test_gpu_registered_host_memory_is_a_host_tier_read_and_written_in_place(kind, monkeypatch):
    """HOST memory made the registered ways: pinned host memory to CUDA (so the staged mover and the
    row movers treat it as HOST), written by the GPU and read back through the host view; freed with
    its last view."""
    from cuda.bindings import runtime

    monkeypatch.setenv("TIERED_TBE_HOST_MEMORY", kind)
    numel = 5 * (1 << 20) + 3
    buffer = allocate(Placement.HOST, numel, torch.float32, "cuda")
    tensor = buffer.tensor
    assert tensor.is_cuda and tensor.numel() == numel and buffer.owner.what.startswith("registered")
    assert _pointer_type(tensor) == runtime.cudaMemoryType.cudaMemoryTypeHost
    assert tiers.is_pinned_host_memory(tensor)
    tensor.copy_(torch.arange(numel, device="cuda", dtype=torch.float32))
    torch.cuda.synchronize()
    host = tiers.host_view(tensor)
    assert host.device.type == "cpu" and torch.equal(host[-5:], torch.arange(numel - 5, numel, dtype=torch.float32))
    owner = weakref.ref(buffer.owner)
    buffer.release()
    del buffer, tensor, host
    gc.collect()
    assert owner() is None


@pytest.mark.gpu
def test_gpu_managed_memory_prefetched_to_the_host_stays_readable_in_place():
    """prefetch_managed_to_host places every page on the host in one call (the driver says the last
    prefetch went to the CPU); the GPU then writes and reads it in place, the host sees the same."""
    from cuda.bindings import runtime

    numel = 3 * (1 << 20) + 5
    buffer = allocate(Placement.MANAGED, numel, torch.float32, "cuda")
    tensor = buffer.tensor
    tiers.prefetch_managed_to_host(tensor.data_ptr(), numel * 4)
    last = _range_attribute(tensor, runtime.cudaMemRangeAttribute.cudaMemRangeAttributeLastPrefetchLocation, 1)
    assert last == [runtime.cudaCpuDeviceId]
    tensor.copy_(torch.arange(numel, device="cuda", dtype=torch.float32))
    torch.cuda.synchronize()
    assert torch.equal(tiers.host_view(tensor)[-3:], torch.arange(numel - 3, numel, dtype=torch.float32))


@pytest.mark.gpu
def test_gpu_managed_memory_first_touched_by_the_host_is_zero_and_read_in_place(monkeypatch):
    """TIERED_TBE_MANAGED_FIRST_TOUCH=host: the store comes zeroed by the host; the GPU writes and reads it
    in place and the host sees the same."""
    monkeypatch.setenv("TIERED_TBE_MANAGED_FIRST_TOUCH", "host")
    numel = 3 * (1 << 20) + 5
    tensor = allocate(Placement.MANAGED, numel, torch.float32, "cuda").tensor
    assert not tensor.any()
    tensor[-4:] = 2.5
    torch.cuda.synchronize()
    assert torch.equal(tiers.host_view(tensor)[-5:], torch.tensor([0.0, 2.5, 2.5, 2.5, 2.5]))
