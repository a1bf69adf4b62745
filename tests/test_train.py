"""The main job (`tiered-tbe train`) runs end to end at a tiny size, serial and pipelined."""

from __future__ import annotations

import math

import pytest

from tiered_tbe import train


@pytest.mark.parametrize("depth", [0, 2])
def test_train_runs_and_says_where(depth, capsys, one_simulated_thread):
    args = train.build_parser().parse_args(
        ["--tables", "2", "--rows", "40", "--dim", "4", "--batch-size", "4", "--bag-size", "2",
         "--steps", "4", "--pipeline-depth", str(depth), "--policy", "lfu"])
    result = train.run(args)
    out = capsys.readouterr().out
    assert "CPU simulation mode" in out and "samples/s" in out
    assert math.isfinite(result["final_loss"]) and 0 <= result["hit_rate"] <= 1
    assert result["steps"] == 4
