"""Pipeline flags, layouts and splitting, checked without processes (the runs are in
tests/test_pipeline_multirank.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_shard import ShardStrategy
from lightning_shard.parallel import MeshLayout
from lightning_shard.pipeline import keep_stage, plan_stages
from lightning_shard.trainer._pipeline import check_contract, split_batch
from tests.helpers import tiny_gpt


def test_defaults_and_off():
    strategy = ShardStrategy(pipeline_parallel_size=2)
    assert strategy.config.pipeline_schedule == "1f1b"
    assert strategy.config.microbatches == 4  # 2 x stages
    assert strategy.config.stages_per_rank == 1
    interleaved = ShardStrategy(pipeline_parallel_size=2, pipeline_schedule="interleaved_1f1b").config
    assert interleaved.stages_per_rank == 2 and interleaved.microbatches == 4
    assert ShardStrategy().config.pipeline_parallel_size == 1
    assert (
        ShardStrategy(pipeline_parallel_size=4, microbatches=8, pipeline_schedule="gpipe").config.microbatches
        == 8
    )


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (dict(pipeline_parallel_size=0), r"pipeline_parallel_size=0\) must be an integer >= 1"),
        (
            dict(pipeline_parallel_size=2, pipeline_schedule="looped"),
            r"pipeline_schedule='looped'\) is unknown",
        ),
        (
            dict(pipeline_parallel_size=2, pipeline_schedule="interleaved_1f1b", stages_per_rank=1),
            r"pipeline_schedule='interleaved_1f1b', stages_per_rank=1\) interleaves.*stages_per_rank >= 2",
        ),
        (
            dict(pipeline_parallel_size=2, stages_per_rank=2),
            r"pipeline_schedule='1f1b', stages_per_rank=2\): this schedule runs one stage per rank",
        ),
        (dict(pipeline_parallel_size=2, stages_per_rank=0), r"stages_per_rank=0\) must be an integer >= 1"),
        (
            dict(pipeline_parallel_size=4, pipeline_schedule="zero_bubble", microbatches=9),
            r"microbatches=9, pipeline_parallel_size=4\): the interleaved schedules run.*multiple of 2",
        ),
        (
            dict(
                pipeline_parallel_size=2,
                pipeline_schedule="zero_bubble",
                pipeline_split_points=["model.blocks.1"],
            ),
            r"names 1 split points; 4 stages need 3",
        ),
        (dict(pipeline_parallel_size=2, microbatches=0), r"microbatches=0\) must be an integer >= 1"),
        (dict(pipeline_parallel_size=4, microbatches=2), r"microbatches=2, pipeline_parallel_size=4\).*>= 4"),
        (dict(microbatches=4), r"microbatches=4\) is only used with pipeline_parallel_size > 1"),
        (dict(pipeline_split_points=["model.blocks.1"]), r"pipeline_split_points=...\) is only used"),
        (
            dict(pipeline_parallel_size=3, pipeline_split_points=["model.blocks.1"]),
            r"names 1 split points; 3 stages need 2",
        ),
        (
            dict(pipeline_parallel_size=2, pipeline_split_points="model.blocks.1"),
            r"must be a list of module names",
        ),
        (
            dict(checkpoint="full", pipeline_parallel_size=2),
            r"checkpoint='full', pipeline_parallel_size=2\) cannot run.*Use checkpoint='sharded'",
        ),
    ],
)
def test_flag_errors(flags, match):
    with pytest.raises(ValueError, match=match):
        ShardStrategy(**flags)


@pytest.mark.deepspeed
def test_deepspeed_engine_refuses_pipeline_stages():
    with pytest.raises(
        ValueError, match=r"pipeline_parallel_size=2\) is not available with the DeepSpeed engine"
    ):
        ShardStrategy(engine="deepspeed", pipeline_parallel_size=2)


def test_layout_puts_stages_outermost():
    layout = MeshLayout.for_world(8, replicate_size=1, tensor_parallel_size=2, pipeline_parallel_size=2)
    assert (layout.pp, layout.replicate, layout.shard, layout.tp) == (2, 1, 2, 2)
    assert layout.data_parallel_size == 2
    # ranks 0-3 are stage 0, 4-7 stage 1; within a stage, pairs are tensor-parallel groups
    assert [layout.data_parallel_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=3\) does not divide the world size 8"):
        MeshLayout.for_world(8, pipeline_parallel_size=3)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4\) does not divide the world size 2"):
        MeshLayout.for_world(4, tensor_parallel_size=4, pipeline_parallel_size=2)


def test_balanced_split_and_pruning():
    model = tiny_gpt(n_layers=4, tie_embeddings=False)
    plan = plan_stages(model, 2)
    assert plan.container == "model.blocks"
    assert plan.before == ("model.tok_emb", "model.pos_emb") and plan.after == ("model.ln_f", "model.head")
    assert plan.starts == (0, 2)
    assert plan_stages(model, 2, ("model.blocks.1",)).starts == (0, 1)
    keep_stage(model, plan, 1)
    names = {name for name, _ in model.named_parameters()}
    assert "model.blocks.2.attn.qkv.weight" in names and "model.head.weight" in names
    assert not any(n.startswith(("model.blocks.0.", "model.blocks.1.", "model.tok_emb")) for n in names)
    hidden = torch.randn(2, 8, 32)  # a stage after the first receives hidden states
    assert model(hidden).shape == (2, 8, 64)


def test_hugging_face_model_splits_by_its_own_plan():
    transformers = pytest.importorskip("transformers")
    from tests.helpers import CausalLM, tiny_llama_config

    torch.manual_seed(0)
    model = CausalLM(tiny_llama_config(num_hidden_layers=4, tie_word_embeddings=False)).eval()
    plan = plan_stages(model, 2)
    assert (plan.container, plan.before, plan.after, plan.placeholder) == (
        "model.model.layers",
        ("model.model.embed_tokens",),
        ("model.model.norm", "model.lm_head"),
        "identity",
    )
    ids = torch.randint(0, 64, (2, 8))
    expected = model.model(input_ids=ids).logits
    first, last = copy.deepcopy(model), copy.deepcopy(model)
    keep_stage(first, plan, 0)
    keep_stage(last, plan, 1)
    assert isinstance(first.model.lm_head, nn.Identity) and isinstance(
        last.model.model.embed_tokens, nn.Identity
    )
    # the model's own forward runs each stage: hidden states go in where the token ids did
    hidden = first.model(input_ids=ids).logits
    assert hidden.shape == (2, 8, 32)
    torch.testing.assert_close(last.model(input_ids=hidden).logits, expected, rtol=0, atol=0)
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64)
    )
    with pytest.raises(
        ValueError, match=r"cannot split GPT2LMHeadModel: its\s+Hugging Face config carries no"
    ):
        plan_stages(gpt2, 2)
    # tied (the config's default): each stage keeps its copy, first stage first
    tied = plan_stages(CausalLM(tiny_llama_config(num_hidden_layers=4)), 2).tied
    assert tied == ((("model.model.embed_tokens.weight", 0), ("model.lm_head.weight", 1)),)


def test_split_errors():
    assert plan_stages(tiny_gpt(), 2).tied == ((("model.tok_emb.weight", 0), ("model.head.weight", 1)),)
    with pytest.raises(ValueError, match=r"at least one block per stage, but model.blocks holds 2"):
        plan_stages(tiny_gpt(tie_embeddings=False), 3)
    with pytest.raises(ValueError, match=r"'model.blocks.5'.*Name blocks of model.blocks, in order"):
        plan_stages(tiny_gpt(tie_embeddings=False, n_layers=4), 2, ("model.blocks.5",))
    with pytest.raises(ValueError, match=r"must name blocks in increasing order"):
        plan_stages(tiny_gpt(tie_embeddings=False, n_layers=4), 3, ("model.blocks.2", "model.blocks.1"))
    with pytest.raises(ValueError, match=r"holds no list of identical blocks"):
        plan_stages(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), 2)

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(1))
            self.blocks = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))

    with pytest.raises(ValueError, match=r"parameters scale held directly by Scaled"):
        plan_stages(Scaled(), 2)


def test_module_contract_errors():
    module = tiny_gpt()
    check_contract(module, 2)  # the demo GPT meets it
    module.pipeline_loss = None  # type: ignore[assignment]
    with pytest.raises(ValueError, match=r"needs GPTModule.pipeline_loss\(output, target\)"):
        check_contract(module, 2)
    module = tiny_gpt()
    module.automatic_optimization = False
    with pytest.raises(ValueError, match=r"manual optimization"):
        check_contract(module, 2)
    x = torch.zeros(2, 3)
    assert split_batch(module, (x, x))[0] == (x,)
    with pytest.raises(ValueError, match=r"Define GPTModule.pipeline_batch\(batch\) -> \(inputs, target\)"):
        split_batch(module, {"x": x})


def test_batch_must_split_into_microbatches():
    from lightning_shard.pipeline.runner import check_microbatches

    check_microbatches((torch.zeros(8, 3),), torch.zeros(8, 3), 4)
    with pytest.raises(ValueError, match=r"microbatches=4\) does not divide the batch of 6 samples"):
        check_microbatches((torch.zeros(6, 3),), None, 4)
    with pytest.raises(ValueError, match=r"found no tensor in the batch"):
        check_microbatches(([1, 2],), None, 2)


def test_predict_inputs():
    from lightning_shard.trainer._pipeline import predict_inputs

    module = tiny_gpt()
    x, y = torch.zeros(2, 3), torch.ones(2, 3)
    assert predict_inputs(module, (x, y)) == (x,)
    assert predict_inputs(module, x)[0] is x
    module.pipeline_batch = lambda batch: (batch["tokens"], None)  # type: ignore[attr-defined]
    assert predict_inputs(module, {"tokens": y})[0] is y


def test_resume_takes_param_names_from_the_live_optimizer_and_hyperparameters_from_the_checkpoint():
    from lightning_shard.engines.fsdp.state import with_live_params as _with_live_params

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # another stage's names, as DCP keeps one stage's copy of the groups
    saved = {"state": {}, "param_groups": [{"lr": 0.5, "params": ["blocks.3.weight"]}]}
    groups = _with_live_params(model, optimizer, saved)["param_groups"]
    assert groups[0]["params"] == ["weight", "bias"] and groups[0]["lr"] == 0.5
    two = {"state": {}, "param_groups": [{"lr": 0.1, "params": ["weight"]}, {"lr": 0.1, "params": ["bias"]}]}
    with pytest.raises(ValueError, match=r"has 2 param groups but configure_optimizers\(\) made 1"):
        _with_live_params(model, optimizer, two)
