"""DeepSpeed checkpoints onto another world size and onto the FSDP engine, through DeepSpeed's own tooling.

A DeepSpeed ZeRO checkpoint (the DeepSpeed engine's, or Lightning ``DeepSpeedStrategy``'s: the same layout and
tag) holds each rank's flat partition of the fp32 master weights and of the optimizer state, and DeepSpeed
loads it only on the data-parallel world size it was saved on. Moving it elsewhere:

* fp32 weights: DeepSpeed's ``zero_to_fp32`` (:func:`~.weights.load_model_weights`), on any world size.
* Adam(W) state: DeepSpeed's universal checkpoint (``deepspeed.checkpoint.ds_to_universal``), which holds per
  parameter its fp32 value, ``exp_avg``, ``exp_avg_sq`` and ``step``. ``engine="deepspeed"`` on another world
  size loads it with DeepSpeed's ``checkpoint.load_universal``; ``engine="fsdp"`` reads it into torch's full
  optimizer state dict, keyed by parameter name, which the engine shards (``set_optimizer_state_dict``).
* No per-parameter state (SGD without momentum): the weights alone resume exactly; nothing is converted.
* Any other state (SGD's ``momentum_buffer``, Adam's ``max_exp_avg_sq``): refused with the fix, never dropped.
  DeepSpeed's universal converter carries Adam's moments only.

The universal checkpoint is written by rank 0 into a hidden directory beside the checkpoint
(``.NAME.XXXXXXXX.universal``: the file system every rank reads the checkpoint from), the other ranks
waiting, and removed once every rank has loaded it. The checkpoint itself is only read.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import shlex
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import lightning_shard.checkpoint._errors as errors
from lightning_shard.checkpoint._errors import CheckpointLoadError
from lightning_shard.checkpoint._pickles import check_deepspeed_files
from lightning_shard.checkpoint.layout import DEEPSPEED_TAG, MODEL_KEY
from lightning_shard.checkpoint.weights import deepspeed_model_states, load_model_weights

log = logging.getLogger(__name__)

#: Per-parameter optimizer state DeepSpeed's universal checkpoint carries (Adam's, and DeepSpeedCPUAdam's).
ADAM_STATE = frozenset({"exp_avg", "exp_avg_sq", "step"})
_UNIVERSAL_SUFFIX = ".universal"


@dataclass(frozen=True)
class SavedLayout:
    """What a DeepSpeed checkpoint was saved with, read from rank 0's files."""

    stage: int
    world_size: int
    #: Keys of the per-parameter optimizer state (empty for SGD without momentum).
    state_keys: frozenset[str]
    #: Hyperparameters of each param group, as configure_optimizers() made them (no ``params``).
    param_groups: list[dict[str, Any]]


def saved_layout(path: Path, states: dict[str, Any] | None = None) -> SavedLayout:
    """The stage, data-parallel world size and optimizer state of the DeepSpeed checkpoint at ``path``
    (its files already scanned, or trusted); ``states``: its rank-0 model-states file, if already read."""
    states = deepspeed_model_states(path, weights_only=False) if states is None else states
    optim_files = sorted((path / DEEPSPEED_TAG).glob("*zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    if optim_files:
        saved = torch.load(optim_files[0], map_location="cpu", weights_only=False)["optimizer_state_dict"]
        stage = int(saved["zero_stage"])
        inner = saved["base_optimizer_state"] if stage <= 2 else saved["optimizer_state_dict"]
    else:  # stage 0: the torch optimizer's own state dict rides in the model-states file
        stage, inner = 0, states.get("optimizer") or {"state": {}, "param_groups": []}
    keys = frozenset(key for entry in inner["state"].values() for key in entry)
    groups = [{k: v for k, v in group.items() if k != "params"} for group in inner["param_groups"]]
    return SavedLayout(stage, int(states.get("dp_world_size", 1)), keys, groups)


def converts_optimizer(path: Path, layout: SavedLayout, target: str) -> bool:
    """Whether the optimizer state must go through a universal checkpoint (Adam's) or needs nothing (none).

    ``target`` names the resume as the user asked for it (``"engine='fsdp'"``), for the refusal."""
    keys = layout.state_keys
    if not keys:
        return False
    amsgrad = any(group.get("amsgrad") for group in layout.param_groups)
    if {"exp_avg", "exp_avg_sq"} <= keys <= ADAM_STATE and not amsgrad and layout.stage > 0:
        return True
    unknown = sorted(keys - ADAM_STATE) + (["max_exp_avg_sq (amsgrad=True)"] if amsgrad else [])
    held = ", ".join(unknown or sorted(keys))
    raise CheckpointLoadError(
        f"Checkpoint {str(path)!r} is a DeepSpeed checkpoint (ZeRO stage {layout.stage}, {layout.world_size} ranks)"
        f" whose optimizer state holds {held}, which ShardStrategy({target}) cannot carry over: DeepSpeed's"
        " universal checkpoint, which moves ZeRO state to another layout, carries Adam's exp_avg, exp_avg_sq and"
        " step only (from ZeRO stages 1-3). Resume it with ShardStrategy(engine='deepspeed') on"
        f" {layout.world_size} ranks, or start from its weights: `lightning-shard consolidate"
        f" {shlex.quote(str(path))} model.pt --weights-only`, model.load_state_dict(torch.load('model.pt')) and"
        " fit without ckpt_path."
    )


def check_files(path: Path, weights_only: bool | None) -> None:
    """On every rank: scan the checkpoint's pickles unless ``weights_only=False`` (DeepSpeed's readers and its
    converter unpickle them with ``weights_only=False``)."""
    if weights_only is not False:
        errors.on_every_rank(path, lambda: check_deepspeed_files(path))


@contextlib.contextmanager
def universal_checkpoint(path: Path, is_rank0: bool, barrier: Callable[[], None]) -> Iterator[Path]:
    """The universal checkpoint of ``path``: a directory whose ``checkpoint/`` DeepSpeed loads with
    ``load_universal``, written by rank 0 while the others wait, removed once every rank leaves the block."""
    root = errors.on_every_rank(path, lambda: _convert(path) if is_rank0 else None)
    root = _broadcast(root)
    try:
        yield root
        barrier()  # every rank has read it
    finally:
        if is_rank0:
            shutil.rmtree(root, ignore_errors=True)


def _convert(path: Path) -> Path:
    from deepspeed.checkpoint import ds_to_universal  # optional: DeepSpeed

    try:
        root = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=_UNIVERSAL_SUFFIX, dir=path.parent))
    except OSError as err:
        raise CheckpointLoadError(
            f"Checkpoint {str(path)!r}: its universal checkpoint (DeepSpeed's layout-free copy, needed to resume it"
            f" on another world size or engine) cannot be written beside it ({err}). Copy the checkpoint to a"
            " writable directory on a file system every rank reads, and resume from the copy."
        ) from err
    args = argparse.Namespace(
        input_folder=str(path / DEEPSPEED_TAG),
        output_folder=str(root / DEEPSPEED_TAG),
        num_extract_workers=1,  # no process pool inside a training rank
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,  # only Megatron-DeepSpeed records the universal-checkpoint info itself
    )
    log.info("Converting DeepSpeed checkpoint %s to a universal checkpoint in %s", path, root)
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # the converter prints its progress
            ds_to_universal.main(args)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    return root


def _broadcast(value: Any) -> Any:
    if not (dist.is_available() and dist.is_initialized()):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# --- the FSDP engine ---------------------------------------------------------------------------------


def load_into_fsdp(
    engine: Any, model: Any, optimizers: list[Any], path: Path, weights_only: bool | None = None
) -> dict[str, Any]:
    """Resume the FSDP engine (any stage, any world size) from a DeepSpeed checkpoint; return Lightning's entries.

    Weights from DeepSpeed's ``zero_to_fp32``; Adam's state through the universal checkpoint; every check on
    every rank before a byte of state is loaded, and every rank raising if one does."""
    check_files(path, weights_only)
    states, layout, weights = errors.on_every_rank(path, lambda: _read(engine, model, path))
    convert = bool(optimizers) and errors.on_every_rank(
        path, lambda: converts_optimizer(path, layout, "engine='fsdp'")
    )
    barrier = engine.run.barrier
    with universal_checkpoint(path, engine.run.is_global_zero, barrier) if convert else _none() as root:
        shapes = {name: value.shape for name, value in weights.items()}
        targets = errors.on_every_rank(
            path,
            lambda: [_full_optimizer_state(engine, model, opt, layout, root, shapes) for opt in optimizers],
        )

        def apply() -> None:
            engine.load_model_state_dict(model, weights, full=True)
            for optimizer, state in zip(optimizers, targets, strict=True):
                engine.load_optimizer_state_dict(model, optimizer, state, full=True)

        errors.on_every_rank(path, apply)
    # Lightning's entries (loops, callbacks, schedulers, hyperparameters) sit beside DeepSpeed's bulky ones.
    return {k: v for k, v in states.items() if k not in ("module", "optimizer")}


@contextlib.contextmanager
def _none() -> Iterator[None]:
    yield None


def _read(engine: Any, model: Any, path: Path) -> tuple[dict[str, Any], SavedLayout, dict[str, torch.Tensor]]:
    try:  # the files were scanned by check_files (or trusted)
        states = deepspeed_model_states(path, weights_only=False)
        weights = load_model_weights(path, weights_only=False)
        layout = saved_layout(path, states)
    except Exception as err:  # noqa: BLE001  (a cut-short file fails in several ways, all the same fault)
        raise errors.unreadable(path, "a DeepSpeed file", err) from err
    saved = {key: tuple(value.shape) for key, value in weights.items()}
    wanted = errors.target_shapes(engine.model_state_dict(model, full=False))
    fix = errors.model_fix(states.get("hyper_parameters"), model)
    errors.check_state(path, saved, wanted, "", "model", strict=True, fix=fix)
    return states, layout, weights


def _full_optimizer_state(
    engine: Any,
    model: Any,
    optimizer: Any,
    layout: SavedLayout,
    root: Path | None,
    shapes: dict[str, torch.Size],
) -> dict[str, Any]:
    """Torch's full optimizer state dict (``{"state": {name: ...}, "param_groups": [...]}``) for ``optimizer``,
    its groups named as the engine names them, hyperparameters and Adam's moments from the checkpoint."""
    live = engine.optimizer_state_dict(model, optimizer, full=False)["param_groups"]
    if len(live) != len(layout.param_groups):
        raise CheckpointLoadError(
            f"The DeepSpeed checkpoint's optimizer has {len(layout.param_groups)} param groups but"
            f" configure_optimizers() made {len(live)}.{errors.OPTIMIZER_FIX}"
        )
    groups = [
        {**saved, "params": list(group["params"])}
        for saved, group in zip(layout.param_groups, live, strict=True)
    ]
    state: dict[str, dict[str, Any]] = {}
    if root is not None:
        names = [name for group in groups for name in group["params"]]
        state = {name: _adam_state(root / DEEPSPEED_TAG, name, shapes[name]) for name in names}
    return {"state": state, "param_groups": groups}


def _adam_state(folder: Path, name: str, shape: torch.Size) -> dict[str, Any]:
    """One parameter's Adam state from the universal checkpoint's ``zero/<name>/`` files."""
    param_dir = folder / "zero" / name
    missing = [key for key in ("exp_avg", "exp_avg_sq") if not (param_dir / f"{key}.pt").is_file()]
    if missing:
        raise CheckpointLoadError(
            f"The DeepSpeed checkpoint holds no {' or '.join(missing)} for parameter {name!r} (its universal"
            f" checkpoint lacks {param_dir.name}/{missing[0]}.pt).{errors.OPTIMIZER_FIX}"
        )
    entry = {key: _tensor(param_dir / f"{key}.pt").reshape(shape) for key in ("exp_avg", "exp_avg_sq")}
    step_file = param_dir / "step.pt"
    if step_file.is_file():  # ZeRO-1/2: one per parameter
        step = torch.load(step_file, map_location="cpu", weights_only=True)
    else:  # ZeRO-3: every sub-group of the optimizer stepped together
        common = torch.load(folder / "zero" / "optimizer_state.pt", map_location="cpu", weights_only=False)
        step = next(iter(common["optimizer_state_dict"]["state"].values()))["step"]
    entry["step"] = torch.as_tensor(step, dtype=torch.float32).clone()
    return entry


def _tensor(file: Path) -> torch.Tensor:
    value = torch.load(file, map_location="cpu", weights_only=True)
    # ZeRO-1/2's files hold {"param": tensor, "cat_dim": ...} in the parameter's shape, ZeRO-3's the flat tensor.
    return (value["param"] if isinstance(value, dict) else value).float()


# --- the DeepSpeed engine on another world size --------------------------------------------------------


def load_into_deepspeed(
    model: Any, path: Path, world_size: int, is_rank0: bool, barrier: Callable[[], None], mixed: bool
) -> dict[str, Any] | None:
    """Load a ZeRO checkpoint saved on another data-parallel world size into DeepSpeed engine ``model``;
    ``None`` when DeepSpeed loads it as it is (same world size, or no ZeRO partitions)."""
    saved_ranks = len(list((path / DEEPSPEED_TAG).glob("*zero_pp_rank_*_mp_rank_00_optim_states.pt")))
    if saved_ranks in (0, world_size):  # no ZeRO partitions (stage 0), or DeepSpeed's own layout
        return None
    layout = errors.on_every_rank(path, lambda: saved_layout(path))
    target = f"engine='deepspeed', {world_size} ranks"
    if errors.on_every_rank(path, lambda: converts_optimizer(path, layout, target)):
        with universal_checkpoint(path, is_rank0, barrier) as root:
            config = model._config  # DeepSpeed reads checkpoint.load_universal when loading, not at set-up
            before, config.load_universal_checkpoint = config.load_universal_checkpoint, True
            try:
                loaded, client_state = model.load_checkpoint(
                    str(root), tag=DEEPSPEED_TAG, load_lr_scheduler_states=False
                )
            finally:
                config.load_universal_checkpoint = before
    else:
        if mixed:
            raise CheckpointLoadError(
                f"Checkpoint {str(path)!r} was saved by DeepSpeed on {layout.world_size} ranks with an optimizer"
                f" that keeps no per-parameter state; on {world_size} ranks its fp32 master weights would be"
                " rebuilt from the module's half-precision copy. Resume on"
                f" {layout.world_size} ranks, with precision='32-true', or with engine='fsdp', which reads the"
                " fp32 weights."
            )
        # No optimizer state to move: the module's weights are the fp32 master weights, on any world size. A
        # ZeRO-3 checkpoint has no whole module file for DeepSpeed's reader at stages 1-2.
        if model.zero_optimization_partition_weights() or layout.stage == 3:
            loaded, client_state = _load_zero3_module(model, path)
        else:
            loaded, client_state = model.load_checkpoint(
                str(path),
                tag=DEEPSPEED_TAG,
                load_optimizer_states=False,
                load_lr_scheduler_states=False,
                load_module_only=True,
            )
    if loaded is None:
        raise CheckpointLoadError(
            f"DeepSpeed found no checkpoint under {str(path)!r} (tag {DEEPSPEED_TAG!r})."
        )
    return {k: v for k, v in client_state.items() if k not in ("module", "optimizer", MODEL_KEY)}


def _load_zero3_module(model: Any, path: Path) -> tuple[str, dict[str, Any]]:
    """What DeepSpeed's ``load_checkpoint(load_module_only=True)`` does at ZeRO-3 (or from a ZeRO-3 checkpoint),
    on any number of ranks: every
    rank rebuilds the fp32 weights from all partitions (``zero_to_fp32``), rank 0's copy goes into the
    partitioned parameters, and the optimizer's fp32 partitions are refreshed from them. DeepSpeed's own call
    reads this rank's ``zero_pp_rank_<r>`` file for the client state, which a run on more ranks than saved lacks;
    here it comes from rank 0's, as every rank's holds the same."""
    import deepspeed  # optional: DeepSpeed

    weights = load_model_weights(path, weights_only=False)  # its files were checked before
    params = [p for p in model.module.parameters() if hasattr(p, "ds_id")]
    with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
        model.module.load_state_dict(weights, strict=True)
    if hasattr(model.optimizer, "refresh_fp32_params"):
        model.optimizer.refresh_fp32_params()
    states = deepspeed_model_states(path, weights_only=False)
    return str(path), {key: value for key, value in states.items() if key != "module"}
