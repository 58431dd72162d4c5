"""The planner on mixtures of experts: the experts read off a model or estimated from a count, their bytes per
device under ``expert_parallel_size``, the all-to-all buffers, the search that recommends it, the CLI, and every
error path (one process, no process group)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from lightning_shard.cli import main
from lightning_shard.config import ShardConfig
from lightning_shard.demos import GPT
from lightning_shard.engines import configure
from lightning_shard.planner import choose_stage, plan, shape_from_module
from lightning_shard.planner.model import shape_from_params
from lightning_shard.units import PlanInputError

ROOT = Path(__file__).resolve().parents[1]
PLAIN = dict(offload_optimizer="none", offload_params="none", activation_checkpointing="none")


def _moe_gpt(n_experts: int = 8, **kwargs) -> GPT:
    with torch.device("meta"):
        return GPT(n_experts=n_experts, top_k=2, **{"d_model": 64, "n_layers": 2, **kwargs})


def _expert_count(model: torch.nn.Module) -> int:
    """The demo's expert weights, counted by name: the 3-D gate_up_proj / down_proj of every experts module."""
    return sum(p.numel() for name, p in model.named_parameters() if ".experts." in name and p.dim() == 3)


def _row(module: torch.nn.Module, stage: int, e: int, **kwargs):
    kwargs = {"world_size": 8, "device_memory": "100GB", "precision": "32-true", **PLAIN, **kwargs}
    row = plan(module=module, stage=stage, expert_parallel_size=e, **kwargs).recommended
    assert row is not None and row.config.stage == stage and row.config.expert_parallel_size == e
    return row


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(["plan", *argv])
    except SystemExit as exit_:
        code = exit_.code
    out = capsys.readouterr()
    return code, out.out, out.err


# --- the model's experts ---------------------------------------------------------------------------------


def test_the_demo_moe_gpt_is_read_as_the_strategy_splits_it():
    gpt = _moe_gpt()
    shape = shape_from_module(gpt)
    total = sum(p.numel() for p in gpt.parameters())
    experts = _expert_count(gpt)
    assert experts / total > 0.8  # the experts dominate
    assert (shape.experts, shape.top_k, shape.moe_layers, shape.expert_params) == (8, 2, 2, experts)
    # A token uses 2 of the 8 experts: 6 FLOPs per active parameter, plus attention's 12 L h T.
    assert shape.active_params == total - experts + experts * 2 // 8
    assert shape.flops_per_token(128) == 6 * shape.active_params + 12 * 2 * 64 * 128
    dense = shape_from_module(_moe_gpt(n_experts=0))
    assert (dense.experts, dense.top_k, dense.expert_params) == (0, 0, 0)
    assert dense.active_params == dense.params


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "olmoe", "deepseek_v3"])
def test_hugging_face_moe_models_are_read_from_their_ep_plan(family):
    pytest.importorskip("transformers")
    from tests.helpers import tiny_moe

    with torch.device("meta"):
        model = tiny_moe(family, experts=8, top_k=2)
    shape = shape_from_module(model)
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    assert (shape.experts, shape.top_k, shape.expert_params) == (8, 2, experts)
    # DeepSeek-V3 starts with a dense block: the unit the planner gathers is one with experts.
    assert shape.block_params >= experts // shape.moe_layers


def test_a_parameter_count_with_experts_is_a_gpt_whose_mlps_are_experts():
    shape = shape_from_params(47_000_000_000, experts=8, top_k=2)
    # (4 + 8 E) h^2 per block with h = 128 L: the numbers docs/planner.md gives.
    assert (shape.layers, shape.hidden, shape.experts, shape.top_k) == (35, 4416, 8, 2)
    assert 0.92 < shape.expert_params / shape.params < 0.94
    h, f = 4416, 4 * 4416
    assert shape.expert_params == 35 * 8 * (2 * h * f + f + h)
    assert shape.ffn == 2 * f  # activations: the token's two experts
    assert shape_from_params(7_000_000_000).layers == 33  # a dense count is inferred as before


# --- bytes per device ------------------------------------------------------------------------------------


@pytest.mark.parametrize("e", [1, 2, 4, 8])
def test_expert_bytes_per_device_divide_by_e_at_stages_0_1_and_by_all_ranks_at_stages_2_3(e):
    gpt = _moe_gpt()
    total, experts = sum(p.numel() for p in gpt.parameters()), _expert_count(gpt)
    held = total - experts + experts // e  # fp32, Adam: 4 bytes each, 8 of optimizer state
    steps = 4 * sum(1 for _ in gpt.parameters())  # Adam's float32 ``step``, one per tensor
    zero = _row(gpt, 0, e, micro_batch=None)
    assert zero.expert_parameters == experts * 4 // e
    assert (zero.parameters, zero.gradients, zero.optimizer) == (4 * held, 4 * held, 8 * held + steps)
    # Stage 1 holds the same E / e whole experts; each block's optimizer state is partitioned over the 8 / e
    # ranks holding it, the rest over all 8: about 1 / 8 of every parameter's state (whole tensors per rank, the
    # busiest rank's figure: tests/test_planner_shards.py counts them exactly).
    one = _row(gpt, 1, e, micro_batch=None)
    assert one.expert_parameters == experts * 4 // e
    assert (one.parameters, one.gradients) == (4 * held, 4 * held)
    largest = max(p.numel() for p in gpt.parameters())  # whole tensors: the busiest rank may hold one more
    assert total <= one.optimizer <= total + 8 * largest + steps
    for stage in (2, 3):  # each rank's E / e experts sharded over the 8 / e ranks left: 1 / 8 of them
        row = _row(gpt, stage, e, micro_batch=None)
        assert row.expert_parameters == experts * 4 // 8
        # the first rank's, padding included
        assert (row.parameters, row.gradients) == pytest.approx((total * 4 // 8, total * 4 // 8), rel=0.02)
        assert row.optimizer == pytest.approx(total, rel=0.02)


def test_stage_3_gathers_only_the_experts_a_device_holds():
    gpt = _moe_gpt(n_layers=6)  # enough blocks that two of them are less than the whole model
    per_block = _expert_count(gpt) // 6
    one, four = (_row(gpt, 3, e, micro_batch=None).buffers_detail for e in (1, 4))
    # The root unit and two blocks gathered, fp32: two blocks' experts less 3 / 4 of them.
    assert one["parameter_copies"] - four["parameter_copies"] == 2 * per_block * 3 // 4 * 4
    assert one["gradient_buffers"] - four["gradient_buffers"] == 2 * per_block * 3 // 4 * 4


def test_all_to_all_buffers_appear_only_with_expert_parallelism():
    gpt = _moe_gpt(seq_len=256)
    rows = {e: _row(gpt, 2, e, micro_batch=4, seq_len=256, precision="bf16-mixed") for e in (1, 2)}
    assert "all_to_all" not in rows[1].buffers_detail
    # One layer's send and receive buffers: 2 x T x k x h in the residual dtype (fp32 under autocast).
    assert rows[2].buffers_detail["all_to_all"] == 2 * (4 * 256) * 2 * 64 * 4
    # The routed rows the backward keeps are the MoE block's with or without expert parallelism.
    assert rows[1].activations == rows[2].activations
    dense = _row(_moe_gpt(n_experts=0, seq_len=256), 2, 1, micro_batch=4, seq_len=256)
    assert "all_to_all" not in dense.buffers_detail
    assert "all_to_all" not in _row(gpt, 2, 2, micro_batch=None).buffers_detail


# --- the search ------------------------------------------------------------------------------------------


def _accepted(line: str) -> ShardConfig:
    """The printed ``ShardStrategy(...)`` line, evaluated against the strategy's own flag check."""
    return eval(line, {"ShardStrategy": lambda **flags: configure(**flags)})  # noqa: S307


def test_experts_that_dominate_are_split_over_every_rank_and_the_line_is_accepted():
    gpt = _moe_gpt(d_model=512, n_layers=8)
    result = plan(module=gpt, world_size=4, device_memory="1GB", precision="32-true")
    assert result.fits and result.strategy == "ShardStrategy(stage=0, expert_parallel_size=4)"
    assert _accepted(result.strategy).expert_parallel_size == 4
    # Without it stage 0 holds all 8 experts and does not fit: the cheapest is stage 2 or 3.
    without = plan(module=gpt, world_size=4, device_memory="1GB", precision="32-true", expert_parallel_size=1)
    assert without.stage >= 2 and "expert_parallel_size" not in str(without.strategy)


@pytest.mark.parametrize("world, e", [(6, 2), (16, 8), (1, 1)])
def test_expert_parallel_size_divides_the_experts_and_the_ranks_within_a_node(world, e):
    result = plan(module=_moe_gpt(), world_size=world, device_memory="100GB", stage=3, gpus_per_node=8)
    assert result.strategy_kwargs().get("expert_parallel_size", 1) == e
    if e > 1:
        assert _accepted(str(result.strategy)).expert_parallel_size == e


def test_expert_parallelism_at_stage_1_and_with_tensor_parallelism():
    gpt = _moe_gpt()
    # Stage 1 partitions each expert block's optimizer state over the ranks holding it: the search splits there too.
    stage_1 = plan(module=gpt, world_size=4, device_memory="100GB", stage=1)
    assert _accepted(str(stage_1.strategy)).expert_parallel_size == 4, stage_1.strategy
    # With tensor parallelism the experts stay whole over its ranks: a device holds (and at stage 0 keeps) E/e
    # experts' worth, not a tp-th of it.
    tp0 = plan(
        module=gpt,
        world_size=4,
        device_memory="100GB",
        stage=0,
        tensor_parallel_size=2,
        expert_parallel_size=2,
    )
    flat0 = plan(module=gpt, world_size=2, device_memory="100GB", stage=0, expert_parallel_size=2)
    assert tp0.recommended.expert_parameters == flat0.recommended.expert_parameters > 0
    # ShardStrategy(stage="auto") plans with the strategy's own expert_parallel_size, never searched; stage 1 is
    # a candidate with it (between stage 0, which no longer fits, and stage 2).
    auto = choose_stage(gpt, 4, 10**11, "32-true", 1, 128)
    assert "expert_parallel_size" not in auto.strategy_kwargs()
    big = _moe_gpt(d_model=512, n_layers=8)
    for memory, stage in ((10**11, 0), (7.5 * 10**8, 1), (7 * 10**8, 2)):
        chosen = choose_stage(
            big,
            4,
            int(memory),
            "32-true",
            1,
            128,
            expert_parallel_size=4,
            offload_optimizer="none",
            offload_params="none",
        ).strategy_kwargs()
        assert chosen["expert_parallel_size"] == 4 and chosen["stage"] == stage, chosen


# --- the CLI ---------------------------------------------------------------------------------------------


def test_cli_recommends_expert_parallel_size_for_a_counted_moe(capsys):
    argv = ["--params", "47e9", "--experts", "8", "--top-k", "2", "--gpus", "64", "--gpu-mem", "80GB"]
    code, out, err = _cli(capsys, *argv)
    assert code == 0, err
    assert "8 experts, top-2: 43.69B in experts, 14.23B active per token" in out
    line = next(line for line in out.splitlines() if line.startswith("recommended:"))
    assert "ShardStrategy(stage=2, expert_parallel_size=8)" in line and ": fits)" in line
    assert "64 (EP 8)" in out  # the layout weighs it too
    code, out, _ = _cli(capsys, *argv, "--json")
    data = json.loads(out)
    assert (data["model"]["experts"], data["model"]["top_k"]) == (8, 2)
    assert data["model"]["active_params"] == 14_233_589_120
    assert data["recommended"]["expert_parallel_size"] == 8 and data["layout"]["suggested"]["ep"] == 8
    assert data["recommended"]["buffers_detail"]["all_to_all"] > 0
    documented = set(re.findall(r"`([a-z_]+)`", (ROOT / "docs/planner.md").read_text()))
    new_keys = {
        "expert_parallel_size",
        "expert_parameters",
        "all_to_all",
        "ep",
        "active_params",
        "flops_per_token",
    }
    assert new_keys | set(data["model"]) <= documented


def test_cli_reads_experts_off_the_model_and_matches_the_docs(capsys):
    doc = (ROOT / "docs/planner.md").read_text()
    command, shown = re.search(
        r"```\n\$ lightning-shard (plan --model [^\n]*n_experts[^\n]*)\n(.*?)```", doc, re.S
    ).groups()
    code, out, err = _cli(capsys, *command.split()[1:])
    assert code == 0, err
    assert out == shown


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--experts", "8"], r"--experts 8 needs --top-k too"),
        (["--top-k", "2"], r"--top-k 2 needs --experts too"),
        (["--experts", "0", "--top-k", "2"], r"--experts 0 must be a whole number >= 1"),
        (["--experts", "8", "--top-k", "9"], r"--top-k 9 routes each token to more experts than the 8"),
        (
            ["--experts", "6", "--top-k", "2", "--expert-parallel-size", "4"],
            r"4 does not divide the 6 experts",
        ),
        (
            ["--expert-parallel-size", "2"],
            r"--expert-parallel-size 2 splits experts, and a parameter count has",
        ),
        (
            ["--experts", "8", "--top-k", "2", "--expert-parallel-size", "8", "--devices", "4"],
            r"expert_parallel_size=8\) does not divide the 4 ranks of a shard group",
        ),
    ],
)
def test_cli_errors_name_the_flag_and_the_fix(capsys, argv, message):
    code, out, err = _cli(capsys, "--params", "1e9", "--gpu-mem", "80GB", *argv)
    assert code == 2 and re.search(message, err) and "Traceback" not in err, err


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(module="dense", experts=8), r"plan\(experts=8\): GPT has no experts the strategy can split"),
        (dict(module="moe", experts=4), r"plan\(experts=4\) disagrees with the 8 experts"),
        (dict(module="moe", top_k=9), r"plan\(top_k=9\) is more than the model's 8 experts"),
        (dict(module="moe", expert_parallel_size=3), r"=3\) does not divide the 8 experts of GPT"),
        (dict(module="dense", expert_parallel_size=2), r"splits experts, and the model \(GPT\) has none"),
        (dict(params=1e9, experts=8, top_k=2, expert_parallel_size="2"), r"must be a whole number >= 1"),
        (dict(params=1e9, experts=8, top_k=True), r"plan\(top_k=True\) must be a whole number >= 1"),
    ],
)
def test_plan_errors_name_the_argument(kwargs, message):
    module = kwargs.pop("module", None)
    if module is not None:
        kwargs["module"] = _moe_gpt(n_experts=8 if module == "moe" else 0)
    with pytest.raises(PlanInputError, match=message):
        plan(world_size=4, device_memory="80GB", **kwargs)
