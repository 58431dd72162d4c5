"""A small run of benchmarks/bench_export.py (its full run: docs/export.md)."""

from __future__ import annotations

import json

import pytest

from tests.helpers import run_benchmark

pytest.importorskip("transformers", reason="export needs pip install 'lightning-shard[hf]'")


@pytest.mark.multirank
def test_bench_export_smoke(tmp_path):
    out = tmp_path / "export.json"
    args = (
        "--layers",
        "2",
        "--d-model",
        "64",
        "--vocab",
        "512",
        "--max-shard-size",
        "50KB",
        "--repeats",
        "1",
    )
    run = run_benchmark("bench_export.py", *args, "--out", str(out))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["files"] > 2 and 0 < report["largest_file_bytes"] < report["model_bytes"]
    for mode, workers in (("full", 1), ("export_1", 1), ("export_2", 2)):
        median = report[mode]["median"]
        assert median["seconds"] > 0
        assert all(f"worker{i}_peak_growth_bytes" in median for i in range(workers))
    assert sum(w["files"] for w in report["export_2"]["runs"][0]["workers"]) == report["files"]
