"""After ``trainer.fit``, a script calls the trained network directly, as under ``DDPStrategy``.

A Hugging Face causal LM held as ``self.net``: ``model.net(x)`` and ``model.net.generate(...)`` on every rank
give DDP's logits and tokens at stages 1-3 (FSDP engine) and stage 3 (DeepSpeed engine), with the
parameters sharded again after each call, and a later ``trainer.test`` still working.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from torch.distributed.tensor import DTensor

from lightning_shard import ShardStrategy
from lightning_shard.demos.ranks import run_ranks
from tests.helpers import SEQ, VOCAB, loader, tiny_llama_config, trainer_kwargs

pytestmark = pytest.mark.multirank


class HoldsLM(L.LightningModule):
    """A tiny Llama with its defaults, held as ``self.net`` (tied embedding and head: the root's own unit)."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        torch.manual_seed(0)
        self.net = transformers.LlamaForCausalLM(tiny_llama_config())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.net(input_ids=x).logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self.net(input_ids=x).logits
        self.log("test_loss", torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _after_fit(strategy: Any, keep: dict[str, Any]) -> dict[str, Any]:
    trainer = L.Trainer(devices=2, strategy=strategy, **trainer_kwargs(max_steps=2))
    model = HoldsLM()
    trainer.fit(model, train_dataloaders=loader(4, n=16))
    prompt = torch.arange(SEQ, dtype=torch.long).remainder(VOCAB)[None].repeat(2, 1)
    out: dict[str, Any] = {"logits": model.net(prompt).logits.detach().clone()}
    out["tokens"] = model.net.generate(prompt[:, :6], max_new_tokens=4, do_sample=False)
    with torch.no_grad():  # twice in a row, and without grad
        out["logits_again"] = model.net(input_ids=prompt).logits.clone()
    # Sharded again between calls (FSDP engine): nothing gathered stays behind.
    out["sharded"] = all(isinstance(p, DTensor) for p in model.parameters())
    out["test"] = trainer.test(model, dataloaders=loader(4, n=8), verbose=False)[0]["test_loss"]
    out["logits_after_test"] = model.net(prompt).logits.detach().clone()
    keep["model"], keep["prompt"] = model, prompt
    return out


def _all(_: None = None) -> dict[str, dict[str, Any]]:
    from lightning.pytorch.strategies import DDPStrategy

    strategies = {
        "fsdp stage 3": lambda: ShardStrategy(stage=3),
        "fsdp stage 2": lambda: ShardStrategy(stage=2),
        "fsdp stage 1": lambda: ShardStrategy(stage=1),
        "deepspeed stage 3": lambda: ShardStrategy(stage=3, engine="deepspeed"),
        "ddp": DDPStrategy,
    }
    kept: dict[str, dict[str, Any]] = {name: {} for name in strategies}
    out = {name: _after_fit(make(), kept[name]) for name, make in strategies.items()}
    # Once the process group is gone, sharded parameters cannot be gathered: the error names the way out.
    torch.distributed.destroy_process_group()
    stage3 = kept["fsdp stage 3"]
    with pytest.raises(RuntimeError, match="lightning-shard consolidate"):
        stage3["model"].net(stage3["prompt"])
    return out


@pytest.mark.deepspeed
def test_submodule_calls_after_fit_match_ddp():
    ranks = run_ranks(_all, None)
    for rank, result in enumerate(ranks):
        ddp = result.pop("ddp")
        for name, got in result.items():
            where = f"{name}, rank {rank}"
            for key in ("logits", "logits_again", "logits_after_test"):
                torch.testing.assert_close(got[key], ddp[key], rtol=1e-5, atol=1e-6, msg=f"{key}: {where}")
            assert torch.equal(got["tokens"], ddp["tokens"]), where
            torch.testing.assert_close(got["test"], ddp["test"], rtol=1e-5, atol=0, msg=where)
        for stage in (2, 3):
            assert result[f"fsdp stage {stage}"]["sharded"], f"stage {stage} left parameters gathered"
