"""Compare two reports of ``tools/compile_kernels.py --save``: what changed per kernel, and
whether a kernel got worse (fewer 16-byte loads or stores, more stack or spill bytes).

Kept apart from ``compile_kernels.py``, which switches Triton's interpreter off as it loads.
"""

from __future__ import annotations


def compare_reports(before: dict, after: dict) -> int:
    """Print what changed per kernel between two reports; 1 if a kernel lost 16-byte loads or
    stores or gained stack or local (spill) bytes, else 0. Kernels in only one report are listed."""
    for key in ("triton", "dim", "dtype", "arch"):
        if before.get(key) != after.get(key):
            print(f"note: {key} differs ({before.get(key)} -> {after.get(key)}): counts may not compare")
    old = {facts["kernel"]: facts for facts in before["kernels"]}
    new = {facts["kernel"]: facts for facts in after["kernels"]}
    worse = False
    for name in sorted(old.keys() | new.keys()):
        if name not in old or name not in new:
            print(f"{name:<44} only {'after' if name in new else 'before'}")
            continue
        changes = {key: (old[name][key], new[name][key]) for key in new[name]
                   if key != "kernel" and old[name].get(key) != new[name][key]}
        if changes:
            print(f"{name:<44} " + ", ".join(f"{key} {a} -> {b}" for key, (a, b) in changes.items()))
        lost = any(new[name][key] < old[name][key] for key in ("v4_loads", "v4_stores"))
        spills = any(new[name][key] > old[name][key] for key in ("stack_bytes", "local_bytes"))
        worse |= lost or spills
    print("compare: " + ("a kernel lost 16-byte accesses or gained spills" if worse else "no kernel got worse"))
    return 1 if worse else 0
