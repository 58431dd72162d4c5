"""Every flag of the front doors, declared once: its type, default, meaning, and where it is read.

:class:`ShardFlags` is the one declaration. Derived from it:

- the signature of :class:`~lightning_shard.ShardStrategy` and :class:`~lightning_shard.ShardFabricStrategy`
  (``__init__.__signature__``, so LightningCLI / jsonargparse read the same typed parameters, defaults and
  help as from a written-out signature; :func:`door_signature`, :func:`args_doc`);
- :class:`~lightning_shard.ShardConfig`, the validated form, which is a ``ShardFlags`` with each value
  normalised (``config.py``: every cross-flag rule);
- the flag table of docs/architecture.md (:func:`flag_table`; ``python -m lightning_shard.flags``
  prints it, and a test keeps the docs equal to it).

A new flag is one field here, with its ``where`` (the modules that read it), and its checks in config.py.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout

from lightning_shard._modules import ModuleClassSpec
from lightning_shard.activation_checkpointing import ActivationCheckpointingConfig
from lightning_shard.context_parallel import ContextParallelMethod
from lightning_shard.fp8 import Fp8Settings
from lightning_shard.offload import OffloadDevice
from lightning_shard.pipeline import PipelineScheduleName

EngineName = Literal["fsdp", "deepspeed"]
EngineFlag = Literal["auto", "fsdp", "deepspeed"]
CheckpointMode = Literal["sharded", "full"]


def _flag(default: Any, doc: str, where: str, trainer_only: bool = False) -> Any:
    return field(default=default, metadata={"doc": doc, "where": where, "trainer_only": trainer_only})


@dataclass(frozen=True)
class ShardFlags:
    """The flags as a user passes them to either front door (before validation)."""

    stage: int | Literal["auto"] = _flag(
        3,
        "ZeRO stage, 0 (replicated, DDP) to 3 (parameters, gradients and optimizer state sharded); ``'auto'``"
        " plans it from the model, the batch and device memory (Trainer only).",
        "engines/, planner/auto_stage.py",
    )
    engine: EngineFlag = _flag(
        "auto",
        "``'auto'`` (FSDP2 unless a flag needs DeepSpeed) or an engine's name, ``'fsdp'`` or ``'deepspeed'``.",
        "config.py, engines/__init__.py",
    )
    shard_modules: Iterable[ModuleClassSpec] | ModuleClassSpec | None = _flag(
        None,
        "module classes (or import-path strings) that become sharding units at stages 2-3; ``None`` detects the"
        " model's repeated block class.",
        "engines/fsdp/sharding.py, core/transform.py, compile.py",
    )
    checkpoint: CheckpointMode = _flag(
        "sharded",
        "``'sharded'`` (each rank writes its shard, a directory) or ``'full'`` (one file).",
        "engines/, checkpoint/",
    )
    process_group_backend: str | None = _flag(
        None, "``'gloo'``, ``'nccl'``, ...; default gloo on CPU and nccl on CUDA.", "core/process_groups.py"
    )
    timeout: timedelta | None = _flag(
        default_pg_timeout,
        "the longest any collective may wait, on every process group the strategy and its engine use (the"
        " device mesh's, the async checkpoint group, DeepSpeed's); past it the job ends with a"
        " ``CollectiveTimeoutError`` naming this flag.",
        "core/processes.py",
    )
    offload_optimizer: OffloadDevice | None = _flag(
        None,
        "``'cpu'`` or ``'nvme'``: keep optimizer state (and its step) off the accelerator.",
        "offload.py, engines/",
    )
    offload_params: OffloadDevice | None = _flag(
        None,
        "``'cpu'`` or ``'nvme'`` (stage 3): keep parameter shards off the accelerator.",
        "offload.py, engines/",
    )
    nvme_path: str | None = _flag(
        None,
        "directory on an NVMe drive for ``'nvme'`` offload; swap files live in a subdirectory of it and are"
        " removed at teardown.",
        "engines/deepspeed/offload.py, engines/deepspeed/config.py",
    )
    pin_memory: bool | None = _flag(
        None,
        "pin host buffers for offload (default: on CUDA).",
        "engines/fsdp/sharding.py, engines/deepspeed/config.py",
    )
    activation_checkpointing: Literal["full", "selective"] | ActivationCheckpointingConfig | None = _flag(
        None,
        "``'full'``, ``'selective'`` or an ``ActivationCheckpointing`` config; the repeated blocks are"
        " checkpointed before they are sharded (the same implementation as the callback).",
        "core/transform.py, activation_checkpointing/",
    )
    device_memory: int | str | None = _flag(
        None,
        "with ``stage='auto'``, the per-device memory to plan for (bytes or e.g. ``'16GB'``); default: free"
        " accelerator memory, or this rank's share of available RAM on CPU.",
        "planner/auto_stage.py",
        trainer_only=True,
    )
    async_checkpoint: bool = _flag(
        False,
        "write sharded checkpoints in the background (``torch.distributed.checkpoint.async_save``; under DeepSpeed,"
        " its own files from a host copy).",
        "engines/fsdp/checkpoint.py, engines/deepspeed/async_save.py, engines/capabilities.py",
    )
    skip_nonfinite: bool = _flag(
        False,
        "skip, on every rank together, an optimizer step whose loss or gradients are NaN/inf on any rank.",
        "core/session.py",
        trainer_only=True,
    )
    max_skipped: int = _flag(
        10,
        "with ``skip_nonfinite``, consecutive skipped steps allowed before training stops.",
        "core/session.py",
        trainer_only=True,
    )
    init_weights: str | Path | None = _flag(
        None,
        "start from full weights: a ``torch.save`` state-dict file (``lightning-shard consolidate`` writes one),"
        " a ``.safetensors`` file, or a Hugging Face model directory. Loaded once per module, after it is"
        " sharded: each rank reads only the slices of its own shards.",
        "core/transform.py, checkpoint/init_weights.py",
    )
    replicate_size: int = _flag(
        1,
        "HSDP (stages 2-3): the data-parallel ranks form this many replica groups; each shards the model over"
        " its own ranks (one node's, say) and gradients are all-reduced across groups.",
        "parallel/dims.py",
    )
    tensor_parallel_size: int = _flag(
        1,
        "split the layers named by the plan over this many ranks (the innermost mesh dimension: keep it"
        " within a node), before FSDP2 shards over the rest; the world is ``replicate_size x shard x"
        " tensor_parallel_size`` (docs/parallelism.md).",
        "parallel/",
    )
    tensor_parallel_plan: dict[str, Any] | None = _flag(
        None,
        "module-name pattern (``'blocks.*.attn.qkv'``) -> ``'colwise'``, ``'rowwise'``, ``'sequence'`` or a"
        " torch ``ParallelStyle``; ``None`` uses the plan the model carries (a ``tensor_parallel_plan``"
        " attribute, or a Hugging Face ``config.base_model_tp_plan``).",
        "parallel/plan.py",
    )
    pipeline_parallel_size: int = _flag(
        1,
        "cut the model into this many pipeline stages (the outermost mesh dimension: ``pp x replicate x"
        " shard x tp``); the module's contract is in docs/pipeline.md.",
        "core/transform.py, pipeline/, parallel/dims.py",
    )
    pipeline_schedule: PipelineScheduleName = _flag(
        "1f1b",
        "``'1f1b'``, ``'gpipe'``, ``'interleaved_1f1b'`` or ``'zero_bubble'`` (torch's schedules; the last two"
        " run several stages on each rank).",
        "pipeline/schedules.py",
    )
    microbatches: int | None = _flag(
        None,
        "pieces each batch is cut into along its first dimension (default 2 x stages).",
        "pipeline/runner.py",
    )
    stages_per_rank: int | None = _flag(
        None,
        "stages on each rank (interleaved schedules only; default 1, and 2 for them).",
        "core/transform.py, pipeline/",
    )
    pipeline_split_points: Sequence[str] | None = _flag(
        None,
        "the blocks that start stages 2, 3, ... (``['model.blocks.2']``); default: balanced by parameter count.",
        "pipeline/split.py",
    )
    context_parallel_size: int = _flag(
        1,
        "cut each sequence over this many ranks (a mesh dimension inside the data-parallel one: FSDP2 shards"
        " over data-parallel x context-parallel ranks, which hold the same model and read the same batches);"
        " the strategy cuts the batch and runs attention across the group (docs/context_parallel.md).",
        "parallel/dims.py, fabric/_context_parallel.py",
    )
    context_parallel_method: ContextParallelMethod = _flag(
        "allgather",
        "attention across the group: ``'allgather'`` (keys and values all-gathered, any backend),"
        " ``'ulysses'`` (all-to-all over heads: head counts divisible by the size), ``'ring'`` (torch's ring"
        " attention, CUDA only).",
        "context_parallel/attention.py",
    )
    expert_parallel_size: int = _flag(
        1,
        "mixture-of-experts models: each of this many ranks holds E / size whole experts of every experts"
        " module, and tokens travel to their experts and back by all-to-all (a mesh dimension carved from the"
        " data-parallel shard one, as torchtitan's; the ranks left shard or replicate each expert block);"
        " docs/expert_parallel.md.",
        "parallel/dims.py, core/transform.py",
    )
    expert_parallel_plan: dict[str, str] | None = _flag(
        None,
        "module-name pattern (``'blocks.*.moe.experts'``) -> ``'experts'`` (a module holding 3-D expert weights"
        " ``[E, ...]``); ``None`` uses the plan a Hugging Face model carries (``config.base_model_ep_plan``).",
        "core/transform.py, expert_parallel/apply.py",
    )
    tiled_mlp: bool | int = _flag(
        False,
        "``True`` or a number of sequence positions: run each MLP (modules named ``mlp`` / ``feed_forward`` /"
        " ``ffn``) a tile of positions at a time, each tile recomputed in backward, so one tile's hidden units"
        " exist at a time (``True``: as many positions as the model is wide; docs/context_parallel.md).",
        "tiling.py, core/transform.py",
    )
    tiled_loss: bool | int = _flag(
        False,
        "``True`` or a number of tokens: compute the output head and the cross-entropy a tile of tokens at a"
        " time (Hugging Face causal LMs given labels, and modules with a ``loss_tile`` attribute), so the"
        " logits are never whole (``True``: one tile's logits as large as the hidden states, at least 1024"
        " tokens).",
        "tiling.py, core/transform.py",
    )
    compile: bool | dict[str, Any] | None = _flag(
        False,
        "``True`` or a dict of ``torch.compile`` options: compile each repeated block after tensor parallelism"
        " and activation checkpointing, before FSDP2 shards it (or DeepSpeed registers its hooks).",
        "compile.py, core/transform.py",
    )
    fp8: bool | Literal["tensorwise", "rowwise"] | dict[str, Any] | Fp8Settings | None = _flag(
        False,
        "``True``, ``'tensorwise'``, ``'rowwise'`` or a dict of options: train the large ``nn.Linear`` layers in"
        " float8 through torchao (FSDP engine; the size rule and its overrides are in docs/fp8.md); at stages"
        " 2-3 FSDP gathers their weights in float8.",
        "fp8.py, core/transform.py, engines/fsdp/fp8.py",
    )
    gradient_compression: str | dict[str, Any] | None = _flag(
        None,
        "stages 0-1: ``'bf16'``, ``'fp16'``, ``'powersgd'`` or ``{'method': 'powersgd', 'rank': r,"
        " 'start_iter': n, ...}``, through DDP's communication hooks; stage 0: ``'onebit_adam'`` or"
        " ``{'method': 'onebit_adam', 'freeze_step': n}`` (1-bit Adam for an Adam / AdamW).",
        "compression.py, onebit.py, engines/fsdp/compression.py",
    )
    matrix_optimizer: bool | Sequence[str | type] | None = _flag(
        None,
        "optimizers whose update needs whole matrices (Muon, Shampoo, SOAP): ``None`` recognises"
        " ``torch.optim.Muon`` and heavyball's ``Muon``, ``MuonAdamW`` and ``SOAP``; ``True`` / ``False`` say it"
        " of every optimizer; or the classes (or their dotted names). Where parameters are sharded or split"
        " (stages 2-3, tensor parallelism; DeepSpeed ZeRO-1/2/3) each matrix is then stepped whole on one owner"
        " rank (docs/optimizers.md).",
        "engines/_matrix_optimizers.py, engines/fsdp/engine.py, engines/deepspeed/engine.py",
    )
    fault_tolerance: dict[str, Any] | None = _flag(
        None,
        "replica groups that train on while one is lost and rejoins, healed from a live peer (torchft):"
        " ``{'replica_id': i, 'replica_groups': n, 'lighthouse': 'http://host:port', 'min_replicas': 1,"
        " 'timeout': 60}``, missing keys read from REPLICA_GROUP_ID, NUM_REPLICA_GROUPS, TORCHFT_LIGHTHOUSE,"
        " TORCHFT_MIN_REPLICAS; every stage of the FSDP engine; ``'semi_sync': 'diloco' | 'local_sgd'`` with"
        " ``'sync_every'``, ``'fragments'``, ``'fragment_update_alpha'``, ``'outer_optimizer'``: DiLoCo every H steps"
        " instead of an every-step gradient mean (Trainer only; docs/fault_tolerance.md).",
        "config.py, parallel/dims.py, core/replica_groups.py, trainer/strategy.py, trainer/_fault_tolerance.py,"
        " trainer/_checkpoint.py, fabric/_fault_tolerance.py, fabric/_setup.py",
    )


#: The flags' names, in declaration order.
FLAG_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(ShardFlags))
#: Flags only the Trainer door serves (they are Trainer hooks).
TRAINER_ONLY: frozenset[str] = frozenset(
    f.name for f in dataclasses.fields(ShardFlags) if f.metadata["trainer_only"]
)

_DDP_DOC = (
    "Lightning's ``DDPStrategy`` options, stages 0-1 of the FSDP engine only (``find_unused_parameters``,"
    " ``static_graph``, ``gradient_as_bucket_view``, any other ``DistributedDataParallel`` argument,"
    " ``ddp_comm_hook`` / ``ddp_comm_state`` / ``ddp_comm_wrapper``)."
)


def door_signature() -> inspect.Signature:
    """``__init__(self, <every flag>, **kwargs)``: what LightningCLI and ``help()`` read for either door."""
    hints = _hints()
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for f in dataclasses.fields(ShardFlags):
        params.append(
            inspect.Parameter(
                f.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=f.default, annotation=hints[f.name]
            )
        )
    params.append(inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD, annotation=Any))
    return inspect.Signature(params, return_annotation=None)


def bind(owner: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[ShardFlags, dict[str, Any]]:
    """The flags given to a door's ``__init__`` (positional or by name, defaults filled in), and the keyword
    arguments left over (Lightning's own and ``DDPStrategy``'s options)."""
    if len(args) > len(FLAG_NAMES):
        raise TypeError(
            f"{owner}() takes at most {len(FLAG_NAMES)} positional arguments ({len(args)} given)."
        )
    given = dict(zip(FLAG_NAMES, args, strict=False))
    doubled = sorted(set(given) & set(kwargs))
    if doubled:
        raise TypeError(f"{owner}() got multiple values for argument {doubled[0]!r}.")
    rest = {key: value for key, value in kwargs.items() if key not in FLAG_NAMES}
    given.update({key: value for key, value in kwargs.items() if key in FLAG_NAMES})
    return ShardFlags(**given), rest


def takes_flags(init: Any) -> Any:
    """Give a door's ``__init__(self, *args, **kwargs)`` the flags' signature, annotations and help."""
    init.__signature__ = door_signature()
    init.__annotations__ = {**_hints(), "kwargs": Any, "return": None}
    return init


def args_doc(indent: str = "    ") -> str:
    """The ``Args:`` section of a door's docstring (jsonargparse shows it as each flag's help)."""
    lines = ["Args:"]
    lines += [f"    {f.name}: {f.metadata['doc']}" for f in dataclasses.fields(ShardFlags)]
    lines.append(f"    **kwargs: {_DDP_DOC}")
    return "\n".join(indent + line for line in lines)


def flag_table() -> str:
    """The Markdown table of docs/architecture.md: each flag, its default, and the modules that read it."""
    rows = ["| flag | default | read in | doors |", "|---|---|---|---|"]
    for f in dataclasses.fields(ShardFlags):
        doors = "Trainer" if f.metadata["trainer_only"] else "Trainer, Fabric"
        rows.append(f"| `{f.name}` | `{f.default!r}` | {f.metadata['where']} | {doors} |")
    rows.append("| DDP options (`**kwargs`) | | _ddp.py (checks), engines/_ddp.py | Trainer, Fabric |")
    return "\n".join(rows)


def _hints() -> dict[str, Any]:
    return typing.get_type_hints(ShardFlags)


if __name__ == "__main__":
    print(flag_table())
