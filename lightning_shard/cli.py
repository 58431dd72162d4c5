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
import dataclasses
import json
import os
import pickle
import sys
from pathlib import Path
from typing import Any

import torch

from lightning_shard import checkpoint, engines
from lightning_shard.checkpoint._hf_plan import refusal_cause
from lightning_shard.dryrun import command as dryrun_command
from lightning_shard.dryrun.models import build_model
from lightning_shard.engines import build_deepspeed_ops
from lightning_shard.fault_tolerance import run_lighthouse
from lightning_shard.planner import available_device_memory, plan
from lightning_shard.planner.experts import check_flags
from lightning_shard.planner.mesh import check_sizes
from lightning_shard.plot import plot_run
from lightning_shard.units import PlanInputError, parse_bandwidth, parse_count, parse_size

_PLAN_EPILOG = """examples:
  lightning-shard plan --params 7e9 --devices 8 --gpu-mem 80GB
  lightning-shard plan --model lightning_shard.demos.gpt.GPT --model.n_layers 12 --model.d_model 768 --devices 2 --gpu-mem 16GB
  lightning-shard plan --params 70e9 --gpus 256 --gpu-mem 80GB --seq-len 4096 --json
  lightning-shard plan --params 7e9 --gpus 64 --gpu-mem 80GB --replicate-size 8
  lightning-shard plan --params 47e9 --experts 8 --top-k 2 --gpus 64 --gpu-mem 80GB
Model constructor arguments are given jsonargparse-style, --model.NAME VALUE."""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1 (got {text!r})")
    return value


_PLAN_HELP = ("per-device memory of ZeRO stages 0-3 and the cheapest ShardStrategy that fits", _PLAN_EPILOG)


def _add_plan(sub: Any, name: str = "plan", text: tuple[str, str] = _PLAN_HELP) -> argparse.ArgumentParser:
    # `dryrun` takes the same arguments, with its own help text
    plan = sub.add_parser(
        name, help=text[0], epilog=text[1], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    model = plan.add_argument_group("model (give --params or --model)")
    model.add_argument("--params", help="parameter count, e.g. 7e9, 7B, 125M")
    model.add_argument(
        "--model",
        help="class path of an nn.Module, built on the meta device, e.g. lightning_shard.demos.gpt.GPT",
    )
    for name in ("layers", "hidden", "heads", "vocab", "ffn"):
        model.add_argument(f"--{name}", type=_positive_int, help=f"override the model's {name}")
    model.add_argument("--experts", type=int, help="mixture of experts: E experts per layer (with --top-k)")
    model.add_argument("--top-k", type=int, help="mixture of experts: the experts each token is routed to")
    run = plan.add_argument_group("devices")
    run.add_argument("--devices", type=_positive_int, help="devices per node (default 1)")
    run.add_argument("--nodes", type=_positive_int, help="nodes (default 1)")
    run.add_argument("--gpus", type=_positive_int, help="total devices (instead of --devices x --nodes)")
    run.add_argument(
        "--gpus-per-node", type=_positive_int, help="node size for the TP limit (default: --devices, else 8)"
    )
    run.add_argument(
        "--gpu-mem",
        "--device-memory",
        dest="gpu_mem",
        help="memory per device, e.g. 80GB or 80GiB (default: this machine's)",
    )
    run.add_argument(
        "--bandwidth", default="25GB/s", help="data-parallel bus bandwidth per device (default 25GB/s)"
    )
    run.add_argument(
        "--tensor-parallel-size",
        type=_positive_int,
        help="plan for this ShardStrategy(tensor_parallel_size=...) (default: from the layout, else 1)",
    )
    run.add_argument(
        "--replicate-size",
        type=_positive_int,
        help="plan for this ShardStrategy(replicate_size=...), HSDP (default: from the layout, else 1)",
    )
    run.add_argument(
        "--pipeline-parallel-size",
        type=_positive_int,
        help="plan for this ShardStrategy(pipeline_parallel_size=...) (default: from the layout, else 1)",
    )
    run.add_argument(
        "--context-parallel-size",
        type=_positive_int,
        help="plan for this ShardStrategy(context_parallel_size=...) (default: 1, or the fewest ranks that"
        " make one sequence's activations fit)",
    )
    run.add_argument(
        "--expert-parallel-size",
        type=_positive_int,
        help="plan for this ShardStrategy(expert_parallel_size=...) (default: searched for a mixture of experts)",
    )
    flags = plan.add_argument_group("training")
    flags.add_argument(
        "--precision", default="bf16-mixed", choices=["32-true", "bf16-mixed", "16-mixed", "bf16-true"]
    )
    flags.add_argument("--optimizer", default="adam", choices=["adam", "adamw", "sgd", "momentum", "muon"])
    flags.add_argument("--stage", default="auto", choices=["0", "1", "2", "3", "auto"])
    flags.add_argument("--offload-optimizer", default="auto", choices=["none", "cpu", "nvme", "auto"])
    flags.add_argument("--offload-params", default="auto", choices=["none", "cpu", "nvme", "auto"])
    flags.add_argument(
        "--activation-checkpointing", default="auto", choices=["none", "selective", "full", "auto"]
    )
    flags.add_argument(
        "--engine", default="auto", choices=["auto", *engines.NAMES], help="ShardStrategy(engine=...)"
    )
    flags.add_argument(
        "--tiled-mlp", action="store_true", help="ShardStrategy(tiled_mlp=True): MLP hidden units not kept"
    )
    flags.add_argument(
        "--tiled-loss", action="store_true", help="ShardStrategy(tiled_loss=True): logits one tile at a time"
    )
    flags.add_argument(
        "--nvme-path", help="directory on the NVMe drive, for --offload-optimizer/--offload-params nvme"
    )
    flags.add_argument(
        "--micro-batch", type=_positive_int, default=1, help="sequences per device per step (default 1)"
    )
    flags.add_argument(
        "--seq-len", type=_positive_int, help="tokens per sequence (default: the model's, else 2048)"
    )
    flags.add_argument(
        "--micro-batches", type=_positive_int, help="pipeline micro-batches per step (default 4 x PP)"
    )
    flags.add_argument(
        "--margin", type=float, default=0.1, help="headroom kept free, a fraction (default 0.1)"
    )
    out = plan.add_argument_group("output")
    out.add_argument(
        "--layout", action="store_true", help="add the TP x PP x DP layout (on by default beyond one node)"
    )
    out.add_argument("--json", action="store_true", help="print the plan as JSON (keys in docs/planner.md)")
    out.add_argument(
        "--plot", metavar="FILE.png", help="draw the stacked bars to FILE.png (needs matplotlib)"
    )
    out.add_argument("--verify", action="store_true", help="dry-run the recommendation (docs/dryrun.md)")
    return plan


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
    _add_plan(sub)
    dryrun_command.add_arguments(_add_plan(sub, "dryrun", dryrun_command.HELP))
    plot = sub.add_parser("plot", help="draw a run's loss and MFU over steps from its CSV logs, as a PNG")
    plot.add_argument("run_dir", help="the run's directory (its logger's save_dir, e.g. outputs/zero3)")
    plot.add_argument("--out", help="the PNG to write (default: RUN_DIR/run.png)")
    lighthouse = sub.add_parser(
        "lighthouse", help="serve the Lighthouse replica groups join at every step (fault_tolerance=...)"
    )
    lighthouse.add_argument("--min-replicas", type=_positive_int, default=1, help="groups a quorum needs")
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
        "--ranks", type=_positive_int, default=1, help="worker processes, each writing its share of the files"
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


def _world(args: argparse.Namespace) -> tuple[int, int]:
    """(world size, devices per node) from --gpus or --devices x --nodes."""
    devices, nodes = args.devices or 1, args.nodes or 1
    if args.gpus is not None and (args.devices or args.nodes) and args.gpus != devices * nodes:
        raise PlanInputError(
            f"--gpus {args.gpus} disagrees with --devices {devices} x --nodes {nodes} = {devices * nodes}."
            " Give --gpus alone, or --devices and --nodes."
        )
    world = args.gpus or devices * nodes
    return world, args.gpus_per_node or args.devices or 8


def _device_memory(args: argparse.Namespace, per_node: int) -> tuple[int, str | None]:
    if args.gpu_mem is not None:
        return parse_size(args.gpu_mem, "--gpu-mem"), None

    if torch.cuda.is_available():
        return available_device_memory(
            "cuda:0"
        ), "--gpu-mem not given: planned with this machine's free CUDA memory."
    ranks = args.devices or 1  # ranks of one host share its RAM
    memory = available_device_memory("cpu", local_world_size=ranks)
    return memory, f"--gpu-mem not given: planned with this machine's available RAM / {ranks} rank(s)."


def _model_argv(parser: argparse.ArgumentParser, extras: list[str], model: str | None) -> list[str]:
    bad = [e for e in extras if e.startswith("-") and not e.startswith("--model.")]
    if bad or (extras and not extras[0].startswith("--model.")):
        parser.error(f"unrecognized arguments: {' '.join(extras)}")
    if extras and model is None:
        parser.error(f"{extras[0]} sets a constructor argument, but no --model CLASS_PATH was given.")
    return extras


def _plan_kwargs(args: argparse.Namespace, model_argv: list[str]) -> dict[str, Any]:
    """The planner's keyword arguments, with every size checked under the flag name the user typed."""
    world, per_node = _world(args)
    check_sizes(
        world,
        args.tensor_parallel_size or 1,
        args.replicate_size or 1,
        cli=True,
        pp=args.pipeline_parallel_size or 1,
    )
    memory, memory_note = _device_memory(args, per_node)
    if args.params is not None:
        parse_count(args.params, "--params")
    check_flags(args.experts, args.top_k, args.expert_parallel_size, args.model is not None, cli=True)
    parse_bandwidth(args.bandwidth, "--bandwidth")
    if not 0 <= args.margin < 1:
        raise PlanInputError(
            f"--margin {args.margin} must be a fraction in [0, 1), e.g. 0.1 for 10% headroom."
        )
    module = None
    if args.model is not None:
        if os.getcwd() not in sys.path:  # like `python -m`, find model classes in the working directory
            sys.path.insert(0, os.getcwd())
        module = build_model(args.model, model_argv)
    same: tuple[str, ...] = (
        "precision",
        "optimizer",
        "offload_optimizer",
        "offload_params",
        "activation_checkpointing",
        "engine",
        "nvme_path",
    )
    same += ("micro_batch", "seq_len", "margin", "layers", "hidden", "heads", "vocab", "ffn", "bandwidth")
    same += ("tiled_mlp", "tiled_loss", "experts", "top_k")
    return {
        **{name: getattr(args, name) for name in same},
        "params": args.params,
        "module": module,
        "model": args.model,
        "world_size": world,
        "device_memory": memory,
        "stage": "auto" if args.stage == "auto" else int(args.stage),
        "layout": args.layout or world > per_node,
        "gpus_per_node": per_node,
        "micro_batches": args.micro_batches,
        "tensor_parallel_size": args.tensor_parallel_size,
        "replicate_size": args.replicate_size,
        "pipeline_parallel_size": args.pipeline_parallel_size,
        "context_parallel_size": args.context_parallel_size or "auto",
        "expert_parallel_size": args.expert_parallel_size or "auto",
        "_note": memory_note,
    }


def _run_plan(args: argparse.Namespace, model_argv: list[str]) -> int:
    kwargs = _plan_kwargs(args, model_argv)
    note = kwargs.pop("_note")
    result = plan(**kwargs)
    if note:
        result = dataclasses.replace(result, notes=(*result.notes, note))
    if args.plot:
        result.plot(args.plot)
    document, checked = dryrun_command.verify(kwargs, result) if args.verify else (result.to_dict(), "")
    print(json.dumps(document, indent=2) if args.json else result.table() + checked)
    if args.plot:
        # With --json, stdout stays one JSON document.
        print(f"wrote {args.plot}", file=sys.stderr if args.json else sys.stdout)
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
        model_argv = _model_argv(parser, extras, args.model)
        if args.params is None and args.model is None and not (args.layers and args.hidden):
            parser.error(f"{args.command} needs a model: give --params (e.g. 7e9) or --model CLASS_PATH.")
        try:
            if args.command == "dryrun":
                return dryrun_command.run(args, _plan_kwargs(args, model_argv))
            return _run_plan(args, model_argv)
        except PlanInputError as err:
            print(f"lightning-shard {args.command}: error: {err}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
