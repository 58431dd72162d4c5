"""``lightning-shard plan`` and the arguments ``lightning-shard dryrun`` shares with it: the model (``--params``,
``--model`` with its constructor arguments, or a ``config.json`` / published config), the devices, the flags,
each size checked under the flag name the user typed (docs/planner.md, docs/dryrun.md)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

import torch

from lightning_shard import engines
from lightning_shard.dryrun import command as dryrun_command
from lightning_shard.dryrun.models import build_model
from lightning_shard.planner import available_device_memory, plan
from lightning_shard.planner.experts import check_flags
from lightning_shard.planner.mesh import check_sizes
from lightning_shard.units import PlanInputError, parse_bandwidth, parse_count, parse_size

_PLAN_EPILOG = """examples:
  lightning-shard plan --params 7e9 --devices 8 --gpu-mem 80GB
  lightning-shard plan --model lightning_shard.demos.gpt.GPT --model.n_layers 12 --model.d_model 768 --devices 2 --gpu-mem 16GB
  lightning-shard plan --params 70e9 --gpus 256 --gpu-mem 80GB --seq-len 4096 --json
  lightning-shard plan --params 7e9 --gpus 64 --gpu-mem 80GB --replicate-size 8
  lightning-shard plan --params 47e9 --experts 8 --top-k 2 --gpus 64 --gpu-mem 80GB
Model constructor arguments are given jsonargparse-style, --model.NAME VALUE."""


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1 (got {text!r})")
    return value


_PLAN_HELP = ("per-device memory of ZeRO stages 0-3 and the cheapest ShardStrategy that fits", _PLAN_EPILOG)


def add_plan(sub: Any, name: str = "plan", text: tuple[str, str] = _PLAN_HELP) -> argparse.ArgumentParser:
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
        model.add_argument(f"--{name}", type=positive_int, help=f"override the model's {name}")
    model.add_argument("--experts", type=int, help="mixture of experts: E experts per layer (with --top-k)")
    model.add_argument("--top-k", type=int, help="mixture of experts: the experts each token is routed to")
    run = plan.add_argument_group("devices")
    run.add_argument("--devices", type=positive_int, help="devices per node (default 1)")
    run.add_argument("--nodes", type=positive_int, help="nodes (default 1)")
    run.add_argument("--gpus", type=positive_int, help="total devices (instead of --devices x --nodes)")
    run.add_argument(
        "--gpus-per-node", type=positive_int, help="node size for the TP limit (default: --devices, else 8)"
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
        type=positive_int,
        help="plan for this ShardStrategy(tensor_parallel_size=...) (default: from the layout, else 1)",
    )
    run.add_argument(
        "--replicate-size",
        type=positive_int,
        help="plan for this ShardStrategy(replicate_size=...), HSDP (default: from the layout, else 1)",
    )
    run.add_argument(
        "--pipeline-parallel-size",
        type=positive_int,
        help="plan for this ShardStrategy(pipeline_parallel_size=...) (default: from the layout, else 1)",
    )
    run.add_argument(
        "--context-parallel-size",
        type=positive_int,
        help="plan for this ShardStrategy(context_parallel_size=...) (default: 1, or the fewest ranks that"
        " make one sequence's activations fit)",
    )
    run.add_argument(
        "--expert-parallel-size",
        type=positive_int,
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
        "--micro-batch", type=positive_int, default=1, help="sequences per device per step (default 1)"
    )
    flags.add_argument(
        "--seq-len", type=positive_int, help="tokens per sequence (default: the model's, else 2048)"
    )
    flags.add_argument(
        "--micro-batches", type=positive_int, help="pipeline micro-batches per step (default 4 x PP)"
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


def model_argv(parser: argparse.ArgumentParser, extras: list[str], model: str | None) -> list[str]:
    bad = [e for e in extras if e.startswith("-") and not e.startswith("--model.")]
    if bad or (extras and not extras[0].startswith("--model.")):
        parser.error(f"unrecognized arguments: {' '.join(extras)}")
    if extras and model is None:
        parser.error(f"{extras[0]} sets a constructor argument, but no --model CLASS_PATH was given.")
    return extras


def plan_kwargs(args: argparse.Namespace, model_argv: list[str]) -> dict[str, Any]:
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


def run_plan(args: argparse.Namespace, model_argv: list[str]) -> int:
    kwargs = plan_kwargs(args, model_argv)
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
