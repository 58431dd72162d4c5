"""Our checkpoint layouts as Lightning checkpoints, in one process: load_from_checkpoint, consolidate, weights_only.

A sharded checkpoint is written here without a process group (``dcp.save(no_dist=True)`` plus
``meta.pt``), laid out as ``save_sharded`` lays it out; the multirank suite writes real ones
(tests/test_load_from_checkpoint_multirank.py).
"""

from __future__ import annotations

import os
import pickle
from fractions import Fraction
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from lightning_shard.checkpoint import (
    CheckpointLoadError,
    consolidate,
    install_load_from_checkpoint,
    load_full_state_dict,
    load_lightning_checkpoint,
)
from lightning_shard.checkpoint._dcp_metadata import MetadataReader
from lightning_shard.checkpoint._pickles import check_deepspeed_pickles
from lightning_shard.checkpoint.init_weights import open_weights
from lightning_shard.cli import main as cli_main


class Tiny(L.LightningModule):
    def __init__(self, width: int = 4, name: str = "a") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = nn.Linear(width, 2)
        self.register_buffer("scale", torch.ones(2))


HPARAMS = {"width": 3, "name": "trained"}


def _sharded(root: Path, hparams: Any = None) -> tuple[Path, dict[str, torch.Tensor]]:
    torch.manual_seed(3)
    model = Tiny(**HPARAMS)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    path = root / "sharded.ckpt"
    dcp.save({"state_dict": model.state_dict()}, checkpoint_id=str(path), no_dist=True)
    meta = {
        "pytorch-lightning_version": L.__version__,
        "epoch": 0,
        "global_step": 3,
        "loops": {},
        "callbacks": {"cb": {}},
        "lr_schedulers": [],
        "hparams_name": "kwargs",
        "hyper_parameters": dict(HPARAMS) if hparams is None else hparams,
    }
    torch.save(meta, path / "meta.pt")
    return path, weights


def _assert_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for key, tensor in expected.items():
        torch.testing.assert_close(actual[key], tensor, rtol=0, atol=0)


def test_load_from_checkpoint_reads_a_sharded_directory(tmp_path):
    path, weights = _sharded(tmp_path)
    import lightning.pytorch.core.saving as saving

    with pytest.raises(IsADirectoryError):  # Lightning's own loader, unwrapped, cannot read a directory
        saving.pl_load.__wrapped__(path)
    model = Tiny.load_from_checkpoint(path)
    assert dict(model.hparams) == HPARAMS
    _assert_equal(model.state_dict(), weights)
    checkpoint = load_lightning_checkpoint(path, map_location="cpu")
    assert checkpoint["global_step"] == 3 and not {"callbacks", "lr_schedulers"} & checkpoint.keys()


def test_other_paths_go_to_lightnings_loader(tmp_path):
    assert install_load_from_checkpoint()  # already installed on import: once, not wrapped twice
    import lightning.pytorch.core.saving as saving

    assert not getattr(saving.pl_load.__wrapped__, "_lightning_shard_adapter", False)
    path, weights = _sharded(tmp_path)
    file = tmp_path / "full.ckpt"
    torch.save({**torch.load(path / "meta.pt"), "state_dict": weights}, file)
    _assert_equal(Tiny.load_from_checkpoint(file).state_dict(), weights)
    (tmp_path / "other").mkdir()
    with pytest.raises(IsADirectoryError):
        Tiny.load_from_checkpoint(tmp_path / "other")


def test_install_without_lightnings_loader_changes_nothing(monkeypatch):
    import lightning.pytorch.core.saving as saving

    monkeypatch.delattr(saving, "pl_load")
    assert install_load_from_checkpoint() is False
    assert not hasattr(saving, "pl_load")


def _planted() -> Any:
    _planted.ran = True  # type: ignore[attr-defined]
    return None


class _Payload:
    def __reduce__(self) -> Any:
        return (_planted, ())


def test_planted_metadata_runs_only_with_weights_only_false(tmp_path):
    path, _ = _sharded(tmp_path)
    with open(path / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    metadata.planner_data = _Payload()
    with open(path / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    _planted.ran = False  # type: ignore[attr-defined]
    with pytest.raises(
        pickle.UnpicklingError, match=r"names the global .*_planted, which weights_only loading"
    ):
        Tiny.load_from_checkpoint(path)
    assert _planted.ran is False  # type: ignore[attr-defined]
    Tiny.load_from_checkpoint(path, weights_only=False)
    assert _planted.ran is True  # type: ignore[attr-defined]


def test_metadata_that_is_not_dcp_metadata(tmp_path):
    (tmp_path / ".metadata").write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(pickle.UnpicklingError, match="holds a dict, not DCP metadata"):
        MetadataReader(tmp_path).read_metadata()


def test_deepspeed_files_checked_before_deepspeed_unpickles_them(tmp_path):
    safe, unsafe = tmp_path / "safe.pt", tmp_path / "unsafe.pt"
    torch.save({"w": torch.ones(2)}, safe)
    torch.save({"w": Fraction(1, 2)}, unsafe)
    check_deepspeed_pickles([safe])
    with pytest.raises(
        pickle.UnpicklingError, match=r"unsafe\.pt' names fractions\.Fraction, which weights_only"
    ):
        check_deepspeed_pickles([safe, unsafe])


def test_load_lightning_checkpoint_refusals(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_lightning_checkpoint(tmp_path / "missing.ckpt")
    torch.save({"layer.weight": torch.ones(2, 3)}, tmp_path / "plain.pt")
    with pytest.raises(
        ValueError, match="is not a Lightning checkpoint .*a plain state dict holds no hyperparameters"
    ):
        load_lightning_checkpoint(tmp_path / "plain.pt")
    (tmp_path / "half.ckpt").mkdir()
    with pytest.raises(
        ValueError,
        match=r"is a directory but not a sharded checkpoint \(no \.metadata / meta\.pt\) nor a DeepSpeed one",
    ):
        load_lightning_checkpoint(tmp_path / "half.ckpt")
    with pytest.raises(ValueError, match=r"consolidate\(format='npz'\) is unknown"):
        consolidate(tmp_path / "half.ckpt", tmp_path / "out.ckpt", format="npz")  # type: ignore[arg-type]


def test_consolidate_writes_a_lightning_file_or_weights_only(tmp_path, capsys):
    path, weights = _sharded(tmp_path)
    assert cli_main(["consolidate", str(path), str(tmp_path / "model.ckpt")]) == 0
    model = Tiny.load_from_checkpoint(tmp_path / "model.ckpt")
    assert dict(model.hparams) == HPARAMS
    _assert_equal(model.state_dict(), weights)
    with open_weights(tmp_path / "model.ckpt") as source:  # init_weights reads it too
        _assert_equal({k: source.read(k) for k in source.keys()}, weights)
    # A file in, a file out: consolidating a full checkpoint drops what only a resume needs.
    assert cli_main(["consolidate", str(tmp_path / "model.ckpt"), str(tmp_path / "again.ckpt")]) == 0
    assert torch.load(tmp_path / "again.ckpt").keys() == torch.load(tmp_path / "model.ckpt").keys()

    assert cli_main(["consolidate", str(path), str(tmp_path / "model.pt"), "--weights-only"]) == 0
    plain = Tiny(**HPARAMS)
    plain.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    _assert_equal(plain.state_dict(), weights)
    assert "wrote" in capsys.readouterr().out


def test_consolidate_untrusted_pickles_need_trusted(tmp_path, capsys):
    path, _ = _sharded(tmp_path, hparams={"width": 3, "name": Fraction(1, 3)})
    assert cli_main(["consolidate", str(path), str(tmp_path / "model.ckpt")]) == 2
    err = capsys.readouterr().err
    assert "WeightsUnpickler error: Unsupported global: GLOBAL fractions.Fraction" in err
    assert "Add --trusted if you trust the checkpoint's source." in err
    assert not (tmp_path / "model.ckpt").exists()
    assert cli_main(["consolidate", str(path), str(tmp_path / "model.ckpt"), "--trusted"]) == 0
    assert torch.load(tmp_path / "model.ckpt", weights_only=False)["hyper_parameters"]["name"] == Fraction(
        1, 3
    )


def test_load_full_state_dict_refuses_another_model(tmp_path):
    model = Tiny(width=3)
    weights = {k: v.clone() for k, v in Tiny(width=5).state_dict().items()}
    with pytest.raises(
        CheckpointLoadError, match=r"layer\.weight is \(2, 5\) in the checkpoint but \(2, 3\) here"
    ):
        load_full_state_dict(model, weights, tmp_path, True, {"width": 5})
    weights = {k: v.clone() for k, v in Tiny(width=3).state_dict().items()}
    load_full_state_dict(model, weights, tmp_path, True)
    _assert_equal(model.state_dict(), weights)


class _WritesMarker:
    """Unpickling it creates ``marker``: what a malicious checkpoint would do instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> Any:
        return (os.makedirs, (self.marker,))  # a side effect, and None in its place


def test_consolidate_runs_no_planted_payload_unless_trusted(tmp_path, capsys):
    marker = tmp_path / "payload-ran"
    path, _ = _sharded(tmp_path, hparams={"width": 3, "name": _WritesMarker(marker)})
    # The weights alone: the hyper-parameters holding the payload are never unpickled.
    assert cli_main(["consolidate", str(path), str(tmp_path / "model.pt"), "--weights-only"]) == 0
    assert not marker.exists()
    # A Lightning file carries the hyper-parameters: refused, nothing run, nothing written.
    assert cli_main(["consolidate", str(path), str(tmp_path / "model.ckpt")]) == 2
    assert "Add --trusted if you trust the checkpoint's source." in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "model.ckpt").exists()
    # The user opted in: the pickle runs, as torch.load(weights_only=False) would run it.
    assert cli_main(["consolidate", str(path), str(tmp_path / "model.ckpt"), "--trusted"]) == 0
    assert marker.exists()


def test_init_weights_runs_no_planted_payload(tmp_path):
    from lightning_shard import ShardStrategy

    marker = tmp_path / "payload-ran"
    weights = tmp_path / "weights.pt"
    torch.save({**Tiny(width=3).state_dict(), "planted": _WritesMarker(marker)}, weights)
    with pytest.raises(
        ValueError, match="cannot be read as a torch.save state dict .*Weights only load failed"
    ) as raised:
        ShardStrategy(stage=3, init_weights=str(weights))
    assert "weights.pt" in str(raised.value), raised.value
    assert not marker.exists()
