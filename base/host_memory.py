"""What Linux says of the host's memory: a field of ``/proc/meminfo``, the transparent huge page setting.

Read where a module sizes an allocation (``tiered_tbe.memory``), where a benchmark reports the huge
pages under a backing store (``tools/bench_host_memory.py``) and where a record names its machine
(``tiered_tbe.records``). Each returns None where the file cannot be read (not Linux).
"""

from __future__ import annotations

from pathlib import Path


def meminfo_bytes(field: str) -> int | None:
    """Bytes of ``field`` of ``/proc/meminfo`` (``MemTotal``, ``MemAvailable``, ``AnonHugePages``, ...:
    the file's kB times 1024), or None where the file or the field is missing."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                name, _, value = line.partition(":")
                if name == field:
                    return int(value.split()[0]) * 1024
    except OSError:
        return None
    return None


def transparent_huge_pages() -> str | None:
    """The kernel's transparent huge page setting and its defrag setting (``"madvise / madvise"``),
    or None where they cannot be read."""
    chosen = []
    for name in ("enabled", "defrag"):
        try:
            text = Path(f"/sys/kernel/mm/transparent_hugepage/{name}").read_text()
        except OSError:
            return None
        chosen.append(text[text.find("[") + 1: text.find("]")] if "[" in text else text.strip())
    return " / ".join(chosen)
