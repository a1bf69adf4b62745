"""tiered-tbe inside TorchRec: DistributedModelParallel with our sharder, 2 ranks over gloo, in CPU simulation.

Each test spawns one small job (tests/torchrec_ranks.py) and checks many plans in it: a job's start
(two processes importing torch, triton, numba and torchrec) is most of its cost. TorchRec's own
``fused`` kernel (FBGEMM's CPU TBE) under the same plan is the baseline for the optimizers FBGEMM's
CPU TBE has (EXACT_SGD, EXACT_ROWWISE_ADAGRAD, EXACT_ADAGRAD); the fp64 reference
(tests/reference_model.py) for the others.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torchrec")
pytest.importorskip("fbgemm_gpu")

import atexit  # noqa: E402
import shutil  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import torchrec_ranks as ranks  # noqa: E402
import torchrec_scenarios as scenarios  # noqa: E402
import torchrec_world_sizes as world_sizes  # noqa: E402
from background import run_in_background  # noqa: E402

from tiered_tbe.base.mode import SIMULATION  # noqa: E402

WORLD = 2
# The 2-rank jobs run on the CPU (gloo, CPU simulation); a GPU machine runs the gpu-marked tests.
on_the_cpu = pytest.mark.skipif(not SIMULATION, reason="2 ranks over gloo in CPU simulation (GPU: the gpu tests)")


@on_the_cpu
def test_every_sharding_type_and_placement_trains_as_torchrecs_fused_kernel():
    """Table-, row-, column-, table-row-wise and mixed plans; HBM, managed and cached tables (4 slots a
    rank: heavy eviction); variable bag lengths with empty bags and hot rows; forward and 4 fused
    updates equal TorchRec's own kernel within 1e-5, weights and optimizer state, for SGD, row-wise
    Adagrad and Adagrad; a weighted collection (per-sample weights)."""
    ranks.spawn(scenarios.every_plan_equals_fbgemm, WORLD)


@on_the_cpu
def test_optimizers_without_an_fbgemm_cpu_kernel_and_an_lr_schedule_equal_the_reference():
    """Adam, PartialRowwiseAdam and LAMB against the fp64 reference, with the learning rate changed
    between steps through model.fused_optimizer; row-wise Adagrad under that schedule against TorchRec's."""
    ranks.spawn(scenarios.optimizers_and_lr_schedule_equal_the_reference, WORLD)


@on_the_cpu
def test_variable_batch_size_train_pipeline_and_evaluation():
    """VBE against TorchRec's own; TrainPipelineSparseDist against TorchRec's kernel; evaluation under
    no_grad leaves no slot locked."""
    ranks.spawn(scenarios.variable_batch_and_train_pipeline, WORLD)


@on_the_cpu
def test_sharded_checkpoints_resume_bitwise_and_load_into_other_plans_and_world_sizes(tmp_path):
    """torch.distributed.checkpoint: resumed = uninterrupted bitwise; another plan loads it and trains on alike;
    a 1-rank job loads it and, trained on both ranks' samples, reaches the uninterrupted 2-rank run."""
    ranks.spawn(scenarios.checkpoints, WORLD, str(tmp_path))
    ranks.spawn(scenarios.checkpoint_on_one_rank, 1, str(tmp_path))


@on_the_cpu
def test_two_ranks_train_as_one_rank_on_the_same_global_batches(tmp_path):
    """Every plan (table-, row-, column-, table-row-wise, mixed, all cached: 4 slots a rank) on 2 ranks and on
    1 rank given both ranks' samples: every step's outputs and the final weights and optimizer state within
    1e-5 (tests/torchrec_world_sizes.py)."""
    ranks.spawn(world_sizes.train_on_two_ranks, WORLD, str(tmp_path), 6, "torch")
    ranks.spawn(world_sizes.train_on_one_rank, 1, str(tmp_path), 6, "torch")


@on_the_cpu
def test_several_features_looking_up_one_table_train_as_torchrecs_fused_kernel():
    """Tables looked up by several features, in every plan and with a variable batch, against TorchRec's."""
    ranks.spawn(scenarios.shared_tables_equal_fbgemm, WORLD)


@on_the_cpu
def test_an_embedding_collection_trains_as_torchrecs_fused_kernel():
    """EmbeddingCollection (a row per lookup) under our sharder: table-wise, row-wise, column-wise and mixed
    placements, against TorchRec's own sequence kernel, forward and fused update."""
    ranks.spawn(scenarios.sequence_plans_equal_fbgemm, WORLD)


@on_the_cpu
def test_an_embedding_collection_checkpoint_loads_into_another_plan(tmp_path):
    """Saved with torch.distributed.checkpoint from a plan of HBM, managed and cached tables, loaded into a
    table-wise plan: the same full state, and the two train on alike."""
    ranks.spawn(scenarios.sequence_checkpoint_reshards, WORLD, str(tmp_path))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# Subprocess checks, started as this module is collected (tests/background.py).
_NO_TORCHREC = run_in_background([sys.executable, "-c", (
    "import sys, tiered_tbe, tiered_tbe.cli, tiered_tbe.train, tiered_tbe.torchrec\n"
    "tiered_tbe.TieredEmbeddingBags, tiered_tbe.cli.build_parser(['train'])\n"
    "print(sorted(m for m in sys.modules if m == 'torchrec' or m.startswith('torchrec.')))")],
    timeout=120, check=True)
TRAIN_FLAGS = ["--tables", "3", "--rows", "50", "--dim", "8", "--batch-size", "8", "--steps", "8", "--backend", "torch"]
# bench torchrec on 2 ranks, recorded for the weak-scaling summary (tools/torchrec_scaling.py) beside a 1-rank run.
_SCALING_RECORDS = Path(tempfile.mkdtemp(prefix="tiered-tbe-scaling-")) / "bench_torchrec.jsonl"
atexit.register(shutil.rmtree, _SCALING_RECORDS.parent, ignore_errors=True)
BENCH_FLAGS = ["--tables", "2", "--max-rows", "2000", "--steps", "2", "--warmup", "0",
               "--record", str(_SCALING_RECORDS)]
_BENCH_ON_TWO = run_in_background([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                   "--master-port", str(_free_port()), "-m", "tiered_tbe", "bench", "torchrec",
                                   *BENCH_FLAGS, "--configs", "fused", "cached"], timeout=300) if SIMULATION else None
_TRAIN_ON_TWO = run_in_background([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                   "--master-port", str(_free_port()), "-m", "tiered_tbe", "train", "--torchrec",
                                   *TRAIN_FLAGS, "--sharding", "table-row-wise", "--torchrec-pipeline", "sparse-dist"],
                                  timeout=300) if SIMULATION else None


def test_tiered_tbe_imports_no_torchrec():
    """``import tiered_tbe`` (and ``tiered-tbe train``'s flags, and tiered_tbe.torchrec itself) load no torchrec."""
    assert _NO_TORCHREC.result().stdout.strip() == "[]"


@on_the_cpu
def test_train_torchrec_on_two_processes():
    """``torchrun --nproc-per-node 2 -m tiered_tbe train --torchrec``: gloo, table-row-wise, cached tables,
    TorchRec's TrainPipelineSparseDist."""
    result = _TRAIN_ON_TWO.result()
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 process(es), gloo" in result.stdout and "table_row_wise" in result.stdout
    assert "over 8 steps (mean of 2 ranks)" in result.stdout


@on_the_cpu
def test_weak_scaling_pairs_a_two_rank_benchmark_with_its_one_rank_run(capsys):
    """`bench torchrec` on 2 ranks (torchrun, gloo) and on 1 rank, recorded to one file: tools/torchrec_scaling.py
    pairs each configuration run at both world sizes and divides each side's samples per second of all ranks;
    `fused`, run on 2 ranks only, has no row."""
    from tiered_tbe.cli import main

    result = _BENCH_ON_TWO.result()
    assert result.returncode == 0, result.stderr[-3000:]
    assert main(["bench", "torchrec", *BENCH_FLAGS, "--configs", "cached"]) == 0
    capsys.readouterr()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import torchrec_scaling

    records = torchrec_scaling.read_records(_SCALING_RECORDS)
    assert sorted((r["configuration"]["name"], r["configuration"]["world_size"]) for r in records) == [
        ("cached", 1), ("cached", 2), ("fused", 2)]
    [row] = torchrec_scaling.scaling_rows(records)
    by_world = {r["configuration"]["world_size"]: r["figures"]
                for r in records if r["configuration"]["name"] == "cached"}
    assert row["name"] == "cached" and row["world_size"] == 2 and row["rows"] == 1460 + 583
    for side in ("ours", "torchrec"):  # samples/s of all ranks: 2 x 16 samples a step on 2 ranks
        assert by_world[2][side]["samples_per_s"] == pytest.approx(32 / by_world[2][side]["step_ms"] * 1e3)
        assert row[f"{side}_scaling"] == pytest.approx(by_world[2][side]["samples_per_s"] /
                                                       by_world[1][side]["samples_per_s"])
        assert row[f"{side}_nccl_share"] is None  # not profiled
    steps = {side: by_world[2][side]["step_ms"] for side in ("ours", "torchrec")}
    assert row["ours_over_torchrec"] == pytest.approx(steps["ours"] / steps["torchrec"])
    assert torchrec_scaling.main([str(_SCALING_RECORDS)]) == 0
    out = capsys.readouterr().out
    assert "| cached | 2,043 | 2 |" in out and "| fused |" not in out


@on_the_cpu
def test_train_torchrec_in_one_process_and_flags_it_refuses(capsys):
    from tiered_tbe import train

    parser = train.build_parser()
    result = train.run(parser.parse_args([*TRAIN_FLAGS, "--torchrec", "--placement", "device", "--steps", "3"]))
    assert result["world_size"] == 1 and result["steps"] == 3
    assert "1 process(es), gloo" in capsys.readouterr().out
    import torch.distributed as dist

    assert not dist.is_initialized()  # the group it made is gone
    for flags, message in ((["--save", "x"], "--save is not supported with --torchrec"),
                           (["--pipeline-depth", "2"], "--torchrec-pipeline"),
                           (["--torchrec-pipeline", "prefetch"], "needs CUDA streams")):
        with pytest.raises(ValueError, match=message):
            train.run(parser.parse_args([*TRAIN_FLAGS, "--torchrec", *flags]))


@on_the_cpu
def test_bench_torchrec_runs_in_simulation(tmp_path, capsys):
    """``tiered-tbe bench torchrec`` at a tiny size, both configurations simulation runs, with --profile and
    --record (the times mean nothing here; the GPU run is the lead's)."""
    import json

    from tiered_tbe.cli import main

    record = tmp_path / "torchrec.jsonl"
    assert main(["bench", "torchrec", "--tables", "2", "--rows-scale", "2", "--max-rows", "2000", "--steps", "1",
                 "--warmup", "0", "--profile", "--trace", str(tmp_path / "traces"), "--record", str(record)]) == 0
    out = capsys.readouterr().out
    assert "ours/TorchRec" in out and "fused " in out and "cached " in out and "ours samples/s" in out
    assert "NCCL collectives" in out
    assert "ours: host ms per step by pipeline stage" in out and "of the embedding backward" in out
    assert sorted(p.name for p in (tmp_path / "traces").iterdir()) == [
        f"{config}-{side}.json" for config in ("cached", "fused") for side in ("ours", "torchrec")]
    lines = {line["configuration"]["name"]: line for line in map(json.loads, record.read_text().splitlines())}
    assert set(lines) == {"fused", "cached"} and all(line["simulation"] for line in lines.values())
    # The first two Criteo tables (1460 and 583 rows), twice the rows each, capped at 2000.
    scaled = lines["cached"]["configuration"]
    assert scaled["rows_scale"] == 2 and scaled["rows"] == 2000 + 1166
    assert lines["cached"]["figures"]["ours"]["step_ms"] > 0 and lines["cached"]["benchmark"] == "torchrec"
    for figures in (lines["cached"]["figures"][side] for side in ("ours", "torchrec")):  # one rank, B=16 a step
        assert figures["samples_per_s"] == pytest.approx(16 / figures["step_ms"] * 1e3)
    for side in ("ours", "torchrec"):  # the unprofiled host time around each side's TBE module
        adapter = lines["fused"]["figures"][side]["adapter_host_ms"]
        assert adapter["kernel"] > adapter["module"] > 0 and adapter["around"] > 0
    assert "unprofiled" in out


@pytest.mark.gpu
def test_gpu_kernels_equal_fbgemms_cuda_tbe():
    ranks.spawn(scenarios.gpu_kernels_equal_fbgemm, 1, nccl=True)


@pytest.mark.gpu
def test_gpu_sequence_kernels_equal_fbgemms_cuda_tbe():
    ranks.spawn(scenarios.gpu_sequence_kernels_equal_fbgemm, 1, nccl=True)


@pytest.mark.gpu
def test_gpu_two_ranks_train_as_one_rank_on_the_same_global_batches(tmp_path):
    """On two GPUs over NCCL (our Triton kernels): 20 steps of every plan on 2 ranks equal 1 rank given both
    ranks' samples, within 1e-5. Skipped on a machine of one GPU."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    ranks.spawn(world_sizes.train_on_two_ranks, 2, str(tmp_path), 20, "triton", nccl=True)
    ranks.spawn(world_sizes.train_on_one_rank, 1, str(tmp_path), 20, "triton", nccl=True)


@pytest.mark.gpu
def test_gpu_every_plan_on_two_gpus_equals_torchrecs_fbgemm_kernels():
    """On two GPUs over NCCL: every plan (table-, row-, column-, table-row-wise, mixed, all cached: 4 slots a
    rank's group), SGD, Adagrad and a weighted collection, 20 steps of our Triton kernels equal TorchRec's
    FBGEMM CUDA kernels under the same plan within 1e-5. Skipped on one GPU."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    ranks.spawn(scenarios.every_plan_equals_fbgemm, 2, "triton", 20, nccl=True)


@pytest.mark.gpu
def test_gpu_checkpoint_of_two_ranks_resumes_on_one_gpu_and_on_the_cpu(tmp_path):
    """On two GPUs over NCCL: the checkpoint scenarios of the CPU test above (resumed bitwise, another plan)
    saved by 2 ranks, then loaded by 1 GPU and by 1 CPU process (simulation mode, gloo), each of which trains
    on to the uninterrupted run. Skipped on one GPU."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    ranks.spawn(scenarios.checkpoints, 2, str(tmp_path), nccl=True)
    ranks.spawn(scenarios.checkpoint_on_one_rank, 1, str(tmp_path), nccl=True)
    ranks.spawn(scenarios.checkpoint_on_one_rank, 1, str(tmp_path), cpu_simulation=True)


@pytest.mark.gpu
def test_gpu_prefetch_train_pipeline_equals_serial_and_evaluation_leaves_no_lock():
    ranks.spawn(scenarios.prefetch_pipeline_equals_serial, 1, nccl=True)


@pytest.mark.gpu
def test_gpu_prefetch_train_pipeline_equals_torchrecs_fbgemm_kernels():
    ranks.spawn(scenarios.prefetch_pipeline_equals_fbgemm, 1, nccl=True)


@pytest.mark.gpu
def test_gpu_prefetch_train_pipeline_on_two_gpus():
    """On two GPUs over NCCL, the mixed plan under PrefetchTrainPipelineSparseDist: bitwise the serial loop
    (whose 2 ranks equal 1 rank on the same global batches: the test above), no slot locked after evaluation,
    and 20 steps equal TorchRec's FBGEMM kernels under the same pipeline within 1e-5. Skipped on one GPU."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    ranks.spawn(scenarios.prefetch_pipeline_equals_serial, 2, nccl=True)
    ranks.spawn(scenarios.prefetch_pipeline_equals_fbgemm, 2, nccl=True)


def test_fused_params_map_fbgemms_names_and_refuse_what_they_cannot_honour():
    import torch
    from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode, CacheAlgorithm
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import WeightDecayMode
    from torchrec.modules.embedding_configs import DataType

    from tiered_tbe import CacheConfig
    from tiered_tbe.optimizers import Adam, RowwiseAdagrad
    from tiered_tbe.torchrec.fused_params import module_arguments

    arguments = module_arguments({"optimizer": EmbOptimType.ADAM, "learning_rate": 0.5, "beta2": 0.9,
                                  "weight_decay": 0.1, "cache_algorithm": CacheAlgorithm.LFU,
                                  "bounds_check_mode": BoundsCheckMode.NONE, "prefetch_pipeline": True,
                                  "cache_precision": SparseType.FP16}, DataType.FP16, cached=True)
    assert arguments.optimizer == Adam(lr=0.5, betas=(0.9, 0.9), eps=1e-8, weight_decay=0.1)
    assert arguments.weights_dtype == torch.float16 and arguments.stochastic_rounding  # FBGEMM's default
    assert arguments.cache == CacheConfig(fraction=0.2, policy="lfu-admit") and arguments.bounds_check == "off"
    defaults = module_arguments(None, DataType.FP32, cached=False)  # FBGEMM's: EXACT_SGD at 0.01
    assert defaults.optimizer.name == "sgd" and defaults.optimizer.lr == 0.01 and defaults.cache is None
    assert defaults.bounds_check == "warn" and not defaults.stochastic_rounding  # fp32 rounds nothing
    for mode, ours in ((BoundsCheckMode.WARNING, "warn"), (BoundsCheckMode.IGNORE, "warn"),
                       (BoundsCheckMode.FATAL, "raise"), (BoundsCheckMode.NONE, "off")):
        assert module_arguments({"bounds_check_mode": mode}, DataType.FP32, cached=False).bounds_check == ours
    ours = module_arguments({"optimizer": RowwiseAdagrad(lr=0.3), "cache_load_factor": 0.1,
                             "cache_config": CacheConfig(slots=64, policy="lookahead"), "backend": "torch"},
                            DataType.FP32, cached=True)
    assert ours.optimizer == RowwiseAdagrad(lr=0.3) and ours.cache.slots == 64 and ours.cache.policy == "lookahead"
    with pytest.raises(ValueError, match="policy='lookahead-admit' needs the lookahead window"):
        module_arguments({"cache_config": CacheConfig(policy="lookahead-admit")}, DataType.FP32, cached=True)
    assert ours.as_kwargs()["backend"] == "torch"
    assert module_arguments({"cache_load_factor": 0.1}, DataType.FP32, cached=True).cache.fraction == 0.1
    for params, message in (
            ({"momentum": 0.9}, "no counterpart"),
            ({"optimizer": RowwiseAdagrad(), "learning_rate": 0.1}, "carries its hyper-parameters"),
            ({"weight_decay_mode": WeightDecayMode.DECOUPLE, "weight_decay": 0.1}, "weight_decay_mode"),
            ({"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "weight_decay": 0.1}, "weight_decay"),
            ({"cache_precision": SparseType.FP16}, "caches rows in their weights precision"),
            ({"output_dtype": SparseType.FP16}, "returns fp32"),
            ({"weights_precision": SparseType.INT8}, "fp32, fp16 or bf16"),
            ({"optimizer": EmbOptimType.LARS_SGD}, "no tiered-tbe counterpart"),
            ({"cache_config": "big"}, "CacheConfig")):
        with pytest.raises(ValueError, match=message):
            module_arguments(params, DataType.FP32, cached=True)


def test_the_sharder_refuses_kernels_and_sharding_types_it_does_not_run():
    from torchrec.distributed.types import ParameterSharding

    from tiered_tbe.torchrec import TieredEmbeddingBagCollectionSharder

    sharder = TieredEmbeddingBagCollectionSharder()
    assert sharder.sharding_types("cpu") == ["table_wise", "row_wise", "column_wise", "table_row_wise"]
    assert sharder.compute_kernels("row_wise", "cpu") == ["fused", "fused_uvm", "fused_uvm_caching"]
    for sharding_type, kernel, message in (("table_wise", "dense", "compute kernel 'dense'"),
                                           ("data_parallel", "fused", "sharding type 'data_parallel'")):
        with pytest.raises(ValueError, match=message):
            sharder.shard(None, {"t0": ParameterSharding(sharding_type=sharding_type, compute_kernel=kernel,
                                                         ranks=[0])}, env=None)
