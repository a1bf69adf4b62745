"""A cache or tables too large for the machine are refused before anything is allocated, with a
size that fits; a cache larger than its tables holds every row and no more.

Nothing large is allocated here: the memory that the device and the host have is replaced by
small numbers, and the check runs before any allocation."""

from __future__ import annotations

import os
import re

import pytest
import torch

from tiered_tbe import CacheConfig, Placement, RowwiseAdagrad, TableSpec
from tiered_tbe import memory as memory_check
from tiered_tbe.cache.slot_cache import SlotCache
from tiered_tbe.module import TieredEmbeddingBags
from tiered_tbe.specs import parse_bytes

MiB = 2**20


def test_a_slot_is_what_the_cache_allocates_per_slot(device):
    cache = TieredEmbeddingBags([TableSpec(64, 5, placement=Placement.HOST_CACHED)], optimizer=RowwiseAdagrad(),
                                cache=CacheConfig(slots=32), weights_dtype=torch.float16, device=device).cache
    per_slot = sum(t.element_size() * t[0].numel() for t in (cache.tags, cache.last_use, cache.use_count,
                                                              cache.dirty, cache.locks, cache.next_use,
                                                              cache.weights, cache.state, cache._way_of_rank))
    assert SlotCache.slot_bytes(5, 1, torch.float16) == per_slot == 5 * 2 + 4 + 33 + 1


@pytest.mark.parametrize("config", [CacheConfig(memory="1TB"), CacheConfig(slots=10**9), CacheConfig(fraction=1.0)])
def test_a_cache_larger_than_its_tables_holds_every_row(config, device):
    tables = [TableSpec(600, 8, placement=Placement.HOST_CACHED), TableSpec(400, 4, placement=Placement.HOST_CACHED)]
    module = TieredEmbeddingBags(tables, optimizer=RowwiseAdagrad(), cache=config, device=device)
    assert module.cache.num_slots == 1024  # 1000 rows, rounded up to whole sets of 32


def test_tables_larger_than_the_host_are_refused_before_allocating():
    """The real host, unpatched: 2**40 rows would be killed by the kernel, or fail in the allocator."""
    with pytest.raises(ValueError, match=r"the module needs .* GiB \(HOST tables \(huge\).*available on the host"
                                         r".*the tables do not fit"):
        TieredEmbeddingBags([TableSpec(2**40, 128, name="huge", placement=Placement.HOST)], device="cpu")


def fake_memory(monkeypatch, host: int, device: int | None = None) -> None:
    monkeypatch.setattr(memory_check, "host_available_bytes", lambda: host)
    if device is not None:  # as on a GPU (check_memory allocates nothing, so no GPU is needed)
        monkeypatch.setattr(memory_check, "SIMULATION", False)
        monkeypatch.setattr(memory_check, "device_free_bytes", lambda d: device)


def test_the_reported_cache_is_refused_with_a_size_that_fits(monkeypatch):
    """CacheConfig(memory="1TB") over a 2M x 128 table: capped at 2M slots (1.1 GB), with 1.2 GiB of
    host memory left it does not fit beside the table (1.0 GB) in simulation."""
    fake_memory(monkeypatch, host=1200 * MiB)
    tables = [TableSpec(2_000_000, 128, name="ads", placement=Placement.HOST_CACHED)]
    with pytest.raises(ValueError) as error:
        TieredEmbeddingBags(tables, optimizer=RowwiseAdagrad(), cache=CacheConfig(memory="1TB"), device="cpu")
    message = str(error.value)
    # A row-wise state goes to the device ("auto" layout), which in simulation is the host.
    assert "the slot cache (2,000,000 slots of 550 B" in message and "HOST tables (ads): 976.6 MiB" in message
    assert "the optimizer state of the HOST tables: 7.6 MiB" in message
    assert "1.2 GiB available on the host (CPU simulation" in message
    assert "CacheConfig(memory='1TB') does not fit. Use at most memory='" in message


def test_a_suggested_size_fits(monkeypatch, device):
    tables = [TableSpec(20_000, 64, name="user", placement=Placement.HOST_CACHED), TableSpec(3, 4, name="tiny")]
    needs = 20_003 * (64 * 4 + 4)  # the backing stores
    fake_memory(monkeypatch, host=needs + 2 * MiB)
    with pytest.raises(ValueError, match=r"Use at most memory='\d+KiB' \([\d,]+ slots\), fraction=[\d.e-]+ "
                                         r"of the 20,000 cached rows, or slots=\d+") as error:
        TieredEmbeddingBags(tables, optimizer=RowwiseAdagrad(), cache=CacheConfig(fraction=1.0), device=device)
    suggested = re.search(r"memory='(\d+KiB)' \(([\d,]+) slots\), fraction=([\d.e-]+) of", str(error.value))
    memory, slots, fraction = suggested.group(1), int(suggested.group(2).replace(",", "")), float(suggested.group(3))
    assert 0 < slots < 20_000 and slots % 32 == 0
    assert parse_bytes(memory) <= 2 * MiB
    for config in (CacheConfig(memory=memory), CacheConfig(fraction=fraction), CacheConfig(slots=slots)):
        module = TieredEmbeddingBags(tables, optimizer=RowwiseAdagrad(), cache=config, device=device)
        assert module.cache.num_slots <= slots


def test_on_a_gpu_the_cache_is_checked_against_the_device(monkeypatch):
    """The issue's example on the H200: what the device and the host have is read, and what fits is said."""
    fake_memory(monkeypatch, host=2**41, device=int(18.2 * 2**30))
    tables = [TableSpec(200_000_000, 128, name="ads", placement=Placement.HOST_CACHED)]
    state_width = [RowwiseAdagrad().state_width(128)]
    plan = memory_check.plan_cache(tables, state_width, torch.float32, CacheConfig(memory="1TB"))
    assert plan.num_slots == 200_000_000  # capped at the rows
    # 550 B a slot and a 512-byte copy row per 16 slots (CacheConfig.in_place_copies).
    with pytest.raises(ValueError, match=r"the module needs 108.6 GiB \(the slot cache \(200,000,000 slots of 550 B"
                                         r".*12,500,000 copy rows of 512 B.*18.2 GiB free on cuda:0: "
                                         r"CacheConfig\(memory='1TB'\) does not fit. Use at most memory='13\d\d\dMiB'"):
        memory_check.check_memory(tables, state_width, torch.float32, "separate", torch.device("cuda:0"), plan)
    # The host holds the table (96 GiB) beside nothing else of the module's.
    fake_memory(monkeypatch, host=90 * 2**30, device=80 * 2**30)
    small = memory_check.plan_cache(tables, state_width, torch.float32, CacheConfig(memory="8GiB"))
    with pytest.raises(ValueError, match=r"HOST tables \(ads\): 96.1 GiB\); 90.0 GiB available on the host: the "
                                         r"tables do not fit"):
        memory_check.check_memory(tables, state_width, torch.float32, "separate", torch.device("cuda:0"), small)
    # With the state in device memory, the device counts it beside the cache (763 MiB more).
    fake_memory(monkeypatch, host=2**41, device=small.device_bytes + 400 * 2**20)
    memory_check.check_memory(tables, state_width, torch.float32, "separate", torch.device("cuda:0"), small)
    with pytest.raises(ValueError, match=r"the optimizer state of the HOST tables: 762.9 MiB.* free on cuda:0"):
        memory_check.check_memory(tables, state_width, torch.float32, "device", torch.device("cuda:0"), small)


@pytest.mark.gpu
def test_gpu_memory_is_read_from_the_device():
    """On the GPU itself: a DEVICE table larger than the device is refused before allocating, and
    the reported 1TB cache over a 2M x 128 table is capped at the table's rows, and fits."""
    free = memory_check.device_free_bytes(torch.device("cuda"))
    rows = free // (128 * 4) + 1
    with pytest.raises(ValueError, match=r"DEVICE tables \(big\).* free on cuda.*the tables do not fit"):
        TieredEmbeddingBags([TableSpec(rows, 128, name="big")], device="cuda")
    module = TieredEmbeddingBags([TableSpec(2_000_000, 128, placement=Placement.HOST_CACHED)],
                                 optimizer=RowwiseAdagrad(), cache=CacheConfig(memory="1TB"), device="cuda")
    assert module.cache.num_slots == 2_000_000


@pytest.mark.skipif(not os.path.exists("/proc/meminfo"), reason="needs Linux's /proc/meminfo")
def test_meminfo_fields_in_bytes():
    from tiered_tbe.base.host_memory import meminfo_bytes, transparent_huge_pages

    total, available = meminfo_bytes("MemTotal"), meminfo_bytes("MemAvailable")
    assert total % 1024 == 0 and 0 < available <= total
    assert meminfo_bytes("Mem") is None and meminfo_bytes("NoSuchField") is None  # whole names only
    setting = transparent_huge_pages()
    assert setting is None or " / " in setting
