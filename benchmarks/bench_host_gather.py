"""How fast the GPU gathers rows in place from pinned host memory, by buffer size and allocation.

The slot cache's fill reads missed rows from the backing store in place (zero-copy), in
ascending row order. On the H200 machine it reached ~50 GB/s from a 4 GB table but ~21 GB/s
(68K rows) to ~34 GB/s (262K rows) from the 17 GB of the 26 Criteo tables: the GPU translates
every host address it touches, and a larger buffer has more pages to translate. This script
measures that directly with ``torch.index_select`` (one 512-byte fp32 row per index) for:

- ``cudaHostAlloc`` buffers of several sizes (what ``Placement.HOST`` allocates);
- pinned host memory from the VMM API (``cuMemCreate`` with a host NUMA location, mapped at
  its allocation granularity);
- anonymous memory advised to transparent huge pages (``madvise(MADV_HUGEPAGE)``), then
  registered with ``cudaHostRegister``: if address translation is the limit, 2 MB host pages
  may help the IOMMU and the GPU's page tables;
- managed memory advised to stay on the host and mapped for the GPU (what ``Placement.MANAGED``
  allocates): FBGEMM and our cache read it about twice as fast in place as ``cudaHostAlloc``
  memory at 17 GB (issue 11); if it gathers faster here too, at the same rows, the difference
  is the mapping (page size of the GPU's mapping of host memory), and ``Placement.HOST`` could
  allocate managed memory instead.

against the pinned ``memcpy`` bandwidth in the same run.

    python benchmarks/bench_host_gather.py                         # 4 and 17 GB, 68K and 262K rows
    python benchmarks/bench_host_gather.py --sizes-gb 4 17 --rows 65536 262144
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import sys
import time

import numpy as np
import torch

from tiered_tbe.base.mode import SIMULATION, describe_mode  # first: picks GPU / simulation mode
from tiered_tbe.benchmarks import common
from tiered_tbe.cache import tiers

ROW_FLOATS = 128  # 512-byte rows


def huge_page_registered(nbytes: int):
    """Anonymous memory advised to transparent huge pages, touched, then pinned and mapped for
    the GPU with ``cudaHostRegister``. Returns the ``_CudaMemory`` (it keeps the mapping alive)."""
    runtime = tiers._runtime()
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer.madvise(mmap.MADV_HUGEPAGE)
    np.frombuffer(buffer, dtype=np.uint8)[::4096] = 1  # fault every page in (2 MB at a time with THP)
    host_pointer = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    flags = runtime.cudaHostRegisterMapped | runtime.cudaHostRegisterPortable
    tiers._check(runtime, runtime.cudaHostRegister(host_pointer, nbytes, flags), "cudaHostRegister")
    device_pointer = tiers._check(runtime, runtime.cudaHostGetDevicePointer(host_pointer, 0),
                                  "cudaHostGetDevicePointer")
    memory = tiers._CudaMemory(int(device_pointer), nbytes, lambda _: runtime.cudaHostUnregister(host_pointer),
                               "huge-page registered host")
    memory.mapping = buffer  # unmapped after the unregister, when the last reference goes
    return memory


def vmm_host_memory(nbytes: int):
    """Pinned host memory from the virtual memory management API (``cuMemCreate`` on the host's
    NUMA node 0, ``cuMemMap`` at the recommended granularity, readable and writable by GPU 0):
    the driver may map it into the GPU's page tables with larger pages than ``cudaHostAlloc``."""
    from cuda.bindings import driver

    def check(result, call):
        err, *values = result if isinstance(result, tuple) else (result,)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"{call} failed: {err}")
        return values[0] if len(values) == 1 else values

    prop = driver.CUmemAllocationProp()
    prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA
    prop.location.id = 0
    granularity = check(driver.cuMemGetAllocationGranularity(
        prop, driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED), "granularity")
    size = -(-nbytes // granularity) * granularity
    handle = check(driver.cuMemCreate(size, prop, 0), "cuMemCreate")
    pointer = check(driver.cuMemAddressReserve(size, granularity, 0, 0), "cuMemAddressReserve")
    check(driver.cuMemMap(pointer, size, 0, handle, 0), "cuMemMap")
    access = driver.CUmemAccessDesc()
    access.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    access.location.id = 0
    access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    check(driver.cuMemSetAccess(pointer, size, [access], 1), "cuMemSetAccess")
    print(f"  (VMM host allocation granularity {granularity / 2**20:g} MiB)")

    def free(_):
        driver.cuMemUnmap(pointer, size)
        driver.cuMemRelease(handle)
        driver.cuMemAddressFree(pointer, size)

    return tiers._CudaMemory(int(pointer), nbytes, free, "VMM host")


def anon_huge_pages_kb() -> int | None:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def gather_gbs(memory, nbytes: int, counts, rep_ms: float) -> list[tuple[int, float, float]]:
    """(rows, ms, GB/s) of ``index_select`` of ``count`` distinct random rows, ascending."""
    table = torch.as_tensor(memory, device="cuda").view(torch.float32).view(-1, ROW_FLOATS)
    num_rows = nbytes // (4 * ROW_FLOATS)
    generator = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for count in counts:
        rows = torch.randperm(num_rows, device="cuda", generator=generator)[:count].sort().values
        out = torch.empty(count, ROW_FLOATS, device="cuda")
        ms = common.time_ms(lambda: torch.index_select(table, 0, rows, out=out), rep_ms)  # noqa: B023
        results.append((count, ms, count * 4 * ROW_FLOATS / ms / 1e6))
    return results


def duplex(memory, nbytes: int, count: int, rep_ms: float) -> list[tuple[str, float, float]]:
    """(what, ms, GB/s) of a scatter of ``count`` rows into the buffer (ascending and random
    order), and of a gather and a scatter of different rows at once on two streams: whether
    the bus's two directions overlap when the GPU reads and writes host memory in place."""
    table = torch.as_tensor(memory, device="cuda").view(torch.float32).view(-1, ROW_FLOATS)
    num_rows = nbytes // (4 * ROW_FLOATS)
    generator = torch.Generator(device="cuda").manual_seed(1)
    chosen = torch.randperm(num_rows, device="cuda", generator=generator)[: 2 * count]
    gather_rows, scatter_rows = chosen[:count].sort().values, chosen[count:].sort().values
    shuffled = scatter_rows[torch.randperm(count, device="cuda", generator=generator)]
    values = torch.randn(count, ROW_FLOATS, device="cuda")
    out = torch.empty(count, ROW_FLOATS, device="cuda")
    other = torch.cuda.Stream()

    def both():
        other.wait_stream(torch.cuda.current_stream())
        torch.index_select(table, 0, gather_rows, out=out)
        with torch.cuda.stream(other):
            table.index_copy_(0, scatter_rows, values)
        torch.cuda.current_stream().wait_stream(other)

    row_bytes = 4 * ROW_FLOATS
    results = []
    for what, fn, moved in (("scatter, ascending rows", lambda: table.index_copy_(0, scatter_rows, values), count),
                            ("scatter, random order", lambda: table.index_copy_(0, shuffled, values), count),
                            ("gather + scatter on two streams", both, 2 * count)):
        ms = common.time_ms(fn, rep_ms)
        results.append((what, ms, moved * row_bytes / ms / 1e6))
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-gb", type=float, nargs="+", default=[4.0, 17.0],
                        help="pinned buffer sizes in GB (default 4 17)")
    parser.add_argument("--rows", type=int, nargs="+", default=[65536, 262144], help="rows gathered per call")
    parser.add_argument("--rep-ms", type=float, default=100.0, help="do_bench repetition time, ms")
    parser.add_argument("--no-huge-pages", action="store_true", help="skip the huge-page registered buffers")
    parser.add_argument("--only-host-alloc", action="store_true",
                        help="measure cudaHostAlloc and managed buffers only")
    parser.add_argument("--duplex", action="store_true",
                        help="also time scatters into the buffer and a gather and a scatter at once")
    args = parser.parse_args(argv)
    print(describe_mode())
    if SIMULATION:
        print("needs a GPU: zero-copy reads of host memory cannot be simulated")
        return 0
    memcpy = common.pinned_copy_bandwidth(1.0, args.rep_ms)
    print(f"pinned memcpy host->device {memcpy['h2d_gbs']:.1f} GB/s")
    try:
        print("transparent huge pages:", open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip())
    except OSError:
        print("transparent huge pages: unknown")
    kinds = [("cudaHostAlloc", lambda n: tiers._pinned_host_memory(n)),
             ("cudaMallocManaged (host-preferred, GPU-mapped)", lambda n: tiers._managed_memory(n, 0)),
             ("cuMemCreate (VMM, host NUMA)", vmm_host_memory)]
    if args.only_host_alloc:
        kinds = kinds[:2]
    elif not args.no_huge_pages:
        kinds.append(("THP + cudaHostRegister", huge_page_registered))
    print("| allocation | buffer GB | rows | ms | GB/s | / memcpy | setup s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, allocate in kinds:
        for size_gb in args.sizes_gb:
            nbytes = int(size_gb * 1e9) // (4 * ROW_FLOATS) * (4 * ROW_FLOATS)
            start = time.perf_counter()
            before = anon_huge_pages_kb()
            with torch.cuda.device(0):
                memory = allocate(nbytes)
            setup_s = time.perf_counter() - start
            after = anon_huge_pages_kb()
            if before is not None and after is not None and name.startswith("THP"):
                print(f"  (AnonHugePages grew by {(after - before) / 1e6:.1f} GB)")
            for count, ms, gbs in gather_gbs(memory, nbytes, args.rows, args.rep_ms):
                print(f"| {name} | {size_gb:g} | {count:,} | {ms:.3f} | {gbs:.1f} | {gbs / memcpy['h2d_gbs']:.2f} "
                      f"| {setup_s:.1f} |", flush=True)
            if args.duplex:
                for count in args.rows:
                    for what, ms, gbs in duplex(memory, nbytes, count, args.rep_ms):
                        print(f"| {name}: {what} | {size_gb:g} | {count:,} | {ms:.3f} | {gbs:.1f} | "
                              f"{gbs / memcpy['h2d_gbs']:.2f} | {setup_s:.1f} |", flush=True)
            del memory
            torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
