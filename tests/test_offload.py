"""Offload flags and the DeepSpeed engine's bad input: errors before any process starts.

Only the tests marked ``deepspeed`` need DeepSpeed installed (tests/conftest.py skips them where it
is missing); the flag checks that fail before an engine is chosen run everywhere.
"""

from __future__ import annotations

import dataclasses
import os
import time

import lightning as L
import pytest

from lightning_shard import ShardPrecision, ShardStrategy
from lightning_shard import offload as offload_mod
from lightning_shard.engines import TrainSettings
from lightning_shard.engines.deepspeed.ops import clear_stale_build_locks
from tests.helpers import make_engine


@pytest.mark.parametrize("flag", ["offload_optimizer", "offload_params"])
@pytest.mark.parametrize("value", ["gpu", "disk", "CPU"])
def test_unknown_offload_target(flag, value):
    with pytest.raises(ValueError, match=rf"{flag}='{value}'\) is not an offload target"):
        ShardStrategy(stage=3, **{flag: value})


def test_offload_params_needs_stage_3():
    with pytest.raises(ValueError, match=r"offload_params='cpu'\) needs stage=3 \(got stage=2\)"):
        ShardStrategy(stage=2, offload_params="cpu", offload_optimizer="cpu")


def test_nvme_below_stage_3(tmp_path):
    with pytest.raises(
        ValueError, match=r"with NVMe needs stage=3 \(got stage=2\): DeepSpeed ignores NVMe offload"
    ):
        ShardStrategy(stage=2, offload_optimizer="nvme", nvme_path=str(tmp_path))


def test_nvme_needs_path():
    with pytest.raises(ValueError, match=r"needs nvme_path"):
        ShardStrategy(stage=3, offload_optimizer="nvme")


def test_nvme_path_without_nvme(tmp_path):
    with pytest.raises(ValueError, match=r"nvme_path=.*is set but nothing is offloaded to 'nvme'"):
        ShardStrategy(stage=3, nvme_path=str(tmp_path))


@pytest.mark.deepspeed
def test_nvme_path_missing_or_not_a_directory(tmp_path):
    with pytest.raises(ValueError, match=r"nvme_path='.*nope'\) does not exist"):
        ShardStrategy(stage=3, offload_optimizer="nvme", nvme_path=str(tmp_path / "nope"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"nvme_path='.*file'\) is not a directory"):
        ShardStrategy(stage=3, offload_optimizer="nvme", nvme_path=str(tmp_path / "file"))


@pytest.mark.deepspeed
def test_nvme_path_not_writable(tmp_path, monkeypatch):
    monkeypatch.setattr(offload_mod.os, "access", lambda path, mode: False)
    with pytest.raises(ValueError, match=r"is not writable by this user"):
        ShardStrategy(stage=3, offload_optimizer="nvme", nvme_path=str(tmp_path))


def test_nvme_path_too_small(tmp_path):
    with pytest.raises(ValueError, match=r"GiB free but the offloaded state needs"):
        offload_mod.check_nvme_path(str(tmp_path), need_bytes=1 << 62)


@pytest.mark.deepspeed
def test_libaio_missing(tmp_path, monkeypatch):
    from deepspeed.ops.op_builder import AsyncIOBuilder

    monkeypatch.setattr(AsyncIOBuilder, "is_compatible", lambda self, verbose=False: False)
    with pytest.raises(ValueError, match=r"NVMe offload needs libaio.*apt-get install libaio-dev"):
        ShardStrategy(stage=3, offload_optimizer="nvme", nvme_path=str(tmp_path))


@pytest.mark.deepspeed
def test_build_ops_builds_what_the_engine_loads_and_names_what_it_skips(capsys):
    """``lightning-shard build-ops`` (the README runs it before the tests): every op the CPU runs loads."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    from lightning_shard import cli

    assert cli.main(["build-ops"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert " built in " in rows["cpu_adam"] and " built in " in rows["deepspeed_shm_comm"]
    assert "skipped: not used on the cpu accelerator" in rows["FusedAdamBuilder"]
    if AsyncIOBuilder().is_compatible(verbose=False):
        assert " built in " in rows["async_io"]
    else:
        assert "skipped: libaio not found: apt-get install libaio-dev" in rows["async_io"]


@pytest.mark.deepspeed
def test_build_ops_reports_a_failed_build_and_exits_1(capsys, monkeypatch):
    from deepspeed.ops.op_builder.cpu.cpu_adam import CPUAdamBuilder

    from lightning_shard import cli

    def fail(self, verbose=True):
        raise RuntimeError("Error building extension 'cpu_adam'")

    monkeypatch.setattr(CPUAdamBuilder, "load", fail)
    assert cli.main(["build-ops"]) == 1
    assert "cpu_adam                 failed" in capsys.readouterr().out


def test_deepspeed_not_installed(monkeypatch):
    real = offload_mod.importlib.util.find_spec
    monkeypatch.setattr(
        offload_mod.importlib.util, "find_spec", lambda name: None if name == "deepspeed" else real(name)
    )
    with pytest.raises(ValueError, match=r"needs DeepSpeed .* pip install --no-build-isolation"):
        ShardStrategy(stage=3, engine="deepspeed")


def test_fsdp_engine_cannot_serve_optimizer_only_offload():
    with pytest.raises(ValueError, match=r"engine='fsdp'.*cannot be served by FSDP2.*Use engine='deepspeed'"):
        ShardStrategy(stage=3, engine="fsdp", offload_optimizer="cpu")


@pytest.mark.parametrize(
    "kwargs, engine",
    [
        ({}, "fsdp"),
        ({"offload_optimizer": "cpu", "offload_params": "cpu"}, "fsdp"),
        pytest.param({"offload_optimizer": "cpu"}, "deepspeed", marks=pytest.mark.deepspeed),
        pytest.param({"engine": "deepspeed"}, "deepspeed", marks=pytest.mark.deepspeed),
    ],
)
def test_auto_engine_choice(kwargs, engine):
    assert ShardStrategy(stage=3, **kwargs).engine_name == engine


@pytest.mark.deepspeed
@pytest.mark.needs_libaio
def test_nvme_chooses_deepspeed(tmp_path):
    assert (
        ShardStrategy(stage=3, offload_optimizer="nvme", nvme_path=str(tmp_path)).engine_name == "deepspeed"
    )


@pytest.mark.parametrize(
    "name, kwargs",
    [
        pytest.param("zero2_offload", dict(stage=2, offload_optimizer="cpu"), marks=pytest.mark.deepspeed),
        ("zero3_offload", dict(stage=3, offload_optimizer="cpu", offload_params="cpu")),
    ],
)
def test_offload_registered_names(name, kwargs):
    strategy = L.Trainer(accelerator="cpu", devices=2, strategy=name, logger=False).strategy
    reference = ShardStrategy(**kwargs)
    assert (strategy.stage, strategy.engine_name, strategy.offload_optimizer, strategy.offload_params) == (
        reference.stage,
        reference.engine_name,
        reference.offload_optimizer,
        reference.offload_params,
    )


def test_deepspeed_engine_rejects_what_it_cannot_serve():
    with pytest.raises(ValueError, match=r"cannot run precision='bf16-true'"):
        make_engine("deepspeed", 3, ShardPrecision("bf16-true"))
    with pytest.raises(
        ValueError, match=r"gradient_clip_algorithm='value'\) is not available with engine='deepspeed'"
    ):
        make_engine("deepspeed", 3).ds_config(TrainSettings(1, 1.0, "value"))


def test_deepspeed_config_from_flags(tmp_path):

    engine = make_engine(
        "deepspeed",
        3,
        ShardPrecision("bf16-mixed"),
        offload_optimizer="nvme",
        offload_params="cpu",
        nvme_path=str(tmp_path),
    )
    engine.run = dataclasses.replace(engine.run, global_rank=1)
    config = engine.ds_config(TrainSettings(4, 0.5, "norm"))
    zero = config["zero_optimization"]
    assert (
        zero["stage"] == 3
        and config["gradient_accumulation_steps"] == 4
        and config["gradient_clipping"] == 0.5
    )
    assert zero["offload_optimizer"] == {
        "device": "nvme",
        "pin_memory": False,
        "nvme_path": str(tmp_path / "lightning_shard_swap" / "rank1"),
    }
    assert zero["offload_param"] == {"device": "cpu", "pin_memory": False}
    assert config["bf16"] == {"enabled": True}


def test_stale_build_lock_is_cleared(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    build = tmp_path / "cpu_adam"
    build.mkdir()
    stale, fresh = build / "lock", tmp_path / "lock"
    stale.write_text("")
    fresh.write_text("")
    old = time.time() - 2 * 3600
    os.utime(stale, (old, old))
    removed = clear_stale_build_locks()
    assert removed == [stale] and not stale.exists() and fresh.exists()


@pytest.mark.deepspeed
def test_build_ops_clears_a_killed_builds_lock_first(tmp_path, monkeypatch):
    """A build killed mid-way leaves its lock; ``build-ops`` would wait on it forever."""
    from lightning_shard.engines.deepspeed import ops as _ds_ops

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    (tmp_path / "async_io").mkdir()
    stale = tmp_path / "async_io" / "lock"
    stale.write_text("")
    old = time.time() - 2 * 3600
    os.utime(stale, (old, old))
    monkeypatch.setattr(_ds_ops, "_builder", lambda accelerator, name: None)  # every op skipped: no build
    assert {op.status for op in _ds_ops.build_deepspeed_ops()} == {"skipped"}
    assert not stale.exists()


def test_swap_directory_is_cleared(tmp_path):
    swap = offload_mod.swap_dir(str(tmp_path), 0)
    swap.mkdir(parents=True)
    (swap / "buffer.swp").write_bytes(b"x" * 10)
    (tmp_path / "user_file").write_text("keep")
    offload_mod.clear_swap(str(tmp_path), 0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["user_file"]


@pytest.mark.deepspeed
@pytest.mark.needs_libaio
def test_nvme_registered_name(tmp_path, monkeypatch):
    monkeypatch.delenv("LIGHTNING_SHARD_NVME_PATH", raising=False)
    with pytest.raises(ValueError, match=r"needs the NVMe swap directory in the environment variable"):
        L.Trainer(accelerator="cpu", devices=2, strategy="zero3_offload_nvme", logger=False)
    monkeypatch.setenv("LIGHTNING_SHARD_NVME_PATH", str(tmp_path))
    strategy = L.Trainer(accelerator="cpu", devices=2, strategy="zero3_offload_nvme", logger=False).strategy
    assert (
        strategy.engine_name,
        strategy.offload_optimizer,
        strategy.offload_params,
        strategy.config.nvme_path,
    ) == ("deepspeed", "nvme", "nvme", str(tmp_path))


def test_clearing_at_start_keeps_the_shared_parent(tmp_path):
    # Another rank may be creating its own directory under the parent at that moment.
    offload_mod.swap_dir(str(tmp_path), 0).mkdir(parents=True)
    offload_mod.clear_swap(str(tmp_path), 0, remove_parent=False)
    assert (tmp_path / offload_mod.SWAP_DIRNAME).is_dir()
    offload_mod.swap_dir(str(tmp_path), 1).mkdir()  # still possible: the parent is there
    offload_mod.clear_swap(str(tmp_path), 1)
    assert not (tmp_path / offload_mod.SWAP_DIRNAME).exists()


@pytest.mark.parametrize("value", ["cpu", "nvme"])
def test_optimizer_offload_needs_zero(value, tmp_path):
    with pytest.raises(ValueError, match=rf"offload_optimizer='{value}'\) needs stage >= 1 \(got stage=0\)"):
        ShardStrategy(stage=0, offload_optimizer=value, nvme_path=str(tmp_path) if value == "nvme" else None)
