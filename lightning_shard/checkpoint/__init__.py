"""Checkpoints: sharded (DCP), async, one-file and DeepSpeed's, all committed by one protocol.

Layout of a sharded checkpoint ``<name>.ckpt/`` (a directory):

* DCP shards and ``.metadata`` for ``{"state_dict": model, "optimizer_0": ..., ...}``, keyed by
  parameter name, so a checkpoint written by N ranks at any stage loads on M ranks at any stage;
* ``meta.pt``: everything else Lightning saves (loops, callbacks, LR schedulers, hyperparameters).

Modules: :mod:`._commit` (``NAME.tmp`` -> rename, used by every writer), :mod:`.layout` (names,
kinds), :mod:`.sharded` (DCP save / load into any layout), :mod:`.async_save` (background writes),
:mod:`.staged` (DeepSpeed's local files on an object store: staged, uploaded, committed by a marker),
:mod:`.weights` (full weights in one process), :mod:`.lightning_format` (any of them as the dict
``LightningModule.load_from_checkpoint`` reads, and ``consolidate``; importing this package lets that classmethod
read our directories), :mod:`._dcp_metadata` and :mod:`._pickles` (``weights_only`` for the pickles DCP and
DeepSpeed unpickle themselves),
:mod:`._errors` (why a resume fails, said on every rank), :mod:`.hf_export` (a Hugging Face model directory from any
of them, streamed file by file).
"""

from lightning_shard.checkpoint._commit import TMP_SUFFIX, commit, remove, save_file, write_committed
from lightning_shard.checkpoint._errors import CheckpointLoadError
from lightning_shard.checkpoint._pickles import check_deepspeed_files
from lightning_shard.checkpoint.async_save import (
    AsyncCheckpointer,
    AsyncCheckpointError,
    new_checkpoint_group,
)
from lightning_shard.checkpoint.hf_export import ExportReport, WorkerReport, export_hf
from lightning_shard.checkpoint.layout import (
    DEEPSPEED_TAG,
    META_FILENAME,
    MODEL_KEY,
    is_deepspeed_checkpoint,
    is_sharded_checkpoint,
    local_path,
    optimizer_key,
    read_metadata,
)
from lightning_shard.checkpoint.lightning_format import (
    ConsolidateFormat,
    consolidate,
    install_load_from_checkpoint,
    is_checkpoint_directory,
    load_lightning_checkpoint,
)
from lightning_shard.checkpoint.sharded import load_full_into, load_sharded_into, read_meta, save_sharded
from lightning_shard.checkpoint.weights import (
    check_deepspeed_checkpoint,
    load_full_state_dict,
    load_model_weights,
)

__all__ = [
    "DEEPSPEED_TAG",
    "META_FILENAME",
    "MODEL_KEY",
    "TMP_SUFFIX",
    "AsyncCheckpointError",
    "AsyncCheckpointer",
    "CheckpointLoadError",
    "ExportReport",
    "ConsolidateFormat",
    "check_deepspeed_checkpoint",
    "check_deepspeed_files",
    "commit",
    "consolidate",
    "export_hf",
    "install_load_from_checkpoint",
    "is_checkpoint_directory",
    "is_deepspeed_checkpoint",
    "is_sharded_checkpoint",
    "load_full_into",
    "load_full_state_dict",
    "load_lightning_checkpoint",
    "load_model_weights",
    "load_sharded_into",
    "local_path",
    "new_checkpoint_group",
    "optimizer_key",
    "read_meta",
    "read_metadata",
    "remove",
    "save_file",
    "save_sharded",
    "WorkerReport",
    "write_committed",
]

install_load_from_checkpoint()
