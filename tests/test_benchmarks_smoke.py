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
