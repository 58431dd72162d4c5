"""bench_matrix_optim.py --smoke (2 blocks of two 64 x 256 matrices, 2 ranks): the bytes it reports are the ones
the whole-matrix step moves and holds, exactly (step times are only checked to exist). Full run:
docs/benchmarks.md."""

from __future__ import annotations

import json

import pytest

from tests.helpers import run_benchmark


@pytest.mark.multirank
def test_bench_matrix_optim_smoke(tmp_path):
    out = tmp_path / "matrix_optim.json"
    run = run_benchmark("bench_matrix_optim.py", "--smoke", "--out", str(out), timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["smoke"] is True and set(report["results"]) == {"2"}
    results = report["results"]["2"]
    d, matrices = report["model"]["d_model"], report["model"]["matrices"]
    params = matrices * 4 * d * d * 4  # fp32 bytes of every matrix
    zero, three = results["stage0"], results["stage3"]
    assert zero["median_optimizer_ms"] > 0 and three["median_optimizer_ms"] > 0
    # Stage 0: every rank holds every momentum and moves nothing in the optimizer step.
    assert zero["state_bytes"] == [params, params]
    assert zero["bytes_per_step"] == [{"gathered": 0, "broadcast": 0}] * 2
    # Stage 3: each matrix's momentum on its owner only, the owners spread over the ranks; every matrix and its
    # gradient gathered whole on every rank of the group, and the update broadcast back.
    assert sum(three["state_bytes"]) == params and sum(three["matrices_owned"]) == matrices
    assert max(three["state_bytes"]) <= results["goals"]["state_per_rank_bound_bytes"]
    assert three["bytes_per_step"] == [{"gathered": 2 * params, "broadcast": params}] * 2
