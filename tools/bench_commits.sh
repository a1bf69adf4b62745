#!/usr/bin/env bash
# Our side of `tiered-tbe bench fbgemm` at several commits, one process each, on one GPU machine: to bisect a
# change of speed, or to compare commits in one call (processes of one code differ by ~1% in a kernel's time,
# machines of one kind by more). Two steps, since the GPU machine gets the working tree without .git:
#
#   bash tools/bench_commits.sh unpack 2028912 8a9f4b1 HEAD     # here: each commit's tree under .trees/<sha>
#   # then on the GPU machine, .trees carried with the tree (it is ignored by git):
#   SKIP_INSTALL=auto source tools/gpu_install.sh    # with OUT set; the install every tree's run uses
#   CONFIGS="cached-managed-lru" OUT=$OUT bash tools/bench_commits.sh run [--steps 30 ...]
#
# `run` benchmarks the working tree first (label: its commit, TIERED_TBE_COMMIT or "worktree"), then every tree
# under .trees in the order unpacked, with the same flags (default: --ours-only --warmup 6 --steps 30); one log
# each, packed at the end into $OUT/bench_commits_logs.tgz (a device call returns 8 files at most: a log a tree
# left the records behind once), its records appended to $OUT/measurements.jsonl, and a line of each one's
# phases printed.
# VARIANTS="label:ENV=value[,ENV=value]..." also runs the working tree under those settings (e.g.
# "nopad:TIERED_TBE_PAD_BATCHES=0"). TREE_VARIANTS="sha:label:flags[;sha:label:flags]..." also runs an unpacked
# tree with bench fbgemm flags of its own after the shared ones (a flag only that tree knows, e.g.
# "970c0ae:t50:--admit-ties 0.5"), labelled sha-label. Each tree imports only itself: the project's editable install maps
# tiered_tbe.{base,cache,kernels} to the working tree's folders whatever the PYTHONPATH (docs/PITFALLS.md),
# so a tree gets links tiered_tbe/<sub> -> ../<sub>, which Python's path finder sees first.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
TREES=${TREES:-.trees}  # where unpack puts the trees (run reads them there)
SUBPACKAGES="base cache kernels benchmarks"

unpack() {
    mkdir -p "$TREES"
    for commit in "$@"; do
        local sha
        sha=$(git rev-parse --short "$commit") || exit 1
        rm -rf "${TREES:?}/$sha" && mkdir -p "$TREES/$sha"
        # Only what a benchmark imports (1.2 MB a tree): the trees are copied to the GPU machine with the rest.
        git archive "$sha" -- . ':!results' ':!docs' ':!tests' ':!tools' | tar -x -C "$TREES/$sha" || exit 1
        echo "$sha" >>"$TREES/order"
        echo "unpacked $commit as $TREES/$sha ($(du -sh "$TREES/$sha" | cut -f1))"
    done
}

one() {  # label dir [ENV=value ...] -- bench flags...
    local label=$1 dir=$2
    shift 2
    local settings=()
    while [[ $# -gt 0 && $1 != -- ]]; do settings+=("$1"); shift; done
    [[ ${1:-} == -- ]] && shift
    if [[ $dir != . ]]; then
        for sub in $SUBPACKAGES; do ln -sfn "../$sub" "$dir/tiered_tbe/$sub"; done
    fi
    (
        cd "$dir" || exit 1
        export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} TIERED_TBE_COMMIT=$label
        for setting in "${settings[@]}"; do export "${setting?}"; done
        local imported
        imported=$(python3 -c "import tiered_tbe.kernels as k; print(k.__file__)") || exit 1
        [[ $imported == "$PWD/"* ]] || { echo "$dir imports $imported, not its own tree"; exit 1; }
        # shellcheck disable=SC2086
        timeout "${RUN_TIMEOUT:-150}" python3 benchmarks/bench_fbgemm.py --configs $CONFIGS "$@" \
            --record "$OUT/measurements.jsonl" >"$LOGS/$label.log" 2>&1
    )
    echo "== $label ${settings[*]}"
    grep -E ": ours prefetch|: ours forward" "$LOGS/$label.log" | sed -E 's/, graph_captures.*//' \
        || tail -n 3 "$LOGS/$label.log"
}

run() {
    : "${CONFIGS:?CONFIGS: the bench fbgemm configurations}" "${OUT:?OUT: where the logs go}"
    LOGS=$OUT/bench_commits
    mkdir -p "$LOGS"
    local flags=("$@")
    [[ ${#flags[@]} -eq 0 ]] && flags=(--ours-only --warmup 6 --steps 30)
    local head=${TIERED_TBE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo worktree)}
    one "$head" . -- "${flags[@]}"
    for variant in ${VARIANTS:-}; do
        IFS=, read -r -a settings <<<"${variant#*:}"
        one "$head-${variant%%:*}" . "${settings[@]}" -- "${flags[@]}"
    done
    if [[ -f $TREES/order ]]; then
        while read -r sha; do one "$sha" "$TREES/$sha" -- "${flags[@]}"; done <"$TREES/order"
    fi
    local tree_variants tree_variant sha label extra extra_flags
    IFS=';' read -r -a tree_variants <<<"${TREE_VARIANTS:-}"
    for tree_variant in "${tree_variants[@]}"; do
        [[ -z $tree_variant ]] && continue
        IFS=: read -r sha label extra <<<"$tree_variant"
        [[ -d $TREES/$sha ]] || { echo "TREE_VARIANTS: no tree $sha under $TREES (unpack it first)"; exit 1; }
        read -r -a extra_flags <<<"$extra"
        one "$sha-$label" "$TREES/$sha" -- "${flags[@]}" "${extra_flags[@]}"
    done
    tar -czf "$OUT/bench_commits_logs.tgz" -C "$OUT" bench_commits && rm -rf "$LOGS"
}

case ${1:-} in
    unpack) shift; unpack "$@" ;;
    run) shift; run "$@" ;;
    *) echo "usage: bash tools/bench_commits.sh unpack COMMIT... | run [bench fbgemm flags]"; exit 2 ;;
esac
