"""base/sorting.py: the stable sorts of row ids against ``torch.sort`` (the reference), on the
CPU (its torch path) and on the GPU (CUB's radix sort through ``cuda.compute`` when it imports)."""

from __future__ import annotations

import pytest
import torch

from tiered_tbe.base.codes import INT32_MAX, INT64_MAX
from tiered_tbe.base.sorting import compact, sort_backend, sort_ids, stable_sort


def _keys(n: int, high: int, dtype: torch.dtype, device, seed: int) -> torch.Tensor:
    """``n`` keys in ``[0, high]``, every 7th equal to ``high`` (the bound, as a "none" marker is)."""
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randint(0, min(high, 1 << 62) + 1, (n,), generator=generator, dtype=torch.int64)
    keys[::7] = high
    return keys.to(dtype).to(device)


def _check_against_torch(keys: torch.Tensor, upper_bound: int | None) -> None:
    expected_keys, expected_order = torch.sort(keys.cpu(), stable=True)
    sorted_keys, order = stable_sort(keys, upper_bound)
    assert sorted_keys.dtype == keys.dtype and order.dtype == torch.int32
    assert torch.equal(sorted_keys.cpu(), expected_keys)
    assert torch.equal(order.cpu().long(), expected_order)


CASES = [
    (0, 5, torch.int32), (1, 0, torch.int32), (2, 1, torch.int32), (17, 3, torch.int32),
    (1000, 1, torch.int32),  # a key repeated hundreds of times: stability shows
    (4099, 20_000_000, torch.int32), (3001, INT32_MAX, torch.int32), (2500, 3_000_000_000, torch.int64),
    (1500, INT64_MAX, torch.int64),
]


@pytest.mark.parametrize("n,high,dtype", CASES)
def test_stable_sort_equals_torch_sort(n, high, dtype, device):
    _check_against_torch(_keys(n, high, dtype, device, seed=n), high)


def test_stable_sort_refuses_keys_it_cannot_number(device):
    class Huge:
        is_cuda = False

        def numel(self):
            return INT32_MAX

    with pytest.raises(ValueError, match="at most 2"):
        stable_sort(Huge())


def test_sort_ids_puts_the_none_marker_last(device):
    ids = torch.tensor([5, INT64_MAX, 0, 5, 2, INT64_MAX, 0], device=device)
    sorted_ids, order = sort_ids(ids, 6)
    assert sorted_ids.tolist() == [0, 0, 2, 5, 5, INT64_MAX, INT64_MAX]
    assert order.tolist() == [2, 6, 4, 0, 3, 1, 5]


@pytest.mark.parametrize("n", [0, 1, 7, 4097])
@pytest.mark.parametrize("share", [0.0, 0.3, 1.0])
def test_compact_moves_the_selected_entries_to_the_front_in_order(n, share, device):
    generator = torch.Generator().manual_seed(n)
    mask = (torch.rand(n, generator=generator) < share).to(device)
    rows = torch.randint(-5, 1 << 40, (n,), generator=generator).to(device)
    slots = torch.randint(0, 99, (n,), generator=generator, dtype=torch.int32).to(device)
    count = int(mask.sum())
    filled_rows, filled_slots = compact(mask, rows, slots, fill=-7)
    assert filled_rows.dtype == rows.dtype and filled_slots.dtype == slots.dtype
    assert filled_rows.tolist() == rows[mask].tolist() + [-7] * (n - count)
    assert filled_slots.tolist() == slots[mask].tolist() + [-7] * (n - count)
    (unfilled,) = compact(mask, rows)
    assert unfilled.shape == (n,) and unfilled[:count].tolist() == rows[mask].tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 31, 4096, 4097, 1 << 20, (1 << 21) + 5])
def test_cub_sort_equals_torch_sort_on_the_gpu(n, device):
    """The backend the GPU uses (CUB where ``cuda.compute`` imports) sorts as ``torch.sort``, bit
    for bit, at the sizes of a batch and with a few distinct keys (long runs of ties)."""
    if sort_backend(device) != "cub":
        pytest.skip("cuda.compute does not import here: the GPU sorts with torch.sort")
    for high, dtype in ((20_000_000, torch.int32), (7, torch.int32), (INT32_MAX, torch.int32),
                        (3_000_000_000, torch.int64)):
        _check_against_torch(_keys(n, high, dtype, device, seed=n + high), high)


@pytest.mark.gpu
def test_cub_sort_replays_in_a_cuda_graph(device):
    keys = _keys(300_000, 1_000_000, torch.int32, device, seed=3)
    stable_sort(keys, 1_000_000)  # builds the sort (JIT) outside the capture, as the first eager batch does
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        graph.capture_begin()
        sorted_keys, order = stable_sort(keys, 1_000_000)
        graph.capture_end()
    torch.cuda.current_stream(device).wait_stream(stream)
    for seed in (4, 5):
        keys.copy_(_keys(keys.numel(), 1_000_000, torch.int32, device, seed=seed))
        graph.replay()
        expected_keys, expected_order = torch.sort(keys, stable=True)
        assert torch.equal(sorted_keys, expected_keys) and torch.equal(order.long(), expected_order)


@pytest.mark.gpu
def test_a_cub_that_cannot_build_falls_back_to_torch_sort(device, monkeypatch):
    """cuda-cccl importing but unable to compile (no NVRTC, an old driver) costs a warning and
    speed, never a result: the sort falls back to torch.sort."""
    from tiered_tbe.base import sorting

    if sorting.sort_backend(device) != "cub":
        pytest.skip("cuda.compute does not import here")

    class Unbuildable:
        SortOrder = sorting._cub().SortOrder

        @staticmethod
        def make_radix_sort(**_):
            raise RuntimeError("NVRTC not found")

    monkeypatch.setattr(sorting, "_cuda_compute", Unbuildable)
    monkeypatch.setattr(sorting, "_sorters", {})
    keys = _keys(5000, 300, torch.int64, device, seed=9)  # int64: a dtype pair no earlier test built
    with pytest.warns(RuntimeWarning, match="torch.sort"):
        _check_against_torch(keys, 300)
    assert sorting.sort_backend(device) == "torch"


def test_a_built_sort_is_kept_on_disk_and_loaded_back(tmp_path, monkeypatch):
    """A CUB sort built once is saved whole (temporary file, then renamed) and loaded by a later
    process; a file that does not load, or a folder that cannot be written, costs a build, never an
    error. The disk part alone, with a stand-in for ``cuda.compute``."""
    from tiered_tbe.base import compiling, sorting

    class FakeCudaCompute:
        @staticmethod
        def serialize(sorter):
            return b"sorter:" + sorter.encode()

        @staticmethod
        def deserialize(blob):
            if not blob.startswith(b"sorter:"):
                raise ValueError("serialization blob: unknown algorithm tag")
            return blob.removeprefix(b"sorter:").decode()

    monkeypatch.setattr(compiling, "COUNTS", type(compiling.COUNTS)())
    path = tmp_path / "cub" / "radix-sort-int32-int32-sm90-cccl1.2.1.cclb"
    assert sorting._load_sorter(FakeCudaCompute, path) is None  # nothing saved yet
    sorting._save_sorter(FakeCudaCompute, "int32 keys", path)
    assert path.read_bytes() == b"sorter:int32 keys" and list(path.parent.iterdir()) == [path]
    assert sorting._load_sorter(FakeCudaCompute, path) == "int32 keys"
    assert compiling.COUNTS["cub loaded"] == 1
    path.write_bytes(b"half a fi")
    assert sorting._load_sorter(FakeCudaCompute, path) is None  # built again, and saved over it
    blocked = tmp_path / "a file, not a folder"
    blocked.write_text("")
    sorting._save_sorter(FakeCudaCompute, "int64 keys", blocked / "sort.cclb")  # no error, nothing kept
    assert sorting._load_sorter(FakeCudaCompute, None) is None
    monkeypatch.setenv("TIERED_TBE_CUB_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert sorting.sorter_cache_dir() == tmp_path / "elsewhere"


@pytest.mark.gpu
def test_a_second_process_loads_the_sort_the_first_built(tmp_path, device):
    """Two fresh processes sharing a sort cache folder: the first builds the CUB sort (int32 keys
    and positions) and saves it, the second loads it and builds none; both sort as torch.sort."""
    import json
    import os
    import subprocess
    import sys

    from tiered_tbe.base import sorting

    if sorting.sort_backend(device) != "cub" or not hasattr(sorting._cub(), "serialize"):
        pytest.skip("cuda.compute does not import here, or cannot save a built sort (cuda-cccl < 1.1)")
    child = ("import json, torch\nfrom tiered_tbe.base import compiling\n"
             "from tiered_tbe.base.sorting import stable_sort\n"
             "keys = torch.randint(0, 1000, (100_000,), dtype=torch.int32, device='cuda')\n"
             "sorted_keys, order = stable_sort(keys, 1000)\n"
             "expected_keys, expected_order = torch.sort(keys, stable=True)\n"
             "same = torch.equal(sorted_keys, expected_keys) and torch.equal(order.long(), expected_order)\n"
             "print(json.dumps(dict(same=same, **compiling.COUNTS)))\n")
    env = dict(os.environ, TIERED_TBE_CUB_CACHE_DIR=str(tmp_path))
    runs = [json.loads(subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True,
                                      check=True).stdout.strip().splitlines()[-1]) for _ in range(2)]
    assert runs[0]["same"] and runs[0].get("cub compiled") == 1 and runs[0].get("cub loaded", 0) == 0
    assert runs[1]["same"] and runs[1].get("cub compiled", 0) == 0 and runs[1].get("cub loaded") == 1
    assert len(list(tmp_path.glob("radix-sort-int32-int32-sm*.cclb"))) == 1
