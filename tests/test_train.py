"""The main job (`tiered-tbe train`) end to end at a tiny size: it learns, says what it trains, and
a resumed run equals the uninterrupted one."""

from __future__ import annotations

import shutil

import pytest
import torch

from tiered_tbe import train
from tiered_tbe.cli import main
from tiered_tbe.optimizers import OPTIMIZERS

TINY = ["--tables", "2", "--rows", "40", "--dim", "4", "--batch-size", "8", "--bag-size", "2"]


def run_train(*flags: str) -> dict:
    return train.run(train.build_parser().parse_args([*TINY, *flags]))


@pytest.mark.parametrize("depth", [0, 2])
def test_train_says_what_it_trains_before_the_first_step(depth, capsys, one_simulated_thread):
    result = run_train("--steps", "4", "--pipeline-depth", str(depth), "--policy", "lfu", "--backend", "torch")
    out = capsys.readouterr().out
    assert "CPU simulation mode" in out and "samples/s" in out
    described = out.index("model: 2 tables of 40 rows x 4 fp32 (managed_cached), rowwise_adagrad lr 0.2")
    # 5% of 80 cached rows = 4 slots, rounded up to one set of 32 ways.
    cache = out.index(f"cache: 32 slots (1 sets of 32 ways, 40.0% of 80 cached rows), policy lfu, "
                      f"pipeline depth {depth}")
    assert described < cache < out.index("data: 4 steps of 8 samples x 2 lookups per table") < out.index("loss ")
    assert 0 <= result["hit_rate"] <= 1 and result["steps"] == 4


def test_the_loss_falls(capsys):
    """The tables and the dense model learn the hidden truth: the loss of the last steps is well
    below that of the first (seeded data: the same numbers every run)."""
    result = run_train("--steps", "60", "--batch-size", "64", "--placement", "device", "--backend", "torch")
    losses = [loss for _, loss in result["losses"]]  # every 5th step
    first, last = sum(losses[:2]) / 2, sum(losses[-3:]) / 3
    assert first > 0.65 and last < first - 0.12, losses


def test_train_with_each_optimizer_and_weights_dtype(capsys):
    for name in OPTIMIZERS:  # the registry: every optimizer it names trains from the command line
        result = run_train("--steps", "3", "--optimizer", name, "--placement", "device", "--backend", "torch",
                           "--dtype", "bf16" if name == "sgd" else "fp32")
        assert torch.isfinite(torch.tensor(result["final_loss"])), name
    assert "rowwise_adagrad" in capsys.readouterr().out


def load(path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_same_checkpoint(a: dict, b: dict) -> None:
    assert a["step"] == b["step"] and a["config"] == b["config"]
    assert a["model"].keys() == b["model"].keys()
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    state_a, state_b = a["dense_optimizer"]["state"], b["dense_optimizer"]["state"]
    assert state_a.keys() == state_b.keys()
    for param in state_a:
        for name, value in state_a[param].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(state_b[param][name])), (param, name)
    assert a["losses"] == b["losses"]


def test_a_resumed_run_equals_the_uninterrupted_one(tmp_path, monkeypatch, capsys, one_simulated_thread):
    common = ["--steps", "7", "--backend", "torch", "--cache-fraction", "0.4"]
    whole = tmp_path / "whole.pt"
    run_train(*common, "--save", str(whole))

    # The same run, checkpointed every 3 steps: keep a copy of each checkpoint as it is written.
    saved = []
    real_save = train.save_checkpoint

    def save_and_copy(path, *args):
        real_save(path, *args)
        saved.append(tmp_path / f"step{args[2]}.pt")
        shutil.copy(path, saved[-1])

    monkeypatch.setattr(train, "save_checkpoint", save_and_copy)
    run_train(*common, "--save", str(tmp_path / "every.pt"), "--save-every", "3")
    monkeypatch.undo()
    assert [p.name for p in saved] == ["step3.pt", "step6.pt", "step7.pt"]
    assert_same_checkpoint(load(saved[-1]), load(whole))

    # Interrupted after step 3, resumed to step 7, on another policy and a pipeline (where rows
    # live and when they move change no result).
    resumed = tmp_path / "resumed.pt"
    capsys.readouterr()
    run_train(*common, "--resume", str(saved[0]), "--save", str(resumed), "--policy", "lookahead",
              "--pipeline-depth", "2")
    out = capsys.readouterr().out
    assert f"resumed from {saved[0]} after step 3" in out and "data: steps 4..7 of" in out
    assert_same_checkpoint(load(resumed), load(whole))
    checkpoint = load(whole)
    assert {"t0.weight", "t0.momentum1", "optimizer_step"} <= {k.split("embeddings.")[-1] for k in checkpoint["model"]}
    assert int(checkpoint["model"]["embeddings.optimizer_step"]) == 7 and "torch_rng" in checkpoint


def final_figures(out: str) -> tuple[str, str]:
    """The last line's loss figures, and what its hit rate covers."""
    line = next(line for line in reversed(out.splitlines()) if line.startswith("loss "))
    loss, rest = line.split("; ", 1)
    return loss, rest.split("cache hit rate (by lookup) ", 1)[1]


def test_a_resumed_run_prints_the_final_figures_of_the_uninterrupted_one(tmp_path, capsys, one_simulated_thread):
    """The final loss covers a fixed window of last steps, whichever run computed them (the
    checkpoint keeps the losses of its last steps), and the hit rate says which steps it covers:
    a resumed run's cache starts empty."""
    common = ["--steps", "14", "--backend", "torch", "--cache-fraction", "0.2"]
    whole = run_train(*common)
    whole_loss, whole_hits = final_figures(capsys.readouterr().out)
    assert whole_loss.startswith("loss ") and "(mean of steps 5-14)" in whole_loss
    assert whole_hits.endswith("over steps 1-14")

    checkpoint = tmp_path / "c.pt"
    run_train(*common[2:], "--steps", "7", "--save", str(checkpoint))  # a shorter run first, as a user would
    capsys.readouterr()
    resumed = run_train(*common, "--resume", str(checkpoint))
    resumed_loss, resumed_hits = final_figures(capsys.readouterr().out)
    assert resumed_loss == whole_loss
    assert resumed["final_loss"] == whole["final_loss"] and resumed["first_loss"] == whole["first_loss"]
    assert resumed["losses"] == whole["losses"]
    assert resumed_hits.endswith("over steps 8-14 (this run's: a resumed run's cache starts empty)")


@pytest.mark.parametrize("flags, message", [
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--rows", "-3"], "--rows must be >= 1, got -3"),
    (["--cache-fraction", "0"], "--cache-fraction must be in (0, 1], got 0.0"),
    (["--pipeline-depth", "9"], "--pipeline-depth must be between 0 and 8, got 9"),
    (["--policy", "lookahead-admit"], "--policy lookahead-admit needs --pipeline-depth 1 or more"),
    (["--lr", "0"], "--lr must be a finite number > 0, got 0.0"),
    (["--alpha", "-1"], "--alpha must be a finite number >= 0"),
    (["--save-every", "2"], "--save-every needs --save PATH"),
    (["--resume", "/no/such/checkpoint.pt"], "--resume /no/such/checkpoint.pt: no such file"),
    (["--save", "/no/such/folder/c.pt"], "--save /no/such/folder/c.pt: the folder does not exist"),
    (["--optimizer", "lion"], "invalid choice: 'lion'"),
])
def test_bad_flags_are_usage_errors(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *flags])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "usage: tiered-tbe train" in err and message in err


def test_resume_refuses_another_model_or_a_finished_run(tmp_path, capsys, one_simulated_thread):
    checkpoint = tmp_path / "c.pt"
    run_train("--steps", "2", "--backend", "torch", "--save", str(checkpoint))
    for flags, message in ((["--dim", "6", "--steps", "4"], "trained with --dim 4 (now 6)"),
                           (["--steps", "2"], "is at step 2: --steps 2 leaves nothing to train")):
        with pytest.raises(SystemExit):
            main(["train", *TINY, "--backend", "torch", "--resume", str(checkpoint), *flags])
        assert message in capsys.readouterr().err
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="cannot read it as a checkpoint"):
        run_train("--resume", str(tmp_path / "junk.pt"))


def test_help_shows_every_flag_with_its_default(capsys):
    parser = train.build_parser()
    for action in parser._actions:
        if action.dest == "help":
            continue
        assert action.help and "default" in action.help, action.option_strings
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for action in parser._actions:
        assert action.option_strings[-1] in out
