"""bench_slow_links.py at its smallest: every run made, DiLoCo crossing the slow link less than HSDP does, and
1-bit Adam's compressed steps less still (full run: docs/fault_tolerance.md, "Slow links")."""

from __future__ import annotations

import json
import math

import pytest

from tests.helpers import run_benchmark

pytest.importorskip("torchft")


@pytest.mark.multirank
def test_bench_slow_links_smoke(tmp_path):
    out = tmp_path / "slow_links.json"
    args = ("--steps", "8", "--h", "2", "4", "--d-model", "32", "--seq-len", "16", "--out", str(out))
    run = run_benchmark("bench_slow_links.py", *args, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert {"benchmark", "link", "runs", "median", "over_hsdp", "goals"} <= set(report)
    assert report["link"]["throttle"].startswith("simulated")
    median = report["median"]
    assert set(median) == {"hsdp", "diloco_2", "diloco_4", "streaming", "onebit_adam"}
    for name, row in median.items():
        assert row["measured_step_s"] > 0 and math.isfinite(row["final_loss"]), (name, row)
        assert row["throttled_step_s"] > row["measured_step_s"], (name, row)
    hsdp = median["hsdp"]["cross_group_bytes_per_step"]
    # Whole DiLoCo sends the model's weight change once per H steps: HSDP's gradient bytes / H, exactly.
    for h in (2, 4):
        assert median[f"diloco_{h}"]["outer_steps"] == 8 // h
        assert median[f"diloco_{h}"]["cross_group_bytes_per_step"] == pytest.approx(hsdp / h)
    assert median["streaming"]["cross_group_bytes_per_step"] < hsdp
    assert median["onebit_adam"]["cross_group_bytes_per_step_after_warmup"] < hsdp / 8
    assert set(report["over_hsdp"]["onebit_adam"]) >= {"bytes_over_hsdp", "loss_over_hsdp"}
