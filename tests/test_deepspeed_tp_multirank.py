"""Tensor parallelism under the DeepSpeed engine (DeepSpeed's AutoTP): a tiny Hugging Face ``LlamaForCausalLM`` on
2 ranks with ``ShardStrategy(engine="deepspeed", stage=0..3, tensor_parallel_size=2)`` follows one process that reads
the same rows (the whole tensor-parallel group reads one batch: Lightning's injected sampler, sized by
``ParallelDims``), step by step and to the final weights (fp32, SGD and AdamW, clipping on); a checkpoint resumes on
the same layout, and a different layout is refused. A tiny Qwen2 (q/k/v biases, split with their columns) follows
``DDPStrategy`` on the same 2 ranks and rows."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch.multiprocessing import ProcessRaisedException
from torch.utils.data import DataLoader, DistributedSampler

from lightning_shard import ShardStrategy
from lightning_shard.checkpoint import load_model_weights
from lightning_shard.demos.ranks import run_ranks
from tests.helpers import (
    SEQ,
    CausalLM,
    LossRecorder,
    tiny_llama_config,
    tiny_qwen2_config,
    token_dataset,
    trainer_kwargs,
)

pytest.importorskip("deepspeed")
transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.multirank, pytest.mark.deepspeed]

TP, BATCH, HIDDEN = 2, 8, 32
# The gradient norm of this model's first steps is ~0.5: a clip at 0.3 cuts every step, so a norm off by a
# factor (a slice counted twice, a replicated weight counted per rank) moves the SGD runs.
CLIP = 0.3
#: (ZeRO stage, optimizer, gradient_clip_val): every stage, SGD (gradient-scale sensitive) and AdamW.
CASES = [
    (0, "sgd", CLIP),
    (1, "sgd", CLIP),
    (1, "adamw", None),
    (2, "sgd", None),
    (2, "adamw", CLIP),
    (3, "sgd", CLIP),
]


class Model(CausalLM):
    """AdamW at eps 1e-5, lr 1e-3: its first steps divide each gradient by its own magnitude plus eps, so a
    gradient near zero whose fp32 rounding differs with the split matmuls' summation order (~1e-10) moves the
    weights by up to lr x 1e-10 / eps. At torch's eps 1e-8 and lr 1e-2 that was 3.3e-5 (losses still equal to
    1e-7); here it stays under 1e-7."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.5)
        return torch.optim.AdamW(self.parameters(), lr=1e-3, eps=1e-5)


class Probe(L.Callback):
    """How q_proj / o_proj are held at the start (each rank's slice, their biases' where they have one), and every
    full weight at the end (ZeRO-3's partitions gathered, then AutoTP's slices)."""

    def __init__(self) -> None:
        self.local: dict[str, Any] = {}
        self.weights: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        attention = pl_module.model.model.layers[0].self_attn
        for name in ("q_proj", "o_proj"):
            layer = getattr(attention, name)
            self.local[name] = (type(layer).__name__, _local_shape(layer.weight))
            if layer.bias is not None:
                self.local[f"{name}.bias"] = _local_shape(layer.bias)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.weights = gathered(pl_module)


def _local_shape(param: torch.Tensor) -> tuple[int, ...]:
    return tuple(getattr(param, "ds_shape", param.shape))


def gathered(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    import deepspeed
    from deepspeed.module_inject.layers import GatherReplacedLayerParams

    out = {}
    for prefix, sub in module.named_modules():
        named = list(sub.named_parameters(recurse=False))
        params = [p for _, p in named]
        if not params:
            continue
        with deepspeed.zero.GatheredParameters(params), GatherReplacedLayerParams(params, sub, enabled=True):
            for name, p in named:
                out[f"{prefix}.{name}"] = p.detach().float().clone()
    return out


def _fit(
    devices: int,
    strategy: Any,
    optimizer: str,
    clip: float | None,
    config: Any = None,
    data_parallel: int | None = None,
) -> tuple[list[float], Probe]:
    """``BATCH`` rows a step over ``data_parallel`` ranks (default: ``devices / TP``); the tiny Llama by default."""
    recorder, probe = LossRecorder(), Probe()
    trainer = L.Trainer(
        devices=devices,
        strategy=strategy,
        callbacks=[recorder, probe],
        # The ranks read through the sampler Lightning injects (ShardStrategy's distributed_sampler_kwargs).
        **trainer_kwargs(max_steps=3, gradient_clip_val=clip, use_distributed_sampler=devices > 1),
    )
    torch.manual_seed(0)
    model = Model(config or tiny_llama_config(max_position_embeddings=SEQ), optimizer)
    dataset = token_dataset()
    if devices > 1:
        data = DataLoader(dataset, batch_size=BATCH // (data_parallel or devices // TP))
    else:  # what one tensor-parallel group reads: Lightning's sampler (shuffled, seed 0) over one data rank
        sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
        data = DataLoader(dataset, batch_size=BATCH, sampler=sampler)
    trainer.fit(model, data)
    return recorder.losses, probe


def _reference(optimizer: str, clip: float | None) -> tuple[list[float], dict[str, torch.Tensor]]:
    losses, probe = _fit(1, "auto", optimizer, clip)
    return losses, {k: v for k, v in probe.weights.items()}


def _ranks() -> list[dict[str, Any]]:
    out = []
    for stage, optimizer, clip in CASES:
        strategy = ShardStrategy(engine="deepspeed", stage=stage, tensor_parallel_size=TP)
        losses, probe = _fit(TP, strategy, optimizer, clip)
        out.append({"losses": losses, "local": probe.local, "weights": probe.weights})
    return out


def _same_weights(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], where: str) -> None:
    for name, weight in expected.items():
        torch.testing.assert_close(
            got[name], weight, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{where}, {n}: {m}"
        )


def test_autotp_every_stage_follows_one_process():
    references = [_reference(optimizer, clip) for _, optimizer, clip in CASES]
    results = run_ranks(_ranks, world_size=TP)
    for rank, cases in enumerate(results):
        for (stage, optimizer, clip), (ref_losses, ref_weights), got in zip(
            CASES, references, cases, strict=True
        ):
            where = f"rank {rank}, stage {stage}, {optimizer}, clip {clip}"
            assert len(ref_losses) == 3
            torch.testing.assert_close(
                got["losses"], ref_losses, rtol=1e-5, atol=0, msg=lambda m, w=where: f"{w}: {m}"
            )
            # The feature acted: each rank holds half of q_proj's rows (column-parallel) and o_proj's columns.
            assert got["local"] == {
                "q_proj": ("LinearLayer", (HIDDEN // TP, HIDDEN)),
                "o_proj": ("LinearAllreduce", (HIDDEN, HIDDEN // TP)),
            }, where
            assert got["weights"].keys() == ref_weights.keys(), where
            _same_weights(got["weights"], ref_weights, where)


def _save_resume(folder: str, resume: str | None, tensor_parallel_size: int = TP) -> list[float]:
    recorder = LossRecorder()
    trainer = L.Trainer(
        devices=2,
        strategy=ShardStrategy(engine="deepspeed", stage=1, tensor_parallel_size=tensor_parallel_size),
        callbacks=[recorder, ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_top_k=-1)],
        **trainer_kwargs(max_steps=4, enable_checkpointing=True, use_distributed_sampler=True),
    )
    torch.manual_seed(0)
    # 16 rows, batch 8: an epoch is 2 steps, so the step-2 checkpoint is an epoch's end (a plain loader resumed
    # mid-epoch would replay the epoch's first rows).
    data = DataLoader(token_dataset(16), batch_size=BATCH)
    trainer.fit(Model(tiny_llama_config(max_position_embeddings=SEQ), "adamw"), data, ckpt_path=resume)
    return recorder.losses


def test_autotp_resumes_on_its_layout_and_refuses_another(tmp_path):
    whole = run_ranks(_save_resume, str(tmp_path), None)[0]
    ckpt = tmp_path / "epoch=0-step=2.ckpt"
    assert sorted(p.name for p in (ckpt / "checkpoint").glob("mp_rank_*")) == [
        "mp_rank_00_model_states.pt",
        "mp_rank_01_model_states.pt",
    ]
    resumed = run_ranks(_save_resume, str(tmp_path / "again"), str(ckpt))[0]
    torch.testing.assert_close(resumed, whole[2:], rtol=1e-5, atol=0)
    with pytest.raises(
        ProcessRaisedException, match=r"written with tensor_parallel_size=2 over 1 data-parallel"
    ):
        run_ranks(_save_resume, str(tmp_path / "other"), str(ckpt), 1)
    with pytest.raises(ValueError, match=r"tensor parallelism \(AutoTP, 2 tensor-parallel ranks\)"):
        load_model_weights(ckpt)


def _tp2_dp2() -> dict[str, Any]:
    # 4 ranks, batch 4 each: the tensor-parallel pairs (0, 1) and (2, 3) read one batch each, 8 rows a step.
    losses, probe = _fit(4, ShardStrategy(engine="deepspeed", stage=1, tensor_parallel_size=TP), "sgd", CLIP)
    return {"losses": losses, "local": probe.local, "weights": probe.weights}


def test_autotp_two_by_two_follows_one_process():
    """TP2 x DP2 on 4 ranks at ZeRO-1: DeepSpeed's data-parallel groups are ``ParallelDims``' (ranks 0 and 2, 1
    and 3), so the two tensor-parallel pairs read the two halves of the rows one process reads at each step
    (Lightning's sampler over 2 data-parallel ranks: step k's rows are the one-rank sampler's 8k..8k+7), and the
    weights end as that process's. (A sampler sized by the world, 4, hands a pair's two ranks different rows:
    the engine's first-step check refuses that, naming the fix.)"""
    ref_losses, ref_weights = _reference("sgd", CLIP)
    results = run_ranks(_tp2_dp2, world_size=4)
    for rank, got in enumerate(results):
        assert got["local"]["q_proj"] == ("LinearLayer", (HIDDEN // TP, HIDDEN)), rank
        _same_weights(got["weights"], ref_weights, f"rank {rank}")
        # the logged loss is the mean over every rank's rows: the one process's over the 8 rows
        torch.testing.assert_close(
            got["losses"], ref_losses, rtol=1e-5, atol=0, msg=lambda m, r=rank: f"{r}: {m}"
        )


def _qwen2() -> dict[str, Any]:
    """AutoTP at ZeRO-1, then DDP, on the same 2 ranks: DDP's ranks read 4 rows each, the two halves of the 8 the
    tensor-parallel pair reads together (Lightning's sampler over 2 ranks, and over 1)."""
    config = tiny_qwen2_config(max_position_embeddings=SEQ)
    strategy = ShardStrategy(engine="deepspeed", stage=1, tensor_parallel_size=TP)
    tp_losses, tp = _fit(TP, strategy, "sgd", None, config)
    ddp_losses, ddp = _fit(TP, DDPStrategy(), "sgd", None, config, data_parallel=TP)
    # DeepSpeed keeps AutoTP's groups at module level: once the first Trainer is done with them they are dropped,
    # so a DeepSpeed run without tensor parallelism in the same processes sets up (and follows DDP).
    dp_losses, _ = _fit(TP, ShardStrategy(engine="deepspeed", stage=1), "sgd", None, config, data_parallel=TP)
    return {"tp": (tp_losses, tp.local, tp.weights), "ddp": (ddp_losses, ddp.weights), "dp": dp_losses}


def test_autotp_qwen2_follows_ddp_and_leaves_no_groups_for_the_next_run():
    """Qwen2's q/k/v carry biases: AutoTP splits each with its layer's output columns. Plain SGD without clipping,
    so a gradient off by a factor (a bias slice reduced over the tensor-parallel pair, or not reduced where it
    must be) moves the losses and the weights."""
    for rank, got in enumerate(run_ranks(_qwen2, world_size=TP)):
        (losses, local, weights), (ddp_losses, ddp_weights) = got["tp"], got["ddp"]
        assert len(ddp_losses) == 3
        torch.testing.assert_close(losses, ddp_losses, rtol=1e-5, atol=0, msg=lambda m, r=rank: f"{r}: {m}")
        assert local == {
            "q_proj": ("LinearLayer", (HIDDEN // TP, HIDDEN)),
            "q_proj.bias": (HIDDEN // TP,),
            "o_proj": ("LinearAllreduce", (HIDDEN, HIDDEN // TP)),
        }, rank
        assert weights.keys() == ddp_weights.keys() and any(k.endswith("v_proj.bias") for k in weights), rank
        _same_weights(weights, ddp_weights, f"rank {rank}, Qwen2 against DDP")
        torch.testing.assert_close(
            got["dp"], ddp_losses, rtol=1e-5, atol=0, msg=lambda m, r=rank: f"{r}: {m}"
        )
