"""HSDP and tensor parallelism on 4 CPU ranks: parity with one process, resharding between layouts,
and the rest of the strategy (meta construction, init_weights, activation checkpointing, skip_nonfinite,
MFU, the Trainer lifecycle) on the (replicate, shard, tp) mesh.

Parity runs with plain SGD as well as AdamW (AdamW hides a wrong gradient scale), with accumulation and
clipping on: the clip sees every layout's global norm (parameters on the (shard, tp) and shard meshes).
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_shard import MFUMonitor, ShardStrategy
from lightning_shard.demos.ranks import run_ranks
from tests.helpers import LossRecorder, loader, tiny_gpt, trainer_kwargs
from tests.test_parity_multirank import CLIP, reference, sgd_gpt

pytestmark = pytest.mark.multirank

WORLD = 4
NO_SEQUENCE = {
    "blocks.*.attn.qkv": "colwise",
    "blocks.*.attn.proj": "rowwise",
    "blocks.*.mlp.0": "colwise",
    "blocks.*.mlp.2": "rowwise",
}
# name -> (flags, tensor_parallel_size). The tiny GPT has 2 heads: T=2 puts one on each rank.
LAYOUTS: dict[str, dict[str, Any]] = {
    "tp2 x shard2, stage 3 (sequence parallel)": dict(stage=3, tensor_parallel_size=2),
    "tp2 x shard2, stage 3 (no sequence parallel)": dict(
        stage=3, tensor_parallel_size=2, tensor_parallel_plan=NO_SEQUENCE
    ),
    "tp2 x shard2, stage 2": dict(stage=2, tensor_parallel_size=2),
    "replicate2 x shard2, stage 3 (HSDP)": dict(stage=3, replicate_size=2),
    "replicate2 x shard2, stage 2 (HSDP)": dict(stage=2, replicate_size=2),
    "replicate2 x tp2, stage 3": dict(stage=3, replicate_size=2, tensor_parallel_size=2),
    "dp2 x tp2, stage 0": dict(stage=0, tensor_parallel_size=2),
}


class EvalGPT(L.LightningModule):
    """The tiny GPT with SGD, a validation loss, and a loss that can be made NaN on one rank and step."""

    def __init__(self, nan_at: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.inner = sgd_gpt()
        self.nan_at = nan_at

    def init_weights(self) -> None:
        self.inner.init_weights()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)

    def _loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        if self.nan_at == (self.global_rank, self.global_step):
            loss = loss * float("nan")
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.inner.configure_optimizers()


def _fit(
    flags: dict[str, Any],
    optimizer: str,
    accumulate: int = 2,
    clip: float | None = CLIP,
    model: L.LightningModule | None = None,
    **extra: Any,
):
    tp = flags.get("tensor_parallel_size", 1)
    recorder = LossRecorder()
    trainer = L.Trainer(
        devices=WORLD,
        strategy=ShardStrategy(**flags),
        callbacks=[recorder, *extra.pop("callbacks", [])],
        **trainer_kwargs(
            max_steps=3,
            accumulate_grad_batches=accumulate,
            gradient_clip_val=clip,
            gradient_clip_algorithm="norm",
            **extra,
        ),
    )
    if model is None:
        model = sgd_gpt() if optimizer == "sgd" else tiny_gpt()
    trainer.fit(model, loader(8 * tp // WORLD, tensor_parallel_size=tp))
    return recorder.losses, trainer


# AdamW is insensitive to a gradient's scale; it checks the sharded optimizer state on each kind of mesh.
ADAMW_LAYOUTS = (
    "tp2 x shard2, stage 3 (sequence parallel)",
    "replicate2 x shard2, stage 3 (HSDP)",
    "dp2 x tp2, stage 0",
)


def _layout_matrix(optimizer: str) -> dict[str, list[float]]:
    names = LAYOUTS if optimizer == "sgd" else ADAMW_LAYOUTS
    return {name: _fit(LAYOUTS[name], optimizer)[0] for name in names}


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_every_layout_follows_one_process(optimizer):
    results = run_ranks(_layout_matrix, optimizer, world_size=WORLD)[0]
    expected = reference(optimizer, 2, CLIP)
    assert len(expected) == 6
    for name, losses in results.items():
        torch.testing.assert_close(
            losses, expected, rtol=1e-5, atol=0, msg=lambda m, n=name: f"{n}, {optimizer}: {m}"
        )


def _what_each_rank_holds() -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    _, trainer = _fit(dict(stage=3, tensor_parallel_size=2), "sgd", callbacks=[MFUMonitor()])
    gpt = trainer.lightning_module.model
    qkv = gpt.blocks[0].attn.qkv.weight
    assert isinstance(qkv, DTensor) and isinstance(gpt.tok_emb.weight, DTensor)
    _, one = _fit(dict(stage=3), "sgd", callbacks=[MFUMonitor()])
    return {
        "qkv_local": tuple(qkv.to_local().shape),
        "qkv_full": tuple(qkv.shape),
        "qkv_mesh": qkv.device_mesh.mesh_dim_names,
        "sampler": trainer.strategy.distributed_sampler_kwargs,
        "flops_tp2": trainer.callbacks[1].counted["model_flops"],
        "flops_tp1": one.callbacks[1].counted["model_flops"],
    }


def test_each_rank_holds_a_quarter_and_counts_its_own_flops():
    results = run_ranks(_what_each_rank_holds, world_size=WORLD)
    for rank, held in enumerate(results):
        # qkv (96 x 32): split by heads over tp (48 rows), then FSDP2 over shard: 24 x 32 per rank.
        assert held["qkv_full"] == (96, 32) and held["qkv_local"] == (24, 32)
        assert held["qkv_mesh"] == ("shard", "tp")
        assert held["sampler"] == {"num_replicas": 2, "rank": rank // 2}
        # Each rank computes half of the split layers' work on twice the batch of the T=1 run (4 dp ranks).
        assert held["flops_tp2"] < 2 * held["flops_tp1"]
        assert held["flops_tp2"] > held["flops_tp1"]


def _save(flags: dict[str, Any], ckpt_dir: str, async_checkpoint: bool = False) -> list[float]:
    return _run_ckpt(flags, 10, ckpt_dir=ckpt_dir, async_checkpoint=async_checkpoint)


def _run_ckpt(
    flags: dict[str, Any],
    max_steps: int,
    ckpt_dir: str | None = None,
    resume: str | None = None,
    async_checkpoint: bool = False,
) -> list[float]:
    import os

    world = int(os.environ.get("WORLD_SIZE", "1"))
    tp = flags.get("tensor_parallel_size", 1)
    recorder = LossRecorder()
    callbacks: list[L.Callback] = [recorder]
    if ckpt_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=5, save_top_k=-1))
    trainer = L.Trainer(
        devices=world,
        strategy=ShardStrategy(**flags, async_checkpoint=async_checkpoint),
        callbacks=callbacks,
        **trainer_kwargs(max_steps=max_steps, enable_checkpointing=ckpt_dir is not None),
    )
    trainer.fit(tiny_gpt(), loader(8 * tp // world, n=40, tensor_parallel_size=tp), ckpt_path=resume)
    return recorder.losses


TP2_SHARD2 = dict(stage=3, tensor_parallel_size=2)


def test_checkpoints_reshard_between_layouts(tmp_path):
    # Written by TP=2 x shard=2 (async), read by plain stage 3 on 2 ranks and on 1 rank.
    saved = run_ranks(_save, TP2_SHARD2, str(tmp_path / "tp"), True, world_size=WORLD)[0]
    ckpt = tmp_path / "tp" / "epoch=0-step=5.ckpt"
    assert (ckpt / ".metadata").is_file() and not list((tmp_path / "tp").glob("*.tmp"))
    for world in (2, 1):
        resumed = run_ranks(_run_ckpt, dict(stage=3), 10, None, str(ckpt), world_size=world)[0]
        torch.testing.assert_close(
            resumed, saved[5:], rtol=1e-5, atol=0, msg=lambda m, w=world: f"on {w}: {m}"
        )
    # And the reverse: written by plain stage 3 on 2 ranks, read by TP=2 x shard=2 and by HSDP.
    plain = run_ranks(_save, dict(stage=3), str(tmp_path / "plain"), world_size=2)[0]
    torch.testing.assert_close(plain, saved, rtol=1e-5, atol=0)
    ckpt = tmp_path / "plain" / "epoch=0-step=5.ckpt"
    for flags in (TP2_SHARD2, dict(stage=3, replicate_size=2)):
        resumed = run_ranks(_run_ckpt, flags, 10, None, str(ckpt), world_size=WORLD)[0]
        torch.testing.assert_close(resumed, plain[5:], rtol=1e-5, atol=0, msg=lambda m, f=flags: f"{f}: {m}")


def _with_the_rest(weights: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for policy in ("selective", "full"):
        flags = dict(TP2_SHARD2, activation_checkpointing=policy)
        out[f"checkpointing {policy}"] = _fit(flags, "sgd")[0]
    # Full weights into a model built on the meta device, split over tp and sharded over shard.
    strategy = ShardStrategy(**TP2_SHARD2, init_weights=weights)
    trainer = L.Trainer(devices=WORLD, strategy=strategy, **trainer_kwargs())
    with trainer.init_module(empty_init=True):
        model = sgd_gpt()
    out["init_weights"] = _fit(dict(TP2_SHARD2, init_weights=weights), "sgd", model=model)[0]
    # Built on meta and initialised per shard: copies of the embedding equal across tp, losses at ln(vocab).
    trainer = L.Trainer(devices=WORLD, strategy=ShardStrategy(**TP2_SHARD2), **trainer_kwargs())
    with trainer.init_module(empty_init=True):
        meta_model = EvalGPT()
    losses, trainer = _fit(TP2_SHARD2, "sgd", model=meta_model)
    out["meta_losses"] = losses
    local = meta_model.inner.model.tok_emb.weight.to_local().detach().clone()
    gathered = [torch.empty_like(local) for _ in range(WORLD)]
    dist.all_gather(gathered, local)
    out["meta_copies_equal"] = [torch.equal(gathered[r], gathered[r ^ 1]) for r in range(WORLD)]
    out["meta_shards_differ"] = not torch.equal(gathered[0], gathered[2])
    # The rest of the lifecycle on the same mesh: validate after fit.
    out["validate"] = trainer.validate(meta_model, loader(4, tensor_parallel_size=2), verbose=False)
    # Mixed precision on the same mesh: FSDP2 computes in bf16 over split layers, fp32 master weights.
    out["bf16"] = _fit(TP2_SHARD2, "sgd", precision="bf16-mixed")[0]
    # A NaN loss on one rank: every rank skips that step together.
    nan_model = EvalGPT(nan_at=(1, 1))
    losses, trainer = _fit(dict(TP2_SHARD2, skip_nonfinite=True), "sgd", accumulate=1, model=nan_model)
    out["skipped"], out["nan_losses"] = trainer.strategy.skipped_steps, losses
    return out


def test_the_rest_of_the_strategy_on_a_tp_mesh(tmp_path):
    weights = tmp_path / "gpt.pt"
    torch.save(sgd_gpt().state_dict(), weights)
    results = run_ranks(_with_the_rest, str(weights), world_size=WORLD)
    expected = reference("sgd", 2, CLIP)
    first = results[0]
    for name in ("checkpointing selective", "checkpointing full", "init_weights"):
        torch.testing.assert_close(
            first[name], expected, rtol=1e-5, atol=0, msg=lambda m, n=name: f"{n}: {m}"
        )
    # bf16 compute: close to the fp32 trajectory, not equal to it (it did run in bf16).
    torch.testing.assert_close(first["bf16"], expected, rtol=2e-2, atol=0)
    assert first["bf16"] != expected
    for held in results:
        assert all(held["meta_copies_equal"]) and held["meta_shards_differ"]
        # GPT-2's init, per shard: the first loss is where the reference's (same init scheme) starts.
        assert abs(held["meta_losses"][0] - expected[0]) < 0.05
        assert held["validate"][0]["val_loss"] > 0
        assert held["skipped"] == 1
