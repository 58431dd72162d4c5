""":func:`dryrun`: a job's real set-up for chosen ranks of its world, each on torch's fake process group, with
the model on the meta device.

For each rank: join the fake group as that rank, build the model on meta, run ``core.transform.prepare`` (the
set-up both doors run: activation checkpointing, the pipeline cut, context parallelism, precision, fp8,
tensor and expert parallelism, compile, the engine's data-parallel wrap) with the flags of the strategy, take
the module's optimizers through the engine and one step on zero gradients, plan its sharded checkpoint, and
count what the shards hold (:mod:`.measure`). The group is destroyed before the next rank. Nothing is
allocated: the shards stay on meta, ``init_weights`` is not read.

Before any rank is built the layout is checked against the world (``ParallelDims.for_world``) and against the
model's own numbers (``parallel.model_sizes``: heads, experts, layers), naming the flag and the sizes that do.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Generator
from contextlib import ExitStack, contextmanager
from typing import Any

from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from lightning_shard import _compat, engines
from lightning_shard._modules import detect_block_classes, find_blocks
from lightning_shard.checkpoint.layout import MODEL_KEY, optimizer_key
from lightning_shard.config import ShardConfig
from lightning_shard.core import transform
from lightning_shard.core.process_groups import parallel_dims
from lightning_shard.dryrun.compare import planner_figures
from lightning_shard.dryrun.measure import checkpoint_writes, collective_bytes, held_bytes
from lightning_shard.dryrun.models import ModelSource, model_factory
from lightning_shard.dryrun.optimizers import step_on_shards, user_optimizers
from lightning_shard.dryrun.report import RankReport
from lightning_shard.dryrun.trace import fake_tensors, sequence_length, traced_step, untraceable
from lightning_shard.dryrun.world import FakeWorld, default_ranks, fake_rank
from lightning_shard.engines import engine_class
from lightning_shard.parallel import ParallelDims
from lightning_shard.parallel.model_sizes import ModelSizes, check_model_sizes
from lightning_shard.pipeline import stages_of_rank
from lightning_shard.planner.experts import count_experts
from lightning_shard.precision import PrecisionPolicy

#: What ``init_weights`` reads as in a dry run: the mark ``prepare`` leaves once weights are loaded is set to it,
#: so the shards are only laid out (on meta) and no file is read.
NOT_READ = "<dry run: weights not read>"
_HEADS = ("num_attention_heads", "n_heads", "n_head", "num_heads")
_KV_HEADS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads")


def strategy_config(strategy: Any) -> ShardConfig:
    """The validated flags of ``strategy``: a ``ShardStrategy`` / ``ShardFabricStrategy``, a ``ShardConfig``, or a
    dict of ``ShardStrategy`` keyword arguments."""
    if isinstance(strategy, ShardConfig):
        return strategy
    if isinstance(strategy, dict):
        return engines.configure(**strategy)
    config = getattr(strategy, "config", None)
    if isinstance(config, ShardConfig):
        return config
    raise TypeError(
        f"dryrun(strategy={strategy!r}) is not a strategy: give ShardStrategy(...), ShardFabricStrategy(...), a"
        " ShardConfig, or a dict of ShardStrategy keyword arguments."
    )


def precision_policy(strategy: Any, precision: str | None, config: ShardConfig) -> PrecisionPolicy:
    plugin = getattr(strategy, "precision_plugin", None) or getattr(strategy, "_fabric_precision", None)
    given = getattr(plugin, "policy", None)
    base = (
        given
        if precision is None and isinstance(given, PrecisionPolicy)
        else PrecisionPolicy(precision or "bf16-mixed")  # type: ignore[arg-type]
    )
    kind = engine_class(config.engine)
    policy = kind.precision_class.from_plugin(base)
    kind.check_precision(config.stage, policy)
    return policy


def _number(module: nn.Module, names: tuple[str, ...]) -> int | None:
    """The first positive integer named ``names`` on the module, its ``config`` / ``hparams``, or any submodule."""
    for sub in module.modules():
        for holder in (sub, getattr(sub, "config", None), getattr(sub, "hparams", None)):
            for name in names:
                value = holder.get(name) if isinstance(holder, dict) else getattr(holder, name, None)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return value
    return None


def model_sizes(module: nn.Module) -> ModelSizes:
    """The numbers of ``module`` a layout must divide (read on meta)."""
    classes = detect_block_classes(module)
    moe, _ = count_experts(module)
    return ModelSizes(
        heads=_number(module, _HEADS),
        kv_heads=_number(module, _KV_HEADS),
        experts=moe.experts if moe else None,
        layers=len(find_blocks(module, classes)) if classes else None,
    )


def check_layout(config: ShardConfig, world_size: int, module: nn.Module) -> ParallelDims:
    """The layout of ``world_size`` ranks, or a ``ValueError`` naming the flag, its value, the number it does not
    divide and the sizes that do: first against the world, then against the model's numbers."""
    dims = parallel_dims(config, world_size)
    check_model_sizes(dims, model_sizes(module), stages_per_rank=config.stages_per_rank)
    return dims


def _unused_loss(output: Any, target: Any) -> Any:
    raise RuntimeError("a dry run runs no step")


@contextmanager
def prepared_rank(
    build: Callable[[], nn.Module],
    config: ShardConfig,
    policy: PrecisionPolicy,
    rank: int,
    world_size: int,
    fake: bool = False,
) -> Generator[tuple[FakeWorld, nn.Module, Any, list[Any], str | None], None, None]:
    """Rank ``rank`` of ``world_size`` set up on the fake group: ``(world, module, session, optimizers, note)``,
    valid until the group is destroyed on the way out. ``fake``: the module laid out on the CPU under fake
    tensors (the meshes built before), so that a step can run on it (:mod:`.trace`)."""
    with fake_rank(rank, world_size), ExitStack() as stack:
        module = build()
        setattr(module, transform._WEIGHTS, NOT_READ)
        config = config.replace(init_weights=NOT_READ)
        world = FakeWorld(config, rank, world_size, device="cpu" if fake else "meta")
        world.build_meshes()
        if fake:
            stack.enter_context(fake_tensors())
            module.to_empty(device="cpu")
        transform.prepare_precision(policy, world)
        try:
            with _compat.ddp_without_shape_check():
                session = transform.prepare(
                    module, config, policy, world, loss_fn=_unused_loss, owner="dryrun"
                )
        except ValueError as error:  # the strategy's own refusal: the job would stop at the same place
            raise ValueError(
                f"dryrun: the set-up of rank {rank} of {world_size} refuses this layout: {error}"
            ) from error
        except Exception as error:
            raise RuntimeError(
                f"dryrun: the {config.engine!r} engine could not be set up for rank {rank} of {world_size} on a"
                f" fake process group with the model on the meta device: {type(error).__name__}: {error}"
            ) from error
        optimizers, note = step_on_shards(session, user_optimizers(module))
        yield world, module, session, optimizers, note


def dry_run_rank(
    build: Callable[[], nn.Module],
    config: ShardConfig,
    policy: PrecisionPolicy,
    rank: int,
    world_size: int,
    batch: tuple[int, int] | None = None,
) -> RankReport:
    """Rank ``rank`` of ``world_size`` set up on the fake group (see the module's docstring); with ``batch``
    (micro-batch, sequence length), one step traced on fake tensors (:mod:`.trace`), or a note saying why not
    (the rank then set up on meta as without it)."""
    skip = untraceable(parallel_dims(config, world_size)) if batch is not None else None
    if batch is not None and skip is None:
        try:
            return _built_rank(build, config, policy, rank, world_size, batch, None)
        except RuntimeError as error:  # the set-up refuses fake tensors where it takes meta ones
            skip = f"the step could not be traced: the set-up on fake tensors failed ({error.__cause__ or error})"
    return _built_rank(build, config, policy, rank, world_size, None, skip)


def _built_rank(
    build: Callable[[], nn.Module],
    config: ShardConfig,
    policy: PrecisionPolicy,
    rank: int,
    world_size: int,
    batch: tuple[int, int] | None,
    skip: str | None,
) -> RankReport:
    start = time.perf_counter()
    traced: dict[str, Any] = {}
    fake = batch is not None
    with prepared_rank(build, config, policy, rank, world_size, fake) as (
        world,
        module,
        session,
        optimizers,
        note,
    ):
        held = held_bytes(session.model, optimizers)
        files, written = checkpoint_writes(
            state_dict(session, optimizers), rank, world.dims.world_size // world.dims.pp
        )
        report = _report(world, module, world.config, rank, held, files, written)
        report["collective_bytes"] = collective_bytes(session.model, held, world.dims.data_parallel_size)
        if batch is not None:
            try:
                traced = traced_step(session.model, optimizers, *batch)
            except Exception as error:  # torch's trackers refuse this layout: the rest of the report stands
                skip = f"the step could not be traced: {type(error).__name__}: {error}"
    seconds = time.perf_counter() - start
    notes = tuple(n for n in (note, skip) if n)
    report.update(traced)
    return RankReport(**{**report, "build_seconds": round(seconds, 3), "notes": notes})


def state_dict(session: Any, optimizers: list[Any]) -> dict[str, Any]:
    """What a sharded save writes: the engine's state dicts of the model and each optimizer, under the keys of
    the package's sharded checkpoints (``state_dict``, ``optimizer_<i>``)."""
    engine, model = session.engine, session.model
    try:
        state = {MODEL_KEY: engine.model_state_dict(model, full=False)}
    except NotImplementedError:
        # the engine copies the state to the host, which meta tensors cannot: the same entries, left in place
        options = StateDictOptions(full_state_dict=False, cpu_offload=False)
        state = {MODEL_KEY: get_model_state_dict(model, options=options)}
    for i, optimizer in enumerate(optimizers):
        state[optimizer_key(i)] = engine.optimizer_state_dict(model, optimizer, full=False)
    return state


def _report(
    world: FakeWorld,
    module: nn.Module,
    config: ShardConfig,
    rank: int,
    held: Any,
    files: list[str],
    written: int,
) -> dict[str, Any]:
    dims = world.dims
    place = dims.coordinates(rank)
    plan = getattr(module, transform._STAGE, None)
    stages: tuple[int, ...] = ()
    if plan is not None:
        stages = tuple(stages_of_rank(place["pp"], dims.pp, config.stages_per_rank))
        layers = tuple(i for s in stages for i in plan.blocks_of(s))
    else:
        classes = detect_block_classes(module)
        layers = tuple(range(len(find_blocks(module, classes)))) if classes else ()
    experts: tuple[int, ...] = ()
    moe, _ = count_experts(module) if dims.ep == 1 else (None, "")
    total = moe.experts if moe else getattr(module, _EXPERTS, 0)
    if total:
        per = total // dims.ep
        experts = tuple(range(place["ep"] * per, (place["ep"] + 1) * per))
    return {
        "rank": rank,
        "world_size": dims.world_size,
        "coordinates": place,
        "pipeline_stages": stages,
        "layers": layers,
        "experts": experts,
        "param_bytes": held.param_bytes,
        "grad_bytes": held.grad_bytes,
        "optimizer_bytes": held.optimizer_bytes,
        "params": held.params,
        "checkpoint_files": tuple(files),
        "checkpoint_bytes": written,
    }


_EXPERTS = "_lightning_shard_dryrun_experts"


def checked_config(strategy: Any) -> ShardConfig:
    """The flags of ``strategy`` (:func:`strategy_config`), refused where a dry run cannot build them."""
    config = strategy_config(strategy)
    if config.stage == "auto":
        raise ValueError(
            "dryrun() needs the ZeRO stage the job runs: ShardStrategy(stage='auto') is resolved from the device's"
            " memory at set-up. Give stage=0, 1, 2 or 3 (lightning-shard plan recommends one)."
        )
    if engine_class(config.engine).capabilities.owns_step:
        raise ValueError(
            f"dryrun: ShardStrategy(engine={config.engine!r}) cannot be dry-run: that engine runs the optimizer step"
            " itself and builds its state in its own initialize from allocated parameters (at stage 3 it refuses a"
            " model on the meta device; at stages 0-2 it allocates the fp32 partitions and starts its own"
            " communication backend), which a fake process group with the model on meta cannot give. Dry-run the"
            " same layout with engine='fsdp'."
        )
    return config


def dryrun(
    model: ModelSource,
    strategy: Any,
    world_size: int,
    ranks: list[int] | None = None,
    *,
    precision: str | None = None,
    init_args: dict[str, Any] | None = None,
    planner: bool = True,
    trace_step: bool = False,
    micro_batch: int = 1,
    seq_len: int | None = None,
) -> list[RankReport]:
    """Set up ``ranks`` of a ``world_size``-rank job of ``model`` under ``strategy``, each on a fake process
    group with the model on the meta device, and report what each rank holds.

    Args:
        model: the model (see :mod:`.models`: a module, a class, a Hugging Face config, a config.json, a
            published config's name, a class path).
        strategy: ``ShardStrategy(...)``, ``ShardFabricStrategy(...)``, a ``ShardConfig`` or a dict of flags.
        world_size: the job's ranks.
        ranks: which ranks (default: the first and last, and one of each pipeline stage and expert block).
        precision: ``Trainer(precision=...)`` (default: the strategy's plugin if it holds one, else
            ``"bf16-mixed"``).
        init_args: constructor arguments when ``model`` is a class or a class path.
        planner: add the planner's figures for the same flags to each report.
        trace_step: also trace one training step of each rank on fake tensors (:mod:`.trace`): its peak memory
            and the collectives' bytes, beside the planner's activation and buffer figures.
        micro_batch, seq_len: the traced step's batch of token ids (default sequence: the model's own length).

    Raises ``ValueError`` before anything is built when the layout does not divide the world or the model.
    """
    config = checked_config(strategy)
    first = model_factory(model, init_args)()
    dims = check_layout(config, world_size, first)
    chosen = default_ranks(dims) if ranks is None else sorted(set(ranks))
    bad = [r for r in chosen if not 0 <= r < world_size]
    if bad:
        raise ValueError(f"dryrun(ranks={ranks}) names ranks outside the world of {world_size}: {bad}.")
    policy = precision_policy(strategy, precision, config)
    moe, _ = count_experts(first)
    experts = moe.experts if moe else 0

    def rebuild() -> nn.Module:
        module = copy.deepcopy(first)  # a tenth of building a large model again
        setattr(module, _EXPERTS, experts)  # expert parallelism leaves each rank its E / ep: E read here
        return module

    batch = (micro_batch, seq_len or sequence_length(first)) if trace_step else None
    figures = None
    if planner:
        figures = planner_figures(first, config, world_size, policy.precision, batch)
    reports = [dry_run_rank(rebuild, config, policy, rank, world_size, batch) for rank in chosen]
    if figures is None:
        return reports
    return [RankReport(**{**r.__dict__, "planner": figures(r.coordinates)}) for r in reports]
