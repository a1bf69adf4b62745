"""The README's example runs as pasted and prints what its comments say.

The example is the README's first ``python`` code block. It runs in a fresh Python process, in
its own working directory (it saves a checkpoint there): on a CPU in simulation mode, on a GPU
with the kernels. Started as this module is collected, on another core (tests/background.py).
"""

import atexit
import re
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from background import run_in_background

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_example() -> str:
    """The source of the README's first ```python block."""
    match = re.search(r"^```python\n(.*?)^```$", README.read_text(), flags=re.MULTILINE | re.DOTALL)
    assert match, "README.md has no ```python block"
    return match.group(1)


def _run_example(directory: Path):
    directory.mkdir(parents=True, exist_ok=True)
    return run_in_background([sys.executable, "-c", readme_example()], cwd=directory, timeout=180)


# pytest's tmp_path is not known at collection: the example writes into a folder of its own,
# removed when the process exits (after the background checks have ended).
_WORKDIR = Path(tempfile.mkdtemp(prefix="tiered_tbe_readme_"))
atexit.register(shutil.rmtree, _WORKDIR, ignore_errors=True)
_EXAMPLE = _run_example(_WORKDIR)


def test_readme_example_is_complete():
    """The example imports what it uses and picks its device by what exists: no "cuda" spelled out."""
    source = readme_example()
    assert "import tiered_tbe" in source and "tiered_tbe.default_device()" in source
    assert '"cuda"' not in source and "'cuda'" not in source


def test_readme_example_runs_and_prints_what_it_says():
    result = _EXAMPLE.result()
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    losses = [float(m.group(1)) for line in lines if (m := re.fullmatch(r"step \d: loss (\d+\.\d+)", line))]
    assert len(losses) == 3, result.stdout
    assert losses[0] > losses[1] > losses[2], f"the loss should fall every step: {losses}"
    assert "item rows: 6 hits, 3 misses" in lines, result.stdout  # the figures its comment gives

    checkpoint = torch.load(_WORKDIR / "embeddings.pt")
    assert set(checkpoint) == {"user.weight", "user.momentum1", "item.weight", "item.momentum1", "optimizer_step"}
    assert tuple(checkpoint["item.weight"].shape) == (100_000, 32)
    assert int(checkpoint["optimizer_step"]) == 3
    # Every update reached the checkpoint, the cached table's included: rows 42 and 99999 of "item"
    # were updated three times (from the cache), row 0 never.
    accumulator = checkpoint["item.momentum1"]
    assert accumulator[42] > 0 and accumulator[99_999] > 0 and accumulator[0] == 0
