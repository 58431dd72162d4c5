"""DeepSpeed checkpoints travel: Lightning ``DeepSpeedStrategy``'s resume under ShardStrategy with both engines,
and a ZeRO checkpoint resumes on another world size (DeepSpeed's universal checkpoint) and under the FSDP engine,
with the losses of the run that was never interrupted (SGD: equal; AdamW: to reduction order)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

from lightning_shard import CheckpointLoadError, ShardStrategy
from lightning_shard.checkpoint import load_model_weights
from lightning_shard.demos import GPTModule
from lightning_shard.demos.ranks import run_ranks
from tests.helpers import VOCAB, LossRecorder, loader, trainer_kwargs
from tests.test_safe_resume_multirank import Payload

pytest.importorskip("deepspeed")
pytestmark = [pytest.mark.multirank, pytest.mark.deepspeed]

STEP2 = "epoch=0-step=2.ckpt"


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    """Lightning's DeepSpeedStrategy with only its CUDA refusal lifted: its checkpoints, written on CPU ranks.

    DeepSpeed receives ``root_device.index`` as its device rank, so the CPU devices are numbered by local rank."""

    def setup_environment(self) -> None:
        self.parallel_devices = [torch.device("cpu", i) for i in range(len(self.parallel_devices or []))]
        DDPStrategy.setup_environment(self)  # DeepSpeedStrategy's own refuses every accelerator but CUDA


class SGDGPT(GPTModule):
    """The tiny GPT with plain SGD (``momentum`` > 0 keeps a momentum buffer per parameter)."""

    def __init__(self, momentum: float = 0.0) -> None:
        torch.manual_seed(0)
        super().__init__(
            vocab_size=VOCAB, seq_len=16, d_model=32, n_layers=2, n_heads=2, lr=0.5, max_steps=50
        )
        self.momentum = momentum

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=self.momentum)


def _model(kind: str) -> GPTModule:
    if kind.startswith("adamw"):
        torch.manual_seed(0)
        return GPTModule(
            vocab_size=VOCAB, seq_len=16, d_model=32, n_layers=2, n_heads=2, lr=1e-2, max_steps=50
        )
    return SGDGPT(momentum=0.9 if kind == "momentum" else 0.0)


def _fit(strategy: Any, kind: str, steps: int, save: Path | None = None, resume: Path | None = None) -> Any:
    """Each rank's losses, or the error's message when the resume is refused."""
    recorder = LossRecorder()
    callbacks: list[Any] = [recorder]
    if save is not None:
        callbacks.append(ModelCheckpoint(dirpath=save, every_n_train_steps=2, save_top_k=-1))
    trainer = L.Trainer(
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),  # run_ranks' world, before and after a Trainer call
        strategy=strategy,
        callbacks=callbacks,
        **trainer_kwargs(max_steps=steps, enable_checkpointing=save is not None),
    )
    batch = 8 // trainer.world_size  # the same 8 samples per step on 1 rank and on 2
    try:
        # One epoch is 2 steps: a resume at step 2 starts the next epoch, in the order the reference saw it.
        trainer.fit(_model(kind), loader(batch, n=16), ckpt_path=None if resume is None else str(resume))
    except CheckpointLoadError as error:
        return str(error)
    return recorder.losses


def _lightning_job(root: str) -> dict[str, Any]:
    path = Path(root) / "lightning"
    out = {"reference": _fit(CPUDeepSpeedStrategy(stage=2), "sgd", steps=4, save=path)}
    for engine, stage in (("deepspeed", 2), ("fsdp", 1), ("fsdp", 3)):
        out[engine, stage] = _fit(ShardStrategy(engine=engine, stage=stage), "sgd", 4, resume=path / STEP2)
    return out


def test_lightning_deepspeed_checkpoint_resumes_under_both_engines_and_loads(tmp_path):
    out = run_ranks(_lightning_job, str(tmp_path))[0]
    reference = out["reference"]
    assert len(reference) == 4
    for resumed in (("deepspeed", 2), ("fsdp", 1), ("fsdp", 3)):
        torch.testing.assert_close(out[resumed], reference[2:], rtol=1e-5, atol=0, msg=str(resumed))
    # One process, no process group: Lightning's classmethod reads DeepSpeed's directory.
    path = tmp_path / "lightning" / STEP2
    loaded = SGDGPT.load_from_checkpoint(path)
    assert loaded.hparams["lr"] == 0.5
    for name, value in load_model_weights(path).items():
        torch.testing.assert_close(loaded.state_dict()[name], value, rtol=0, atol=0)
    assert not list(tmp_path.glob("lightning/.*")), "a universal checkpoint was left beside the checkpoint"


def _save_job(root: str) -> dict[str, Any]:
    """ZeRO-2 on 2 ranks: the uninterrupted runs, each with its step-2 checkpoint."""
    out = {}
    for kind, steps in (("sgd", 4), ("adamw", 4), ("momentum", 2)):
        out[kind] = _fit(ShardStrategy(engine="deepspeed", stage=2), kind, steps, save=Path(root) / kind)
    # ZeRO-3 lays out its universal checkpoint otherwise (flat moments, no per-parameter step).
    out["adamw3"] = _fit(ShardStrategy(engine="deepspeed", stage=3), "adamw3", 4, save=Path(root) / "adamw3")
    return out


def _resume_job(root: str, engine: str, stage: int) -> dict[str, Any]:
    strategy = lambda: ShardStrategy(engine=engine, stage=stage)  # noqa: E731
    out = {kind: _fit(strategy(), kind, 4, resume=Path(root) / kind / STEP2) for kind in ("sgd", "adamw")}
    out["momentum"] = _fit(strategy(), "momentum", 4, resume=Path(root) / "momentum" / STEP2)
    if engine == "fsdp":
        out["adamw3"] = _fit(strategy(), "adamw3", 4, resume=Path(root) / "adamw3" / STEP2)
        out["planted"] = _fit(strategy(), "sgd", 4, resume=Path(root) / "planted" / STEP2)
    return out


def test_zero_checkpoint_resumes_on_another_world_size_and_under_fsdp(tmp_path):
    root = str(tmp_path)
    reference = run_ranks(_save_job, root)[0]
    # A payload in a file only the conversion reads (another rank's partition) must never run.
    planted = tmp_path / "planted" / STEP2
    shutil.copytree(tmp_path / "sgd" / STEP2, planted)
    partition = next((planted / "checkpoint").glob("zero_pp_rank_1_*optim_states.pt"))
    torch.save({**torch.load(partition, weights_only=False), "planted": Payload(tmp_path / "ran")}, partition)

    fsdp = run_ranks(_resume_job, root, "fsdp", 3)[0]
    one_rank = run_ranks(_resume_job, root, "deepspeed", 2, world_size=1)[0]
    for resumed, where in ((fsdp, "engine='fsdp' on 2 ranks"), (one_rank, "engine='deepspeed' on 1 rank")):
        torch.testing.assert_close(resumed["sgd"], reference["sgd"][2:], rtol=1e-5, atol=0, msg=where)
        # AdamW's moments travel through DeepSpeed's universal checkpoint; a lost moment changes the step.
        torch.testing.assert_close(resumed["adamw"], reference["adamw"][2:], rtol=1e-4, atol=0, msg=where)
        assert "whose optimizer state holds momentum_buffer" in resumed["momentum"], resumed["momentum"]
        assert "Resume it with ShardStrategy(engine='deepspeed') on 2 ranks" in resumed["momentum"]
    torch.testing.assert_close(fsdp["adamw3"], reference["adamw3"][2:], rtol=1e-4, atol=0)
    assert "ShardStrategy(engine='fsdp')" in fsdp["momentum"]
    assert "ShardStrategy(engine='deepspeed', 1 ranks)" in one_rank["momentum"]
    assert "refused by weights_only loading (it names io.open)" in fsdp["planted"], fsdp["planted"]
    assert not (tmp_path / "ran").exists()
    assert sorted(p.name for p in tmp_path.glob("*/.*")) == [], "a universal checkpoint was left behind"
    # The checkpoints were only read.
    assert sorted(p.name for p in (tmp_path / "adamw" / STEP2 / "checkpoint").iterdir()) == [
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]
