"""Compile the Triton TBE kernels for a GPU on a machine without one, and report what came out.

Triton can compile for a target it is told of (here sm_90, the H200) with no GPU present: this
script sets ``TRITON_INTERPRET=0``, stands a small driver in for the missing CUDA one (it names
the target and a stream; nothing is launched), and calls each kernel's ``warmup`` on tensors of
the right dtypes. For each kernel it prints registers per thread, spills, shared memory, and the
16-byte vector loads and stores in the PTX: the compiler's view of what simulation mode (the
interpreter) cannot show. It catches kernels that the interpreter runs but the compiler
rejects, and lost vector loads, at no GPU time.

    python tools/compile_kernels.py                # dim 128, fp32, every optimizer
    python tools/compile_kernels.py --dim 64 --dtype bf16 --arch 90
    python tools/compile_kernels.py --count-compilations   # compiles over batches of varying sizes
    python tools/compile_kernels.py --compare tools/compiled_triton36.json   # against a saved report

``tools/compile_like_device.sh`` runs it with the GPU machine's Triton (3.6); its report of
the last measured commit is ``tools/compiled_triton36.json`` (``--save`` writes one), so
``bash tools/compile_like_device.sh --compare tools/compiled_triton36.json`` says in a
minute whether a change lost 16-byte loads on the device's compiler.

``--count-compilations`` runs the real host functions (``pooled_forward``, ``per_sample_weights_grad``,
``backward_update``) over batches whose sizes, steps and seeds vary, every launch compiled and none
run, and prints how many kernels each Triton function compiled: one per model shape (per tile the
autotuner tries, for the forward) when no per-batch integer is specialized; then how many of them
Triton compiled and how many it loaded from its disk cache (a second run with the same
``TRITON_CACHE_DIR`` compiles none, and loads the forward's winning tile only).

Run it as its own process (it must set TRITON_INTERPRET before triton is imported).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"
os.environ["TIERED_TBE_COMPILE_ONLY"] = "1"
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.driver import DriverBase  # noqa: E402


class OfflineDriver(DriverBase):
    """A driver with a target and no device: enough for ``JITFunction.warmup`` to compile."""

    def __init__(self, arch: int):
        self.target = GPUTarget("cuda", arch, 32)

    @classmethod
    def is_active(cls):
        return False

    def map_python_to_cpp_type(self, ty):
        raise NotImplementedError

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_benchmarker(self):
        raise NotImplementedError("nothing runs offline")

    def get_device_capability(self, device=None):
        return divmod(self.target.arch, 10)


# A PTX access's qualifiers between its space and its vector width (.L1::evict_first, .nc, ...).
QUALIFIERS = r"(?:\.[A-Za-z0-9_:]+)*"

def _resource_usage(cubin: bytes) -> dict:
    """Registers, stack frame and local (spill) memory of a cubin, per ``cuobjdump -res-usage``
    (the cuobjdump Triton ships)."""
    import subprocess
    import tempfile

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernel.cubin"
        path.write_bytes(cubin)
        log = subprocess.run([str(cuobjdump), "-res-usage", str(path)], capture_output=True, text=True,
                             check=True).stdout

    def number(key):
        found = re.search(key + r":(\d+)", log)
        return int(found.group(1)) if found else 0

    return {"registers": number("REG"), "stack_bytes": number("STACK"), "local_bytes": number("LOCAL")}


def _report(name: str, compiled, arch: int = 90) -> dict:
    ptx = compiled.asm["ptx"]
    facts = {
        "kernel": name,
        **_resource_usage(compiled.asm["cubin"]),
        "shared_bytes": compiled.metadata.shared,
        # 16-byte loads: to registers, or (a pipelined loop's) asynchronous copies to shared memory.
        "v4_loads": len(re.findall(rf"ld\.global{QUALIFIERS}\.v4\.", ptx))
        + len(re.findall(rf"cp\.async\.c[ag]\.shared\.global{QUALIFIERS} \[[^]]+\], \[[^]]+\], (?:16|0x10)\b", ptx)),
        "v4_stores": len(re.findall(rf"st\.global{QUALIFIERS}\.v4\.", ptx)),
        "scalar_loads": len(re.findall(rf"ld\.global{QUALIFIERS}\.b32 ", ptx)),
    }
    print(f"{name:<44} regs {facts['registers']:>3}  stack {facts['stack_bytes']:>4}  local {facts['local_bytes']:>4} "
          f"shared {facts['shared_bytes']:>6}  v4 ld {facts['v4_loads']:>3}  v4 st {facts['v4_stores']:>3}  "
          f"32-bit ld {facts['scalar_loads']:>3}")
    return facts


def compile_all(dim: int = 128, dtype: torch.dtype = torch.float32, arch: int = 90,
                optimizers: list[str] | None = None) -> list[dict]:
    """Compile every kernel for ``arch`` at one model shape; returns one dict of facts per kernel."""
    triton.runtime.driver.set_active(OfflineDriver(arch))
    import tiered_tbe.kernels.backward as backward
    import tiered_tbe.kernels.forward as forward
    import tiered_tbe.kernels.hint_rows as hint_rows
    import tiered_tbe.kernels.linearize as linearize
    from tiered_tbe.kernels.optimizers import OPTIMIZERS

    assert not forward.INTERPRETING, "TRITON_INTERPRET must be 0 before tiered_tbe loads"
    block_d = triton.next_power_of_2(dim)
    n = 4096
    i32, i64, f32 = (torch.zeros(n, dtype=t) for t in (torch.int32, torch.int64, torch.float32))
    weights = torch.zeros(64, dim, dtype=dtype)
    addresses = torch.zeros(4, dtype=torch.int64)
    descriptor = torch.zeros(4, 16, dtype=torch.int64)
    results = []
    grid = (1,)

    for tile in forward.forward_tiles(block_d):
        # Launched directly (the tensors pointer arguments) and as a CUDA graph runs it (their addresses
        # loaded from a tensor, the alignment hints all Triton knows of them): the same 16-byte accesses.
        # Grouped: one launch of a column group (a model of mixed dims), its feature read from its descriptor row.
        # Copies: a training forward of a cache that keeps the rows it reads in place (16-byte stores too).
        for graphed, grouped, copies, label in ((False, False, False, ""), (True, False, False, ", addresses"),
                                                (True, True, False, ", addresses, grouped"),
                                                (True, True, True, ", addresses, grouped, copies")):
            kernel = forward._pooled_forward_kernel.fn.warmup(
                addresses, f32, 3328, dim, descriptor, weights, dim, i64, i64, i32, f32, i32, weights, dim, 64, 65536,
                0, POOLING=0, HAS_PER_SAMPLE_WEIGHTS=False, USE_CACHE=True, KEEPS_COPIES=copies,
                ALIGN=16 // weights.element_size(),
                ALIGN_BYTES=16, BLOCK_D=block_d, GROUPED=grouped, ADDRESSES=graphed, OUTPUT_ALIGN_BYTES=16,
                INPUT_ALIGN_BYTES=16, BLOCK_B=tile.bags, BLOCK_L=tile.lanes, GROUPS=tile.groups, STAGES=tile.stages,
                grid=grid, num_warps=tile.warps)
            results.append(_report(f"forward B{tile.bags} L{tile.lanes} w{tile.warps} G{tile.groups} "
                                   f"S{tile.stages}{label}", kernel, arch))
    for block_b, block_l in ((128, 1), (4, 32)):  # bags of one (Criteo) and of 32 (linearize_tile)
        results.append(_report(f"linearize B{block_b} L{block_l}", linearize._linearize_kernel.warmup(
            i32, i32, descriptor, i64, i64, n, 65536, BLOCK_B=block_b, BLOCK_L=block_l, grid=grid, num_warps=4), arch))
    for key, none_key in ((i32, 2**31 - 1), (i64, 2**63 - 1)):  # int32 sort keys, and int64 past 2^31 global rows
        label = f"hint keys ({str(key.dtype).removeprefix('torch.')})"
        results.append(_report(label, hint_rows._hint_keys_kernel.warmup(
            key, i64, i64, i64, i64, n, 12, none_key, SEARCH_STEPS=4, BLOCK=hint_rows.BLOCK, grid=grid), arch))
    results.append(_report("hint first of runs", hint_rows._first_of_runs_kernel.warmup(
        i32, i32, n, 2**31 - 1, BLOCK=hint_rows.BLOCK, grid=grid), arch))
    results.append(_report("hint compact runs", hint_rows._compact_runs_kernel.warmup(
        i64, i32, i32, i32, n, 2**63 - 1, BLOCK=hint_rows.BLOCK, grid=grid), arch))
    import tiered_tbe.cache.window_bits as window_bits

    for set_bit in (True, False):  # the lookahead window's bits, set for a recorded batch and cleared after it
        label = f"window bits ({'set' if set_bit else 'clear'})"
        results.append(_report(label, window_bits._update_window_bits_kernel.warmup(
            i64, i64, i64, i64, n, 12, 5, SET_BIT=set_bit, SEARCH_STEPS=4, BLOCK=window_bits.BLOCK, grid=grid), arch))
    config = backward.default_config(block_d)
    align = 16 // weights.element_size()
    common = dict(POOLING=0, HAS_PER_SAMPLE_WEIGHTS=False, ALIGN=align, GRAD_ALIGN_BYTES=16, SHARED_TABLES=False,
                  CHUNK=config.chunk, BLOCK_D=block_d)
    # order, bags, weights, offsets, step arguments, grad stride, the tables' descriptor
    gradient_args = (i64, i32, f32, i64, i64, 3328, descriptor)
    results.append(_report("hot window sums", backward.hot_window_sums_kernel.warmup(
        f32, i32, *gradient_args, i32, 1 << 20, n, 65536, **common, WINDOWS=config.sum_windows, grid=grid,
        num_warps=config.sum_warps), arch))
    results.append(_report("hot group sums", backward.hot_group_sums_kernel.warmup(
        f32, f32, i32, n, CHUNK=config.chunk, GROUP=32, BLOCK_D=block_d, grid=grid, num_warps=4), arch))
    state = torch.zeros(64, 2 * dim, dtype=torch.float32)
    for name in optimizers or list(OPTIMIZERS):
        optimizer = OPTIMIZERS[name]()
        load_state, update, store_state = optimizer.TRITON
        num_hyper = len(optimizer.kernel_hyper())
        updating = dict(USE_CACHE=True, OPTIMIZER_LOAD_STATE=load_state, OPTIMIZER_UPDATE=update,
                        OPTIMIZER_STORE_STATE=store_state, STOCHASTIC_ROUNDING=dtype != torch.float32,
                        NUM_HYPER=num_hyper,
                        ALIGN_BYTES=16,
                        STATE_ALIGN_BYTES=4 if optimizer.state_width(dim) % 4 else 16)
        update_args = (i32, i32, weights, dim, state, 2 * dim, f32)
        copy_args = (i32, weights, dim, 64)  # ranks by sorted position, the copy rows, their stride and count
        label = f"row update ({name}) R{config.rows} L{config.lanes} w{config.num_warps}"
        # rows_end, then the column groups' plan (runs_end, run_shift, the group's first and end entries)
        one_launch = (1 << 20, i32, i32, 0, 1)
        results.append(_report(label, backward._row_update_kernel.warmup(
            i32, i32, *gradient_args, *update_args, *copy_args, *one_launch, n, 65536, **common, **updating,
            READS_COPIES=True, ROWS=config.rows,
            BLOCK_L=config.lanes, GROUPED=False, TABLE_STEPS=1, grid=grid, num_warps=config.num_warps), arch))
        if name == (optimizers or list(OPTIMIZERS))[0]:  # features sharing a table: a column read per lookup
            results.append(_report(f"{label}, shared tables", backward._row_update_kernel.warmup(
                i32, i32, *gradient_args, *update_args, *copy_args, *one_launch, n, 65536,
                **dict(common, SHARED_TABLES=True), **updating, READS_COPIES=False, ROWS=config.rows,
                BLOCK_L=config.lanes, GROUPED=False, TABLE_STEPS=1, grid=grid,
                num_warps=config.num_warps), arch))
            # A column group of a model of mixed dims: its runs through the plan, a tile of its own width.
            results.append(_report(f"{label}, grouped", backward._row_update_kernel.warmup(
                i32, i32, *gradient_args, *update_args, *copy_args, 1 << 20, i32, i32, 2, 6, n, 65536, **common,
                **updating, READS_COPIES=True, ROWS=config.rows, BLOCK_L=config.lanes, GROUPED=True, TABLE_STEPS=4,
                grid=grid, num_warps=config.num_warps), arch))
        results.append(_report(f"hot row update ({name})", backward.hot_row_update_kernel.warmup(
            f32, f32, i32, i32, *gradient_args, *update_args, *copy_args, 1 << 20, n, 65536, **common, **updating,
            READS_COPIES=True, GROUP=32,
            WINDOWS=config.hot_windows, BLOCK_P=32, BLOCK_L=backward.HOT_LANES, grid=grid, num_warps=4), arch))
    import tiered_tbe.kernels.per_sample_weights as per_sample_weights

    results.append(_report("per-sample-weight grad", per_sample_weights._per_sample_weights_grad_kernel.warmup(
        f32, f32, 3328, descriptor, weights, dim, i64, i64, i32, 65536, POOLING=0,
        USE_CACHE=True, ALIGN=16 // weights.element_size(), ALIGN_BYTES=16, BLOCK_B=8, BLOCK_L=4, BLOCK_D=block_d,
        GROUPED=False, grid=grid, num_warps=4), arch))
    return results


def compile_only(arch: int = 90) -> None:
    """Compile on every launch, run nothing: an offline driver, and the autotuner "times" each
    candidate by compiling it (every candidate then counts as compiled once)."""
    from triton.runtime import autotuner, jit

    triton.runtime.driver.set_active(OfflineDriver(arch))
    run = jit.JITFunction.run

    def compile_instead(self, *args, grid, warmup, **kwargs):
        return run(self, *args, grid=grid, warmup=True, **kwargs)

    def bench_by_compiling(self, *args, config, **meta):
        self.fn.run(*args, **meta, **config.all_kwargs())
        return [0.0, 0.0, 0.0]

    jit.JITFunction.run = compile_instead
    autotuner.Autotuner._bench = bench_by_compiling


def compilations() -> dict[str, int]:
    """Kernels compiled so far by each Triton function of tiered_tbe.kernels."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    import tiered_tbe.kernels.backward as backward
    import tiered_tbe.kernels.forward as forward
    import tiered_tbe.kernels.grouping as grouping
    import tiered_tbe.kernels.linearize as linearize
    import tiered_tbe.kernels.per_sample_weights as per_sample_weights

    counts = {}
    for module in (forward, backward, grouping, linearize, per_sample_weights):
        for name, value in vars(module).items():
            function = value.fn if isinstance(value, Autotuner) else value
            if isinstance(function, JITFunction) and name.endswith("_kernel"):
                counts[name] = sum(len(caches[0]) for caches in function.device_caches.values())
    return counts


def count_compilations(batches: int = 6) -> dict[str, int]:
    """Forward, per-sample-weight gradient and backward (row-wise Adagrad, SGD) over ``batches``
    batches of one model shape (three tables, a slot cache, weighted lookups) whose batch sizes
    (1 and 16 among them), lookup counts (multiples of 16 and not), steps and seeds vary; returns
    ``compilations()``."""
    compile_only()
    from tiered_tbe.kernels.backward import backward_update
    from tiered_tbe.kernels.forward import pooled_forward
    from tiered_tbe.kernels.optimizers import SGD, RowwiseAdagrad
    from tiered_tbe.kernels.per_sample_weights import per_sample_weights_grad
    from tiered_tbe.kernels.rows import Lookups, RowStores

    generator = torch.Generator().manual_seed(0)
    tables = [1000, 50, 7]
    dim = 64
    state = [torch.zeros(n, 1) for n in tables]
    stores = RowStores(tuple(torch.randn(n, dim) for n in tables), tuple(state), torch.randn(32, dim),
                       torch.zeros(32, 1))
    for batch in range(batches):
        batch_size = (512, 1, 16, 512, 2, 77)[batch % 6]
        # Bags of 2 or 3 lookups: the same bag-length class (one set of forward tiles) in every batch.
        lengths = torch.randint(2, 4, (len(tables) * batch_size,), generator=generator)
        if batch_size == 2:  # 16 lookups
            lengths = torch.tensor([3, 3, 3, 3, 2, 2])
        elif batch_size > 16:  # lookup counts that are multiples of 16 in some batches, odd or even in others
            lengths[0] += (16 - int(lengths.sum()) + (0, 0, 0, 1, 0, 9)[batch % 6]) % 16
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
        offsets[1:] = lengths.cumsum(0)
        num_lookups = int(offsets[-1])
        table_of = torch.arange(len(tables)).repeat_interleave(batch_size).repeat_interleave(lengths)
        indices = (torch.rand(num_lookups, generator=generator) * torch.tensor(tables)[table_of]).long()
        slots = torch.randint(-1, 32, (num_lookups,), generator=generator, dtype=torch.int32)
        lookups = Lookups(indices, offsets, batch_size, torch.rand(num_lookups, generator=generator))
        pooled_forward(stores, lookups, slots, "sum")
        grad = torch.randn(batch_size, dim * len(tables), generator=generator)
        per_sample_weights_grad(grad, stores, lookups, slots, "sum")
        for optimizer in (RowwiseAdagrad(lr=0.01 * (batch + 1)), SGD(lr=0.1)):
            backward_update(grad, stores, lookups, slots, "sum", optimizer, step=batch + 1, seed=batch)
    return compilations()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=128, help="embedding dim (default 128)")
    parser.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), default="fp32", help="weights dtype")
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (default 90: H100/H200)")
    parser.add_argument("--optimizers", nargs="+", help="optimizer names (default: all)")
    parser.add_argument("--count-compilations", action="store_true",
                        help="count the kernels compiled over batches of varying sizes instead")
    parser.add_argument("--save", metavar="JSON", help="also write the report (one dict per kernel) to this file")
    parser.add_argument("--compare", metavar="JSON",
                        help="compare with a report saved by --save (same Triton, dim, dtype): print each kernel "
                             "that changed, exit 1 if one lost 16-byte loads or stores or gained spills")
    args = parser.parse_args(argv)
    if args.count_compilations:
        from tiered_tbe.base import compiling

        for name, count in sorted(count_compilations().items()):
            print(f"{name:<36} {count} compiled")
        # Of those, what Triton compiled and what it loaded from its disk cache (TRITON_CACHE_DIR).
        print(f"triton: {compiling.COUNTS['triton compiled']} compiled, {compiling.COUNTS['triton loaded']} loaded")
        return 0
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    print(f"triton {triton.__version__}: compiling for sm_{args.arch}, dim {args.dim}, {args.dtype} (nothing runs)")
    results = compile_all(args.dim, dtype, args.arch, args.optimizers)
    report = {"triton": triton.__version__, "dim": args.dim, "dtype": args.dtype, "arch": args.arch,
              "kernels": results}
    if args.save:
        Path(args.save).write_text(json.dumps(report, indent=1) + "\n")
    if args.compare:
        from compile_reports import compare_reports  # beside this script

        return compare_reports(json.loads(Path(args.compare).read_text()), report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
