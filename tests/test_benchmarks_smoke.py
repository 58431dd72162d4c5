"""Small versions of the benchmarks that are too big for the suite (their full runs: docs/)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import run_benchmark

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.multirank
def test_stress_exit_smoke(tmp_path):
    out = tmp_path / "stress.json"
    run = run_benchmark(
        "stress_exit.py", "--runs", "1", "--engines", "fsdp", "--stages", "3", "--out", str(out)
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["jobs"] == 1 and report["failures"] == 0 and report["exit_codes"] == {"0": 1}


@pytest.mark.multirank
def test_bench_big_init_smoke(tmp_path):
    out = tmp_path / "big_init.json"
    run = run_benchmark("bench_big_init.py", "--layers", "2", "--d-model", "128", "--out", str(out))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["memory"].startswith("RssAnon")
    for mode in ("empty", "file", "full"):
        median = report[mode]["median"]
        for key in ("setup_anon", "setup_total", "step_anon", "step_total"):
            assert median[f"rank0_{key}_bytes"] > 0 and median[f"rank1_{key}_x_params"] > 0


@pytest.mark.multirank
def test_bench_pipeline_smoke(tmp_path):
    """Activation memory of torch's schedules, exactly: GPipe holds every micro-batch, 1F1B at most p + 1 on the
    first stage (a forward runs before each backward in its steady state) and one on the last."""
    out = tmp_path / "pipeline.json"
    args = ("--stages", "2", "--microbatches", "4", "--steps", "1", "--width", "64", "--out", str(out))
    run = run_benchmark("bench_pipeline.py", *args)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert results["gpipe/m=4"]["peak_activation_microbatches_per_rank"] == [4.0, 4.0]
    first, last = results["1f1b/m=4"]["peak_activation_microbatches_per_rank"]
    assert first <= 3 and last == 1.0
    for row in results.values():
        # The measured bubble is a timing (it reads below 0 when other jobs load the machine); the formula is exact.
        assert -1 < row["measured_bubble_median_over_ranks"] < 1 and row["formula_bubble"] == 0.2


@pytest.mark.multirank
def test_bench_compile_smoke(tmp_path):
    out = tmp_path / "compile.json"
    # Selective activation checkpointing with compile: tests/test_compile.py (the smoke runs the bench's path).
    args = (
        "--rounds",
        "1",
        "--steps",
        "3",
        "--stages",
        "3",
        "--ac",
        "none",
        "--layers",
        "2",
        "--d-model",
        "64",
    )
    run = run_benchmark("bench_compile.py", *args, "--out", str(out))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["compiled_over_eager"]) == {"stage3"}
    assert all(ratio > 0 for ratio in report["compiled_over_eager"].values())
    assert set(report["recompiles"].values()) == {0}


@pytest.mark.multirank
def test_bench_compression_smoke(tmp_path):
    """Bytes are counted: fp16 halves them; PowerSGD sends a small fraction. --steps 4, the fewest the script
    takes: PowerSGD's 2 warm-up steps of plain all-reduce, its first compressed step left out, one step counted."""
    out = tmp_path / "compression.json"
    run = run_benchmark("bench_compression.py", "--rounds", "1", "--steps", "4", "--out", str(out))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    ratio = json.loads(out.read_text())["bytes_over_uncompressed"]
    assert ratio["none"] == 1.0 and ratio["fp16"] == pytest.approx(0.5, rel=1e-3)
    assert 0 < ratio["powersgd_rank1"] < ratio["powersgd_rank4"] < 0.5


def test_bench_activation_checkpointing_smoke(tmp_path):
    out = tmp_path / "ac.json"
    run = run_benchmark(
        "bench_activation_checkpointing.py",
        *("--n-layers", "2", "--d-model", "32", "--seq-len", "64", "--batch-size", "2", "--rounds", "1"),
        *("--policies", "none", "selective", "selective_all_matmuls", "full", "--out", str(out)),
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    mb = {name: results[name]["activation_bytes"] for name in results}
    # The default selective policy stores less than keeping every matmul output, more than full recompute.
    assert mb["full"] < mb["selective"] < mb["selective_all_matmuls"] < mb["none"]
    assert results["selective"]["recompute_flops"] > 0 == results["selective_all_matmuls"]["recompute_flops"]
    assert all(results[name]["step_time_vs_none"] > 0 for name in results)


@pytest.mark.multirank
def test_bench_engines_smoke(tmp_path):
    # One stage row's FSDP side (a DeepSpeed stage run costs its engine's start-up; the ratios are the full runs',
    # docs/benchmarks.md) and the 2-rank tensor-parallel row's both sides, in the one pair of processes.
    out = tmp_path / "engines.json"
    only = ("fsdp_stage2", "fsdp_tp2", "deepspeed_tp2")
    run = run_benchmark("bench_engines.py", "--smoke", "--only", *only, "--profile", "--out", str(out))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["median_step_ms"]) == set(only) and min(report["median_step_ms"].values()) > 0
    assert set(report["fsdp_over_deepspeed"]) == {"tp2"} and report["fsdp_over_deepspeed"]["tp2"] > 0
    # A chrome trace, and the ops behind the step in the JSON.
    assert json.loads((tmp_path / "traces" / "fsdp_stage2.json").read_text())["traceEvents"]
    ops = report["profiles"]["fsdp_stage2"]
    assert ops[0]["self_cpu_ms_per_step"] > 0
    # Every layout row names what its refusing side would have run and why; the 4-rank rows were not run.
    layouts = report["layouts"]
    assert layouts["tp2"]["deepspeed"]["median_step_ms"] > 0
    assert layouts["tp2_dp2"]["fsdp"]["median_step_ms"] is None
    assert "ZeroRedundancyOptimizer does not take tensor-parallel" in layouts["tp2"]["refused"]["message"]
    hsdp = layouts["hsdp"]["refused"]
    assert hsdp["flags"]["replicate_size"] == 2 and hsdp["reason"] in hsdp["message"]
    assert hsdp["reason"].startswith("DeepSpeed removed MiCS")


@pytest.mark.multirank
def test_bench_collectives_smoke(tmp_path):
    out = tmp_path / "collectives.json"
    run = run_benchmark("bench_collectives.py", "--smoke", "--out", str(out))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    ms = report["median_ms"]["1"]
    assert len(ms) == 7 and all(t > 0 for t in ms.values())
    assert set(report["shm_over_gloo"]["1"]) == {
        "all_gather",
        "reduce_scatter_vs_all_to_all",
        "reduce_scatter_vs_gloo",
        "all_reduce",
    }


@pytest.mark.multirank
def test_bench_async_checkpoint_smoke(tmp_path):
    out = tmp_path / "async.json"
    # One save per saving run, at step 2: the async one is written while step 3 trains.
    args = ("--depth", "1", "--steps", "3", "--every", "2", "--rounds", "1", "--out", str(out))
    run = run_benchmark("bench_async_checkpoint.py", *args)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["median_run_s"]) == {"none", "sync", "async"}
    assert report["median_write_cpu_s_per_save"]["async"] > 0
    assert report["async_saving_run_over_no_save_run"] > 0


def test_bench_gpu_mfu_smoke(tmp_path):
    """The GPU MFU benchmark at a toy size on CPU, compiled, with async saves: its PaLM FLOP count agrees
    with MFUMonitor's count of the ops the step ran, no block recompiles, the saves are timed, and the
    profiled steps' trace is written."""
    out = tmp_path / "gpu_mfu.json"
    args = ("--device", "cpu", "--layers", "2", "--d-model", "64", "--heads", "2", "--seq", "32")
    args += ("--vocab", "128", "--batch", "2", "--steps", "4", "--warmup", "2", "--profile-steps", "1")
    args += ("--modes", "compiled", "--saves", "async", "--save-every", "2", "--save-dir", str(tmp_path))
    run = run_benchmark("bench_gpu_mfu.py", *args, "--out", str(out))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())["results"]["compiled+async_save"]
    assert len(result["blocked_s_per_save"]) == 2 and result["checkpoint_gb"] > 0 and result["run_s"] > 0
    assert result["recompiles"] == 0 and result["dynamo_graphs"] >= 1  # compiled, also under MFUMonitor
    assert len(result["step_ms"]) == 5 and result["step_ms_median"] > 0
    assert result["counted_tflops_per_step"] == pytest.approx(result["palm_tflops_per_step"], rel=0.05)
    assert (tmp_path / result["trace"]).stat().st_size > 0 and result["profile"]["wall_ms_per_step"] > 0


@pytest.mark.multirank
def test_bench_cp_smoke(tmp_path):
    """Context parallelism cuts activations: at cp=2 each rank keeps about half of one process's (Ulysses keeps
    no more than its T / 2 tokens' share; all-gather adds the group's keys and values and one mask)."""
    out = tmp_path / "cp.json"
    args = ("--seq-lens", "512", "--cp", "1", "2", "--steps", "1", "--budget", "4MiB", "--out", str(out))
    run = run_benchmark("bench_cp.py", *args)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"cp1", "cp2/allgather", "cp2/ulysses"}
    for rows in report["results"].values():
        row = rows["512"]
        assert row["step_s_median"] > 0 and row["planned_activation_bytes"] > 0
        assert 0.5 < row["measured_over_planned"] < 1.5
    ulysses, allgather = report["results"]["cp2/ulysses"]["512"], report["results"]["cp2/allgather"]["512"]
    assert ulysses["one_over_c"] == 0.5 and 0.45 < ulysses["ratio_to_cp1"] < 0.6
    assert ulysses["peak_activation_bytes_per_rank"][0] == ulysses["peak_activation_bytes_per_rank"][1]
    assert 0.5 < allgather["ratio_to_cp1"] < 0.8
    assert report["longest_sequence_in_budget"]["cp2/ulysses"] == {"measured": 512, "planned": 512}
    assert report["longest_sequence_in_budget"]["cp1"]["measured"] is None


def test_bench_tiling_smoke(tmp_path):
    """The tiled MLP and loss keep less than half the activation bytes at 512 tokens (the MLP's hidden units
    and the logits are cut into tiles), so a longer sequence fits the same budget."""
    out = tmp_path / "tiling.json"
    args = ["--seq-lens", "256", "512", "--vocab", "2048", "--loss-tile", "128", "--steps", "1"]
    args += ["--budget", "20MiB", "--out", str(out)]
    run = run_benchmark("bench_tiling.py", *args)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["results"]["tiled"]["512"]["memory_ratio_to_untiled"] < 0.55
    assert report["longest_sequence_in_budget"] == {"untiled": 256, "tiled": 512}
