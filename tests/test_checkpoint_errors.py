"""Resuming from a checkpoint that cannot be loaded: a clear error naming the path, on every rank.

One 2-rank run (module fixture) saves a sharded and a full checkpoint, damages copies of them, and
tries to resume each into the real Trainer + ShardStrategy; each test checks one case's messages. Where
DeepSpeed is installed, the same run then saves a DeepSpeed checkpoint and gives each engine the other's.
A hang instead of an error fails within the strategies' short process-group timeout.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_shard import ShardStrategy
from lightning_shard.checkpoint import CheckpointLoadError, check_deepspeed_checkpoint
from lightning_shard.checkpoint import _errors as _checkpoint_errors
from lightning_shard.demos import GPTModule
from lightning_shard.demos.ranks import run_ranks
from tests.helpers import loader, tiny_gpt, trainer_kwargs

multirank = pytest.mark.multirank
TIMEOUT = timedelta(seconds=90)  # a rank left waiting in a collective fails the test instead of hanging it


class SGDGPT(GPTModule):
    """The tiny GPT with SGD + momentum: optimizer state of another shape than AdamW's."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _sgd_gpt() -> GPTModule:
    model = tiny_gpt()
    sgd = SGDGPT(**model.hparams)
    sgd.load_state_dict(model.state_dict())
    return sgd


def _trainer(engine: str = "fsdp", mode: str = "sharded", ckpt_dir: Path | None = None) -> L.Trainer:
    callbacks = [] if ckpt_dir is None else [ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2)]
    return L.Trainer(
        devices=2,
        strategy=ShardStrategy(stage=3, engine=engine, checkpoint=mode, timeout=TIMEOUT),  # type: ignore[arg-type]
        callbacks=callbacks,
        **trainer_kwargs(max_steps=4 if ckpt_dir is None else 2, enable_checkpointing=ckpt_dir is not None),
    )


def _save(ckpt_dir: Path, engine: str = "fsdp", mode: str = "sharded") -> Path:
    _trainer(engine, mode, ckpt_dir).fit(tiny_gpt(), loader(4))
    return ckpt_dir / "epoch=0-step=2.ckpt"


def _resume_error(path: Path, model: GPTModule | None = None, engine: str = "fsdp") -> str | None:
    try:
        _trainer(engine).fit(model or tiny_gpt(), loader(4), ckpt_path=str(path))
    except Exception as err:  # noqa: BLE001  (the message is what is under test)
        return f"{type(err).__name__}: {err}"
    return None


SHARDED_DAMAGE = ("metadata", "meta", "shard", "cut", "unfinished")


def _truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def _damage(root: Path, sharded: Path, full: Path) -> dict[str, Path]:
    """Damaged copies of the saved checkpoints (made on rank 0); the same paths on every rank."""
    paths = {name: root / f"{name}.ckpt" for name in SHARDED_DAMAGE}
    paths |= {"full_cut": root / "full_cut.ckpt", "plain": root / "plain.pt", "ds_layout": root / "ds.ckpt"}
    # Between Trainer calls: the strategy has released its process group, so ranks meet on a file.
    done = root / "damaged"
    if int(os.environ["RANK"]) == 0:
        for name in SHARDED_DAMAGE:
            shutil.copytree(sharded, paths[name])
        _truncate(paths["metadata"] / ".metadata")
        _truncate(paths["meta"] / "meta.pt")
        (paths["shard"] / "__1_0.distcp").unlink()
        _truncate(paths["cut"] / "__0_0.distcp")
        (paths["unfinished"] / ".metadata").unlink()
        shutil.copy(full, paths["full_cut"])
        _truncate(paths["full_cut"])
        torch.save(tiny_gpt().state_dict(), paths["plain"])
        (paths["ds_layout"] / "checkpoint").mkdir(parents=True)
        (paths["ds_layout"] / "checkpoint" / "mp_rank_00_model_states.pt").write_bytes(b"")
        done.touch()
    while not done.exists():
        time.sleep(0.05)
    return paths


def _all_cases(root: str) -> dict[str, Any]:
    sharded = _save(Path(root) / "sharded")
    full = _save(Path(root) / "full", mode="full")
    attempts: dict[str, tuple[Path, Any]] = {
        name: (path, tiny_gpt) for name, path in _damage(Path(root), sharded, full).items()
    }
    attempts.update(
        wider=(sharded, lambda: tiny_gpt(d_model=48)),
        deeper=(sharded, lambda: tiny_gpt(n_layers=3)),
        shallower=(sharded, lambda: tiny_gpt(n_layers=1)),
        sgd=(sharded, _sgd_gpt),
        full_wider=(full, lambda: tiny_gpt(d_model=48)),
        absent=(Path(root) / "absent.ckpt", tiny_gpt),
    )
    out: dict[str, Any] = {
        name: (str(path), _resume_error(path, make())) for name, (path, make) in attempts.items()
    }
    out["control"] = (str(sharded), _resume_error(sharded))  # the undamaged checkpoint still resumes
    out |= _injected_faults(sharded, missing_shard=attempts["shard"][0])
    if importlib.util.find_spec("deepspeed") is not None:
        # In this run rather than a second one: DeepSpeed's cases need a process of their own only for its
        # first import. Their failure is kept for their own test, not raised on the FSDP cases.
        try:
            out["other_engine"] = _ds_cases(root, sharded)
        except Exception:  # noqa: BLE001  (re-raised by the DeepSpeed test)
            out["other_engine"] = traceback.format_exc()
    return out


def _injected_faults(sharded: Path, missing_shard: Path) -> dict[str, Any]:
    """Faults the up-front checks cannot see: one rank alone fails, and DCP's read fails on one rank."""

    def fail_on_rank1(*args: Any) -> None:
        if dist.get_rank() == 1:
            raise OSError("injected on rank 1")

    out = {}
    with mock.patch.object(_checkpoint_errors, "check_files", fail_on_rank1):
        out["one_rank"] = (str(sharded), _resume_error(sharded))
    with mock.patch.object(_checkpoint_errors, "check_files", lambda *args: None):
        out["unchecked_shard"] = (str(missing_shard), _resume_error(missing_shard))
    return out


def _ds_cases(root: str, sharded: Path) -> dict[str, Any]:
    """``sharded``: the FSDP engine's undamaged sharded checkpoint (its own test shows it resumes)."""
    deepspeed_ckpt = _save(Path(root) / "ds", engine="deepspeed")
    return {
        "ds_into_fsdp": (str(deepspeed_ckpt), _resume_error(deepspeed_ckpt)),
        "dcp_into_ds": (str(sharded), _resume_error(sharded, engine="deepspeed")),
        "control": (str(deepspeed_ckpt), _resume_error(deepspeed_ckpt, engine="deepspeed")),
    }


@pytest.fixture(scope="module")
def resumed_per_rank(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Each rank's cases, as the run returned them."""
    return run_ranks(_all_cases, str(tmp_path_factory.mktemp("checkpoint_errors")))


@pytest.fixture(scope="module")
def resumed(resumed_per_rank: list[dict[str, Any]]) -> dict[str, tuple[str, list[str | None]]]:
    """Per case: the checkpoint path and each rank's error (``None`` where the resume worked)."""
    results = resumed_per_rank
    cases = [name for name in results[0] if name != "other_engine"]
    return {name: (results[0][name][0], [rank[name][1] for rank in results]) for name in cases}


def _raised_on_every_rank(case: tuple[str, list[str | None]], match: str) -> list[str]:
    path, messages = case
    for message in messages:
        assert message is not None, f"a rank resumed from {path} without an error: {messages}"
        with pytest.raises(CheckpointLoadError, match=match):
            raise CheckpointLoadError(message)
        assert f"'{path}'" in message, f"the message does not name the checkpoint: {message}"
    return messages  # type: ignore[return-value]


@multirank
def test_truncated_metadata(resumed):
    _raised_on_every_rank(
        resumed["metadata"],
        r"^CheckpointLoadError: .* is damaged: \.metadata cannot be read \(UnpicklingError: .*\)\. .*Copy the"
        r" checkpoint again in full, or resume from another checkpoint\.$",
    )


@multirank
def test_truncated_meta_pt(resumed):
    _raised_on_every_rank(
        resumed["meta"], r"is damaged: meta\.pt cannot be read \(RuntimeError: .*zip archive"
    )


@multirank
def test_missing_and_truncated_shard_files(resumed):
    _raised_on_every_rank(
        resumed["shard"], r"is incomplete: __1_0\.distcp is missing\. .*Copy the whole checkpoint"
    )
    _raised_on_every_rank(
        resumed["cut"], r"is incomplete: __0_0\.distcp has \d+ bytes, \.metadata expects at least"
    )


@multirank
def test_unfinished_save(resumed):
    _raised_on_every_rank(
        resumed["unfinished"], r"is not a complete sharded checkpoint \(missing \.metadata\)"
    )


@multirank
def test_damaged_deepspeed_layout_given_to_the_fsdp_engine(resumed):
    _raised_on_every_rank(
        resumed["ds_layout"],
        r"is damaged: a DeepSpeed file cannot be read \(.*\)\. The file was cut short",
    )


@multirank
@pytest.mark.parametrize("case", ["wider", "full_wider"])
def test_model_of_another_width(resumed, case):
    _raised_on_every_rank(
        resumed[case],
        r"does not fit the model being resumed: model\.tok_emb\.weight is \(64, 32\) in the checkpoint but"
        r" \(64, 48\) here, .* and \d+ more\. It was saved with d_model=32; this model has d_model=48\. Resume with"
        r" the model configuration the checkpoint was saved with",
    )


@multirank
def test_model_of_another_depth(resumed):
    _raised_on_every_rank(
        resumed["deeper"],
        r"missing from the checkpoint: model\.blocks\.2\.ln1\.weight, .*saved with n_layers=2; this model has n_layers=3",
    )
    # DCP reads only the keys asked for: without the check, a deeper checkpoint loaded into a shallower model.
    _raised_on_every_rank(
        resumed["shallower"],
        r"in the checkpoint but not in the model: model\.blocks\.1\.ln1\.weight, .*n_layers=1",
    )


@multirank
def test_another_optimizer(resumed):
    _raised_on_every_rank(
        resumed["sgd"],
        r"does not fit the optimizer \(optimizer_0\) being resumed: missing from the checkpoint:"
        r" state\.model\.tok_emb\.weight\.momentum_buffer, .*Resume with the optimizer configure_optimizers\(\)",
    )


@multirank
def test_full_file_truncated_or_weights_only(resumed):
    _raised_on_every_rank(resumed["full_cut"], r"is damaged: the file cannot be read \(RuntimeError: ")
    _raised_on_every_rank(
        resumed["plain"],
        r"is not a Lightning training checkpoint \(no 'state_dict' entry\): a plain state dict",
    )


@multirank
def test_a_path_that_does_not_exist(resumed):
    path, messages = resumed["absent"]
    for message in messages:
        assert message is not None and f"'{path}'" in message
        with pytest.raises(
            FileNotFoundError, match=r"^Checkpoint '.*absent\.ckpt' does not exist\. Check the path"
        ):
            raise FileNotFoundError(message.removeprefix("FileNotFoundError: "))  # type: ignore[union-attr]


@multirank
def test_a_fault_on_one_rank_stops_every_rank(resumed):
    rank0, rank1 = _raised_on_every_rank(
        resumed["one_rank"], r"failed: OSError: injected on rank 1\. Check that"
    )
    assert rank0.endswith("(rank 1 failed; every rank stops)") and rank1.endswith(
        "resume from another checkpoint."
    )


@multirank
def test_a_read_failure_past_the_checks_raises_on_every_rank(resumed):
    # DCP gathers every rank's read errors and raises them on all ranks; the message keeps the first one.
    _raised_on_every_rank(
        resumed["unchecked_shard"],
        r"^CheckpointLoadError: Reading checkpoint .* failed: FileNotFoundError: .*__1_0\.distcp'? \(on rank \d\)\.",
    )


@multirank
def test_an_undamaged_checkpoint_still_resumes(resumed):
    assert resumed["control"][1] == [None, None]


@multirank
@pytest.mark.deepspeed
def test_checkpoints_given_to_the_other_engine(resumed_per_rank):
    pytest.importorskip("deepspeed")
    results = [rank["other_engine"] for rank in resumed_per_rank]
    for result in results:
        assert not isinstance(result, str), result  # DeepSpeed's cases raised: the rank's traceback
    assert [rank["control"][1] for rank in results] == [None, None], (
        "a DeepSpeed checkpoint no longer resumes"
    )
    # The FSDP engine reads a DeepSpeed checkpoint through DeepSpeed's own tooling (deepspeed_interop).
    assert [rank["ds_into_fsdp"][1] for rank in results] == [None, None]
    for name, match in (
        (
            "dcp_into_ds",
            r"is a sharded DCP checkpoint of the FSDP engine, which ShardStrategy\(engine='deepspeed'\) cannot"
            r" resume\. Resume it with ShardStrategy\(engine='fsdp'\) \(any world size, any stage\), or .* consolidate",
        ),
    ):
        _raised_on_every_rank((results[0][name][0], [rank[name][1] for rank in results]), match)


# --- one process ---------------------------------------------------------------------------------


def test_the_deepspeed_engine_refuses_a_full_file(tmp_path):
    path = tmp_path / "full.ckpt"
    torch.save({"state_dict": {}}, path)
    with pytest.raises(
        CheckpointLoadError, match=r"'.*full\.ckpt' is a one-file checkpoint .*engine='deepspeed'"
    ):
        check_deepspeed_checkpoint(path)
    check_deepspeed_checkpoint(tmp_path / "absent.ckpt")  # left to DeepSpeed's own "no checkpoint" error


def test_an_unexpected_error_names_the_checkpoint(tmp_path):
    def fail() -> None:
        raise KeyError("loops")

    with pytest.raises(
        CheckpointLoadError, match=r"Loading checkpoint '.*x\.ckpt' failed: KeyError: 'loops'\."
    ):
        _checkpoint_errors.on_every_rank(tmp_path / "x.ckpt", fail)
