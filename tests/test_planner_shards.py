"""The planner's model state per rank (pipeline stage, place in the shard group), against bytes computed here from
the demo GPT's layer shapes; and Hugging Face's own tensor-parallel styles (``replicated_with_grad_allreduce``,
``moe_tp_experts`` with ``packed_colwise``), which the set-up now builds.

Expected figures: FSDP2 shards dim 0 of each tensor-parallel / expert-parallel piece over its shard group, every
rank keeping ``ceil(rows / ranks)`` rows (padding on the last ranks) for parameters and gradients, the optimizer's
two Adam states covering only the real rows, plus one float32 ``step`` per tensor.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import _StridedShard

from lightning_shard.demos.gpt import GPT
from lightning_shard.parallel.hf_styles import ExpertsTensorParallel, parameter_placement
from lightning_shard.parallel.plan import carried_plan
from lightning_shard.planner import plan

VOCAB, SEQ = 250, 100  # uneven over the shard groups below


def _gpt(**kwargs: int) -> torch.nn.Module:
    with torch.device("meta"):
        return GPT(vocab_size=VOCAB, seq_len=SEQ, **kwargs)


def _block(d: int, experts: int) -> list[tuple[tuple[int, ...], str]]:
    """(shape, how the plan splits it) of one demo GPT block."""
    shapes = [((d,), ""), ((d,), ""), ((3 * d, d), "col"), ((3 * d,), "col"), ((d, d), "row"), ((d,), "")]
    shapes += [((d,), ""), ((d,), "")]
    if experts:
        return [*shapes, ((experts, d), ""), ((experts, 4 * d, d), "exp"), ((experts, d, 2 * d), "exp")]
    return [*shapes, ((4 * d, d), "col"), ((4 * d,), "col"), ((d, 4 * d), "row"), ((d,), "")]


def _expected(
    d: int, layers: int, stage: int, index: int, *, tp: int, pp: int, k: int, experts: int = 0, ep: int = 1
) -> tuple[int, int, int]:
    """fp32 (parameters, gradients, optimizer) of the rank at ``index`` of its shard group of ``k`` on ``stage``."""
    tensors = [t for _ in range(layers // pp) for t in _block(d, experts)]
    if stage == 0:
        tensors += [((VOCAB, d), ""), ((SEQ, d), "")]
    if stage == pp - 1:
        tensors += [((d,), ""), ((d,), "")] + ([((VOCAB, d), "")] if pp > 1 else [])  # the tied head's copy
    padded = real = 0
    for shape, how in tensors:
        rows, rest, ranks, mine = shape[0], math.prod(shape[1:]), k, index
        if how == "col":
            rows //= tp
        elif how == "row":
            rest //= tp
        elif how == "exp":
            rows, ranks, mine = rows // ep, k // ep, index // ep
        chunk = -(-rows // ranks)
        padded += chunk * rest
        real += max(0, min(chunk, rows - mine * chunk)) * rest
    return 4 * padded, 4 * padded, 4 * (2 * real + len(tensors))


def _plan(module: torch.nn.Module, world: int, **flags: int):  # type: ignore[no-untyped-def]
    return plan(
        module=module,
        world_size=world,
        device_memory="1PB",
        precision="32-true",
        stage=3,
        offload_optimizer="none",
        offload_params="none",
        activation_checkpointing="none",
        micro_batch=None,
        gpus_per_node=8,
        **flags,
    ).stages[3]


def test_uneven_shards_with_tensor_and_pipeline_parallelism():
    # 1024 ranks = 4 stages x 4 replicas x 16 shard ranks x TP 4: 250 and 100 rows split unevenly over 16.
    row = _plan(
        _gpt(d_model=256, n_heads=8, n_layers=8),
        1024,
        tensor_parallel_size=4,
        pipeline_parallel_size=4,
        replicate_size=4,
    )
    got = {(p.stage, p.index): (p.parameters, p.gradients, p.optimizer) for p in row.places}
    assert sorted(got) == [(s, i) for s in range(4) for i in (0, 15)]
    for (stage, index), figures in got.items():
        assert figures == _expected(256, 8, stage, index, tp=4, pp=4, k=16), (stage, index)
    # the worst rank is what the row reports (and what must fit): the first stage's first rank
    assert (row.parameters, row.gradients, row.optimizer) == got[(0, 0)]
    assert got[(0, 15)][2] < got[(0, 0)][2]  # the last rank's optimizer state is short of its padded rows
    # a rank anywhere in the group, as the dry run asks for it
    assert row.rank_figures(2, 7) == dict(
        zip(("parameters", "gradients", "optimizer"), _expected(256, 8, 2, 7, tp=4, pp=4, k=16), strict=True)
    ) | {"host": 0}


def test_fewer_experts_than_their_shard_group():
    # 4 experts over EP 2: 2 per rank, sharded by dim 0 over the 32 ranks holding the block: every rank pays one
    # expert's rows, only the first two hold real ones. The even split would count 2/32 of an expert per rank.
    row = _plan(_gpt(d_model=64, n_heads=4, n_layers=2, n_experts=4), 64, expert_parallel_size=2)
    for place in row.places:
        assert (place.parameters, place.gradients, place.optimizer) == _expected(
            64, 2, place.stage, place.index, tp=1, pp=1, k=64, experts=4, ep=2
        )
    expert_rows = 2 * (4 * 64 * 64 + 64 * 128)  # 2 layers x (gate_up + down), one padded expert each
    assert row.parameters >= 4 * expert_rows


def test_a_layout_whose_worst_rank_does_not_fit_is_not_recommended():
    module = _gpt(d_model=64, n_heads=4, n_layers=2, n_experts=4)
    worst = _expected(64, 2, 0, 0, tp=1, pp=1, k=64, experts=4, ep=2)
    even = sum(p.numel() for p in module.parameters()) * 4 * 4 // 64  # parameters, gradients, two states
    assert sum(worst) > 2 * even
    flags = dict(
        world_size=64,
        precision="32-true",
        stage=3,
        expert_parallel_size=2,
        offload_optimizer="none",
        offload_params="none",
        activation_checkpointing="none",
        micro_batch=None,
    )
    row = plan(module=module, device_memory="1PB", **flags).stages[3]
    assert row.model_state == sum(worst)
    # memory for the rest and a state halfway between the even split and the worst rank's: does not fit
    between = row.total - row.model_state + (even + sum(worst)) // 2
    assert not plan(module=module, device_memory=int(between / 0.9), **flags).stages[3].fits
    assert plan(module=module, device_memory=int(row.total / 0.9) + 10, **flags).stages[3].fits


def test_stage_1_partitions_whole_tensors_as_the_job_does():
    from lightning_shard.dryrun import dryrun

    # ZeroRedundancyOptimizer's greedy partition by whole tensors, the expert blocks over the ranks holding them
    init = dict(n_experts=8, top_k=2, d_model=64, n_layers=2)
    flags = dict(stage=1, expert_parallel_size=2)
    reports = dryrun(GPT, flags, 8, list(range(8)), precision="32-true", init_args=init)
    held = [r.optimizer_bytes for r in reports]
    assert len(set(held)) > 2  # uneven: whole tensors
    assert [r.planner["optimizer"] for r in reports if r.planner] == held


def _tiny_qwen3():  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers")
    return transformers.Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
    )


def _tiny_deepseek():  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers")
    return transformers.DeepseekV3Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
    )


@pytest.mark.parametrize("config", [_tiny_qwen3, _tiny_deepseek], ids=["qwen3-moe", "deepseek-v3"])
def test_hugging_face_styles_build_and_match_the_planner(config):
    from lightning_shard.dryrun import dryrun

    reports = dryrun(config(), dict(stage=3, tensor_parallel_size=4), 16)
    assert len(reports) == 2
    for report in reports:
        want = report.planner
        assert want is not None
        got = {
            "parameters": report.param_bytes,
            "gradients": report.grad_bytes,
            "optimizer": report.optimizer_bytes,
        }
        assert got == {k: want[k] for k in got}, report.rank


def test_the_carried_plans_translate_to_torch_styles():
    from lightning_shard.dryrun.models import model_factory

    qwen = model_factory(_tiny_qwen3())()
    plan_, _ = carried_plan(qwen)
    assert type(plan_["model.layers.*.self_attn.q_norm"]).__name__ == "ReplicatedGradAllReduce"
    experts = plan_["model.layers.*.mlp.experts"]
    assert isinstance(experts, ExpertsTensorParallel)
    assert experts.parameters == {"gate_up_proj": "packed_colwise", "down_proj": "rowwise"}
    assert "model.layers.*.mlp.experts.gate_up_proj" not in plan_
    # expert parallelism holds the experts whole: their entries are left out
    assert "model.layers.*.mlp.experts" not in carried_plan(qwen, experts_whole=True)[0]


def test_packed_colwise_keeps_a_slice_of_each_half():
    # rank r of 2 holds rows [gate_r; up_r] of a packed (E, 2I, H) weight
    assert parameter_placement("packed_colwise", 3) == _StridedShard(1, split_factor=2)
    assert parameter_placement("rowwise", 3) == Shard(2) and parameter_placement("colwise", 2) == Shard(0)
    gate_up = torch.arange(2 * 8).reshape(1, 8, 2)  # gate rows 0-3, up rows 4-7
    pieces = _StridedShard(1, split_factor=2)._split_tensor(gate_up, 2, with_padding=False)[0]
    assert [p[0, :, 0].tolist() for p in pieces] == [[0, 2, 8, 10], [4, 6, 12, 14]]


def test_styles_refuse_what_they_cannot_split():
    with pytest.raises(
        ValueError, match=r"ExpertsTensorParallel\(parameters=.*'gate_up_proj': 'packed_rowwise'"
    ):
        ExpertsTensorParallel({"gate_up_proj": "packed_rowwise"})
    with pytest.raises(ValueError, match="no placement for the parameter style 'sequence'"):
        parameter_placement("sequence", 3)
    style = ExpertsTensorParallel({"missing": "colwise"})
    with pytest.raises(ValueError, match="Linear has no parameter 'missing' for the style 'colwise'"):
        style._apply(torch.nn.Linear(2, 2), None)


def test_an_experts_parameter_style_without_a_torch_equivalent_is_refused():
    from lightning_shard.dryrun.models import model_factory

    config = _tiny_qwen3()
    config.base_model_tp_plan = {
        "layers.*.mlp.experts": "moe_tp_experts",
        "layers.*.mlp.experts.gate_up_proj": "packed_rowwise",
    }
    with pytest.raises(ValueError, match=r"splits the parameters \{'gate_up_proj': 'packed_rowwise'\} of"):
        carried_plan(model_factory(config)())
