"""Hugging Face's own tensor-parallel styles on 2 gloo ranks give one process's loss and gradients: Qwen3-MoE's
``replicated_with_grad_allreduce`` q/k norms and ``moe_tp_experts`` (``packed_colwise`` gate_up, ``rowwise`` down),
DeepSeek-V3's experts and shared experts, each split by the plan the model carries."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_shard.demos.ranks import run_ranks

pytestmark = pytest.mark.multirank

transformers = pytest.importorskip("transformers")


def _model(kind: str) -> Any:
    torch.manual_seed(0)
    if kind == "qwen3-moe":
        config = transformers.Qwen3MoeConfig(
            vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, head_dim=16, num_experts=8, num_experts_per_tok=2,
        )  # fmt: skip
    else:
        config = transformers.DeepseekV3Config(
            vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
            first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
            num_experts_per_tok=2, n_group=2, topk_group=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=16,
        )  # fmt: skip
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norms away from 1, so that a gradient summed over the wrong ranks shows
        for param in model.parameters():
            param.normal_(0, 0.05) if param.dim() > 1 else param.uniform_(0.5, 1.5)
    return model


def _compare(kind: str) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from lightning_shard.parallel.plan import apply_tensor_parallel

    dist.init_process_group("gloo")
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    whole, split = _model(kind), _model(kind)
    reference = whole(ids, labels=ids).loss
    reference.backward()
    plan = apply_tensor_parallel(split, init_device_mesh("cpu", (2,)), None)
    loss = split(ids, labels=ids).loss
    loss.backward()
    worst = 0.0
    for (name, param), (_, ref) in zip(split.named_parameters(), whole.named_parameters(), strict=True):
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        assert grad is not None and ref.grad is not None, name
        worst = max(worst, float((grad - ref.grad).abs().max()) / float(ref.grad.abs().max()))
    styles = sorted({type(style).__name__ for style in plan.values() if not isinstance(style, str)})
    return {"loss": (float(loss), float(reference)), "worst": worst, "styles": styles}


@pytest.mark.parametrize(
    "kind, styles",
    [
        ("qwen3-moe", ["ExpertsTensorParallel", "ReplicatedGradAllReduce"]),
        ("deepseek-v3", ["ExpertsTensorParallel"]),
    ],
)
def test_hugging_face_styles_match_one_process(kind, styles):
    for result in run_ranks(_compare, kind):
        assert result["styles"] == styles
        assert result["loss"][0] == pytest.approx(result["loss"][1], abs=1e-5)
        assert result["worst"] < 1e-4
