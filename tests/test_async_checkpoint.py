"""Async sharded checkpoints and non-finite step skipping: validation in one process, behaviour on 2 ranks."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.checkpoint import FileSystemWriter

from lightning_shard import ShardStrategy
from lightning_shard.core.nonfinite import NonFiniteGuard
from lightning_shard.demos.ranks import run_ranks
from tests.helpers import LossRecorder, full_weights, loader, tiny_gpt, trainer_kwargs

N = 40  # 5 global batches of 8 per epoch


def test_async_needs_sharded_checkpoints():
    with pytest.raises(
        ValueError, match=r"async_checkpoint=True\) needs checkpoint='sharded' \(got checkpoint='full'\)"
    ):
        ShardStrategy(async_checkpoint=True, checkpoint="full")


@pytest.mark.parametrize("value", [0, -3, True, 1.5])
def test_max_skipped_must_be_positive(value):
    with pytest.raises(ValueError, match=r"max_skipped=.*\) must be an integer >= 1"):
        ShardStrategy(skip_nonfinite=True, max_skipped=value)


def test_guard_stops_after_max_consecutive_skips():
    guard = NonFiniteGuard(max_skipped=2)
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    assert not guard.should_skip(torch.tensor(1.0), [p], torch.device("cpu"))
    assert guard.should_skip(torch.tensor(float("nan")), [p], torch.device("cpu"))
    p.grad = torch.tensor([1.0, float("inf"), 0.0])
    assert guard.should_skip(torch.tensor(1.0), [p], torch.device("cpu"))
    with pytest.raises(
        RuntimeError, match=r"max_skipped=2\): 3 consecutive steps had a non-finite loss or gradient"
    ):
        guard.should_skip(torch.tensor(float("inf")), [p], torch.device("cpu"))
    assert guard.total == 3


def _fit(world, ckpt_dir, max_steps=10, resume=None, every=5, top_k=-1, fail_on=None):
    recorder = LossRecorder()
    checkpoint = ModelCheckpoint(
        dirpath=ckpt_dir, every_n_train_steps=every, save_top_k=top_k, save_last=True
    )
    trainer = L.Trainer(
        devices=world,
        strategy=ShardStrategy(stage=3, async_checkpoint=True),
        callbacks=[recorder, checkpoint],
        **trainer_kwargs(max_steps=max_steps, enable_checkpointing=True),
    )
    if fail_on is not None:
        _break_writes(*fail_on)
    trainer.fit(tiny_gpt(), loader(8 // world, n=N), ckpt_path=resume)
    last_committed = trainer.strategy.engine.async_checkpointer.last_committed
    return recorder.losses, full_weights(trainer), last_committed


def _break_writes(save_number: int, how: str) -> None:
    """From the ``save_number``-th save on, make this rank's shard write fail (``raise``) or die (``kill``)."""
    original = FileSystemWriter.write_data
    calls = {"n": 0}

    def write_data(self, plan, planner):
        calls["n"] += 1
        if calls["n"] >= save_number:
            if how == "kill" and dist.get_rank() == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            if how == "raise":
                raise OSError(28, "No space left on device")
        return original(self, plan, planner)

    FileSystemWriter.write_data = write_data


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[float], Path]:
    """One uninterrupted 2-rank run saving every 5 steps: its directory, losses and last committed save."""
    root = tmp_path_factory.mktemp("uninterrupted")
    losses, _, committed = run_ranks(_fit, 2, str(root))[0]
    return root, losses, committed


@pytest.mark.multirank
def test_async_save_resume_parity_across_world_sizes(tmp_path, uninterrupted):
    saved, reference, committed = uninterrupted
    assert committed == saved / "epoch=1-step=10.ckpt"
    assert sorted(p.name for p in saved.iterdir()) == [
        "epoch=0-step=5.ckpt",
        "epoch=1-step=10.ckpt",
        "last.ckpt",
    ]
    assert (saved / "last.ckpt").resolve() == committed.resolve()
    resumed, _, _ = run_ranks(
        _fit, 1, str(tmp_path / "resumed"), 10, str(saved / "epoch=0-step=5.ckpt"), world_size=1
    )[0]
    torch.testing.assert_close(resumed, reference[5:], rtol=1e-5, atol=0)


@pytest.mark.multirank
def test_top_k_pruning_keeps_only_committed_checkpoints(tmp_path):
    run_ranks(_fit, 2, str(tmp_path), 10, None, 2, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=1-step=10.ckpt", "last.ckpt"]


@pytest.mark.multirank
def test_writer_error_surfaces_and_previous_checkpoint_resumes(tmp_path):
    with pytest.raises(Exception, match=r"AsyncCheckpointError|No space left on device"):
        run_ranks(_fit, 2, str(tmp_path), 10, None, 5, -1, (2, "raise"))
    _assert_only_first_checkpoint_visible(tmp_path)


@pytest.mark.multirank
def test_rank_killed_during_background_write_leaves_previous_checkpoint(tmp_path, uninterrupted):
    # The killed rank, or rank 0 aborting on its dead peer first (gloo): either way a rank ended abnormally.
    with pytest.raises((mp.ProcessExitedException, mp.ProcessRaisedException)):
        run_ranks(_fit, 2, str(tmp_path), 10, None, 5, -1, (2, "kill"))
    _assert_only_first_checkpoint_visible(tmp_path)
    _, reference, _ = uninterrupted  # the same run, never interrupted
    resumed, _, _ = run_ranks(_fit, 2, str(tmp_path / "resumed"), 10, str(tmp_path / "last.ckpt"))[0]
    torch.testing.assert_close(resumed, reference[5:], rtol=1e-5, atol=0)


def _assert_only_first_checkpoint_visible(tmp_path: Path) -> None:
    finals = sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".tmp"))
    assert finals == ["epoch=0-step=5.ckpt", "last.ckpt"], finals
    assert (tmp_path / "last.ckpt").resolve() == (tmp_path / "epoch=0-step=5.ckpt").resolve()
    assert (tmp_path / "epoch=0-step=5.ckpt" / ".metadata").is_file()


class _Snapshots(L.Callback):
    def __init__(self) -> None:
        self.weights: dict[int, dict[str, torch.Tensor]] = {}
        self.optim: dict[int, list[torch.Tensor]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.weights[batch_idx] = full_weights(trainer)
        optimizer = trainer.optimizers[0]
        # ZeroRedundancyOptimizer (stage 1) keeps this rank's partition of the state in its inner ``optim``.
        state = getattr(optimizer, "optim", optimizer).state
        self.optim[batch_idx] = [
            (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
            for s in state.values()
            for v in s.values()
            if torch.is_tensor(v)
        ]


def _fit_nan(stage: int):
    snapshots = _Snapshots()
    module = tiny_gpt()
    original = module.training_step

    def training_step(batch, batch_idx):
        loss = original(batch, batch_idx)
        return loss * float("nan") if (batch_idx == 2 and dist.get_rank() == 1) else loss

    module.training_step = training_step
    trainer = L.Trainer(
        devices=2,
        strategy=ShardStrategy(stage=stage, skip_nonfinite=True, max_skipped=3),
        callbacks=[snapshots],
        **trainer_kwargs(max_steps=5),
    )
    trainer.fit(module, loader(4))
    return snapshots.weights, snapshots.optim, trainer.strategy.skipped_steps, trainer.global_step


@pytest.mark.multirank
@pytest.mark.parametrize("stage", [1, 3])
def test_nan_on_one_rank_skips_the_step_on_both(stage):
    for weights, optim, skipped, steps in run_ranks(_fit_nan, stage):
        assert skipped == 1 and steps == 5  # the skipped step still counts as a step
        assert sorted(weights) == sorted(optim) == [0, 1, 2, 3, 4]
        assert len(weights[2]) == len(tiny_gpt().state_dict()) and optim[2], "nothing to compare"
        for name, before in weights[2].items():
            torch.testing.assert_close(weights[3][name], before, rtol=0, atol=0)
        for after, before in zip(optim[3], optim[2], strict=True):
            torch.testing.assert_close(after, before, rtol=0, atol=0)
        assert any((weights[4][n] != weights[3][n]).any() for n in weights[3]), "training did not go on"


def test_an_exception_checkpoint_of_the_same_step_is_written_not_linked(tmp_path):
    from lightning_shard.checkpoint.async_save import AsyncCheckpointer

    def nothing() -> None:
        return None

    checkpointer = AsyncCheckpointer(is_rank0=True)
    state = {"model": {"w": torch.ones(3)}}
    checkpointer.save(state, {"global_step": 7}, tmp_path / "epoch=0-step=7.ckpt", nothing)
    checkpointer.save(state, {"global_step": 7}, tmp_path / "last.ckpt", nothing)  # same step: a link
    checkpointer.save(state, {"global_step": 7}, tmp_path / "on_exception.ckpt", nothing, alias=False)
    checkpointer.close()
    assert (tmp_path / "last.ckpt").is_symlink()
    exception = tmp_path / "on_exception.ckpt"
    assert exception.is_dir() and not exception.is_symlink() and (exception / ".metadata").is_file()


def test_each_async_save_holds_its_own_step(tmp_path):
    """A save returns once the state is copied: each checkpoint holds the values of its own step, though
    training changes the tensor in place while the write runs."""
    import torch.distributed.checkpoint as dcp

    from lightning_shard.checkpoint.async_save import AsyncCheckpointer

    def nothing() -> None:
        return None

    checkpointer = AsyncCheckpointer(is_rank0=True)
    weight = torch.zeros(1000)
    for step in range(1, 4):
        weight.fill_(step)
        checkpointer.save(
            {"model": {"w": weight}}, {"global_step": step}, tmp_path / f"s{step}.ckpt", nothing
        )
        weight.fill_(-1.0)  # training goes on while the write runs
    checkpointer.close()
    for step in range(1, 4):
        loaded = {"model": {"w": torch.empty(1000)}}
        dcp.load(loaded, checkpoint_id=str(tmp_path / f"s{step}.ckpt"), no_dist=True)
        assert torch.equal(loaded["model"]["w"], torch.full((1000,), float(step)))
