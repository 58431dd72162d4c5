"""The ``lightning-shard`` console script.

``lightning-shard consolidate CKPT OUT.ckpt`` writes one Lightning checkpoint file (the full weights and
hyperparameters: ``MyModel.load_from_checkpoint(OUT.ckpt)``) from a sharded or DeepSpeed checkpoint
directory or a full checkpoint file; with ``--weights-only``, one plain state dict (``torch.load`` +
``module.load_state_dict``) instead.

``lightning-shard export CKPT OUT_DIR`` writes a Hugging Face model directory (``config.json`` + safetensors
files, ``from_pretrained(OUT_DIR)``) from any of those checkpoints, streamed file by file (``--ranks N``
workers; see docs/export.md).

``lightning-shard plan --params 7e9 --devices 8 --gpu-mem 80GB`` prints per-device memory for ZeRO
stages 0-3 and the cheapest ``ShardStrategy(...)`` that fits (see docs/planner.md); beyond one node,
with the ``tensor_parallel_size`` / ``pipeline_parallel_size`` / ``replicate_size`` its TP x PP x DP
layout implies; for a mixture of experts (``--experts E --top-k k``, or a ``--model`` that has experts), with
the ``expert_parallel_size`` that splits them.
"""

from __future__ import annotations

import argparse
import pickle
import sys
from pathlib import Path
from typing import Any

from lightning_shard import checkpoint
from lightning_shard.checkpoint._hf_plan import refusal_cause
from lightning_shard.cli.plan import add_plan, model_argv, plan_kwargs, positive_int, run_plan
from lightning_shard.dryrun import command as dryrun_command
from lightning_shard.engines import build_deepspeed_ops
from lightning_shard.fault_tolerance import run_lighthouse
from lightning_shard.plot import plot_run
from lightning_shard.units import PlanInputError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-shard", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    consolidate = sub.add_parser(
        "consolidate",
        help="write a checkpoint's full model weights as one file (a Lightning checkpoint, or --weights-only)",
    )
    _checkpoint_arguments(consolidate)
    consolidate.add_argument("out", help="output file, e.g. model.ckpt (model.pt with --weights-only)")
    consolidate.add_argument(
        "--weights-only",
        action="store_true",
        help="write the plain state dict (module.load_state_dict(torch.load(OUT))) instead of a Lightning checkpoint",
    )
    _add_export(sub)
    add_plan(sub)
    dryrun_command.add_arguments(add_plan(sub, "dryrun", dryrun_command.HELP))
    plot = sub.add_parser("plot", help="draw a run's loss and MFU over steps from its CSV logs, as a PNG")
    plot.add_argument("run_dir", help="the run's directory (its logger's save_dir, e.g. outputs/zero3)")
    plot.add_argument("--out", help="the PNG to write (default: RUN_DIR/run.png)")
    lighthouse = sub.add_parser(
        "lighthouse", help="serve the Lighthouse replica groups join at every step (fault_tolerance=...)"
    )
    lighthouse.add_argument("--min-replicas", type=positive_int, default=1, help="groups a quorum needs")
    lighthouse.add_argument("--port", type=int, default=29510, help="port to listen on (default 29510)")
    lighthouse.add_argument(
        "--join-timeout-ms", type=int, default=1000, help="how long a quorum waits for more groups to join"
    )
    sub.add_parser(
        "build-ops",
        help="build DeepSpeed's compiled ops (CPU Adam, async I/O for NVMe, ...) once, before any job loads them",
    )
    return parser


def _checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    """The checkpoint to read, and the opt-in out of safe unpickling: the same for every reading command."""
    parser.add_argument(
        "checkpoint", help="a sharded or DeepSpeed checkpoint directory, or a full checkpoint file"
    )
    parser.add_argument(
        "--trusted",
        action="store_true",
        help="unpickle without torch's weights_only restriction (hyperparameters of custom classes);"
        " only for checkpoints from a source you trust",
    )


def _add_export(sub: Any) -> None:
    export = sub.add_parser(
        "export",
        help="write a Hugging Face model directory (config.json + safetensors) from a checkpoint, streamed",
    )
    _checkpoint_arguments(export)
    export.add_argument("out_dir", help="the model directory to write (appears only once complete)")
    export.add_argument(
        "--config",
        help="a Hugging Face config.json or model directory (default: the checkpoint's hyperparameters)",
    )
    export.add_argument(
        "--prefix",
        help="the LightningModule attribute holding the model, e.g. 'model.' ('' for none; default: detected)",
    )
    export.add_argument(
        "--max-shard-size", default="5GB", help="bytes per safetensors file, e.g. 5GB or 200MB (default 5GB)"
    )
    export.add_argument(
        "--dtype", choices=["fp32", "bf16", "fp16"], help="cast floating weights (default: as saved)"
    )
    export.add_argument(
        "--architecture", help="transformers model class (default: the config's, else AutoModelForCausalLM)"
    )
    export.add_argument(
        "--ranks", type=positive_int, default=1, help="worker processes, each writing its share of the files"
    )
    export.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists")


def _unpickling_message(err: pickle.UnpicklingError) -> str:
    cause = refusal_cause(err)
    if cause is None:
        return (str(err).strip().splitlines() or [type(err).__name__])[0]
    return f"{cause} Add --trusted if you trust the checkpoint's source."


def _run_export(args: argparse.Namespace) -> int:
    try:
        report = checkpoint.export_hf(
            args.checkpoint,
            args.out_dir,
            config=args.config,
            prefix=args.prefix,
            max_shard_size=args.max_shard_size,
            dtype=args.dtype,
            architecture=args.architecture,
            weights_only=False if args.trusted else None,
            workers=args.ranks,
            overwrite=args.overwrite,
        )
    except pickle.UnpicklingError as err:
        print(f"lightning-shard export: {_unpickling_message(err)}", file=sys.stderr)
        return 2
    except (FileNotFoundError, FileExistsError, ImportError, ValueError) as err:
        print(f"lightning-shard export: {err}", file=sys.stderr)
        return 2
    print(f"wrote {report.out_dir} ({len(report.files)} safetensors file(s), {report.total_bytes} bytes)")
    return 0


def _run_build_ops() -> int:
    try:
        results = build_deepspeed_ops()
    except RuntimeError as err:
        print(f"lightning-shard build-ops: {err}", file=sys.stderr)
        return 2
    for op in results:
        seconds = f" in {op.seconds:.1f} s" if op.status != "skipped" else ""
        detail = f": {op.detail}" if op.detail else ""
        print(f"{op.name:<24} {op.status}{seconds}{detail}  [{op.used_for}]")
    return 1 if any(op.status == "failed" for op in results) else 0


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, extras = parser.parse_known_args(argv)
    if args.command == "consolidate":
        if extras:
            parser.error(f"unrecognized arguments: {' '.join(extras)}")
        fmt: checkpoint.ConsolidateFormat = "state_dict" if args.weights_only else "lightning"
        try:
            out = checkpoint.consolidate(
                args.checkpoint, args.out, format=fmt, weights_only=False if args.trusted else None
            )
        except pickle.UnpicklingError as err:
            print(f"lightning-shard consolidate: {_unpickling_message(err)}", file=sys.stderr)
            return 2
        except (FileNotFoundError, ValueError) as err:
            print(f"lightning-shard consolidate: {err}", file=sys.stderr)
            return 2
        print(f"wrote {out}")
    elif args.command == "export":
        if extras:
            parser.error(f"unrecognized arguments: {' '.join(extras)}")
        return _run_export(args)
    elif args.command == "plot":
        if extras:
            parser.error(f"unrecognized arguments: {' '.join(extras)}")
        try:
            print(f"wrote {plot_run(args.run_dir, args.out or Path(args.run_dir) / 'run.png')}")
        except (FileNotFoundError, ValueError, ImportError) as err:
            print(err, file=sys.stderr)
            return 2
    elif args.command == "lighthouse":
        if extras:
            parser.error(f"unrecognized arguments: {' '.join(extras)}")
        return run_lighthouse(args.min_replicas, args.port, args.join_timeout_ms)
    elif args.command == "build-ops":
        if extras:
            parser.error(f"unrecognized arguments: {' '.join(extras)}")
        return _run_build_ops()
    elif args.command in ("plan", "dryrun"):
        model_args = model_argv(parser, extras, args.model)
        if args.params is None and args.model is None and not (args.layers and args.hidden):
            parser.error(f"{args.command} needs a model: give --params (e.g. 7e9) or --model CLASS_PATH.")
        try:
            if args.command == "dryrun":
                return dryrun_command.run(args, plan_kwargs(args, model_args))
            return run_plan(args, model_args)
        except PlanInputError as err:
            print(f"lightning-shard {args.command}: error: {err}", file=sys.stderr)
            return 2
    return 0
