"""``weights_only`` for DeepSpeed's checkpoint files, which DeepSpeed's ``zero_to_fp32`` loads with
``weights_only=False``.

Before it does, :func:`check_deepspeed_pickles` lists each file's globals with torch's own scanner
(``torch.serialization.get_unsafe_globals_in_checkpoint``, which reads the pickle's opcodes and runs nothing)
and refuses a file naming anything beyond DeepSpeed's plain classes below. DCP's ``.metadata``, the other
pickle a library unpickles itself, is read by :mod:`._dcp_metadata`.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch

import lightning_shard.checkpoint._errors as errors
from lightning_shard.checkpoint._dcp_metadata import TRUST
from lightning_shard.checkpoint._torch_files import allowed_names
from lightning_shard.checkpoint.layout import DEEPSPEED_TAG

#: Globals DeepSpeed's checkpoint files name beyond torch's ``weights_only`` allowlist: an enum, the
#: ZeRO-1/2 partition bookkeeping dataclass and the loss scalers' plain state classes.
DEEPSPEED_GLOBALS = frozenset(
    {
        "deepspeed.runtime.zero.config.ZeroStageEnum",
        "deepspeed.utils.tensor_fragment.fragment_address",
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    }
)


def check_deepspeed_files(path: Path) -> None:
    """Every file of a DeepSpeed checkpoint directory passes :func:`check_deepspeed_pickles`, or
    :class:`~lightning_shard.CheckpointLoadError` names the file, the global and the opt-in."""
    files = sorted((Path(path) / DEEPSPEED_TAG).glob("*.pt"))
    try:
        check_deepspeed_pickles(files)
    except Exception as err:  # noqa: BLE001  (a refused global, or a file cut short: the scanner reads it whole)
        raise errors.unreadable(Path(path), "a DeepSpeed file", err) from err


def check_deepspeed_pickles(files: list[Path]) -> None:
    """Raise ``pickle.UnpicklingError`` unless every file names only torch-safe and DeepSpeed's plain globals,
    and the harmless hyper-parameter classes a ``torch.load`` of ours allows (:mod:`._torch_files`)."""
    for file in files:
        named = set(torch.serialization.get_unsafe_globals_in_checkpoint(str(file)))
        unsafe = named - DEEPSPEED_GLOBALS - allowed_names(str(file))
        if unsafe:
            raise pickle.UnpicklingError(
                f"{str(file)!r} names {', '.join(sorted(unsafe))}, which weights_only loading refuses. {TRUST}"
            )
