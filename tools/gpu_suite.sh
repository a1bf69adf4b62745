#!/usr/bin/env bash
# The GPU suite: everything a GPU machine must show, in one call of at most ~9 minutes.
#
#   1. install the project offline and check that tiered_tbe.cache / tiered_tbe.kernels import on
#      a GPU (not in simulation); print versions and the GPU's name;
#   2. the gpu-marked tests (pytest -m gpu -x); with FBGEMM_GPU's wheels in .peer/, ours beside
#      FBGEMM (benchmarks/bench_fbgemm.py; tools/gpu_fbgemm.sh runs every configuration);
#   3. benchmarks/bench_kernels.py, bench_cache.py (both row movers), bench_pipeline.py (and again
#      with the staged mover), then tools/profile_step.py,
#      tools/trace_pipeline.py (per-stream busy / idle time of pipelined steps) and bench_pipeline.py
#      with the steps on the current stream (what PrefetchPipeline(high_priority=True) adds);
#   4. last and optional, bench_cache.py's big-table mode (a 60 GB pinned table, 8 GB cache);
#   5. a short summary table, printed LAST (a device call returns only the tail of the output).
#
# Each step runs under `timeout`, bounded by what is left of the suite's budget, so one hang does
# not eat the call; a step that would get too little time is skipped and says so.
#
# Files under $OUT (8):
#   gpu-tests.log, bench_kernels.log, bench_cache.log, bench_pipeline.log, profile.log, bench_big.log,
#   results.json (every step's status, the versions, each benchmark's JSON), measurements.jsonl (the
#   benchmarks' --record lines: append them to results/measurements.jsonl).
#
# Run from anywhere, with numpy < 2.5 installed (numba-cuda needs it; tools/pack_gpu_site.sh):
#   bash tools/gpu_suite.sh
# Environment (all optional):
#   OUT                where the logs go (default ./out in the repository)
#   SUITE_BUDGET_S     total seconds for the suite (default 530)
#   RUN_BIG_TABLE      1 = run the big-table test last if time is left (default 1); 0 = skip it
#   BIG_TABLE_GB       size of the big table in GB (default 60); BIG_CACHE_GB its cache (default 8)
#   CACHE_ARGS, PIPELINE_ARGS, KERNELS_ARGS   extra flags for the benchmark scripts
#   SKIP_INSTALL=1, ALLOW_SIMULATION=1   to try the script itself on a CPU machine (tiny sizes,
#                      times meaningless), e.g. with BIG_TABLE_GB=0.00005 BIG_CACHE_GB=0.00001
set -uo pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.." || exit 1
REPO=$PWD
OUT=${OUT:-$REPO/out}
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/gpu_suite.XXXXXX)  # JSON pieces and statuses; merged into $OUT/results.json
BUDGET=${SUITE_BUDGET_S:-530}
RESERVE=15  # seconds kept for the summary
STATUS_FILE=$WORK/status.tsv
: >"$STATUS_FILE"

# run_step NAME CAP_SECONDS LOG MIN_SECONDS COMMAND...: run COMMAND under timeout (the smaller of
# CAP and the budget left), output to LOG; record "NAME<TAB>status<TAB>seconds" in STATUS_FILE.
run_step() {
    local name=$1 cap=$2 log=$3 min=$4
    shift 4
    local left=$((BUDGET - SECONDS - RESERVE))
    local limit=$((cap < left ? cap : left))
    if ((limit < min)); then
        printf '%s\tskipped: %ss left of the budget, needs %ss\t0\n' "$name" "$left" "$min" >>"$STATUS_FILE"
        echo "== $name: skipped ($left s left of the budget)"
        return 0
    fi
    echo "== $name (timeout ${limit}s) -> $log"
    local start=$SECONDS rc status
    timeout -k 10 "$limit" "$@" >"$log" 2>&1
    rc=$?
    case $rc in
        0) status=ok ;;
        124 | 137) status="TIMEOUT after ${limit}s" ;;
        *) status="FAILED rc=$rc" ;;
    esac
    printf '%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - start))" >>"$STATUS_FILE"
    echo "   $name: $status in $((SECONDS - start)) s; last lines:"
    tail -n 4 "$log" | sed 's/^/     /' | cut -c1-200
    return $rc
}

# 1. Install (offline) and check the imports, the mode, the versions.
if [[ ${SKIP_INSTALL:-0} != 1 ]]; then
    run_step install 180 "$WORK/install.log" 10 \
        python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || {
        cat "$WORK/install.log"
        echo "install failed: stopping"
        exit 1
    }
    # numpy 2.4 and cuda-cccl, when their archive came with the tree (tools/pack_gpu_site.sh).
    if [[ -f .gpusite/site.tar.xz ]]; then
        mkdir -p /tmp/site && tar -xJf .gpusite/site.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
    fi
    # FBGEMM_GPU beside ours, when its wheels came in .peer/ with an install-on-device.sh script.
    if [[ -d .peer ]]; then
        run_step fbgemm-install 120 "$WORK/fbgemm-install.log" 20 bash .peer/install-on-device.sh .peer \
            && export PYTHONPATH=/tmp/fbsite:${PYTHONPATH:-}
    fi
fi
run_step check 120 "$WORK/check.log" 10 python3 - "$WORK/env.json" <<'PY' || { cat "$WORK/check.log"; echo "check failed: stopping"; exit 1; }
import json, os, subprocess, sys
import tiered_tbe, tiered_tbe.cache, tiered_tbe.kernels  # noqa: F401  (the check itself)
import numba, numpy, torch, triton
env = {"python": sys.version.split()[0], "torch": torch.__version__, "triton": triton.__version__,
       "numba": numba.__version__, "numpy": numpy.__version__, "mode": tiered_tbe.describe_mode()}
for name in ("numba_cuda", "cupy", "cuda.bindings", "cuda.compute"):
    try:
        module = __import__(name, fromlist=["_"])
        env[name] = getattr(module, "__version__", "?")
    except Exception as error:  # noqa: BLE001 - report whatever is missing
        env[name] = f"missing ({type(error).__name__})"
try:
    env["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, check=True).stdout.strip()
except (OSError, subprocess.CalledProcessError) as error:
    env["gpu"] = f"nvidia-smi failed: {error}"
for key, value in env.items():
    print(f"{key:>14}: {value}")
json.dump(env, open(sys.argv[1], "w"), indent=1)
if tiered_tbe.SIMULATION and os.environ.get("ALLOW_SIMULATION") != "1":
    sys.exit("tiered_tbe chose CPU simulation mode: no CUDA device visible to torch")
if tuple(int(x) for x in numpy.__version__.split(".")[:2]) >= (2, 5):
    print("WARNING: numpy >= 2.5: numba-cuda cannot compile kernels; install the numpy 2.4 wheel first")
PY

# 2. The gpu-marked tests.
run_step gpu-tests 150 "$OUT/gpu-tests.log" 30 python3 -m pytest -m gpu -q -x -p no:cacheprovider

# 3. The benchmarks (each appends its measurements to measurements.jsonl and, where it can, writes a JSON).
RECORD=(--record "$OUT/measurements.jsonl")
# Ours beside FBGEMM on the same batches, when fbgemm_gpu imports (FBGEMM_CONFIGS: which ones).
if python3 -c "import fbgemm_gpu" >/dev/null 2>&1; then
    # shellcheck disable=SC2086
    run_step bench_fbgemm 200 "$WORK/bench_fbgemm.log" 60 \
        python3 benchmarks/bench_fbgemm.py --configs ${FBGEMM_CONFIGS:-criteo-adagrad big-zipf-adagrad cached-lru \
        cached-lru-pipelined} "${RECORD[@]}" --json "$WORK/bench_fbgemm.json"
else
    printf 'bench_fbgemm\tskipped: fbgemm_gpu does not import (carry .peer)\t0\n' >>"$STATUS_FILE"
fi
# shellcheck disable=SC2086  # *_ARGS are flag lists, split on purpose
run_step bench_kernels 100 "$OUT/bench_kernels.log" 40 \
    python3 benchmarks/bench_kernels.py --rep-ms 100 "${RECORD[@]}" ${KERNELS_ARGS:-}
# shellcheck disable=SC2086
run_step bench_cache 200 "$OUT/bench_cache.log" 40 \
    python3 benchmarks/bench_cache.py --warmup 15 --batches 15 "${RECORD[@]}" --json "$WORK/bench_cache.json" \
    ${CACHE_ARGS:-}
# shellcheck disable=SC2086
run_step bench_pipeline 240 "$OUT/bench_pipeline.log" 60 \
    python3 benchmarks/bench_pipeline.py --warmup 60 --batches 15 "${RECORD[@]}" \
    --json "$WORK/bench_pipeline.json" ${PIPELINE_ARGS:-}

# The pipeline with the staged row mover (host threads, pinned staging, the copy engines).
run_step pipeline_staged 150 "$WORK/pipeline_staged.log" 60 \
    python3 benchmarks/bench_pipeline.py --mover staged --modes hbm pipelined --warmup 60 --batches 15 "${RECORD[@]}"

# Where the step time goes (host vs device per phase, launch costs, top operators).
run_step profile 90 "$OUT/profile.log" 40 python3 tools/profile_step.py --warmup 10 --steps 3 --top 30
# The GPU timeline of pipelined steps: does the training stream wait (idle) while prefetches run?
run_step trace 80 "$WORK/trace.log" 40 python3 tools/trace_pipeline.py --alpha 1.05 --warmup 70 --steps 5 \
    --top 3 --runs lru-pipelined lookahead-pipelined
# The same pipeline with the steps on the current (default-priority) stream.
run_step priority 80 "$WORK/priority.log" 40 python3 benchmarks/bench_pipeline.py --alpha 1.05 --policies lru \
    --modes hbm pipelined --warmup 60 --batches 15 --training-priority default

# 4. Last and optional: a table larger than the GPU memory given to the module.
if [[ ${RUN_BIG_TABLE:-1} == 1 ]]; then
    run_step bench_big 170 "$OUT/bench_big.log" 90 \
        python3 benchmarks/bench_cache.py --big-table-gb "${BIG_TABLE_GB:-60}" --cache-gb "${BIG_CACHE_GB:-8}" \
        "${RECORD[@]}" --json "$WORK/bench_big.json"
else
    printf 'bench_big\tskipped: RUN_BIG_TABLE=%s\t0\n' "${RUN_BIG_TABLE}" >>"$STATUS_FILE"
fi

# 5. The summary, last.
python3 - "$WORK" "$OUT" "$SECONDS" <<'PY'
import json, re, sys
from pathlib import Path

work, out, elapsed = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
load = lambda p: json.loads(p.read_text()) if p.exists() else None  # noqa: E731
statuses = [line.split("\t") for line in (work / "status.tsv").read_text().splitlines() if line]
env = load(work / "env.json") or {}
merged = {"elapsed_s": int(elapsed), "env": env,
          "steps": [{"step": s, "status": st, "seconds": int(sec)} for s, st, sec in statuses]}
for name in ("bench_cache", "bench_pipeline", "bench_big"):
    merged[name] = load(work / f"{name}.json")
(out / "results.json").write_text(json.dumps(merged, indent=1, default=str) + "\n")

def log_tail(name, pattern):
    path = out / name
    if not path.exists():
        return []
    return [line for line in path.read_text(errors="replace").splitlines() if re.search(pattern, line)]

def f(value, spec=".2f"):
    return "-" if value is None else format(value, spec)

print()
print(f"===== GPU suite summary: {env.get('gpu', '?')}; {elapsed} s =====")
print("  " + ", ".join(f"{k} {env[k]}" for k in ("python", "torch", "triton", "numba", "numba_cuda", "numpy", "cupy",
                                                  "cuda.bindings") if k in env))
tests = log_tail("gpu-tests.log", r"\d+ (passed|failed|skipped|deselected|errors?)|no tests ran")
for s, st, sec in statuses:
    extra = f"  [{tests[-1].strip('= ')}]" if s == "gpu-tests" and tests else ""
    print(f"  {s:<15} {st} ({sec} s){extra}")

rows = log_tail("bench_kernels.log", r"^\| (device copy|forward|fwd\+bwd)")
if rows:
    print("bench_kernels (op | lookups | unique | ours ms | torch ms | ours GB/s | torch GB/s | torch/ours):")
    for line in rows:
        print("  " + line)

cache = merged["bench_cache"]
if cache:
    memcpy = next((r for r in cache["results"] if r["kind"] == "memcpy"), {})
    print(f"bench_cache (pinned memcpy h2d {f(memcpy.get('h2d_gbs'), '.1f')} GB/s, d2h {f(memcpy.get('d2h_gbs'), '.1f')}):")
    print(f"  {'model':<12} {'mover':<9} {'zipf':>5} {'prefetch':>9} {'fwd':>7} {'bwd':>7} {'step ms':>8} {'hit':>6} "
          f"{'rows in':>8} {'step/HBM':>8} {'pipe ms':>8} {'pipe/HBM':>8}")
    for r in (r for r in cache["results"] if r["kind"] == "model"):
        hit = r["stats"]["hit_rate_by_lookup"] if r["model"] != "all HBM" else None
        print(f"  {r['model']:<12} {r.get('mover', '-'):<9} {r['alpha']:>5g} {f(r['prefetch'], '.3f'):>9} "
              f"{f(r['forward'], '.3f'):>7} {f(r['backward'], '.3f'):>7} {f(r['step'], '.3f'):>8} {f(hit, '.3f'):>6} "
              f"{f(r.get('rows_in_per_batch'), ',.0f'):>8} {f(r['step_vs_hbm']):>8} "
              f"{f(r.get('pipelined_step'), '.3f'):>8} {f(r.get('pipelined_vs_hbm')):>8}")
    for r in (r for r in cache["results"] if r["kind"] == "copy"):
        print(f"  {r.get('mover', 'zero_copy'):<9} {r['direction']:<10}: {r['rows']:>9,} rows x {r['row_bytes']} B"
              + (f", <= {r['blocks']} blocks" if r.get("blocks") else "") + f": {f(r['ms'], '.3f')} ms "
              f"{f(r['gbs'], '.1f')} GB/s = {f(r['vs_memcpy'])} of memcpy"
              + (f"; write-back hidden {f(r['write_back_hidden'])}" if r.get("write_back_hidden") is not None else ""))

pipe = merged["bench_pipeline"]
if pipe:
    print("bench_pipeline (throughput against all-HBM and rows moved against LRU's, same run):")
    print(f"  {'model':<44} {'zipf':>5} {'step ms':>8} {'thru/HBM':>8} {'rows/batch':>11} {'rows/LRU':>8} {'hit':>6}")
    for r in pipe["results"]:
        name = r["model"] + (f" {r.get('mover')} {r['run']}" if r["policy"] else "")
        if not r["available"]:
            print(f"  {name:<44} {r['alpha']:>5g}  n/a ({r.get('reason', '')[:60]})")
            continue
        if r.get("lookahead_hints") is False:
            name += " (no hints)"
        print(f"  {name:<44} {r['alpha']:>5g} {f(r['step_ms'], '.3f'):>8} {f(r['throughput_vs_hbm']):>8} "
              f"{f(r['rows_in_per_batch'], ',.0f'):>11} {f(r['rows_vs_lru']):>8} {f(r['hit_rate'], '.3f'):>6}")

big = merged["bench_big"]
if big:
    r = big["results"][0]
    print(f"bench_big ({r.get('mover', 'zero_copy')} mover): {r['table_gb']:.1f} GB table, {r['cache_gb']:g} GB cache, zipf {r['alpha']:g}: step "
          f"{f(r['step'], '.2f')} ms (median of last {r['timed_steps']} of {r['steps']}), hit rate "
          f"{r['stats']['hit_rate_by_lookup']:.3f}, setup {r['setup_s']:.0f} s")
else:
    fails = log_tail("bench_big.log", r"(big-table mode|Error|error)")
    if fails:
        print("bench_big: " + fails[-1][:200])
for name, pattern in (("trace.log", r"^== |stream|host ms|span"), ("priority.log", r"^\| (all HBM|host_cached)"),
                      ("pipeline_staged.log", r"^\| (all HBM|host_cached)|^- zipf"),
                      ("bench_fbgemm.log", r"^\| [a-z].* \| (forward|backward|step|prefetch) \|")):
    path = work / name
    lines = [line for line in path.read_text(errors="replace").splitlines() if re.search(pattern, line)] \
        if path.exists() else []
    if lines:
        print({"trace.log": "trace_pipeline (zipf 1.05, depth 2; per-stream busy/idle ms per step):",
               "priority.log": "bench_pipeline with steps on the default-priority stream (zipf 1.05):",
               "pipeline_staged.log": "bench_pipeline with the staged mover:",
               "bench_fbgemm.log": "bench_fbgemm (configuration | phase | FBGEMM ms | ours ms | ours/FBGEMM):"}[name])
        for line in lines:
            print("  " + line.strip())
phases = log_tail("profile.log", r"^== |^   (prefetch|forward|backward) |host time of one")
if phases:
    print("profile (host ms to enqueue / device ms per phase, from an idle GPU; then launch costs):")
    for line in phases:
        print("  " + line.strip())
print(f"logs and results.json, measurements.jsonl under {out}")
PY
