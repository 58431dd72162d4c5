"""Every fallback in lightning_shard._compat does what the private API it stands in for does."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_shard import _compat
from lightning_shard.demos.ranks import run_ranks
from lightning_shard.trainer import _compat as trainer_compat


def test_backend_and_initialized_fallbacks_match():
    from lightning.fabric.utilities.distributed import (
        _distributed_is_initialized,
        _get_default_process_group_backend_for_device,
    )

    for device in (torch.device("cpu"), torch.device("cuda", 0)):
        assert _compat.default_backend_fallback(device) == _get_default_process_group_backend_for_device(
            device
        )
    assert _compat.distributed_is_initialized_fallback() is _distributed_is_initialized() is False


def _stateful_optimizer() -> torch.optim.Optimizer:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return optimizer


def test_optimizers_to_device_fallback_matches():
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    real, fallback = _stateful_optimizer(), _stateful_optimizer()
    _optimizers_to_device([real], torch.device("meta"))
    _compat.optimizers_to_device_fallback([fallback], torch.device("meta"))
    for a, b in zip(real.state.values(), fallback.state.values(), strict=True):
        for key in ("exp_avg", "exp_avg_sq"):
            assert a[key].device == b[key].device == torch.device("meta")


def test_flatten_state_dict_fallback_matches():
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    optimizer = _stateful_optimizer()
    state = {"state_dict": {"w": torch.ones(2)}, "optimizer_0": optimizer.state_dict()}
    assert set(_compat.flatten_state_dict_fallback(state)[0]) == set(flatten_state_dict(state)[0])


def test_build_directory_is_where_torch_builds(tmp_path, monkeypatch):
    from torch.utils.cpp_extension import _get_build_directory

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    assert _compat.build_directory() == tmp_path / "ext"
    assert Path(_get_build_directory("op", verbose=False)).is_relative_to(tmp_path / "ext")
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert Path(_get_build_directory("op", verbose=False)).is_relative_to(_compat.build_directory())


def test_each_python_environment_builds_extensions_in_its_own_folder(tmp_path, monkeypatch):
    import hashlib
    import sys

    from torch.utils.cpp_extension import _get_build_directory

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    _compat.build_per_environment()
    tag = hashlib.sha256(os.path.realpath(sys.prefix).encode()).hexdigest()[:12]
    folder = (
        tmp_path
        / "cache"
        / "torch_extensions"
        / f"py{sys.version_info.major}{sys.version_info.minor}-env-{tag}"
    )
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(folder)
    assert Path(_get_build_directory("op", verbose=False)) == folder / "op"  # where torch builds DeepSpeed's
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "another-venv"))
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    _compat.build_per_environment()
    assert os.environ["TORCH_EXTENSIONS_DIR"] != str(folder)  # another environment, another folder
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "mine"))
    _compat.build_per_environment()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(tmp_path / "mine")  # the user's choice is kept


def test_a_missing_private_api_names_itself_and_the_tested_versions():
    fail = _compat._unavailable("torch.secret_thing", ImportError("gone"))
    with pytest.raises(RuntimeError, match=r"needs torch.secret_thing.*gone.*tested with torch 2\.6"):
        fail()


def _collectives() -> dict[str, list[float]]:
    from lightning.fabric.utilities.distributed import _sync_ddp_if_available

    torch.distributed.init_process_group("gloo")
    assert torch.distributed.get_world_size() == 2
    value = torch.tensor([1.0 + torch.distributed.get_rank(), -2.0])
    out = {}
    for op in ("mean", "sum", "max", "min"):
        out[op] = [
            _compat.sync_ddp_fallback(value, None, op).tolist(),
            _sync_ddp_if_available(value.clone(), None, op).tolist(),
        ]
    return out


@pytest.mark.multirank
def test_process_group_and_reduction_fallbacks_match():
    for rank_result in run_ranks(_collectives):
        for op, (fallback, real) in rank_result.items():
            assert fallback == real, op
        assert rank_result["sum"][0] == [3.0, -4.0]


def test_lightnings_sigterm_notifier_is_replaced_alone_and_restored_at_teardown():
    import signal

    import lightning as L

    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    original = signal.getsignal(signal.SIGTERM)
    trainer._signal_connector.register_signal_handlers()
    try:
        calls: list[int] = []
        assert trainer_compat.replace_sigterm_notifier(trainer, lambda signum, frame: calls.append(signum))
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)  # type: ignore[operator]
        assert calls == [signal.SIGTERM]
        assert not trainer.received_sigterm  # Lightning's own notifier did not run
        trainer_compat.mark_sigterm_received(trainer)
        assert trainer.received_sigterm
        assert not trainer_compat.replace_sigterm_notifier(
            trainer, lambda signum, frame: None
        )  # already gone
    finally:
        trainer._signal_connector.teardown()
    assert signal.getsignal(signal.SIGTERM) == original


def _live_groups() -> list[int]:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.new_group(backend="gloo")
    counts = [len(_compat.live_process_groups()), len(_compat.live_process_groups_fallback())]
    dist.destroy_process_group()
    return counts + [len(_compat.live_process_groups())]


def test_live_process_groups_lists_every_group_the_fallback_the_default_one():
    assert run_ranks(_live_groups) == [[2, 1, 0], [2, 1, 0]]


def test_keeping_the_root_gathered_falls_back_to_nothing_without_fsdp_state():
    # A module without FSDP2's private state (or a release that moved it): nothing changes, no error.
    module = torch.nn.Linear(2, 2)
    assert _compat.fsdp_keep_gathered_after_nested_forward(module) is None


def test_dynamo_dispatch_mode_skip_check_and_its_fallback_match():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts
    from torch.utils.flop_counter import FlopCounterMode

    checks = (_compat.dynamo_skips_for_dispatch_mode, _compat.dynamo_skips_for_dispatch_mode_fallback)
    assert [check() for check in checks] == [False, False]
    with FlopCounterMode(display=False):
        assert [check() for check in checks] == [True, True]
    # selective activation checkpointing's modes ignore compile internals: dynamo compiles under them
    forward, _ = create_selective_checkpoint_contexts(lambda ctx, op, *a, **k: None)
    with forward:
        assert _compat.dynamo_skips_for_dispatch_mode() is False
