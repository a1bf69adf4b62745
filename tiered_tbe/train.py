"""``tiered-tbe train``: train a small DLRM-style click model whose embedding tables are tiered.

A dense MLP ("bottom") embeds the dense features, :class:`TieredEmbeddingBags` pools one bag
per table, and a top MLP turns their concatenation into a click logit. Clicks come from a
hidden ground truth (a fixed score per row plus a linear function of the dense features), so
the loss falls as the tables learn the row scores. On a GPU the tables sit in pinned host
memory behind the slot cache; without one, the same code runs in CPU simulation mode at a
small size.

Checkpoints (``--save``, ``--save-every``, ``--resume``) hold everything the next step depends
on: the embedding tables with their optimizer state (the module's ``state_dict``, every cached
update flushed), the dense model and its optimizer, the step and the torch RNG. Batch ``i`` of
the synthetic data is a function of the seed and ``i`` alone, so the data position is the step:
a resumed run trains exactly what the uninterrupted one would have.

The final figures a run prints are those a resumed run prints too: the loss of step 1 and the
mean loss of the last ``FINAL_STEPS`` steps (the checkpoint keeps the losses of its last steps);
the cache's hit rate covers the steps of this run only, as it says (a resumed run's cache starts
empty, so its rate is not the uninterrupted run's).
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from tiered_tbe.backends import BACKENDS
from tiered_tbe.base.mode import SIMULATION, default_device, describe_mode
from tiered_tbe.cache.policy import DEFAULT_POLICY, POLICIES
from tiered_tbe.module import TieredEmbeddingBags
from tiered_tbe.optimizers import OPTIMIZERS, optimizer_named
from tiered_tbe.specs import WEIGHTS_DTYPES, CacheConfig, Placement, TableSpec
from tiered_tbe.zipf import ZipfSampler

NUM_DENSE = 13
# The final loss: the mean over this many last steps (the loss of one step is noisy).
FINAL_STEPS = 10
# The loss shown beside the progress bar: every this many steps, smoothed.
LOG_EVERY = 5
CHECKPOINT_FORMAT = "tiered-tbe train checkpoint, version 1"
# Flags a resumed run must share with the checkpoint's (they decide the model, the data or the
# math). The others (placement, cache, policy, pipeline depth) only decide where rows live and
# when they move, which changes no result.
RESUME_MUST_MATCH = ("tables", "rows", "dim", "dtype", "batch_size", "bag_size", "alpha", "optimizer", "lr",
                     "seed", "backend")


@dataclass
class ClickBatch:
    dense: torch.Tensor  # fp32 [B, num_dense]
    indices: torch.Tensor  # int64 [N]
    offsets: torch.Tensor  # int64 [T*B+1]
    labels: torch.Tensor  # fp32 [B], 0 or 1


class SyntheticClicks:
    """Seeded click batches: Zipf lookups, ``bag_size`` per table per sample, labels from a hidden truth.

    :meth:`batch` ``(i)`` depends on the seed and ``i`` only (its own generator), so any batch
    of the stream can be made without the ones before it: a resumed run starts at its step.
    """

    def __init__(self, tables: list[TableSpec], batch_size: int, bag_size: int, alpha: float,
                 num_dense: int, device: torch.device, seed: int = 0):
        self.tables, self.batch_size, self.bag_size = tables, batch_size, bag_size
        self.num_dense, self.device, self.seed = num_dense, device, seed
        streams = np.random.SeedSequence(seed).spawn(len(tables) + 1)
        self.samplers = [ZipfSampler(table.num_embeddings, alpha, np.random.default_rng(stream))
                         for table, stream in zip(tables, streams)]
        truth = np.random.default_rng(streams[-1]).standard_normal(num_dense)
        self.dense_truth = torch.from_numpy(truth).float() / math.sqrt(num_dense)
        self.row_offset = torch.tensor([0] + [t.num_embeddings for t in tables]).cumsum(0)[:-1]

    def batch(self, step: int) -> ClickBatch:
        B, L, T = self.batch_size, self.bag_size, len(self.tables)
        rng = np.random.default_rng([self.seed, step])
        rows = torch.from_numpy(np.stack([s.sample(rng, B * L) for s in self.samplers]))  # [T, B*L]
        dense = torch.from_numpy(rng.standard_normal((B, self.num_dense))).float()
        # The hidden score of a row: a fixed pseudo-random value in [-1, 1] per global row id.
        global_rows = (rows + self.row_offset[:, None]).double()
        row_score = torch.sin(global_rows * 12.9898 + 78.233).float().view(T, B, L).sum(dim=(0, 2))
        logit = row_score / math.sqrt(T * L) * 3 + dense @ self.dense_truth
        labels = torch.from_numpy(rng.random(B) < torch.sigmoid(logit).numpy()).float()
        offsets = torch.arange(0, T * B * L + 1, L, dtype=torch.int64)
        to = dict(device=self.device, non_blocking=True)
        return ClickBatch(dense.to(**to), rows.reshape(-1).to(**to), offsets.to(**to), labels.to(**to))


class TinyDLRM(nn.Module):
    """bottom MLP(dense) ‖ pooled embeddings -> top MLP -> click logit [B]."""

    def __init__(self, embeddings: TieredEmbeddingBags, num_dense: int, hidden: int = 64):
        super().__init__()
        total_dim = sum(t.embedding_dim for t in embeddings.tables)
        self.bottom = nn.Sequential(nn.Linear(num_dense, hidden), nn.ReLU())
        self.embeddings = embeddings
        self.top = nn.Sequential(nn.Linear(hidden + total_dim, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, batch: ClickBatch) -> torch.Tensor:
        pooled = self.embeddings(batch.indices, batch.offsets)
        return self.top(torch.cat([self.bottom(batch.dense), pooled], dim=1)).squeeze(1)


# Defaults: (on a GPU, in CPU simulation), where they differ.
_SIZES = dict(tables=(8, 4), rows=(2_000_000, 500), dim=(64, 8), batch_size=(8192, 32), bag_size=(8, 2),
              steps=(300, 40))


def _default(name: str):
    gpu, simulation = _SIZES[name]
    return simulation if SIMULATION else gpu


def _default_text(name: str) -> str:
    gpu, simulation = _SIZES[name]
    return f"default {gpu:,} on a GPU, {simulation:,} in CPU simulation"


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Add the flags of ``tiered-tbe train`` to ``parser`` (a new one if None) and return it."""
    parser = parser or argparse.ArgumentParser(prog="tiered-tbe train")
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    model = parser.add_argument_group("model and data")
    model.add_argument("--tables", type=int, default=_default("tables"),
                       help=f"number of embedding tables ({_default_text('tables')})")
    model.add_argument("--rows", type=int, default=_default("rows"), help=f"rows per table ({_default_text('rows')})")
    model.add_argument("--dim", type=int, default=_default("dim"), help=f"embedding dim ({_default_text('dim')})")
    model.add_argument("--dtype", choices=tuple(WEIGHTS_DTYPES), default="fp32",
                       help="weights dtype of the tables; optimizer state and arithmetic are fp32 (default fp32)")
    model.add_argument("--batch-size", type=int, default=_default("batch_size"),
                       help=f"samples per batch ({_default_text('batch_size')})")
    model.add_argument("--bag-size", type=int, default=_default("bag_size"),
                       help=f"lookups per table per sample ({_default_text('bag_size')})")
    model.add_argument("--alpha", type=float, default=1.05,
                       help="Zipf exponent of the lookups, >= 0 (0: uniform; default 1.05)")
    model.add_argument("--seed", type=int, default=0, help="seed of the weights and the data (default 0)")

    tiers = parser.add_argument_group("tiers and cache")
    # Managed memory: the GPU reads it in place ~2x faster than pinned memory (README, "Placements").
    tiers.add_argument("--placement", default=Placement.MANAGED_CACHED.value, choices=[p.value for p in Placement],
                       help=f"where every table's rows live (default {Placement.MANAGED_CACHED.value})")
    tiers.add_argument("--cache-fraction", type=float, default=0.05,
                       help="slot cache size, fraction of the cached tables' rows, in (0, 1] (default 0.05)")
    tiers.add_argument("--policy", default=DEFAULT_POLICY, choices=list(POLICIES),
                       help=f"cache policy (default {DEFAULT_POLICY})")
    tiers.add_argument("--pipeline-depth", type=int, default=0,
                       help="prefetch this many batches ahead on a side stream, 0..8 (default 0: each forward "
                            "prefetches its own batch)")

    training = parser.add_argument_group("training")
    training.add_argument("--steps", type=int, default=_default("steps"),
                          help=f"training steps in all, counting those of a --resume checkpoint "
                               f"({_default_text('steps')})")
    training.add_argument("--optimizer", default="rowwise_adagrad", choices=list(OPTIMIZERS),
                          help="the tables' optimizer, fused into the backward (default rowwise_adagrad)")
    training.add_argument("--lr", type=float, default=0.2, help="learning rate of the tables' optimizer (default 0.2)")
    training.add_argument("--backend", default="triton", choices=list(BACKENDS),
                          help="triton: the kernels; torch: their plain-torch reference, faster in CPU simulation "
                               "(default triton)")

    from tiered_tbe.torchrec.train import add_flags  # imports no torchrec

    add_flags(parser)
    checkpoints = parser.add_argument_group("checkpoints")
    checkpoints.add_argument("--save", metavar="PATH",
                             help="write a checkpoint to PATH at the end (and every --save-every steps); "
                                  "default: none")
    checkpoints.add_argument("--save-every", type=int, metavar="N",
                             help="also write the --save checkpoint every N steps (default: only at the end)")
    checkpoints.add_argument("--resume", metavar="PATH",
                             help="continue from the checkpoint at PATH, to --steps steps in all (default: start "
                                  "afresh)")
    return parser


def check_args(args: argparse.Namespace) -> None:
    """``ValueError`` naming the flag, for values that cannot train."""
    for name in ("tables", "rows", "dim", "batch_size", "bag_size", "steps"):
        value = getattr(args, name)
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if not (args.alpha >= 0 and math.isfinite(args.alpha)):
        raise ValueError(f"--alpha must be a finite number >= 0, got {args.alpha}")
    if not 0 < args.cache_fraction <= 1:
        raise ValueError(f"--cache-fraction must be in (0, 1], got {args.cache_fraction}")
    if not 0 <= args.pipeline_depth <= 8:
        raise ValueError(f"--pipeline-depth must be between 0 and 8, got {args.pipeline_depth}")
    if POLICIES[args.policy].needs_window and args.pipeline_depth == 0 and not getattr(args, "torchrec", False):
        # Its window of batches ahead comes from the pipeline; without one it lets no row into a full set.
        raise ValueError(f"--policy {args.policy} needs --pipeline-depth 1 or more (its lookahead window comes from "
                         "the prefetch pipeline)")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        raise ValueError(f"--lr must be a finite number > 0, got {args.lr}")
    if args.save_every is not None:
        if args.save_every < 1:
            raise ValueError(f"--save-every must be >= 1, got {args.save_every}")
        if args.save is None:
            raise ValueError("--save-every needs --save PATH (where to write the checkpoints)")
    for flag, path in (("--save", args.save), ("--resume", args.resume)):
        if path is None:
            continue
        if flag == "--resume" and not os.path.isfile(path):
            raise ValueError(f"--resume {path}: no such file")
        if flag == "--save" and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise ValueError(f"--save {path}: the folder does not exist")


def _config(args: argparse.Namespace) -> dict:
    return {name: getattr(args, name) for name in RESUME_MUST_MATCH}


def save_checkpoint(path: str, model: TinyDLRM, dense_optimizer: torch.optim.Optimizer, step: int, config: dict,
                    losses: dict) -> None:
    """Write the checkpoint after ``step`` steps to ``path`` (through a temporary file: a crash while
    writing leaves the previous checkpoint whole). ``model.state_dict()`` flushes the cache first."""
    checkpoint = dict(format=CHECKPOINT_FORMAT, step=step, config=config, model=model.state_dict(),
                      dense_optimizer=dense_optimizer.state_dict(), torch_rng=torch.get_rng_state(), losses=losses)
    if torch.cuda.is_available() and not SIMULATION:
        checkpoint["cuda_rng"] = torch.cuda.get_rng_state_all()
    temporary = f"{path}.tmp"
    torch.save(checkpoint, temporary)
    os.replace(temporary, path)


def load_checkpoint(path: str, config: dict) -> dict:
    """The checkpoint at ``path``; ``ValueError`` if it is not one, or was made with other flags."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # a truncated file, another format: the user's to fix
        raise ValueError(f"--resume {path}: cannot read it as a checkpoint ({error})") from None
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"--resume {path}: not a checkpoint of tiered-tbe train ({CHECKPOINT_FORMAT!r})")
    different = [f"--{k.replace('_', '-')} {checkpoint['config'].get(k)} (now {v})"
                 for k, v in config.items() if checkpoint["config"].get(k) != v]
    if different:
        raise ValueError(f"--resume {path}: the checkpoint was trained with " + ", ".join(different)
                         + "; give the same flags to continue it")
    return checkpoint


def describe(args: argparse.Namespace, embeddings: TieredEmbeddingBags, start_step: int) -> str:
    """What is trained, in two lines: tables, rows, cache slots and policy, optimizer, steps."""
    placement = Placement(args.placement)
    lines = [f"model: {args.tables} tables of {args.rows:,} rows x {args.dim} {args.dtype} ({placement.value}), "
             f"{args.optimizer} lr {args.lr:g}; TinyDLRM on top (hidden 64, {NUM_DENSE} dense features)"]
    if embeddings.cache is not None:
        cache = embeddings.cache
        cached_rows = sum(t.num_embeddings for t in embeddings.tables if t.placement.is_cached)
        lines.append(f"cache: {cache.num_slots:,} slots ({cache.num_sets:,} sets of {cache.associativity} ways, "
                     f"{100 * cache.num_slots / cached_rows:.1f}% of {cached_rows:,} cached rows), policy "
                     f"{cache.policy}, pipeline depth {args.pipeline_depth}")
    else:
        lines.append(f"cache: none ({placement.value} tables are not cached), pipeline depth {args.pipeline_depth}")
    steps = f"steps {start_step + 1}..{args.steps}" if start_step else f"{args.steps} steps"
    lines.append(f"data: {steps} of {args.batch_size} samples x {args.bag_size} lookups per table, "
                 f"Zipf {args.alpha:g}, seed {args.seed}; {args.backend} kernels")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict:
    """Train; return the losses, hit rate and throughput. ``ValueError`` for flags that do not fit."""
    check_args(args)
    if getattr(args, "torchrec", False):
        from tiered_tbe.torchrec.train import run_torchrec

        return run_torchrec(args)
    config = _config(args)
    checkpoint = load_checkpoint(args.resume, config) if args.resume else None
    start_step = checkpoint["step"] if checkpoint else 0
    if start_step >= args.steps:
        raise ValueError(f"--resume {args.resume} is at step {start_step}: --steps {args.steps} leaves nothing to "
                         "train (--steps counts every step, those of the checkpoint included)")
    torch.manual_seed(args.seed)
    device = default_device()
    print(f"tiered-tbe train: {describe_mode()}")
    placement = Placement(args.placement)
    tables = [TableSpec(args.rows, args.dim, name=f"t{t}", placement=placement) for t in range(args.tables)]
    cache = CacheConfig(fraction=args.cache_fraction, policy=args.policy) if placement.is_cached else None
    embeddings = TieredEmbeddingBags(tables, optimizer=optimizer_named(args.optimizer, lr=args.lr),
                                     weights_dtype=WEIGHTS_DTYPES[args.dtype], cache=cache, device=device,
                                     seed=args.seed, backend=args.backend)
    model = TinyDLRM(embeddings, NUM_DENSE).to(device)
    dense_optimizer = torch.optim.Adam(list(model.parameters()), lr=1e-3)
    # first: step 1's loss; logged: every LOG_EVERY-th step's, and its smoothed value; recent: (step, loss)
    # of the last FINAL_STEPS steps. Each depends on the steps trained only, not on where a run stopped.
    losses = dict(first=None, smoothed=None, logged=[], recent=[])
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model"])
        dense_optimizer.load_state_dict(checkpoint["dense_optimizer"])
        torch.set_rng_state(checkpoint["torch_rng"])
        if "cuda_rng" in checkpoint and not SIMULATION:
            torch.cuda.set_rng_state_all(checkpoint["cuda_rng"])
        losses = {"recent": [], **checkpoint["losses"]}
        print(f"resumed from {args.resume} after step {start_step}")
    recent = deque(losses["recent"], maxlen=FINAL_STEPS)  # losses as device tensors: read at a save, and at the end
    print(describe(args, embeddings, start_step), flush=True)

    data = SyntheticClicks(tables, args.batch_size, args.bag_size, args.alpha, NUM_DENSE, device, args.seed)
    batches = (data.batch(i) for i in range(start_step, args.steps))
    if args.pipeline_depth > 0:
        from tiered_tbe.pipeline import PrefetchPipeline

        batches = PrefetchPipeline(model, batches, depth=args.pipeline_depth,
                                   lookups=lambda b: {"embeddings": (b.indices, b.offsets)})
    loss_fn = nn.BCEWithLogitsLoss()
    start = time.perf_counter()
    samples = 0
    progress = tqdm(batches, total=args.steps, initial=start_step, unit="batch", dynamic_ncols=True)
    for step, batch in enumerate(progress, start_step):
        loss = loss_fn(model(batch), batch.labels)
        dense_optimizer.zero_grad(set_to_none=True)
        loss.backward()  # the embedding tables update here, fused
        dense_optimizer.step()
        samples += args.batch_size
        recent.append((step, loss.detach()))
        if step % LOG_EVERY == 0:
            value = loss.item()
            losses["logged"].append((step, value))
            losses["first"] = value if losses["first"] is None else losses["first"]
            losses["smoothed"] = value if losses["smoothed"] is None else 0.8 * losses["smoothed"] + 0.2 * value
            rate = samples / (time.perf_counter() - start)
            hit_rate = embeddings.cache_stats().hit_rate_by_lookup if embeddings.cache else 1.0
            progress.set_postfix(loss=f"{losses['smoothed']:.4f}", hit_rate=f"{hit_rate:.3f}",
                                 samples_s=f"{rate:,.0f}")
        done = step + 1
        if args.save and (done == args.steps or (args.save_every and done % args.save_every == 0)):
            losses["recent"] = [(s, float(value)) for s, value in recent]
            save_checkpoint(args.save, model, dense_optimizer, done, config, losses)
    progress.close()
    elapsed = time.perf_counter() - start
    stats = embeddings.cache_stats()
    final = [float(value) for _, value in recent]
    result = dict(first_loss=losses["first"], final_loss=sum(final) / len(final), losses=losses["logged"],
                  samples_per_s=samples / elapsed, hit_rate=stats.hit_rate_by_lookup if embeddings.cache else 1.0,
                  hit_rate_steps=(start_step + 1, args.steps), steps=args.steps)
    if embeddings.cache is None:
        hits = "no cache"
    else:
        hits = f"cache hit rate (by lookup) {result['hit_rate']:.3f} over steps {start_step + 1}-{args.steps}"
        if start_step:
            hits += " (this run's: a resumed run's cache starts empty)"
    print(f"loss {losses['first']:.4f} at step 1 -> {result['final_loss']:.4f} (mean of steps {recent[0][0] + 1}-"
          f"{args.steps}); {result['samples_per_s']:,.0f} samples/s; {hits}")
    if args.save:
        print(f"saved {args.save} (step {args.steps})")
    if SIMULATION:
        print("(simulation mode: throughput is of the CPU interpreter, not of any GPU)")
    return result


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    try:
        run(parser.parse_args(argv))
    except ValueError as error:
        parser.error(str(error))


if __name__ == "__main__":
    main()
