"""Small versions of the benchmarks that are too big for the suite (their full runs: docs/)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


@pytest.mark.multirank
def test_stress_exit_smoke(tmp_path):
    out = tmp_path / "stress.json"
    run = _run("stress_exit.py", "--runs", "1", "--engines", "fsdp", "--stages", "3", "--out", str(out))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["jobs"] == 1 and report["failures"] == 0 and report["exit_codes"] == {"0": 1}


@pytest.mark.multirank
def test_bench_big_init_smoke(tmp_path):
    out = tmp_path / "big_init.json"
    run = _run("bench_big_init.py", "--layers", "2", "--d-model", "128", "--out", str(out))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["memory"].startswith("RssAnon")
    for mode in ("empty", "file", "full"):
        median = report[mode]["median"]
        for key in ("setup_anon", "setup_total", "step_anon", "step_total"):
            assert median[f"rank0_{key}_bytes"] > 0 and median[f"rank1_{key}_x_params"] > 0
