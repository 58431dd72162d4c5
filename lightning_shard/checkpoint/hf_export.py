"""A Hugging Face model directory (``config.json`` + safetensors) from any checkpoint the pack reads, streamed.

Design (docs/export.md): the export is cut into output files of at most ``max_shard_size`` bytes before a
tensor is read (:mod:`._hf_plan`). Each worker takes a subset of the files and, file by file, reads only that
file's tensors from the checkpoint (:mod:`._hf_sources`: DCP with a load target of those keys, or an mmap'd
``torch.load``), writes the safetensors file, frees it and goes on. No worker ever holds more than one output
file's tensors, whatever the model's size. Workers are the ranks of an initialised ``torch.distributed`` group
(``torchrun``), else ``workers`` processes spawned here, else this process. All files go to ``OUT_DIR.tmp``;
the index and ``config.json`` are written last, then one rename makes ``OUT_DIR`` appear complete
(:mod:`._commit`). A DeepSpeed ZeRO checkpoint streams the same way: each parameter is assembled from the
ranks' flat fp32 partitions only when its file is written (:mod:`._zero_reader`).
"""

from __future__ import annotations

import json
import os
import resource
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_shard.checkpoint import _commit
from lightning_shard.checkpoint._hf_plan import (
    DTYPES,
    ExportPlan,
    HFDtype,
    OutTensor,
    map_keys,
    meta_model,
    require_transformers,
    resolve_config,
    split_files,
)
from lightning_shard.checkpoint._hf_sources import Source
from lightning_shard.checkpoint.layout import local_path
from lightning_shard.units import parse_size

INDEX_NAME = "model.safetensors.index.json"


@dataclass
class WorkerReport:
    """What one worker did: the files it wrote, the keys and bytes it read, its memory high-water mark."""

    rank: int
    files: list[str]
    keys_read: list[str] = field(default_factory=list)
    bytes_read: int = 0
    #: Bytes of the checkpoint tensors its files are made of: ``bytes_read`` never exceeds it.
    bytes_assigned: int = 0
    #: The most bytes of tensors held at once (one file's); bounded by the largest file, not the model.
    max_bytes_held: int = 0
    seconds: float = 0.0
    #: Resident bytes when the worker started reading, and its resident high-water mark at the end (Linux:
    #: ``VmRSS`` / ``VmHWM``, which start afresh in a new process; elsewhere ``ru_maxrss`` for both, which a
    #: spawned process inherits from its parent's peak).
    baseline_rss_bytes: int = 0
    peak_rss_bytes: int = 0


@dataclass
class ExportReport:
    out_dir: Path
    #: Output file -> the Hugging Face tensor names it holds.
    files: dict[str, list[str]]
    total_bytes: int
    prefix: str
    #: Checkpoint names dropped as tied duplicates (``lm_head.weight`` of a tied embedding).
    dropped_tied: list[str]
    workers: list[WorkerReport]


def export_hf(
    checkpoint: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    config: Any = None,
    prefix: str | None = None,
    max_shard_size: int | str = "5GB",
    dtype: HFDtype | None = None,
    architecture: str | None = None,
    weights_only: bool | None = None,
    workers: int = 1,
    overwrite: bool = False,
) -> ExportReport:
    """Write ``out_dir`` as a Hugging Face model directory that ``AutoModelForCausalLM.from_pretrained`` reads.

    ``checkpoint``: a sharded DCP directory (ShardStrategy, any stage / world size; ModelParallelStrategy's), a
    one-file checkpoint (``checkpoint="full"``, DDPStrategy's, ``consolidate`` output) or a DeepSpeed directory.
    ``config``: a ``PretrainedConfig``, or the path of a ``config.json`` / model directory; by default the one
    the checkpoint's hyper-parameters hold. ``prefix``: the LightningModule attribute holding the model
    (``"model."``; ``""`` for none); by default detected against the config's model. ``max_shard_size``: bytes
    per safetensors file (``"5GB"``, ``"200MB"``, an int), beyond which the weights are split and indexed.
    ``dtype``: cast floating tensors (``"bf16"``, ``"fp16"``, ``"fp32"``); by default they keep the saved dtype.
    ``architecture``: the transformers class to check the keys against (default: the config's, else
    ``AutoModelForCausalLM``). ``weights_only``: as ``torch.load``'s (None: torch's default, safe).
    ``workers``: processes to spawn (ignored under an initialised process group, whose ranks are the workers).
    ``overwrite``: replace an existing ``out_dir``.

    Memory: each worker holds one output file's tensors at a time (streaming), whatever the checkpoint kind.
    """
    out = local_path(out_dir, "export(out_dir)")
    size = parse_size(max_shard_size, "max_shard_size")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is unknown. Use one of {', '.join(DTYPES)} (CLI --dtype).")
    if workers < 1:
        raise ValueError(f"workers={workers} must be at least 1 (CLI --ranks N).")
    if (out.exists() or out.is_symlink()) and not overwrite:
        raise FileExistsError(
            f"{str(out)!r} exists. Pass overwrite=True (CLI --overwrite) to replace it, or choose another OUT_DIR."
        )
    grouped = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    rank, world = (dist.get_rank(), dist.get_world_size()) if grouped else (0, 1)
    require_transformers()
    config_obj, model, plan, source, error = None, None, None, None, None
    if rank == 0:  # planning reads metadata only (names, shapes, dtypes): once
        try:
            source = Source(checkpoint, weights_only)
            config_obj, model, plan = _plan(source, config, prefix, size, dtype, architecture)
        except Exception as err:  # noqa: BLE001  (re-raised below, after the other ranks are told)
            error = err
    if grouped:
        plan = _broadcast(plan, error)
    if error is not None:
        raise error
    assert plan is not None
    if not grouped and workers > 1 and len(plan.files) > 1:
        return _spawned(plan, out, min(workers, len(plan.files)), config_obj, model)
    barrier = dist.barrier if grouped else (lambda: None)
    tmp = _commit.begin(out, rank == 0, barrier)
    mine = assign(plan, world)[rank]
    if grouped:
        reports = _write_on_every_rank(plan, mine, tmp, rank, world, source)
    else:
        reports = [write_files(plan, mine, tmp, rank, source)]
    if rank == 0:
        _finish(plan, tmp, out, config_obj, model)
    barrier()
    return _report(plan, out, reports)


def _plan(
    source: Source, config: Any, prefix: str | None, size: int, dtype: str | None, architecture: str | None
) -> tuple[Any, Any, ExportPlan]:
    config_obj = resolve_config(config, source)
    model = meta_model(config_obj, architecture)
    saved = source.tensors()
    names, prefix, dropped = map_keys(saved, model, prefix)
    cast = DTYPES[dtype] if dtype is not None else None
    files = split_files(names, saved, cast, size)
    plan = ExportPlan(
        checkpoint=str(source.path),
        kind=source.kind,
        weights_only=source.weights_only,
        dtype=cast,
        prefix=prefix,
        files={f: [OutTensor(n, names[n], saved[names[n]]) for n in fnames] for f, fnames in files.items()},
        dropped=tuple(sorted(dropped)),
    )
    return config_obj, model, plan


def _broadcast(plan: ExportPlan | None, error: Exception | None) -> ExportPlan | None:
    """Rank 0's plan on every rank; a failure there (raised by rank 0 itself) stops the others with its message,
    rather than leaving them waiting in the next collective."""
    box: list[Any] = [plan if error is None else f"{type(error).__name__}: {error}"]
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], str) and error is None:
        raise RuntimeError(f"export_hf failed on rank 0, so every rank stops: {box[0]}")
    return box[0] if error is None else None


def _write_on_every_rank(
    plan: ExportPlan, mine: list[str], tmp: Path, rank: int, world: int, source: Source | None
) -> list[WorkerReport]:
    """Every rank's report; a rank whose writing fails raises, and the others raise with its message instead
    of waiting for it in the next collective."""
    outcome: Any
    failure: Exception | None = None
    try:
        outcome = write_files(plan, mine, tmp, rank, source)
    except Exception as err:  # noqa: BLE001  (re-raised below, after the other ranks are told)
        failure, outcome = err, f"{type(err).__name__}: {err}"
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, outcome)
    if failure is not None:
        raise failure
    failed = [(r, text) for r, text in enumerate(gathered) if isinstance(text, str)]
    if failed:
        raise RuntimeError(f"export_hf failed on rank {failed[0][0]}, so every rank stops: {failed[0][1]}")
    return gathered


def assign(plan: ExportPlan, world: int) -> list[list[str]]:
    """The output files of each worker: largest first to the least loaded."""
    shares: list[list[str]] = [[] for _ in range(world)]
    load = [0] * world
    for name in sorted(plan.files, key=lambda f: (-plan.file_bytes(f), f)):
        i = load.index(min(load))
        shares[i].append(name)
        load[i] += plan.file_bytes(name)
    return [sorted(share) for share in shares]


def write_files(
    plan: ExportPlan, names: list[str], tmp: Path, rank: int, source: Source | None = None
) -> WorkerReport:
    """One worker: each file's tensors read, cast, written and freed before the next file is read."""
    from safetensors.torch import save_file  # optional: safetensors (the hf extra)

    if names and source is None:  # opening it (imports, index) is set-up, before the baseline
        source = Source(plan.checkpoint, plan.weights_only)
    report = WorkerReport(rank=rank, files=list(names), baseline_rss_bytes=rss()[0])
    report.bytes_assigned = sum(plan.file_bytes(name) for name in names)
    start = time.perf_counter()
    for name in names:
        entries = plan.files[name]
        assert source is not None
        read = source.read([t.key for t in entries])
        report.keys_read += list(read)
        held = sum(t.nbytes for t in read.values())
        report.bytes_read += held
        report.max_bytes_held = max(report.max_bytes_held, held)
        # The cast copy replaces the read one, so two copies never pile up; no name outlives the file.
        tensors = {t.name: _cast(read.pop(t.key), plan.dtype) for t in entries}
        save_file(tensors, str(tmp / name), metadata={"format": "pt"})
        del tensors, read
    report.seconds = time.perf_counter() - start
    report.peak_rss_bytes = rss()[1]
    return report


def _cast(value: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return value.to(dtype) if dtype is not None and value.is_floating_point() else value


def rss() -> tuple[int, int]:
    """(resident bytes now, this process's resident high-water mark); see ``WorkerReport.peak_rss_bytes``."""
    try:
        with open("/proc/self/status") as f:
            found = {line[:5]: int(line.split()[1]) * 1024 for line in f if line[:5] in ("VmRSS", "VmHWM")}
        return found["VmRSS"], found["VmHWM"]
    except (OSError, KeyError, ValueError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        return peak, peak


def _finish(plan: ExportPlan, tmp: Path, out: Path, config: Any, model: Any) -> None:
    """Index and config last, then the one rename that makes ``out`` appear."""
    if len(plan.files) > 1:
        total = sum(_out_bytes(plan, t) for ts in plan.files.values() for t in ts)
        index = {
            "metadata": {"total_parameters": model.num_parameters(), "total_size": total},
            "weight_map": {t.name: f for f, ts in plan.files.items() for t in ts},
        }
        (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    floating = [t.saved.dtype for ts in plan.files.values() for t in ts if t.saved.dtype.is_floating_point]
    dtype = plan.dtype or (max(set(floating), key=floating.count) if floating else torch.float32)
    config.dtype = str(dtype).removeprefix("torch.")  # what save_pretrained records (torch_dtype before v5)
    config.save_pretrained(str(tmp))
    if model.can_generate() and getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(str(tmp))
    _commit.commit(tmp, out)


def _out_bytes(plan: ExportPlan, t: OutTensor) -> int:
    if plan.dtype is None or not t.saved.dtype.is_floating_point:
        return t.saved.nbytes
    return t.saved.nbytes // t.saved.dtype.itemsize * plan.dtype.itemsize


def _report(plan: ExportPlan, out: Path, reports: list[WorkerReport]) -> ExportReport:
    return ExportReport(
        out_dir=out,
        files={f: [t.name for t in ts] for f, ts in plan.files.items()},
        total_bytes=sum(_out_bytes(plan, t) for ts in plan.files.values() for t in ts),
        prefix=plan.prefix,
        dropped_tied=list(plan.dropped),
        workers=reports,
    )


def _worker(rank: int, plan: ExportPlan, shares: list[list[str]], tmp: str, results: str) -> None:
    torch.set_num_threads(1)  # the workers share the machine's cores; reading and copying is I/O-bound
    report = write_files(plan, shares[rank], Path(tmp), rank)
    torch.save(report.__dict__, Path(results) / f"{rank}.pt")


def _spawned(plan: ExportPlan, out: Path, workers: int, config: Any, model: Any) -> ExportReport:
    """``workers`` spawned processes write the files; this process writes the index and config and commits."""
    tmp = _commit.begin(out, True, lambda: None)
    shares = assign(plan, workers)
    with tempfile.TemporaryDirectory() as results:
        mp.start_processes(
            _worker, args=(plan, shares, str(tmp), results), nprocs=workers, start_method="spawn"
        )
        reports = [
            WorkerReport(**torch.load(Path(results) / f"{r}.pt", weights_only=True)) for r in range(workers)
        ]
    _finish(plan, tmp, out, config, model)
    return _report(plan, out, reports)
