"""Checkpoints on an object store through fsspec (``s3fs``), against a real S3 server started here (``moto`` in
server mode on localhost; the endpoint comes from ``AWS_ENDPOINT_URL``, as boto users set it): a 2-rank async save
lands in the bucket, resumes on 1 rank exactly, consolidates and loads with ``load_from_checkpoint``; a job
killed mid-save leaves no checkpoint a reader would take for complete, and the previous one resumes. The DeepSpeed
engine (ZeRO-3) saves there too (each rank's files staged locally, uploaded, then the marker) and resumes exactly;
a save that fails midway leaves nothing under its name."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_shard import ShardStrategy
from lightning_shard.checkpoint import AsyncCheckpointer, export_hf, load_model_weights
from lightning_shard.checkpoint.storage import ALIAS_HEADER, Remote, newest_last
from lightning_shard.cli import main as cli_main
from lightning_shard.demos import GPTModule
from lightning_shard.demos.ranks import run_ranks
from lightning_shard.demos.s3 import local_s3_server
from tests.helpers import LossRecorder, full_weights, loader, tiny_gpt, trainer_kwargs

s3fs = pytest.importorskip("s3fs", reason="needs the [s3] extra: pip install 'lightning-shard[s3]'")
pytest.importorskip("moto.server", reason="needs moto's S3 server (the [dev] extra) to test against")

pytestmark = pytest.mark.multirank
N = 16  # 2 global batches of 8 per epoch: every checkpoint sits at an epoch boundary


@pytest.fixture(scope="module")
def s3() -> Iterator[Any]:
    with local_s3_server(bucket="ckpt") as fs:  # spawned ranks inherit its AWS_ENDPOINT_URL
        yield fs


class SGDGPT(GPTModule):
    def __init__(self) -> None:
        super().__init__(**vars(tiny_gpt().hparams))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _fit(
    world: int,
    max_steps: int,
    dirpath: str | None = None,
    resume: str | None = None,
    kill_at: int = 0,
    sync: bool = False,
    checkpoint: str = "sharded",
):
    if kill_at:
        _crash_before_commit(kill_at)
    recorder = LossRecorder()
    callbacks: list[L.Callback] = [recorder]
    if dirpath is not None:
        callbacks.append(
            ModelCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_top_k=-1, save_last=True)
        )
    trainer = L.Trainer(
        devices=world,
        strategy=ShardStrategy(stage=3, async_checkpoint=not sync, checkpoint=checkpoint),
        callbacks=callbacks,
        **trainer_kwargs(max_steps=max_steps, enable_checkpointing=dirpath is not None),
    )
    trainer.fit(SGDGPT(), loader(8 // world, n=N), ckpt_path=resume)
    return recorder.losses, full_weights(trainer)


def _crash_before_commit(step: int) -> None:
    """Rank 0 dies after every rank's shards and DCP's ``.metadata`` are stored, before the commit marker:
    the worst moment to die, made certain instead of left to a timer."""
    finish = AsyncCheckpointer._finish

    def dying(self: AsyncCheckpointer, future: Any, tmp: Any, path: Any) -> None:
        if self._step == step and self.is_rank0:
            future.result()
            os._exit(17)
        finish(self, future, tmp, path)

    AsyncCheckpointer._finish = dying  # type: ignore[method-assign]


def test_async_save_on_two_ranks_resume_on_one_consolidate_and_load(s3: Any, tmp_path: Path) -> None:
    reference, weights = run_ranks(_fit, 2, 6, "s3://ckpt/run")[0]
    assert not Path("s3:").exists(), "a URL became a local directory"
    names = sorted(p.rsplit("/", 1)[1] for p in s3.ls("ckpt/run", refresh=True))
    assert names == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "epoch=2-step=6.ckpt", "last.ckpt"]
    for name in names[:3]:
        files = sorted(p.rsplit("/", 1)[1] for p in s3.ls(f"ckpt/run/{name}", refresh=True))
        assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"], name
    assert s3.cat("ckpt/run/last.ckpt") == ALIAS_HEADER + b"epoch=2-step=6.ckpt"

    resumed, _ = run_ranks(_fit, 1, 6, None, "s3://ckpt/run/epoch=0-step=2.ckpt", world_size=1)[0]
    torch.testing.assert_close(resumed, reference[2:], rtol=1e-5, atol=0)

    # Through the alias, in one process, no process group: consolidate's reader and load_from_checkpoint.
    consolidated = load_model_weights("s3://ckpt/run/last.ckpt")
    for name, tensor in weights.items():
        torch.testing.assert_close(consolidated[name], tensor, rtol=0, atol=0)
    loaded = SGDGPT.load_from_checkpoint("s3://ckpt/run/last.ckpt")
    for name, tensor in loaded.state_dict().items():
        torch.testing.assert_close(tensor, consolidated[name], rtol=0, atol=0)


def _uninterrupted_runs(local_dir: str) -> dict[str, Any]:
    """The 2-rank runs the tests below compare with, in one job (one start of the ranks): the FSDP engine's
    uninterrupted run, and the DeepSpeed engine's runs (:func:`_deepspeed_job`)."""
    return {"fsdp": _fit(2, 6, "s3://ckpt/other")[0], "deepspeed": _deepspeed_job(local_dir)}


@pytest.fixture(scope="module")
def two_rank_runs(s3: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    local_dir = tmp_path_factory.mktemp("deepspeed")
    return {**run_ranks(_uninterrupted_runs, str(local_dir))[0], "local_dir": local_dir}


def test_a_job_killed_mid_save_leaves_the_previous_checkpoint_to_resume(s3: Any, two_rank_runs: Any) -> None:
    reference = two_rank_runs["fsdp"]
    with pytest.raises(Exception, match="exit code|exited"):
        run_ranks(_fit, 2, 6, "s3://ckpt/kill", kill_at=4)
    names = sorted(p.rsplit("/", 1)[1] for p in s3.ls("ckpt/kill", refresh=True))
    assert names == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "last.ckpt"]
    # Every rank's shards and .metadata of step 4 are there, its marker is not: not a checkpoint.
    assert s3.exists("ckpt/kill/epoch=1-step=4.ckpt/.metadata")
    assert not s3.exists("ckpt/kill/epoch=1-step=4.ckpt/meta.pt")
    assert s3.cat("ckpt/kill/last.ckpt") == ALIAS_HEADER + b"epoch=0-step=2.ckpt"
    with pytest.raises(
        Exception, match=r"CheckpointLoadError.*epoch=1-step=4.ckpt.*not a complete sharded checkpoint"
    ):
        run_ranks(_fit, 1, 6, None, "s3://ckpt/kill/epoch=1-step=4.ckpt", world_size=1)
    # ckpt_path="last" finds the alias (Lightning alone would list the bucket without its scheme and start
    # from scratch). ModelCheckpoint sees the unfinished step-4 prefix and saves step 4 as "-v1", as it
    # versions any name that exists.
    resumed, _ = run_ranks(_fit, 1, 6, "s3://ckpt/kill", "last", world_size=1)[0]
    torch.testing.assert_close(resumed, reference[2:], rtol=1e-5, atol=0)
    assert s3.exists("ckpt/kill/epoch=1-step=4-v1.ckpt/meta.pt")
    # What the next ckpt_path="last" takes is the step-6 checkpoint. (ModelCheckpoint may have named it
    # last-v1.ckpt: the alias read back is the step-2 checkpoint's data, whose callback state predates
    # last.ckpt, as with Lightning's save_last="link", and the callback versions a name it did not write.)
    newest = newest_last(Remote("s3://ckpt/kill"))
    assert newest is not None and s3.cat(newest.key) == ALIAS_HEADER + b"epoch=2-step=6.ckpt"


def _deepspeed_fit(max_steps: int, dirpath: str, resume: str | None = None) -> list[float]:
    recorder = LossRecorder()
    trainer = L.Trainer(
        devices=2,
        strategy=ShardStrategy(stage=3, engine="deepspeed"),
        callbacks=[recorder, ModelCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_top_k=-1)],
        **trainer_kwargs(max_steps=max_steps, enable_checkpointing=True),
    )
    trainer.fit(SGDGPT(), loader(4, n=N), ckpt_path=resume)
    return recorder.losses


def _deepspeed_job(local_dir: str) -> dict[str, Any]:
    from lightning_shard.checkpoint import staged

    reference = _deepspeed_fit(4, "s3://ckpt/ds")
    resumed = _deepspeed_fit(4, local_dir, "s3://ckpt/ds/epoch=0-step=2.ckpt")
    upload = staged.upload

    def failing(local: Path, path: Any) -> None:  # one file stored, then the connection drops
        first = next(f for f in sorted(local.rglob("*")) if f.is_file())
        path.fs.put_file(str(first), (path / first.relative_to(local).as_posix()).key)
        raise ConnectionError("upload failed")

    staged.upload = failing  # type: ignore[assignment]
    try:
        _deepspeed_fit(2, "s3://ckpt/ds")
        failed = "no error"
    except ConnectionError as error:
        failed = str(error)
    finally:
        staged.upload = upload  # type: ignore[assignment]
    return {"reference": reference, "resumed": resumed, "failed": failed}


def test_deepspeed_saves_to_s3_resumes_exactly_and_a_failed_save_leaves_nothing(
    s3: Any, two_rank_runs: Any
) -> None:
    out, tmp_path = two_rank_runs["deepspeed"], two_rank_runs["local_dir"]
    torch.testing.assert_close(out["resumed"], out["reference"][2:], rtol=1e-5, atol=0)
    assert out["failed"] == "upload failed"
    step4 = "ckpt/ds/epoch=1-step=4.ckpt"
    top = sorted(p.rsplit("/", 1)[1] for p in s3.ls(step4, refresh=True))
    assert {"checkpoint", "latest", "meta.pt"} <= set(top), top
    assert sorted(p.rsplit("/", 1)[1] for p in s3.ls(f"{step4}/checkpoint", refresh=True)) == [
        f"zero_pp_rank_{rank}_mp_rank_00_{kind}_states.pt" for rank in (0, 1) for kind in ("model", "optim")
    ]  # each rank's own files, uploaded by that rank
    # The failed save (ModelCheckpoint versions the name it finds taken) stored a file but never its marker:
    # not a checkpoint. The one saved before under the first name is untouched.
    failed = "ckpt/ds/epoch=0-step=2-v1.ckpt"
    assert s3.exists(f"{failed}/checkpoint") and not s3.exists(f"{failed}/meta.pt")
    assert s3.exists("ckpt/ds/epoch=0-step=2.ckpt/meta.pt")
    with pytest.raises(ValueError, match=r"step=2-v1.ckpt' is not a complete checkpoint \(missing meta.pt"):
        load_model_weights(f"s3://{failed}")
    # Read back from the bucket in one process: the resumed run's local step-4 checkpoint, the same weights.
    remote, local = load_model_weights(f"s3://{step4}"), load_model_weights(tmp_path / "epoch=1-step=4.ckpt")
    assert remote.keys() == local.keys()
    for name, tensor in local.items():
        torch.testing.assert_close(remote[name], tensor, rtol=1e-6, atol=0)


def test_sync_saves_and_ckpt_path_last(s3: Any) -> None:
    """Synchronous saves in one process: last.ckpt is a whole checkpoint, found by ckpt_path="last"."""
    first, _ = _fit(1, 2, "s3://ckpt/sync", sync=True)
    assert s3.exists("ckpt/sync/last.ckpt/meta.pt")
    resumed, _ = _fit(1, 4, "s3://ckpt/sync", "last", sync=True)
    reference, _ = _fit(1, 4, sync=True)
    assert len(first) == 2 and len(resumed) == 2
    torch.testing.assert_close(resumed, reference[2:], rtol=1e-5, atol=0)
    names = sorted(p.rsplit("/", 1)[1] for p in s3.ls("ckpt/sync", refresh=True))
    assert names == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "last.ckpt"]


def test_full_file_checkpoints_consolidate_and_export_through_s3(s3: Any, tmp_path: Path) -> None:
    """One-file checkpoints (one object), ``consolidate`` onto the bucket, and ``export`` from it."""
    first, _ = _fit(1, 2, "s3://ckpt/full", sync=True, checkpoint="full")
    assert s3.isfile("ckpt/full/last.ckpt") and s3.isfile("ckpt/full/epoch=0-step=2.ckpt")
    resumed, weights = _fit(1, 4, "s3://ckpt/full", "last", sync=True, checkpoint="full")
    reference, _ = _fit(1, 4, sync=True)
    torch.testing.assert_close(resumed, reference[2:], rtol=1e-5, atol=0)

    assert (
        cli_main(["consolidate", "s3://ckpt/full/last.ckpt", "s3://ckpt/full/model.pt", "--weights-only"])
        == 0
    )
    with s3.open("ckpt/full/model.pt", "rb") as f:
        consolidated = torch.load(f, weights_only=True)
    assert consolidated.keys() == weights.keys()
    assert all(torch.equal(consolidated[k], v) for k, v in weights.items())
    assert not Path("s3:").exists()

    transformers = pytest.importorskip(
        "transformers", reason="export needs pip install 'lightning-shard[hf]'"
    )
    from tests.test_export import gpt2_config, lightning_file, logits, sharded_dir

    file, model = lightning_file(tmp_path, gpt2_config())
    s3.put(str(sharded_dir(tmp_path, file)), "ckpt/hf/sharded.ckpt", recursive=True)
    export_hf("s3://ckpt/hf/sharded.ckpt", tmp_path / "hf", max_shard_size="20KB")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert torch.equal(logits(loaded), logits(model))
    with pytest.raises(ValueError, match=r"export\(out_dir\)='s3://ckpt/hf/out': this writer needs a local"):
        export_hf("s3://ckpt/hf/sharded.ckpt", "s3://ckpt/hf/out")
