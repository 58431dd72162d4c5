"""A dry run's traced step: one forward, backward and optimizer step of a rank's real shards on fake tensors.

A small GPT at ZeRO-3 on 8 fake ranks: the tracker's peak holds at least the model state the shards give, the
parameters, gradients and optimizer state it sees live are the shards' bytes, and the all-gathers and
reduce-scatters the fake group receives are the ones counted from the shards. Layouts whose step is not traced
say why in the notes and keep the rest of their report.
"""

from __future__ import annotations

import json

import pytest

from lightning_shard import cli
from lightning_shard.dryrun import RankReport, dryrun

GPT = "lightning_shard.demos.gpt.GPT"
TINY = {"vocab_size": 250, "seq_len": 64, "d_model": 64, "n_layers": 2, "n_heads": 4}


def _run(ranks: list[int] | None = None, experts: int = 0, **flags: object) -> list[RankReport]:
    init_args = {**TINY, "n_experts": experts}
    return dryrun(
        GPT, {"stage": 3, **flags}, 8, ranks or [0], init_args=init_args, trace_step=True, micro_batch=2
    )


@pytest.fixture(scope="module")
def zero3() -> list[RankReport]:
    return _run([0, 7])


def test_traced_peak_holds_the_model_state(zero3):
    for report in zero3:
        assert report.notes == ()
        assert report.peak_bytes is not None and report.peak_bytes > 0
        assert report.peak_bytes >= report.model_state_bytes
        assert report.peak_breakdown["activation"] > 0
        assert report.peak_bytes >= sum(report.peak_breakdown.values())


def test_traced_model_state_is_the_shards(zero3):
    first, last = zero3
    assert first.traced_state_bytes == {
        "parameters": first.param_bytes,
        "gradients": first.grad_bytes,
        "optimizer": first.optimizer_bytes,
    }
    # the last rank of uneven shards (250 tokens over 8 ranks): the tracker sees the gradients' padded buffers,
    # but leaves out the parameters whose shard is a narrowed view of FSDP2's padded buffer (docs/dryrun.md)
    assert last.traced_state_bytes["gradients"] == last.grad_bytes
    assert last.traced_state_bytes["optimizer"] == last.optimizer_bytes
    assert 0 < last.traced_state_bytes["parameters"] < last.param_bytes


def test_traced_collectives_are_the_shards(zero3):
    for report in zero3:
        traced, counted = report.traced_collective_bytes, report.collective_bytes
        assert traced["all_gather"] == counted["all_gather"] > 0
        assert traced["reduce_scatter"] == counted["reduce_scatter"] > 0
        assert traced.get("all_reduce", 0) == counted["all_reduce"] == 0


def test_planners_step_figures_beside_the_peak(zero3):
    report = zero3[0]
    assert report.planner is not None
    assert report.planner["activations"] > 0 and report.planner["buffers"] > 0
    # the step's figures stay out of the model state's comparison
    assert report.difference("model_state") == pytest.approx(
        100.0
        * (sum(report.planner[k] for k in ("parameters", "gradients", "optimizer", "host")))
        / report.model_state_bytes
        - 100.0
    )


def test_tensor_parallel_step_adds_the_activations_traffic():
    (report,) = _run(tensor_parallel_size=2)
    assert report.notes == ()
    assert report.traced_state_bytes["parameters"] == report.param_bytes
    traced, counted = report.traced_collective_bytes, report.collective_bytes
    assert traced["all_gather"] > counted["all_gather"]  # the sequence-parallel gathers of activations
    assert traced["all_reduce"] > 0


@pytest.mark.parametrize(
    ("flags", "note"),
    [
        ({"pipeline_parallel_size": 2}, "not traced with pipeline stages"),
        ({"stage": 0}, "the set-up on fake tensors failed"),
        ({"experts": 4, "expert_parallel_size": 2}, "aten.bincount"),  # data-dependent routing
    ],
)
def test_untraced_layouts_say_why(flags, note):
    (report,) = _run(**flags)
    assert report.peak_bytes is None and report.traced_collective_bytes == {}
    assert any(note in n for n in report.notes)
    assert report.param_bytes > 0 and report.collective_bytes


def test_cli_trace_step(capsys):
    argv = [
        "dryrun",
        "--model",
        GPT,
        "--model.d_model",
        "64",
        "--model.n_layers",
        "2",
        "--model.seq_len",
        "64",
    ]
    argv += ["--world-size", "8", "--gpu-mem", "80GB", "--stage", "3", "--ranks", "0", "--trace-step"]
    assert cli.main([*argv, "--json"]) == 0
    (rank,) = json.loads(capsys.readouterr().out)["ranks"]
    assert rank["peak_bytes"] >= rank["model_state_bytes"]
    assert rank["traced_collective_bytes"]["reduce_scatter"] == rank["collective_bytes"]["reduce_scatter"]
    assert cli.main(argv) == 0
    assert "step peak" in capsys.readouterr().out


def test_stage_2_reduce_scatter_is_the_shards():
    # At stage 2 small blocks are packed into one unit (``fully_shard([block, block])``), whose modules share
    # one state: each unit's gradients are reduce-scattered once.
    (report,) = _run(stage=2)
    assert report.traced_collective_bytes["reduce_scatter"] == report.collective_bytes["reduce_scatter"]
