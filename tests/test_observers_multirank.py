"""The monitors and activation checkpointing are observers: a run with them trains bit for bit like one without.

One 2-rank job trains Hugging Face GPT-2 at its default config (dropout on, ``use_cache=True``) beside a
small BatchNorm tower (running statistics are buffers a training forward moves) under Lightning's
DDPStrategy, Lightning's ModelParallelStrategy (FSDP2 applied by hand in ``configure_model``) and
``ShardStrategy(stage=3)``, each with and without ``[MFUMonitor(), StragglerDetector()]`` and with and
without ``ActivationCheckpointing``, and compares per-step losses and final weights and buffers exactly.
Under ShardStrategy, Lightning's own ThroughputMonitor also gets FLOPs and a peak and logs MFU.
"""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ThroughputMonitor
from torch import nn

from lightning_shard import ActivationCheckpointing, MFUMonitor, ShardStrategy, StragglerDetector
from lightning_shard.demos.ranks import run_ranks
from tests.helpers import VOCAB, LossRecorder, MemoryLogger, loader, trainer_kwargs

pytestmark = pytest.mark.multirank

STEPS = 4


class BNBlock(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.lin, self.bn, self.drop = nn.Linear(d, d), nn.BatchNorm1d(d), nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(torch.relu(self.bn(self.lin(x))))  # (b, d)


class Tower(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(BNBlock(d) for _ in range(2))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Observed(L.LightningModule):
    """GPT-2 (default config: dropout, key/value cache) and a BatchNorm tower, one loss, plain SGD."""

    def __init__(self, fsdp_by_hand: bool = False) -> None:
        super().__init__()
        import transformers

        torch.manual_seed(0)
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32)
        self.gpt = transformers.GPT2LMHeadModel(config)
        self.tower = Tower()
        self.fsdp_by_hand = fsdp_by_hand

    def configure_model(self) -> None:
        if not self.fsdp_by_hand:
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in [*self.gpt.transformer.h, *self.tower.blocks]:
            fully_shard(block, mesh=mesh)
        fully_shard(self.gpt, mesh=mesh)
        fully_shard(self.tower, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch  # (b, SEQ) token ids
        logits = self.gpt(input_ids=x).logits  # (b, SEQ, VOCAB)
        lm = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        features = x[:, :16].float() / VOCAB  # (b, 16)
        regression = F.mse_loss(self.tower(features).squeeze(-1), y[:, 0].float() / VOCAB)
        return lm + regression

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class FinalState(L.Callback):
    """Full weights and buffers at the end of training, gathered while the process group is up."""

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] = {}

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
        state = get_model_state_dict(pl_module, options=options)
        self.state = {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in state.items()
        }


def _monitors() -> list[L.Callback]:
    # Every 2 batches, so their all_gathers run inside the 4 steps.
    return [MFUMonitor(log_every_n_steps=2), StragglerDetector(every_n_steps=2)]


def _checkpointing() -> list[L.Callback]:
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    return [ActivationCheckpointing(blocks=[GPT2Block, BNBlock])]


CONFIGS = {
    "plain": list,
    "monitors": _monitors,
    "checkpointing": _checkpointing,
    "checkpointing+monitors": lambda: _checkpointing() + _monitors(),
}


def _fit(strategy: Any, callbacks: list[L.Callback], fsdp_by_hand: bool = False, **kwargs: Any) -> dict:
    recorder, final = LossRecorder(), FinalState()
    trainer = L.Trainer(
        devices=2,
        strategy=strategy,
        callbacks=[recorder, final, *callbacks],
        **trainer_kwargs(max_steps=STEPS, **kwargs),
    )
    trainer.fit(Observed(fsdp_by_hand), loader(4))
    return {"losses": recorder.losses, "state": final.state, "trainer": trainer}


def _all_runs() -> dict[str, Any]:
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    strategies = {
        "ddp": (lambda: DDPStrategy(), False),
        "fsdp2": (lambda: ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), True),
        "zero3": (lambda: ShardStrategy(stage=3), False),
    }
    out: dict[str, Any] = {}
    for name, (strategy, by_hand) in strategies.items():
        for label, callbacks in CONFIGS.items():
            run = _fit(strategy(), callbacks(), by_hand)
            out[f"{name}/{label}"] = {"losses": run["losses"], "state": run["state"]}
    logger = MemoryLogger()
    throughput = ThroughputMonitor(batch_size_fn=lambda batch: batch[0].size(0), window_size=2)
    run = _fit(ShardStrategy(stage=3), [throughput], logger=logger, log_every_n_steps=1)
    out["zero3/throughput"] = {"losses": run["losses"], "state": run["state"]}
    out["throughput_metrics"] = logger.metrics
    out["flops_per_batch"] = run["trainer"].lightning_module.flops_per_batch
    out["rank"] = int(os.environ["RANK"])
    return out


def test_monitors_and_checkpointing_change_no_number_under_ddp_fsdp2_and_zero3():
    ranks = run_ranks(_all_runs)
    for rank_out in ranks:
        for name in ("ddp", "fsdp2", "zero3"):
            reference = rank_out[f"{name}/plain"]
            assert len(reference["losses"]) == STEPS
            assert any(".bn.running_mean" in k for k in reference["state"])  # buffers are compared too
            labels = [*CONFIGS, "throughput"] if name == "zero3" else list(CONFIGS)
            for label in labels:
                got, where = rank_out[f"{name}/{label}"], f"rank {rank_out['rank']} {name} {label}"
                assert got["losses"] == reference["losses"], (
                    f"{where}: {got['losses']} != {reference['losses']}"
                )
                assert got["state"].keys() == reference["state"].keys(), where
                for key, value in reference["state"].items():
                    assert torch.equal(got["state"][key], value), f"{where}: {key} differs"
    # Lightning's ThroughputMonitor (rank 0 logs) got FLOPs per batch and a CPU peak: MFU is logged.
    rank0 = next(r for r in ranks if r["rank"] == 0)
    mfu = [m["train/device/mfu"] for m in rank0["throughput_metrics"] if "train/device/mfu" in m]
    assert len(mfu) == STEPS - 1 and all(0 < value < 10 for value in mfu), rank0["throughput_metrics"]
    assert rank0["flops_per_batch"] is None  # after the fit it holds no stale number
