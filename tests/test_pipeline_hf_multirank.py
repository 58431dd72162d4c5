"""A Hugging Face model split by its own pipeline plan: a tiny random ``LlamaForCausalLM`` (built here, its
defaults left on: ``use_cache``) in 2 stages of ``ShardStrategy(stage=3, pipeline_parallel_size=2)``
follows the single-process run (SGD and AdamW, accumulation 2, clipping on), and validates after fit; so does
the same model with its head tied to the input embedding (``tie_word_embeddings=True``).

The LightningModule's forward is the one a user has without stages (``self.model(input_ids=x).logits``):
the strategy cuts ``model.layers`` and puts identities where a stage does not run the embeddings, the
final norm or the head, so the later stage's hidden states go in where the token ids did.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch

from lightning_shard import ShardStrategy
from lightning_shard.demos.ranks import run_ranks
from tests.helpers import SEQ, CausalLM, LossRecorder, full_weights, tiny_llama_config, trainer_kwargs
from tests.test_parity_multirank import CLIP
from tests.test_pipeline_multirank import BATCH, WEIGHT_ATOL, _loader

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.multirank


class PipeLlama(CausalLM):
    """The tests' Hugging Face causal LM with the pipeline contract's loss, and a validation loss."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits

    def pipeline_loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), target.flatten())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.pipeline_loss(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", self.pipeline_loss(self(x), y))


def _fit(optimizer: str, world: int, tied: bool = False) -> dict[str, Any]:
    recorder = LossRecorder()
    pp = 2 if world > 1 else 1
    strategy = ShardStrategy(stage=3, pipeline_parallel_size=2, microbatches=2) if world > 1 else "auto"
    trainer = L.Trainer(
        devices=world,
        strategy=strategy,
        callbacks=[recorder],
        **trainer_kwargs(
            max_steps=3, accumulate_grad_batches=2, gradient_clip_val=CLIP, gradient_clip_algorithm="norm"
        ),
    )
    torch.manual_seed(0)
    config = tiny_llama_config(num_hidden_layers=4, tie_word_embeddings=tied, max_position_embeddings=SEQ)
    model = PipeLlama(config, optimizer)
    trainer.fit(model, _loader(world, pp, BATCH))
    val = trainer.validate(model, _loader(world, pp, BATCH), verbose=False)[0]["val_loss"]
    return {"losses": recorder.losses, "weights": full_weights(trainer), "val_loss": val}


def _both(world: int) -> dict[str, Any]:
    runs = {optimizer: _fit(optimizer, world) for optimizer in ("sgd", "adamw")}
    # the head tied to the input embedding (as in Llama 3.2 1B, Qwen2 0.5B, SmolLM): a copy on each stage
    return {**runs, "tied sgd": _fit("sgd", world, tied=True)}


def test_hf_llama_splits_by_its_own_plan_and_follows_one_process():
    ranks = run_ranks(_both, 2, world_size=2)
    expected = _both(1)
    for run, reference in expected.items():
        optimizer = run.removeprefix("tied ")
        stage0, stage1 = (rank[run]["weights"] for rank in ranks)
        # the plan's placement: embeddings and the first half of the layers, then the rest and the head
        assert "model.model.embed_tokens.weight" in stage0 and "model.lm_head.weight" in stage1
        assert {k.split(".")[3] for k in stage0 if ".layers." in k} == {"0", "1"}
        assert {k.split(".")[3] for k in stage1 if ".layers." in k} == {"2", "3"}
        merged = {**stage0, **stage1}
        assert sorted(merged) == sorted(reference["weights"])
        if run.startswith("tied"):
            tied = stage0["model.model.embed_tokens.weight"], stage1["model.lm_head.weight"]
            torch.testing.assert_close(*tied, rtol=0, atol=0)  # the copies stayed one parameter
        for rank in ranks:
            result = rank[run]
            assert len(result["losses"]) == 6
            torch.testing.assert_close(result["losses"], reference["losses"], rtol=1e-5, atol=0)
            torch.testing.assert_close(result["val_loss"], reference["val_loss"], rtol=1e-5, atol=0)
        for key, value in reference["weights"].items():
            torch.testing.assert_close(
                merged[key], value, rtol=1e-5, atol=WEIGHT_ATOL[optimizer], msg=lambda m, k=key: f"{k}: {m}"
            )
