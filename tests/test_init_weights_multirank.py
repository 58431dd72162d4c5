"""Start from full pretrained weights: a Hugging Face causal LM saved with ``save_pretrained``,
fine-tuned through ``ShardStrategy(stage=3, init_weights=DIR)`` on 2 ranks, follows the
single-process fine-tune from the same weights (fp32, SGD and AdamW)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_shard import ShardStrategy
from lightning_shard.demos.ranks import run_ranks
from tests.helpers import SEQ, CausalLM, LossRecorder, loader, tiny_llama_config, trainer_kwargs

transformers = pytest.importorskip("transformers")


def _config() -> Any:
    return tiny_llama_config(max_position_embeddings=SEQ)


def _pretrained(root: Path) -> Path:
    torch.manual_seed(123)
    model = transformers.LlamaForCausalLM(_config())
    with torch.no_grad():  # not the default init, so a model that skipped loading could not match
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    out = root / "tiny-llama"
    model.save_pretrained(out, max_shard_size="40KB")
    return out


def _finetune(
    devices: int, strategy: Any, optimizer: str, path: str, configure_model: bool = False
) -> list[float]:
    recorder = LossRecorder()
    trainer = L.Trainer(
        devices=devices, strategy=strategy, callbacks=[recorder], **trainer_kwargs(max_steps=4)
    )
    if configure_model:  # built straight into shards in configure_model: asked for with empty_init=True
        with trainer.init_module(empty_init=True):
            model = CausalLM(_config(), optimizer, build_in_configure_model=True)
    else:
        with trainer.init_module(empty_init=devices > 1):
            model = CausalLM(_config(), optimizer)
        if devices == 1:  # the reference: the whole model, loaded the way users do without sharding
            model.model.load_state_dict(transformers.LlamaForCausalLM.from_pretrained(path).state_dict())
    trainer.fit(model, loader(8 // devices))
    return recorder.losses


def _sharded(path: str) -> dict[str, list[float]]:
    out = {}
    for optimizer in ("sgd", "adamw"):
        out[f"fsdp-{optimizer}"] = _finetune(2, ShardStrategy(stage=3, init_weights=path), optimizer, path)
    # Stage 1 allocates whole replicas of the meta model: the tied embedding must stay tied (the file
    # stores it once).
    out["stage1-sgd"] = _finetune(2, ShardStrategy(stage=1, init_weights=path), "sgd", path)
    return out


def _deepspeed(path: str) -> dict[str, list[float]]:
    strategy = ShardStrategy(stage=3, engine="deepspeed", init_weights=path)
    return {"deepspeed-sgd": _finetune(2, strategy, "sgd", path, configure_model=True)}


def _reference(path: str) -> dict[str, list[float]]:
    return {optimizer: _finetune(1, "auto", optimizer, path) for optimizer in ("sgd", "adamw")}


def test_hf_llama_finetune_from_safetensors_follows_one_process(tmp_path):
    path = str(_pretrained(tmp_path))
    assert (Path(path) / "model.safetensors.index.json").exists()  # sharded files, HF layout
    reference = _reference(path)
    for rank in run_ranks(_sharded, path):
        for optimizer in ("sgd", "adamw"):
            torch.testing.assert_close(rank[f"fsdp-{optimizer}"], reference[optimizer], rtol=1e-5, atol=0)
        torch.testing.assert_close(rank["stage1-sgd"], reference["sgd"], rtol=1e-5, atol=0)


@pytest.mark.deepspeed
def test_hf_llama_deepspeed_zero3_configure_model_with_init_weights_follows_one_process(tmp_path):
    path = str(_pretrained(tmp_path))
    reference = _reference(path)
    for rank in run_ranks(_deepspeed, path):
        torch.testing.assert_close(rank["deepspeed-sgd"], reference["sgd"], rtol=1e-5, atol=0)
