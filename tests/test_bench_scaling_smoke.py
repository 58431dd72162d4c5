"""bench_scaling.py --smoke: stage 3 halves the per-rank state at two ranks, the measured bytes follow the ZeRO
formula, activations grow with the model (full run: docs/scaling.md)."""

from __future__ import annotations

import json

import pytest

from tests.helpers import run_benchmark

#: Measured total vs the ZeRO formula. The smoke run's stages (0 and 3) on the FSDP engine hold exactly
#: what the formula counts, and the demo GPT's dimensions divide by two ranks, so FSDP2 adds no padding;
#: the slack only covers a shard rounded up.
FORMULA_TOLERANCE = 0.02


@pytest.mark.multirank
def test_bench_scaling_smoke(tmp_path):
    out = tmp_path / "scaling.json"
    # One sequence per rank (--smoke keeps the default 4): the model-state bytes checked below do not depend on
    # it, and the activations still grow with the model.
    args = ("--smoke", "--micro-batch", "1", "--out", str(out))
    run = run_benchmark("bench_scaling.py", *args, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert {"formula", "notes", "sizes", "points", "largest_params_for_budget"} <= set(report)
    assert "activations" in report["notes"]

    sizes = sorted(report["sizes"], key=lambda row: row["n_layers"])
    assert [row["n_layers"] for row in sizes] == [1, 2]
    assert sizes[0]["params"] < sizes[1]["params"]
    assert 0 < sizes[0]["activation_bytes"] < sizes[1]["activation_bytes"]

    points = {(p["n_layers"], p["world_size"], p["stage"]): p for p in report["points"]}
    assert set(points) == {(n, w, s) for n in (1, 2) for w in (1, 2) for s in (0, 3)}
    for (n_layers, _, stage), point in points.items():
        assert {"measured", "zero_formula", "planner", "engine_at_rest", "step_ms"} <= set(point)
        assert point["measured_over_formula"] == pytest.approx(1, abs=FORMULA_TOLERANCE)
        assert point["measured"]["total"] == pytest.approx(point["planner"]["total"], rel=FORMULA_TOLERANCE)
        assert point["step_ms"] > 0
        if stage == 3:
            one_rank = points[(n_layers, 1, 3)]["measured"]["total"]
            assert point["measured_total_per_rank"] == [point["measured"]["total"]] * point["world_size"]
            assert point["measured"]["total"] == pytest.approx(one_rank / point["world_size"], rel=0.10)
    # Stage 0 replicates everything: two ranks hold what one does.
    assert points[(2, 2, 0)]["measured"]["total"] == points[(2, 1, 0)]["measured"]["total"]


def test_bench_scaling_refuses_too_few_steps(tmp_path):
    run = run_benchmark("bench_scaling.py", "--steps", "2", "--out", str(tmp_path / "scaling.json"))
    assert run.returncode == 2
    assert "--steps 2: the first two steps are warm-up; use --steps 3 or more" in run.stderr
    assert not (tmp_path / "scaling.json").exists()
