"""Resuming never runs code from a checkpoint unless the user opts in (``weights_only=False``), as
Lightning's ``fit(ckpt_path=..., weights_only=...)`` promises: a pickle payload planted in a sharded
checkpoint's ``meta.pt`` or DCP ``.metadata``, in a ``checkpoint="full"`` file or in a DeepSpeed checkpoint's
files is refused with an error naming the opt-in, and runs only when the user opts in."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_shard import CheckpointLoadError, ShardStrategy
from lightning_shard.demos.ranks import run_ranks
from tests.helpers import ENGINES, loader, tiny_gpt, trainer_kwargs

pytestmark = pytest.mark.multirank


class Payload:
    """Unpickling it creates ``marker``: what a malicious checkpoint would do instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> Any:
        return (open, (self.marker, "w"))


def _strategy(engine: str, kind: str) -> ShardStrategy:
    return ShardStrategy(stage=3, engine=engine, checkpoint="full" if kind == "full" else "sharded")


def _save(root: str, engine: str) -> None:
    kinds = ("sharded", "full") if engine == "fsdp" else ("sharded",)
    for kind in kinds:
        every = ModelCheckpoint(dirpath=Path(root) / kind, save_last=True)
        trainer = L.Trainer(
            devices=2,
            strategy=_strategy(engine, kind),
            callbacks=[every],
            **trainer_kwargs(max_steps=2, enable_checkpointing=True),
        )
        trainer.fit(tiny_gpt(), loader(4))


def _plant(path: Path, where: str, marker: Path) -> None:
    if where == "meta.pt":
        meta = torch.load(path / "meta.pt", weights_only=False)
        torch.save({**meta, "planted": Payload(marker)}, path / "meta.pt")
    elif where == ".metadata":
        with open(path / ".metadata", "rb") as f:
            metadata = pickle.load(f)
        metadata.planner_data = Payload(marker)
        with open(path / ".metadata", "wb") as f:
            pickle.dump(metadata, f)
    elif where == "full":
        checkpoint = torch.load(path, weights_only=False)
        torch.save({**checkpoint, "planted": Payload(marker)}, path)
    else:  # a DeepSpeed checkpoint: Lightning's client state rides in DeepSpeed's model-states file
        for states in (path / "checkpoint").glob("*mp_rank_00_model_states.pt"):
            saved = torch.load(states, weights_only=False)
            torch.save({**saved, "planted": Payload(marker)}, states)


def _resume(engine: str, planted: dict[str, str]) -> dict[str, str]:
    out = {}
    for where, path in planted.items():
        kind = "full" if where == "full" else "sharded"
        trainer = L.Trainer(devices=2, strategy=_strategy(engine, kind), **trainer_kwargs(max_steps=3))
        try:
            trainer.fit(tiny_gpt(), loader(4), ckpt_path=path)  # Lightning's default: weights_only=None
            out[where] = "resumed"
        except CheckpointLoadError as error:
            out[where] = str(error)
    # The user's opt-in for a checkpoint they trust: the payload runs, as torch.load(weights_only=False) would.
    where, path = next(iter(planted.items()))
    trainer = L.Trainer(devices=2, strategy=_strategy(engine, where), **trainer_kwargs(max_steps=3))
    trainer.fit(tiny_gpt(), loader(4), ckpt_path=path, weights_only=False)
    out["opted_in"] = trainer.global_step
    return out


@pytest.mark.parametrize("engine", ENGINES)
def test_planted_payloads_are_refused_on_resume_and_run_only_when_opted_in(tmp_path, engine):
    run_ranks(_save, str(tmp_path), engine)
    places = ["meta.pt", ".metadata", "full"] if engine == "fsdp" else ["deepspeed"]
    planted, markers = {}, {}
    for where in places:
        source = tmp_path / ("full" if where == "full" else "sharded") / "last.ckpt"
        target = tmp_path / "planted" / where.strip(".") / "last.ckpt"
        target.parent.mkdir(parents=True)
        (shutil.copy2 if source.is_file() else shutil.copytree)(source.resolve(), target)
        markers[where] = tmp_path / f"ran-{where.strip('.')}"
        _plant(target, where, markers[where])
        planted[where] = str(target)
    out = run_ranks(_resume, engine, planted)[0]
    for where in places:
        message = out[where]
        assert "refused by weights_only loading" in message, (where, message)
        assert "weights_only=False" in message and "it names io.open" in message, (where, message)
    opted_in = places[0]
    for where, marker in markers.items():
        assert marker.exists() == (where == opted_in), where  # nothing ran but what the user opted into
    assert out["opted_in"] == 3


def _urls(root: str) -> dict[str, str]:
    import os

    os.chdir(root)  # where pathlib would have put a directory named "memory:"
    out = {}
    url = "memory://bucket/run"
    trainer = L.Trainer(
        devices=2,
        strategy=ShardStrategy(stage=3),
        callbacks=[ModelCheckpoint(dirpath=url, save_last=True)],
        **trainer_kwargs(max_steps=1, enable_checkpointing=True),
    )
    for call, run in (
        ("dirpath", lambda: trainer.fit(tiny_gpt(), loader(4))),
        (
            "ckpt_path",
            lambda: L.Trainer(devices=2, strategy=ShardStrategy(stage=3), **trainer_kwargs()).fit(
                tiny_gpt(), loader(4), ckpt_path=f"{url}/last.ckpt"
            ),
        ),
    ):
        try:
            run()
            out[call] = "ran"
        except ValueError as error:
            out[call] = str(error)
    return out


def test_checkpoint_urls_are_refused_before_training_and_never_become_local_paths(tmp_path):
    out = run_ranks(_urls, str(tmp_path))[0]
    # memory:// lives in one process: no scheme the ranks could share (s3:// is: tests/test_s3_multirank.py).
    refused = "ShardStrategy cannot write checkpoints to memory:// URLs"
    assert out["dirpath"].startswith(f"ModelCheckpoint(dirpath)='memory://bucket/run': {refused}")
    assert out["ckpt_path"].startswith(f"ckpt_path='memory://bucket/run/last.ckpt': {refused}")
    assert not list(tmp_path.glob("memory:*"))
