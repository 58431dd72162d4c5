"""The dry-run benchmark's smoke mode (Llama-3 8B's published config at the planner's recommendation for 64
ranks, the first and last rank): its report has every field, each rank's model state beside the planner's.
Full run: docs/dryrun.md."""

from __future__ import annotations

import json

import pytest

from tests.helpers import run_benchmark


def test_bench_dryrun_smoke(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "dryrun.json"
    run = run_benchmark("bench_dryrun.py", "--smoke", "--out", str(out))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    (row,) = report["rows"]
    assert (
        row["model"] == "llama-3-8b"
        and row["world_size"] == 64
        and row["strategy"].startswith("ShardStrategy(")
    )
    assert [r["rank"] for r in row["ranks"]] == [0, 63]
    for rank in row["ranks"]:
        assert (
            rank["model_state_bytes"]
            == rank["param_bytes"] + rank["grad_bytes"] + rank["optimizer_bytes"]
            > 0
        )
        assert rank["planner_model_state_bytes"] > 0 and rank["build_seconds"] > 0
    assert "| llama-3-8b | 64 |" in run.stdout
