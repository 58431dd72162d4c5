"""The DeepSpeed engine's background checkpoint writer in one process, with a stand-in for DeepSpeed's engine."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from lightning_shard import ShardStrategy
from lightning_shard.checkpoint import AsyncCheckpointError
from lightning_shard.engines.deepspeed.async_save import DeepSpeedAsyncWriter
from tests.helpers import make_engine


class _SlowTorchEngine:
    """DeepSpeed's TorchCheckpointEngine on a slow disk: the write outlasts the caller's next step."""

    zipfile_serialization = True

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.threads: list[str] = []

    def save(self, state_dict, path: str) -> None:
        time.sleep(0.2)
        self.threads.append(threading.current_thread().name)
        if self.fail:
            raise OSError(28, "No space left on device")
        torch.save(state_dict, path)


class _Model:
    def __init__(self, engine: _SlowTorchEngine) -> None:
        self.checkpoint_engine = engine


def _save(writer: DeepSpeedAsyncWriter, model: _Model, state: dict, path: Path) -> None:
    writer.save(
        model, lambda tmp: model.checkpoint_engine.save(state, str(tmp / "states.pt")), path, lambda: None
    )


def test_saves_a_copy_in_the_background_and_commits_when_written(tmp_path):
    engine = _SlowTorchEngine()
    model, writer = _Model(engine), DeepSpeedAsyncWriter(is_rank0=True, on_host=True)
    base = torch.arange(8.0)
    state = {"w": base, "view": base[2:4], "step": 3}
    (tmp_path / "ref").mkdir()
    torch.save(state, tmp_path / "ref" / "states.pt")
    path = tmp_path / "ckpt"
    _save(writer, model, state, path)
    assert model.checkpoint_engine is engine  # DeepSpeed's engine back in place once the save returns
    assert not path.exists()  # returned before the file was written
    base.add_(1)  # the next training step changes the live state
    writer.wait()
    assert engine.threads == ["deepspeed-checkpoint_0"]
    assert (path / "states.pt").read_bytes() == (tmp_path / "ref" / "states.pt").read_bytes()
    assert not (tmp_path / "ckpt.tmp").exists()
    writer.close()


def test_background_error_surfaces_at_the_next_wait_and_keeps_the_previous(tmp_path):
    engine = _SlowTorchEngine()
    model, writer = _Model(engine), DeepSpeedAsyncWriter(is_rank0=True, on_host=True)
    _save(writer, model, {"w": torch.ones(2)}, tmp_path / "good")
    writer.wait()
    engine.fail = True
    _save(writer, model, {"w": torch.ones(2)}, tmp_path / "bad")
    with pytest.raises(
        AsyncCheckpointError, match=r"'.*bad' in the background failed: .*No space left.*good"
    ):
        writer.wait()
    assert (tmp_path / "good" / "states.pt").is_file() and not (tmp_path / "bad").exists()
    writer.wait()  # raised once
    writer.close()


def test_removal_waits_for_the_pending_save(tmp_path):
    model, writer = _Model(_SlowTorchEngine()), DeepSpeedAsyncWriter(is_rank0=True, on_host=True)
    _save(writer, model, {"w": torch.ones(2)}, tmp_path / "old")
    writer.wait()
    _save(writer, model, {"w": torch.ones(2)}, tmp_path / "new")
    writer.remove(tmp_path / "old")
    assert (tmp_path / "old").exists()  # the new one is not committed yet
    writer.close()
    assert not (tmp_path / "old").exists() and (tmp_path / "new" / "states.pt").is_file()


@pytest.mark.deepspeed
def test_deepspeed_engine_serves_async_checkpoint():
    pytest.importorskip("deepspeed")
    assert ShardStrategy(stage=3, engine="deepspeed", async_checkpoint=True).engine_name == "deepspeed"
    assert make_engine("deepspeed", 3, async_checkpoint=True).async_writer is not None
    assert make_engine("deepspeed", 3).async_writer is None
