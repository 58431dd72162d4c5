"""The DeepSpeed engine and offload on 2 CPU ranks: offload convergence, NVMe swap, resume.

Parity of every DeepSpeed stage with one process lives in test_parity_multirank.py (SGD and AdamW).
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_shard import ShardStrategy
from lightning_shard.checkpoint import load_model_weights
from lightning_shard.demos.ranks import run_ranks
from tests.helpers import LossRecorder, loader, tiny_gpt, trainer_kwargs

pytest.importorskip("deepspeed")
pytestmark = [pytest.mark.multirank, pytest.mark.deepspeed]


def _fit(
    strategy_kwargs: dict, precision: str = "32-true", probe: L.Callback | None = None, model=None, **kwargs
):
    recorder = LossRecorder()
    callbacks = [recorder] + ([probe] if probe is not None else [])
    trainer = L.Trainer(
        devices=2,
        strategy=ShardStrategy(**strategy_kwargs),
        precision=precision,
        callbacks=callbacks,
        **trainer_kwargs(**kwargs),
    )
    trainer.fit(model or tiny_gpt(), loader(4))
    return recorder.losses, trainer.strategy.state_bytes()


class _SwapProbe(L.Callback):
    def __init__(self, nvme_path: str) -> None:
        self.nvme_path = Path(nvme_path)
        self.swap_files: list[str] = []
        self.state: dict = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == 2:
            self.swap_files = sorted(
                str(p.relative_to(self.nvme_path)) for p in self.nvme_path.rglob("*") if p.is_file()
            )
            self.state = trainer.strategy.state_bytes()


def _offload(nvme_path: str) -> dict:
    # DeepSpeed swaps only tensors of at least one aio block (1 MiB): d_model 192 gives 1.7 MiB per rank.
    def model():
        return tiny_gpt(d_model=192, n_heads=4)

    out = {"none": _fit({"stage": 3, "engine": "deepspeed"}, model=model())}
    out["cpu"] = _fit({"stage": 3, "offload_optimizer": "cpu"}, model=model())
    probe = _SwapProbe(nvme_path)
    out["nvme"] = _fit(
        {"stage": 3, "offload_optimizer": "nvme", "nvme_path": nvme_path}, probe=probe, model=model()
    )
    out["swap_files"], out["nvme_state"] = probe.swap_files, probe.state
    out["after"] = sorted(p.name for p in Path(nvme_path).iterdir())
    return out


@pytest.mark.needs_libaio
def test_cpu_and_nvme_optimizer_offload_converge_like_no_offload(tmp_path):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    (nvme / "keep.txt").write_text("user data")
    results = run_ranks(_offload, str(nvme))
    rank0 = results[0]
    base_losses, base_state = rank0["none"]
    torch.testing.assert_close(rank0["cpu"][0], base_losses, rtol=1e-4, atol=0)
    torch.testing.assert_close(rank0["nvme"][0], base_losses, rtol=1e-4, atol=0)
    for rank, result in enumerate(results):
        assert any(f.startswith(f"lightning_shard_swap/rank{rank}/") for f in result["swap_files"]), result[
            "swap_files"
        ]
        held = result["nvme_state"]["optimizer"]
        in_memory = held["host"] + held["accelerator"]
        assert held["nvme"] > 0
        assert in_memory <= 0.1 * (
            base_state["optimizer"]["host"] + base_state["optimizer"]["accelerator"]
        ), held
    assert rank0["after"] == ["keep.txt"]  # swap files removed at teardown, nothing else touched


def _save_resume(ckpt_dir: str, resume: str | None):
    recorder = LossRecorder()
    trainer = L.Trainer(
        devices=2,
        strategy=ShardStrategy(stage=3, engine="deepspeed"),
        callbacks=[recorder, ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=5, save_top_k=-1)],
        **trainer_kwargs(max_steps=10, enable_checkpointing=True),
    )
    trainer.fit(tiny_gpt(), loader(4, n=40), ckpt_path=resume)
    return recorder.losses


def test_deepspeed_exact_resume_and_consolidate(tmp_path):
    reference = run_ranks(_save_resume, str(tmp_path), None)[0]
    ckpt = tmp_path / "epoch=0-step=5.ckpt"
    assert ckpt.is_dir() and not list(tmp_path.glob("*.tmp"))
    resumed = run_ranks(_save_resume, str(tmp_path / "again"), str(ckpt))[0]
    torch.testing.assert_close(resumed, reference[5:], rtol=1e-5, atol=0)
    weights = load_model_weights(tmp_path / "epoch=1-step=10.ckpt")
    model = tiny_gpt()
    model.load_state_dict(weights)  # strict: every name, every shape
    assert any((model.state_dict()[k] != tiny_gpt().state_dict()[k]).any() for k in weights), (
        "weights not trained"
    )
