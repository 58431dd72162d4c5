"""``lightning-shard dryrun``: the dry run from the command line, with ``plan``'s model sources and flags.

``lightning_shard.cli`` registers the command with ``plan``'s arguments (the model, the devices, the flags) and
these (:func:`add_arguments`); the flags left at ``auto`` are the planner's recommendation for the world, so
``lightning-shard dryrun --model llama-3-70b --gpus 1024 --gpu-mem 80GB`` dry-runs what ``plan`` recommends.
``plan --verify`` runs the same on its own recommendation (:func:`verify`).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from lightning_shard.dryrun.report import JSON_VERSION, RankReport, table
from lightning_shard.dryrun.resharding import reshard, reshard_table
from lightning_shard.dryrun.run import dryrun
from lightning_shard.planner import Plan, plan
from lightning_shard.units import PlanInputError

EPILOG = """examples:
  lightning-shard dryrun --model llama-3-70b --gpus 1024 --gpu-mem 80GB
  lightning-shard dryrun --model lightning_shard.demos.gpt.GPTModule --model.n_layers 8 --world-size 1024 --stage 3 --tensor-parallel-size 4 --pipeline-parallel-size 4 --replicate-size 4 --gpu-mem 80GB
  lightning-shard dryrun --model deepseek-v3 --gpus 8192 --gpu-mem 80GB --ranks 0,8191 --json
  lightning-shard dryrun --model llama-3-8b --world-size 1024 --gpu-mem 80GB --stage 3 --replicate-size 8 --load-world-size 512 --load-flags replicate_size=4
Models: a class path (constructor arguments as --model.NAME VALUE), a config.json, or a published config's name."""
HELP = ("build chosen ranks' real shards on a fake process group (docs/dryrun.md)", EPILOG)


def _ranks(text: str) -> list[int]:
    try:
        return sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be ranks separated by commas, e.g. 0,17,1023 (got {text!r})"
        ) from None


def _value(text: str) -> Any:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return int(text)
    except ValueError:
        return text


def _flags(text: str) -> dict[str, Any]:
    """``NAME=VALUE,NAME=VALUE``: ShardStrategy's keyword arguments (integers and true/false as such)."""
    flags: dict[str, Any] = {}
    for part in (p.strip() for p in text.split(",")):
        name, sep, value = part.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise argparse.ArgumentTypeError(
                f"must be NAME=VALUE pairs separated by commas, e.g. replicate_size=4,stage=3 (got {part!r} in"
                f" {text!r})"
            )
        flags[name.strip()] = _value(value.strip())
    return flags


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The dry run's own arguments, beside ``plan``'s."""
    group = parser.add_argument_group("dry run")
    group.add_argument("--world-size", dest="gpus", type=int, help="ranks of the job (the same as --gpus)")
    group.add_argument(
        "--ranks",
        type=_ranks,
        help="ranks to build, e.g. 0,17,1023 (default: first, last, one per stage and expert block); with"
        " --load-world-size, ranks of the loading world",
    )
    group.add_argument(
        "--trace-step",
        action="store_true",
        help="also trace one training step of each rank on fake tensors (--micro-batch sequences of --seq-len"
        " tokens): its peak memory and the collectives' bytes, beside the planner's activations and buffers",
    )
    group.add_argument(
        "--load-world-size",
        type=int,
        help="plan a checkpoint saved by --world-size ranks and loaded by this many: the files and bytes each"
        " loading rank reads",
    )
    group.add_argument(
        "--load-flags",
        type=_flags,
        default={},
        help="the loading layout's ShardStrategy arguments where they differ from the saving one, e.g."
        " replicate_size=4,tensor_parallel_size=2 (with --load-world-size)",
    )


def _recommended(kwargs: dict[str, Any]) -> tuple[Plan, dict[str, Any]]:
    result = plan(**kwargs)
    if result.recommended is None:
        raise PlanInputError(f"the planner found no configuration to dry-run: {' '.join(result.notes)}")
    return result, result.strategy_kwargs()


def _document(reports: list[RankReport], flags: dict[str, Any], line: str | None) -> dict[str, Any]:
    return {
        "version": JSON_VERSION,
        "world_size": reports[0].world_size if reports else 0,
        "strategy": line,
        "strategy_kwargs": flags,
        "ranks": [r.to_dict() for r in reports],
    }


def _reports(
    kwargs: dict[str, Any], flags: dict[str, Any], ranks: list[int] | None, trace: bool = False
) -> list[RankReport]:
    if kwargs.get("module") is None:
        raise PlanInputError(
            "the dry run builds the model: give --model (a class path, a config.json or a name)."
        )
    try:
        return dryrun(
            kwargs["module"],
            flags,
            kwargs["world_size"],
            ranks,
            precision=kwargs["precision"],
            trace_step=trace,
            micro_batch=kwargs.get("micro_batch") or 1,
            seq_len=kwargs.get("seq_len"),
        )
    except ValueError as error:
        raise PlanInputError(str(error)) from error


def _reshard(
    args: argparse.Namespace, kwargs: dict[str, Any], flags: dict[str, Any], line: str | None
) -> int:
    """``--load-world-size``: the checkpoint of the saving layout read by the loading one."""
    if kwargs.get("module") is None:
        raise PlanInputError("--load-world-size plans the model's checkpoint: give --model.")
    if args.load_world_size < 1:
        raise PlanInputError(f"--load-world-size must be 1 or more ranks (got {args.load_world_size}).")
    load = {**flags, **args.load_flags}
    try:
        result = reshard(
            kwargs["module"],
            flags,
            kwargs["world_size"],
            load,
            args.load_world_size,
            args.ranks,
            precision=kwargs["precision"],
        )
    except TypeError as error:  # a name ShardStrategy does not take
        raise PlanInputError(f"--load-flags {args.load_flags}: {error}") from error
    except ValueError as error:
        raise PlanInputError(str(error)) from error
    if args.json:
        document = {
            "version": JSON_VERSION,
            "strategy": line,
            "strategy_kwargs": flags,
            "load_strategy_kwargs": load,
        }
        print(json.dumps({**document, **result.to_dict()}, indent=2))
    else:
        print(f"saved by: {line}\nloaded with: {load}\n{reshard_table(result)}")
    return 0


def run(args: argparse.Namespace, kwargs: dict[str, Any]) -> int:
    """``lightning-shard dryrun``: the flags (``auto`` ones as the planner recommends), then each rank's report,
    or with ``--load-world-size`` the checkpoint's reads (:func:`~lightning_shard.dryrun.reshard.reshard`)."""
    kwargs = {k: v for k, v in kwargs.items() if k != "_note"}
    if args.load_flags and args.load_world_size is None:
        raise PlanInputError(
            f"--load-flags {args.load_flags} describes a loading layout: give --load-world-size too."
        )
    result, flags = _recommended(kwargs)
    if args.load_world_size is not None:
        return _reshard(args, kwargs, flags, result.strategy)
    reports = _reports(kwargs, flags, args.ranks, getattr(args, "trace_step", False))
    if args.json:
        print(json.dumps(_document(reports, flags, result.strategy), indent=2))
    else:
        print(f"strategy: {result.strategy}\n{table(reports)}")
    return 0


def verify(kwargs: dict[str, Any], result: Plan) -> tuple[dict[str, Any], str]:
    """``plan --verify``: the plan's JSON with the dry run of its recommendation (key ``dryrun``), and the dry
    run's table to print after the plan's."""
    if result.recommended is None:
        raise PlanInputError("plan --verify: the plan has no recommendation to dry-run.")
    flags = result.strategy_kwargs()
    reports = _reports(kwargs, flags, None)
    document = {**result.to_dict(), "dryrun": _document(reports, flags, result.strategy)}
    return document, f"\n\nverified by a dry run:\n{table(reports)}"
