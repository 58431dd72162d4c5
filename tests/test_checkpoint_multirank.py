"""Sharded and full checkpoints: resume equality across world sizes and stages, consolidation."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_shard import ShardStrategy
from lightning_shard.cli import main as cli_main
from lightning_shard.demos.ranks import run_ranks
from tests.helpers import LossRecorder, full_weights, loader, tiny_gpt, trainer_kwargs

pytestmark = pytest.mark.multirank
N = 40  # 5 global batches of 8: a checkpoint at step 5 sits at an epoch boundary


def _fit(
    world: int,
    stage: int,
    max_steps: int,
    ckpt_dir: str | None = None,
    resume: str | None = None,
    mode: str = "sharded",
    async_checkpoint: bool = False,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    recorder = LossRecorder()
    callbacks: list[L.Callback] = [recorder]
    if ckpt_dir is not None:
        callbacks.append(
            ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=5, save_top_k=-1, save_last=True)
        )
    trainer = L.Trainer(
        devices=world,
        strategy=ShardStrategy(stage=stage, checkpoint=mode, async_checkpoint=async_checkpoint),
        callbacks=callbacks,
        **trainer_kwargs(max_steps=max_steps, enable_checkpointing=ckpt_dir is not None),
    )
    trainer.fit(tiny_gpt(), loader(8 // world, n=N), ckpt_path=resume)
    return recorder.losses, full_weights(trainer)


def _save_then_continue(world: int, stage: int, ckpt_dir: str, mode: str = "sharded"):
    return _fit(world, stage, 10, ckpt_dir=ckpt_dir, mode=mode)


def _resume(world: int, stage: int, path: str):
    return _fit(world, stage, 10, resume=path)


def _resume_each(world: int, stage: int, paths: list[str]) -> list[list[float]]:
    """The losses of a resume from each of ``paths``, one after the other on the same ranks."""
    return [_resume(world, stage, path)[0] for path in paths]


@pytest.mark.parametrize("saved_on, resumed_on, stage", [(2, 1, 3), (1, 2, 1)])
def test_resume_on_a_different_world_size(tmp_path, saved_on, resumed_on, stage):
    reference, _ = run_ranks(_save_then_continue, saved_on, 3, str(tmp_path), world_size=saved_on)[0]
    ckpt = tmp_path / "epoch=0-step=5.ckpt"
    assert ckpt.is_dir() and (ckpt / ".metadata").is_file()
    assert not list(tmp_path.glob("*.tmp")), "a temporary checkpoint was left behind"
    resumed, _ = run_ranks(_resume, resumed_on, stage, str(ckpt), world_size=resumed_on)[0]
    assert len(reference) == 10 and len(resumed) == 5
    torch.testing.assert_close(resumed, reference[5:], rtol=1e-5, atol=0)


def test_resume_from_last_and_consolidate(tmp_path):
    reference, weights = run_ranks(_save_then_continue, 2, 2, str(tmp_path))[0]
    paths = [str(tmp_path / "last.ckpt"), str(tmp_path / "epoch=0-step=5.ckpt")]
    from_last, from_step5 = run_ranks(_resume_each, 2, 2, paths)[0]
    # last.ckpt is the step-10 checkpoint: resuming it trains no further steps.
    assert from_last == []
    torch.testing.assert_close(from_step5, reference[5:], rtol=1e-5, atol=0)

    out = tmp_path / "model.pt"
    assert cli_main(["consolidate", str(tmp_path / "epoch=1-step=10.ckpt"), str(out), "--weights-only"]) == 0
    plain = tiny_gpt()
    plain.load_state_dict(torch.load(out, weights_only=True))
    for name, tensor in plain.state_dict().items():
        torch.testing.assert_close(tensor, weights[name], rtol=0, atol=0)
    x = torch.randint(0, 64, (2, 16))
    reference_model = tiny_gpt()
    reference_model.load_state_dict(weights)
    torch.testing.assert_close(plain(x), reference_model(x))


def test_full_checkpoint_is_one_plain_file(tmp_path):
    reference, weights = run_ranks(_save_then_continue, 2, 3, str(tmp_path), "full")[0]
    path = tmp_path / "epoch=1-step=10.ckpt"
    assert path.is_file()
    plain = tiny_gpt()
    plain.load_state_dict(torch.load(path, weights_only=False)["state_dict"])
    for name, tensor in plain.state_dict().items():
        torch.testing.assert_close(tensor, weights[name], rtol=0, atol=0)
    resumed, _ = run_ranks(_resume, 2, 3, str(tmp_path / "epoch=0-step=5.ckpt"))[0]
    torch.testing.assert_close(resumed, reference[5:], rtol=1e-5, atol=0)


def _save_and_resume_every_mode(stage: int, root: str) -> dict[str, tuple[list[float], list[float]]]:
    out = {}
    for name, mode, async_checkpoint in (
        ("sharded", "sharded", False),
        ("async", "sharded", True),
        ("full", "full", False),
    ):
        ckpt_dir = str(Path(root) / name)
        kwargs = dict(mode=mode, async_checkpoint=async_checkpoint)
        uninterrupted, _ = _fit(2, stage, 10, ckpt_dir=ckpt_dir, **kwargs)
        resumed, _ = _fit(2, stage, 10, resume=str(Path(ckpt_dir) / "epoch=0-step=5.ckpt"), **kwargs)
        out[name] = (uninterrupted, resumed)
    return out


@pytest.mark.parametrize("stage", [0, 1])
def test_replicated_stages_save_and_resume_sync_async_and_full(tmp_path, stage):
    results = run_ranks(_save_and_resume_every_mode, stage, str(tmp_path))[0]
    for name, (uninterrupted, resumed) in results.items():
        assert len(uninterrupted) == 10 and len(resumed) == 5, name
        # AdamW: a resume that lost the (stage-1: partitioned) moments would move these losses.
        torch.testing.assert_close(resumed, uninterrupted[5:], rtol=1e-5, atol=0, msg=f"stage {stage} {name}")
    assert (tmp_path / "full" / "epoch=0-step=5.ckpt").is_file()
    assert (tmp_path / "async" / "epoch=0-step=5.ckpt" / ".metadata").is_file()
    assert not list(tmp_path.rglob("*.tmp")), "a temporary checkpoint was left behind"


def test_consolidate_errors(tmp_path, capsys):
    assert cli_main(["consolidate", str(tmp_path / "missing.ckpt"), str(tmp_path / "out.pt")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "half.ckpt").mkdir()
    assert cli_main(["consolidate", str(tmp_path / "half.ckpt"), str(tmp_path / "out.pt")]) == 2
    assert "not a sharded checkpoint" in capsys.readouterr().err
    assert not Path(tmp_path / "out.pt").exists()
