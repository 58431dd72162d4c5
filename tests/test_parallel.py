"""Tensor-parallel plans and mesh flags, in one process: every refusal names the flag and the fix."""

from __future__ import annotations

import re

import lightning as L
import pytest
import torch
from torch import nn

from lightning_shard import ShardStrategy
from lightning_shard.parallel import MeshLayout, carried_plan, resolve_plan
from lightning_shard.parallel.plan import to_styles
from tests.helpers import tiny_gpt, tiny_llama_config


def test_layout_orders_tp_innermost_then_shard_then_replicate():
    layout = MeshLayout.for_world(16, replicate_size=2, tensor_parallel_size=4)
    assert (layout.replicate, layout.shard, layout.tp) == (2, 2, 4)
    assert layout.data_parallel_size == 4
    assert [layout.data_parallel_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert not MeshLayout.for_world(4).multi_dimensional


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(tensor_parallel_size=0), "tensor_parallel_size=0) must be an integer >= 1"),
        (dict(replicate_size=True), "replicate_size=True) must be an integer >= 1"),
        (dict(stage=1, replicate_size=2), "need stage 2 or 3"),
        (dict(stage=0, replicate_size=2), "need stage 2 or 3"),
        (dict(stage=1, tensor_parallel_size=2), "Use stage=2"),
        pytest.param(
            dict(engine="deepspeed", stage=2, replicate_size=2),
            "which is not replicate_size's layout. Use engine='fsdp'",
            marks=pytest.mark.deepspeed,
        ),
        pytest.param(
            dict(
                engine="deepspeed", tensor_parallel_size=2, tensor_parallel_plan={"blocks.*.qkv": "colwise"}
            ),
            "splits the layers by its own AutoTP",
            marks=pytest.mark.deepspeed,
        ),
        pytest.param(
            dict(engine="deepspeed", stage=1, tensor_parallel_size=2, expert_parallel_size=2),
            "expert_parallel_size=2) is not available: DeepSpeed's AutoTP builds its own",
            marks=pytest.mark.deepspeed,
        ),
        pytest.param(
            dict(engine="deepspeed", stage=1, tensor_parallel_size=2, context_parallel_size=2),
            "context_parallel_size=2) is not available: DeepSpeed's AutoTP builds its own",
            marks=pytest.mark.deepspeed,
        ),
        pytest.param(
            dict(stage=3, offload_optimizer="nvme", nvme_path="/tmp", replicate_size=2),
            "Use engine='fsdp'",
            marks=[pytest.mark.deepspeed, pytest.mark.needs_libaio],
        ),
        (dict(tensor_parallel_plan={"blocks.*.qkv": "colwise"}), "only used with tensor_parallel_size > 1"),
        (
            dict(tensor_parallel_size=2, tensor_parallel_plan={"blocks.*.qkv": "diagonal"}),
            "unknown style 'diagonal'",
        ),
        (dict(tensor_parallel_size=2, tensor_parallel_plan={}), "non-empty mapping"),
        (
            dict(expert_parallel_size=2, gradient_compression="powersgd"),
            "gradient_compression) is not available: with expert parallelism",
        ),
        pytest.param(
            dict(engine="deepspeed", stage=3, expert_parallel_size=2),
            "Use stage=1 or 2 with engine='deepspeed'",
            marks=pytest.mark.deepspeed,
        ),
        pytest.param(
            dict(engine="deepspeed", stage=0, expert_parallel_size=2),
            "at stage 0 its clip norm counts only the rank's own experts",
            marks=pytest.mark.deepspeed,
        ),
    ],
)
def test_flags_refused_at_construction(flags, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ShardStrategy(**flags)


@pytest.mark.parametrize("stage", [0, 1, 2, 3, "auto"])
def test_expert_parallelism_is_accepted_at_every_stage(stage):
    config = ShardStrategy(stage=stage, expert_parallel_size=2).config
    assert (config.stage, config.expert_parallel_size, config.engine) == (stage, 2, "fsdp")


@pytest.mark.parametrize(
    "devices, flags, message",
    [
        (3, dict(tensor_parallel_size=2), r"tensor_parallel_size=2\) does not divide the world size 3"),
        (4, dict(replicate_size=3), r"replicate_size=3\) does not divide the 4 data-parallel ranks"),
        (4, dict(tensor_parallel_size=2, replicate_size=4), r"replicate_size=4\) does not divide the 2"),
    ],
)
def test_sizes_that_do_not_divide_the_world_fail_when_the_trainer_is_built(devices, flags, message):
    with pytest.raises(ValueError, match=message):
        L.Trainer(accelerator="cpu", devices=devices, strategy=ShardStrategy(**flags), logger=False)


def test_sampler_reads_by_data_parallel_rank():
    strategy = ShardStrategy(stage=3, tensor_parallel_size=2)
    L.Trainer(accelerator="cpu", devices=4, strategy=strategy, logger=False)
    strategy.cluster_environment.set_global_rank(3)  # type: ignore[union-attr]
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 1}


def test_demo_gpt_carries_its_plan_and_wrappers_do_not_hide_names():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = tiny_gpt()
    plan, where = carried_plan(model)  # type: ignore[misc]
    assert where == "GPT.tensor_parallel_plan" and "model.blocks.*.attn.qkv" in plan
    for i, block in enumerate(model.model.blocks):
        model.model.blocks[i] = checkpoint_wrapper(block)
    resolved = resolve_plan(model, None, 2)
    assert resolved["model.blocks.0._checkpoint_wrapped_module.attn.qkv"] == "colwise"
    assert resolved["model.blocks.1._checkpoint_wrapped_module.ln1"] == "sequence" and len(resolved) == 12


def test_sequence_parallel_region_enters_at_the_first_block_and_leaves_after_the_last():
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, PrepareModuleOutput

    model = tiny_gpt(n_layers=3)
    styles = to_styles(model, resolve_plan(model, None, 2))
    assert isinstance(styles["model.blocks.0"], PrepareModuleInput)
    assert isinstance(styles["model.blocks.2"], PrepareModuleOutput)
    assert "model.blocks.1" not in styles
    qkv = styles["model.blocks.1.attn.qkv"]
    assert isinstance(qkv, ColwiseParallel) and qkv.input_layouts == (Shard(1),)


def test_hugging_face_plan_is_found_and_anchored_at_the_base_model():
    transformers = pytest.importorskip("transformers")
    holder = nn.Module()
    holder.model = transformers.LlamaForCausalLM(
        tiny_llama_config(num_attention_heads=4, num_key_value_heads=2)
    )
    holder.config = holder.model.config  # a LightningModule that keeps the config is not the model
    plan, where = carried_plan(holder)  # type: ignore[misc]
    assert where == "LlamaForCausalLM.config.base_model_tp_plan"
    assert plan["model.model.layers.*.self_attn.q_proj"] == "colwise"
    resolved = resolve_plan(holder, None, 2)
    assert resolved["model.model.layers.0.self_attn.o_proj"] == "rowwise"
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4\) does not divide .*num_key_value_heads=2"):
        resolve_plan(holder, None, 4)


@pytest.mark.parametrize(
    "plan, tp, message",
    [
        ({"blocks.*.attn.qkvx": "colwise"}, 2, "'blocks.*.attn.qkvx' matches no module of GPTModule"),
        ({"blocks.*.attn": "colwise"}, 2, "splits nn.Linear and nn.Embedding only"),
        ({"blocks.*.attn.qkv": "colwise", "blocks.0.attn.qkv": "rowwise"}, 2, "matched by more than one"),
        (
            {"blocks.*.attn.qkv": "colwise"},
            4,
            "tensor_parallel_size=4) does not divide model.blocks.0.attn.n_heads=2",
        ),
        ({"ln_f": "sequence"}, 2, "is 'sequence' but is not inside one of the model's repeated blocks"),
    ],
)
def test_plan_errors_name_the_pattern_and_the_fix(plan, tp, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        resolve_plan(tiny_gpt(), plan, tp)


def test_a_model_without_a_plan_is_asked_for_one():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2\) needs a plan: Sequential carries none"):
        resolve_plan(model, None, 2)


def test_clip_counts_each_element_once_across_copies_and_shards():
    # One process: a plain tensor's norm is its own; the formula's world factor is 1.
    from lightning_shard.parallel import clip_grad_norm_

    p = nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([3.0, 4.0, 0.0])
    norm = clip_grad_norm_([p], max_norm=1.0)
    assert norm.item() == pytest.approx(5.0)
    torch.testing.assert_close(p.grad, torch.tensor([0.6, 0.8, 0.0]), rtol=1e-5, atol=1e-6)


def test_hugging_face_vocabulary_ends_stay_whole():
    # Some transformers releases split the embedding ("embedding_rowwise") or gather the head's output;
    # those ends stay whole here (often tied to each other) and the layers between are split.
    transformers = pytest.importorskip("transformers")
    config = tiny_llama_config(num_attention_heads=4, num_key_value_heads=2)
    config.base_model_tp_plan = {**config.base_model_tp_plan, "embed_tokens": "embedding_rowwise"}
    holder = nn.Module()
    holder.model = transformers.LlamaForCausalLM(config)
    plan, _ = carried_plan(holder)  # type: ignore[misc]
    assert "model.model.embed_tokens" not in plan and "model.model.layers.*.mlp.up_proj" in plan
    config.base_model_tp_plan = {"layers.*.mlp.up_proj": "local_colwise"}
    with pytest.raises(ValueError, match="carries the style 'local_colwise'.*Pass tensor_parallel_plan="):
        carried_plan(holder)


@pytest.mark.deepspeed
def test_a_model_autotp_split_nothing_of_is_refused_naming_the_fix():
    from lightning_shard.engines.deepspeed.tensor_parallel import check_split

    with pytest.raises(
        ValueError, match=r"AutoTP split no layer of Sequential.*engine='fsdp' with tensor_parallel_plan"
    ):
        check_split(nn.Sequential(nn.Linear(4, 4)), 2)


@pytest.mark.deepspeed
@pytest.mark.parametrize(
    ("files", "sizes"),
    [
        # ZeRO-3 on 2 data-parallel ranks without tensor parallelism: one model-state file per rank, all mp_rank_00
        (["zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt"], (1, 0)),
        (["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"], (2, 0)),  # stage 0, AutoTP over 2
        (
            [f"zero_pp_rank_{d}_mp_rank_0{t}_{kind}" for d in (0, 1) for t in (0, 1)
             for kind in ("model_states.pt", "optim_states.pt")],
            (2, 2),
        ),  # ZeRO-3, TP2 x DP2
    ],
)  # fmt: skip
def test_a_deepspeed_checkpoints_tensor_parallel_ranks_are_its_distinct_mp_ranks(tmp_path, files, sizes):
    from lightning_shard.checkpoint import DEEPSPEED_TAG
    from lightning_shard.engines.deepspeed.tensor_parallel import check_resume, saved_sizes

    (tmp_path / DEEPSPEED_TAG).mkdir()
    for name in files:
        (tmp_path / DEEPSPEED_TAG / name).touch()
    tp = sizes[0]
    assert saved_sizes(tmp_path)[0] == tp
    check_resume(tmp_path, tp, sizes[1] or 2)  # the layout it was written with resumes
    with pytest.raises(ValueError, match="resumes with the same tensor_parallel_size"):
        check_resume(tmp_path, 2 if tp == 1 else 1, 2)


def test_readers_of_whole_weights_refuse_a_deepspeed_checkpoint_with_autotp_slices(tmp_path):
    # `lightning-shard export` / consolidate read DeepSpeed checkpoints through ZeroReader; each mp_rank file of an
    # AutoTP checkpoint holds its own slices, which it would take as whole layers.
    from lightning_shard.checkpoint import DEEPSPEED_TAG
    from lightning_shard.checkpoint._errors import CheckpointLoadError
    from lightning_shard.checkpoint._zero_reader import ZeroReader

    (tmp_path / DEEPSPEED_TAG).mkdir()
    for t in (0, 1):
        (tmp_path / DEEPSPEED_TAG / f"mp_rank_0{t}_model_states.pt").touch()
    with pytest.raises(CheckpointLoadError, match=r"tensor parallelism \(AutoTP, 2 tensor-parallel ranks\)"):
        ZeroReader(tmp_path, weights_only=True)
