"""The layouts benchmark's smoke mode (a tiny GPT) on 2 ranks: its report has every field, and the bytes targets
hold (they are deterministic; step times are only checked to exist). Full run: docs/benchmarks.md.

One world size: the script runs the same code for every one (4 ranks only changes the mesh sizes, and costs
twice the 2-rank run on a small machine); the 4-rank meshes themselves (tp2 x shard2, HSDP 2 x 2) are trained
and checked in tests/test_parallel_multirank.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import run_benchmark

ROOT = Path(__file__).resolve().parents[1]

LAYOUTS = ("fsdp", "hsdp", "tp_sp", "tp")
MESHES = {
    2: {"fsdp": (1, 2, 1), "hsdp": (2, 1, 1), "tp_sp": (1, 1, 2), "tp": (1, 1, 2)},
}


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    """One smoke run of the benchmark over the world sizes of ``MESHES``: its stdout and its report."""
    out = tmp_path_factory.mktemp("layouts") / "layouts.json"
    worlds = [str(w) for w in MESHES]
    run = run_benchmark("bench_layouts.py", "--smoke", "--world-sizes", *worlds, "--out", str(out))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout, json.loads(out.read_text())


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", list(MESHES))
def test_bench_layouts_smoke(smoke_run, world_size):
    stdout, report = smoke_run
    # This world's table, from its header to the next one's.
    table = stdout.split(f"\n== {world_size} ranks, ", 1)[1].split("\n== ", 1)[0]
    assert "PASS  sp_block_activation_reduction" in table
    assert report["smoke"] is True and report["all_targets_pass"] is True
    world = report["worlds"][str(world_size)]
    assert world["reference"] == "hsdp" and set(world["layouts"]) == set(LAYOUTS)

    for name, entry in world["layouts"].items():
        mesh = entry["mesh"]
        assert (mesh["replicate"], mesh["shard"], mesh["tp"]) == MESHES[world_size][name], name
        assert entry["sequence_parallel"] is (name == "tp_sp")
        assert entry["split_modules"] == 4 * report["model"]["n_layers"]  # qkv, proj, mlp.0, mlp.2
        for kind in ("parameters", "gradients", "optimizer"):
            per_rank = entry["split_layers"][kind]
            assert len(per_rank) == world_size and min(per_rank) > 0, (name, kind)
        assert len(entry["state_bytes"]) == world_size
        for state in entry["state_bytes"]:
            assert state["total"] == sum(
                sum(state[k].values()) for k in ("parameters", "gradients", "optimizer")
            )
            assert state["total"] > 0
        for kind in ("saved", "allocated_profiler"):
            assert len(entry["block_activation_bytes"][kind]) == world_size
        assert min(entry["block_activation_bytes"]["saved"]) > 0
        assert entry["median_step_ms"] > 0 and entry["tokens_per_s"] > 0

    # Parameters sharded over the same number of ranks (the shard size): tensor parallelism halves the
    # split layers (their row-split biases stay whole, hence not exactly 0.5).
    for name in ("tp_sp", "tp"):
        ratios = world["ratios_vs_reference"][name]
        for kind in ("split_parameters", "split_optimizer", "split_gradients"):
            assert all(0.475 <= r <= 0.525 for r in ratios[kind]), (name, kind, ratios[kind])
    # FSDP over every rank shards the split layers as finely as T=2 x the reference's shard size.
    layouts = world["layouts"]
    assert layouts["fsdp"]["split_layers"]["parameters"][0] == pytest.approx(
        layouts["hsdp"]["split_layers"]["parameters"][0] / 2, rel=0.01
    )
    # Data parallelism does not change a rank's activations; sequence parallelism cuts them the most.
    saved = {name: max(layouts[name]["block_activation_bytes"]["saved"]) for name in LAYOUTS}
    assert saved["fsdp"] == saved["hsdp"]
    assert saved["tp_sp"] < saved["tp"] < saved["hsdp"]

    targets = world["targets"]
    assert set(targets) == {
        "tp2_halves_split_parameters",
        "tp2_halves_split_optimizer",
        "sp_block_activation_reduction",
    }
    assert all(t["pass"] for t in targets.values()), targets
    assert targets["sp_block_activation_reduction"]["value"] >= 0.35
    assert (
        0
        < world["tp_without_sp_block_activation_reduction"]
        < targets["sp_block_activation_reduction"]["value"]
    )
