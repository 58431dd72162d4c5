"""The dry run in one process: 1024-rank jobs of three layouts built rank by rank on torch's fake process group,
each rank's bytes against figures computed here from the model's shapes (shard factors, padding of uneven
shards), and the layouts that cannot be built refused before anything is.

The expected figures never read the built module: they follow from the demo GPT's layer shapes written out
below, the tensor-parallel plan's styles (colwise rows / rowwise columns split ``tp`` ways, norms and embeddings
whole), the pipeline's even cut of the blocks (the first stage keeps the embeddings, the last the final norm and
its copy of the tied head), and FSDP2's dim-0 sharding: ``ceil(rows / ranks)`` rows on every rank (the last ones
padding), while the optimizer's state covers only a rank's real rows.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

import pytest
import torch.distributed as dist

from lightning_shard import cli
from lightning_shard.core import transform
from lightning_shard.dryrun import RankReport, dryrun

GPT = "lightning_shard.demos.gpt.GPT"
# Uneven on purpose: 250 tokens and 100 positions do not divide by the 16, 256 or 32 sharding ranks below.
VOCAB, SEQ = 250, 100
ADAM_STATES = 2  # exp_avg, exp_avg_sq; plus one float32 ``step`` per parameter tensor


def _block_shapes(d: int, experts: int = 0) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, how the tensor-parallel plan splits it) of one demo GPT block."""
    shapes = [
        ("ln1.weight", (d,), "whole"),
        ("ln1.bias", (d,), "whole"),
        ("attn.qkv.weight", (3 * d, d), "colwise"),
        ("attn.qkv.bias", (3 * d,), "colwise"),
        ("attn.proj.weight", (d, d), "rowwise"),
        ("attn.proj.bias", (d,), "whole"),
        ("ln2.weight", (d,), "whole"),
        ("ln2.bias", (d,), "whole"),
    ]
    if experts:
        hidden = 2 * d
        return shapes + [
            ("mlp.router.weight", (experts, d), "whole"),
            ("mlp.experts.gate_up_proj", (experts, 2 * hidden, d), "experts"),
            ("mlp.experts.down_proj", (experts, d, hidden), "experts"),
        ]
    return shapes + [
        ("mlp.0.weight", (4 * d, d), "colwise"),
        ("mlp.0.bias", (4 * d,), "colwise"),
        ("mlp.2.weight", (d, 4 * d), "rowwise"),
        ("mlp.2.bias", (d,), "whole"),
    ]


def _rows(rows: int, ranks: int, index: int) -> int:
    """Rows of ``rows`` that rank ``index`` of ``ranks`` really holds under dim-0 sharding (torch.chunk's)."""
    chunk = math.ceil(rows / ranks)
    return max(0, min(chunk, rows - index * chunk))


def expected_bytes(
    d: int,
    layers: int,
    place: dict[str, int],
    *,
    tp: int,
    pp: int,
    dp: int,
    dp_index: int,
    experts: int = 0,
    ep: int = 1,
) -> dict[str, int]:
    """param / grad / optimizer / checkpoint bytes of the rank at ``place`` (fp32 shards, AdamW)."""
    stage, stage_ranks = place["pp"], 1024 // pp
    tensors: list[tuple[tuple[int, ...], str]] = []
    per_stage = layers // pp
    for _ in range(per_stage):
        tensors += [(shape, how) for _, shape, how in _block_shapes(d, experts)]
    if stage == 0:
        tensors += [((VOCAB, d), "whole"), ((SEQ, d), "whole")]  # token and position embeddings
    if stage == pp - 1:
        tensors += [((d,), "whole"), ((d,), "whole")]  # final norm
        if pp > 1:
            tensors.append(((VOCAB, d), "whole"))  # the last stage's copy of the tied head
    edp, edp_index = dp // ep, place["edp"]
    padded = real = count = 0
    written = (
        0.0  # the checkpoint: each real chunk (weights and both states) shared among the ranks holding it
    )
    for shape, how in tensors:
        rows, rest = shape[0], math.prod(shape[1:])
        ranks, index = dp, dp_index
        if how == "colwise":
            rows //= tp
        elif how == "rowwise":
            rest //= tp
        elif how == "experts":
            rows, ranks, index = rows // ep, edp, edp_index
        padded += math.ceil(rows / ranks) * rest
        mine = _rows(rows, ranks, index) * rest
        real += mine
        count += 1
        # split tensors are held once per split; each expert-parallel rank's experts are its own
        holders = stage_ranks // ranks // {"colwise": tp, "rowwise": tp, "experts": ep}.get(how, 1)
        written += 4 * (1 + ADAM_STATES) * mine / holders + 4 / stage_ranks  # + the plain float32 ``step``
    if pp == 1:  # the state dict names the tied head apart from the embedding: its weights are written twice
        written += 4 * _rows(VOCAB, dp, dp_index) * d / (stage_ranks // dp)
    params = 4 * padded
    return {
        "param_bytes": params,
        "grad_bytes": params,
        "optimizer_bytes": 4 * (ADAM_STATES * real + count),
        "checkpoint_bytes": round(written),
    }


def _check(reports: list[RankReport], expect: Any) -> None:
    for report in reports:
        want = expect(report.coordinates)
        got = {k: getattr(report, k) for k in want}
        assert got == want, (report.rank, report.coordinates, got, want)
        # the planner's figures for the same place: the same bytes, padding included
        assert report.planner is not None
        planned = {k: report.planner[k] for k in ("parameters", "gradients", "optimizer")}
        held = {
            "parameters": want["param_bytes"],
            "gradients": want["grad_bytes"],
            "optimizer": want["optimizer_bytes"],
        }
        assert planned == held, (report.rank, report.coordinates, planned, held)


@pytest.fixture(scope="module")
def three_layouts() -> dict[str, Any]:
    """The three 1024-rank jobs, timed together."""
    start = time.perf_counter()
    dense = dryrun(
        GPT,
        dict(stage=3, tensor_parallel_size=4, pipeline_parallel_size=4, replicate_size=4),
        1024,
        init_args=dict(vocab_size=VOCAB, seq_len=SEQ, d_model=256, n_heads=8, n_layers=8),
    )
    moe = dryrun(
        GPT,
        dict(stage=3, expert_parallel_size=8, pipeline_parallel_size=4),
        1024,
        init_args=dict(vocab_size=VOCAB, seq_len=SEQ, d_model=64, n_heads=4, n_layers=4, n_experts=16),
    )
    cp = dryrun(
        GPT,
        dict(stage=3, context_parallel_size=8, tensor_parallel_size=4),
        1024,
        init_args=dict(vocab_size=VOCAB, seq_len=SEQ, d_model=128, n_heads=4, n_layers=2),
    )
    return {"dense": dense, "moe": moe, "cp": cp, "seconds": time.perf_counter() - start}


def test_three_1024_rank_layouts_build_in_under_a_minute(three_layouts):
    assert three_layouts["seconds"] < 60, three_layouts["seconds"]
    assert not dist.is_initialized()  # every rank's fake group torn down


def test_dense_tp_pp_hsdp_bytes_per_rank(three_layouts):
    reports = three_layouts["dense"]
    # first, last, and one rank per stage
    assert [r.rank for r in reports] == [0, 256, 512, 768, 1023]
    assert [r.pipeline_stages for r in reports] == [(0,), (1,), (2,), (3,), (3,)]
    assert [r.layers for r in reports] == [(0, 1), (2, 3), (4, 5), (6, 7), (6, 7)]
    assert reports[-1].coordinates == {
        "pp": 3,
        "replicate": 3,
        "shard": 15,
        "cp": 0,
        "tp": 3,
        "edp": 15,
        "ep": 0,
    }
    _check(
        reports,
        lambda at: expected_bytes(256, 8, at, tp=4, pp=4, dp=16, dp_index=at["shard"]),
    )
    # The padding counts: 250 token rows over 16 ranks allocate 16 rows each (not 250 / 16).
    first = reports[0]
    assert first.param_bytes > 4 * (256 * 250 / 16 + 100 * 256 / 16)


def test_dense_collectives_of_one_step_from_the_shards(three_layouts):
    # bf16-mixed: gathered in bf16 (2 bytes), reduced in fp32 (4); 16 shard ranks, 4 replicas. Each block is a
    # unit resharded after forward (gathered twice); the stage's root unit (embeddings, final norm, head) once.
    for report in three_layouts["dense"]:
        at = report.coordinates
        elements = expected_bytes(256, 8, at, tp=4, pp=4, dp=16, dp_index=at["shard"])["param_bytes"] // 4
        middle = {**at, "pp": 1}  # a middle stage holds its blocks only
        blocks = expected_bytes(256, 8, middle, tp=4, pp=4, dp=16, dp_index=at["shard"])["param_bytes"] // 4
        assert report.collective_bytes == {
            "all_gather": (2 * blocks + (elements - blocks)) * 16 * 2,
            "reduce_scatter": elements * 16 * 4,
            "all_reduce": elements * 4,
        }, report.rank


def test_moe_ep_pp_bytes_and_experts_per_rank(three_layouts):
    reports = three_layouts["moe"]
    by_rank = {r.rank: r for r in reports}
    assert sorted(by_rank) == [
        0,
        1,
        2,
        3,
        4,
        5,
        6,
        7,
        256,
        512,
        768,
        1023,
    ]  # one per expert block, one per stage
    assert [by_rank[r].experts for r in range(8)] == [(2 * e, 2 * e + 1) for e in range(8)]
    assert by_rank[1023].experts == (14, 15) and by_rank[1023].coordinates["edp"] == 31
    _check(
        reports,
        lambda at: expected_bytes(64, 4, at, tp=1, pp=4, dp=256, dp_index=at["shard"], experts=16, ep=8),
    )
    # 2 experts per block sharded over 32 ranks: every rank allocates one expert's rows, 30 of 32 only padding.
    assert by_rank[1023].optimizer_bytes < by_rank[0].optimizer_bytes


def test_cp_tp_bytes_per_rank(three_layouts):
    reports = three_layouts["cp"]
    assert [r.rank for r in reports] == [0, 1023]
    assert reports[-1].coordinates["cp"] == 7 and reports[-1].coordinates["tp"] == 3
    # context-parallel ranks shard with the rest: FSDP2 runs over shard x cp = 256 ranks
    _check(
        reports,
        lambda at: expected_bytes(128, 2, at, tp=4, pp=1, dp=256, dp_index=at["shard"] * 8 + at["cp"]),
    )


def test_checkpoint_files_of_a_rank(three_layouts):
    first, last = three_layouts["cp"]
    assert first.checkpoint_files == ("__0_0.distcp", ".metadata")
    assert last.checkpoint_files == ("__1023_0.distcp",)
    # rank 1023 holds no real rows of the uneven tensors (only padding), rank 0 one of each
    assert first.checkpoint_bytes > last.checkpoint_bytes


def test_reports_carry_the_planners_figures(three_layouts):
    report = three_layouts["dense"][1]
    assert report.planner is not None and set(report.planner) == {
        "parameters",
        "gradients",
        "optimizer",
        "host",
    }
    record = report.to_dict()
    assert record["planner_difference_pct"]["model_state"] == report.difference("model_state")
    json.dumps(record)


# --- refusals, before anything is built --------------------------------------------------------------------


@pytest.fixture
def nothing_built(monkeypatch):
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("prepare() ran: the layout should have been refused before")

    monkeypatch.setattr(transform, "prepare", refuse)
    yield
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    "init_args, flags, message",
    [
        (
            dict(d_model=192, n_heads=6),
            dict(tensor_parallel_size=4),
            r"tensor_parallel_size=4\) does not divide the model's 6 attention heads .* \(1, 2; nearest: 2\)",
        ),
        (
            dict(n_experts=12),
            dict(expert_parallel_size=8),
            r"expert_parallel_size=8\) does not divide the model's 12 experts .* \(1, 2, 4; nearest: 4\)",
        ),
        (
            dict(n_layers=4),
            dict(pipeline_parallel_size=8),
            r"pipeline_parallel_size=8\) cuts the model into 8 stages .* only 4 blocks .* \(1, 2, 4; nearest: 4\)",
        ),
        (
            dict(),
            dict(tensor_parallel_size=3),
            r"tensor_parallel_size=3\) does not divide the world size 1024",
        ),
        (dict(), dict(replicate_size=3), r"replicate_size=3\) does not divide the 1024 data-parallel ranks"),
    ],
)
def test_a_layout_that_cannot_be_built_is_refused_first(nothing_built, init_args, flags, message):
    with pytest.raises(ValueError, match=message):
        dryrun(GPT, dict(stage=3, **flags), 1024, init_args=init_args)


def test_key_value_heads_are_checked_too(nothing_built):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
    )
    with pytest.raises(ValueError, match=r"does not divide the model's 2 key-value heads .*nearest: 2\)"):
        dryrun(config, dict(stage=3, tensor_parallel_size=4), 64)


def test_other_refusals(nothing_built):
    with pytest.raises(ValueError, match=r"needs the ZeRO stage the job runs"):
        dryrun(GPT, dict(stage="auto"), 8)
    with pytest.raises(ValueError, match=r"ranks outside the world of 8: \[8\]"):
        dryrun(GPT, dict(stage=3), 8, ranks=[0, 8])
    with pytest.raises(ValueError, match=r"engine='deepspeed'\) cannot be dry-run"):
        dryrun(GPT, dict(stage=2, engine="deepspeed", offload_optimizer="cpu"), 8)
    with pytest.raises(TypeError, match=r"is not a strategy"):
        dryrun(GPT, 3, 8)
    with pytest.raises(TypeError, match=r"is not a model"):
        dryrun(42, dict(stage=3), 8)


# --- the command line ----------------------------------------------------------------------------------------


def test_cli_dryrun_json_and_table(capsys):
    argv = ["dryrun", "--model", GPT, "--model.n_layers", "4", "--world-size", "64", "--gpu-mem", "80GB"]
    argv += ["--stage", "3", "--pipeline-parallel-size", "2", "--ranks", "0,63"]
    assert cli.main([*argv, "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["strategy"] == "ShardStrategy(stage=3, pipeline_parallel_size=2)"
    assert [r["rank"] for r in document["ranks"]] == [0, 63]
    assert [r["pipeline_stages"] for r in document["ranks"]] == [[0], [1]]
    assert cli.main(argv) == 0
    table = capsys.readouterr().out
    assert "rank" in table and "model state" in table and "%)" in table


def test_cli_dryrun_refusal_is_one_line(capsys):
    argv = ["dryrun", "--model", GPT, "--model.n_heads", "4", "--world-size", "64", "--gpu-mem", "80GB"]
    assert cli.main([*argv, "--stage", "3", "--tensor-parallel-size", "8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "lightning-shard dryrun: error: ShardStrategy(tensor_parallel_size=8) does not divide"
    )


def test_plan_verify_dry_runs_the_recommendation(capsys):
    argv = ["plan", "--model", GPT, "--model.n_layers", "2", "--gpus", "8", "--gpu-mem", "1GB", "--verify"]
    assert cli.main([*argv, "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["dryrun"]["strategy"] == document["recommended"]["strategy"]
    assert document["dryrun"]["ranks"][0]["rank"] == 0
