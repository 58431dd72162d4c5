"""bench_moe.py --smoke (MoE GPT 2 x 64, 8 experts, top-2, 4 ranks): the bytes it reports are the ones expert
parallelism moves, exactly (they are deterministic; step times are only checked to exist). Full run:
docs/benchmarks.md."""

from __future__ import annotations

import json
import statistics

import pytest

from tests.helpers import run_benchmark

WORLD, EXPERTS, FP32 = 4, 8, 4
EP = {"zero3": 1, "zero3_ep2": 2, "zero3_ep4": 4}


@pytest.mark.multirank
def test_bench_moe_smoke(tmp_path):
    out = tmp_path / "moe.json"
    run = run_benchmark("bench_moe.py", "--smoke", "--out", str(out), timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["smoke"] is True and report["timed_steps_per_run"] == 1
    results, model = report["results"], report["model"]
    assert set(results) == set(EP) and report["target"]["value"] == results["zero3_ep4"]["speedup_over_zero3"]
    d, layers = model["d_model"], model["n_layers"]
    # Each expert is a SwiGLU of hidden 2d: gate_up [4d, d] and down [d, 2d].
    expert_bytes = layers * EXPERTS * 6 * d * d * FP32
    # What one step's all-to-alls take in, summed over the ranks of a group: per layer the rows out and back in
    # forward and their gradients in backward (each rank's T k rows of width d, 4 passes), and the counts [E].
    rows = report["batch_size_per_rank"] * model["seq_len"] * model["top_k"]
    all_to_all_mean = layers * (4 * rows * d * FP32 + EXPERTS * 8)
    other = results["zero3"]["all_gather_bytes_per_step_by_kind"][0]["other"]
    assert other > 0

    for name, e in EP.items():
        r = results[name]
        assert r["median_step_ms"] > 0 and r["speedup_over_zero3"] > 0
        assert r["experts_per_rank"] == [EXPERTS // e] * WORLD
        # At rest ZeRO-3 keeps 1/4 of the expert weights per rank with or without expert parallelism...
        assert [p["experts"] for p in r["param_bytes"]] == [expert_bytes // WORLD] * WORLD
        assert all(0 < p["other"] < p["experts"] / 5 for p in r["param_bytes"])  # experts dominate
        # ...but a rank gathers and computes with E/e experts: 1/e of the expert weights.
        assert r["expert_block_bytes"] == [expert_bytes // e] * WORLD
        # The block is gathered in forward and again in backward, and its gradient reduce-scattered, unless
        # it is whole on its rank (e = world); the rest is gathered alike in every configuration.
        gathered = 0 if e == WORLD else 2 * expert_bytes // e
        reduced = 0 if e == WORLD else expert_bytes // e
        assert r["all_gather_counters_agree"] is True
        for rank in range(WORLD):
            assert r["all_gather_bytes_per_step_by_kind"][rank] == {"experts": gathered, "other": other}
            assert r["all_gather_bytes_per_step"][rank] == gathered + other
            assert r["reduce_scatter_bytes_per_step_by_kind"][rank]["experts"] == reduced
        # Tokens go by all-to-all only with expert parallelism, and cross ranks there.
        if e == 1:
            assert r["all_to_all_bytes_per_step"] == [0] * WORLD
            assert r["rows_from_other_ranks_last_step"] == [0] * WORLD
        else:
            assert statistics.mean(r["all_to_all_bytes_per_step"]) == pytest.approx(all_to_all_mean)
            for sent, crossed in zip(
                r["all_to_all_bytes_per_step"], r["all_to_all_crossed_bytes_per_step"], strict=True
            ):
                assert 0 < crossed < sent
            assert min(r["rows_from_other_ranks_last_step"]) > 0


def test_bench_moe_refuses_too_few_steps(tmp_path):
    run = run_benchmark("bench_moe.py", "--steps", "2", "--out", str(tmp_path / "moe.json"))
    assert run.returncode == 2
    assert "--steps 2: the first 2 steps are warm-up; use --steps 3 or more" in run.stderr
    assert not (tmp_path / "moe.json").exists()
