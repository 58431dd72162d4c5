"""The engine contract: everything either front door asks of a sharding engine, and nothing else.

The doors own processes, the device mesh and their framework's hooks; an engine owns how the module
and its optimizers are wrapped, how gradients are reduced and stepped, how state is saved and
loaded, and what it must release at the end. The core builds one engine (``engines.engine_class(name)``,
in :func:`lightning_shard.core.transform.prepare`) and the doors talk to it only through this class, so a
third engine is one more subclass and one more line in ``engines/__init__.py``'s table, with no change
to either door.

Lifecycle, per Trainer call (``fit``, ``validate``, ``test``, ``predict``; any order, any number)::

    check_module(module)             (refusals before any transform: nothing to train, a layout it cannot take)
    setup_module(module)             -> the module to run: the one data-parallel wrap and the allocation
                                        from meta (wrapped once; re-used on later calls). Every transform
                                        before it is core.transform.prepare's, in its order.
    setup_optimizers(model, opts)    -> (model, optimizers) to train with       (fit only)
    pre_backward / backward / step   (training; ``owns_step`` says who runs backward and step)
    no_sync(model)                   (accumulation: no gradient communication on this micro-batch)
    save_checkpoint / load_checkpoint / remove_checkpoint
    state_bytes(model, optimizers)   -> bytes held, by kind and by place (one shape for every engine)
    wait_for_checkpoints()           (an exception checkpoint: committed before the job exits)
    teardown()                       (pending checkpoints committed, threads joined, files removed)
    destroy_world()                  (the strategy destroys the process groups through it, at exit)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Generator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from lightning_shard._meta import parameters_on_meta
from lightning_shard.checkpoint import remove
from lightning_shard.checkpoint._errors import on_every_rank
from lightning_shard.checkpoint.init_weights import InitWeightsError, load_full_weights
from lightning_shard.checkpoint.storage import Location
from lightning_shard.config import ShardConfig
from lightning_shard.engines._redirect import ForwardRedirection
from lightning_shard.engines.capabilities import Capabilities
from lightning_shard.parallel import ParallelDims, ParallelMeshes
from lightning_shard.precision import PrecisionPolicy

PLACES = ("accelerator", "host", "nvme")
KINDS = ("parameters", "gradients", "optimizer")


@dataclass(frozen=True)
class RunContext:
    """What an engine needs to know about the processes it runs in (filled in by the strategy)."""

    device: torch.device
    meshes: ParallelMeshes | None
    """Every mesh of the layout, by name (``None``: one process, no mesh)."""
    global_rank: int
    world_size: int
    backend: str
    barrier: Callable[[], None]

    @property
    def dims(self) -> ParallelDims:
        """The layout's sizes (one data-parallel dimension when there is no mesh)."""
        return ParallelDims(1, self.world_size, 1) if self.meshes is None else self.meshes.dims

    @property
    def mesh(self) -> Any:
        """The data-parallel ``DeviceMesh``: 1-D, or ``(replicate, shard)`` for HSDP."""
        return None if self.meshes is None else self.meshes.data_parallel

    @property
    def world_mesh(self) -> Any:
        """The dense layers' mesh (``([pp,] replicate, shard, tp)``, or the 1-D data-parallel one)."""
        return None if self.meshes is None else self.meshes.dense

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0


@dataclass(frozen=True)
class TrainSettings:
    """The Trainer flags an engine that owns backward and step must follow."""

    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: str | None = None


@dataclass(frozen=True)
class ReplicaSync:
    """What fault tolerance's replica groups need of an engine (:meth:`Engine.replica_sync`)."""

    within: Callable[..., Any]
    """DDP's communication hook for the mean inside the group, before the mean over the groups (stages 0-1)."""
    own_state: Any = None
    """An optimizer state this rank keeps in a layout of its own (``holds``, ``state``, ``load``), or ``None``."""


@dataclass
class StateBytes:
    """Bytes of model state this rank holds: ``{kind: {place: bytes}}`` plus totals."""

    held: dict[str, dict[str, int]] = field(
        default_factory=lambda: {k: dict.fromkeys(PLACES, 0) for k in KINDS}
    )

    def add(self, kind: str, tensor: torch.Tensor) -> None:
        place = "host" if tensor.device.type == "cpu" else "accelerator"
        self.held[kind][place] += tensor.numel() * tensor.element_size()

    def total(self, kind: str) -> int:
        return sum(self.held[kind].values())

    def as_dict(self) -> dict[str, Any]:
        """``{"parameters": {"accelerator", "host", "nvme"}, "gradients": ..., "optimizer": ..., "total": int}``."""
        return {**{k: dict(v) for k, v in self.held.items()}, "total": sum(self.total(k) for k in KINDS)}


def on_every_rank_init(path: str, load: Callable[[], Any]) -> None:
    """Run an ``init_weights`` load; if it fails on any rank, every rank raises ``InitWeightsError``."""
    on_every_rank(Path(path), load, InitWeightsError)


class Engine(ABC):
    """One way of sharding: the strategy's only collaborator for wrapping, stepping and state."""

    #: What the engine supports, declared once (:mod:`.capabilities`): the doors, the planner and the flag
    #: checks ask it, and never compare the engine's name.
    capabilities: ClassVar[Capabilities]
    #: ``True`` when the engine runs backward and the optimizer step itself (DeepSpeed); then it also
    #: counts accumulation micro-batches and clips from ``TrainSettings``.
    owns_step: bool = False
    #: The precision policy class this engine runs with (built from the door's precision plugin).
    precision_class: type[PrecisionPolicy] = PrecisionPolicy

    @classmethod
    def check_precision(cls, stage: int | str, precision: PrecisionPolicy) -> None:
        """Refuse a precision this engine cannot serve (called when the Trainer assigns it)."""
        return None

    @classmethod
    def construction_context(cls, config: ShardConfig, precision: PrecisionPolicy) -> Any:
        """Where ``configure_model`` builds modules: parameters on the meta device, sharded and allocated
        at set-up (``lightning_shard._meta``)."""
        return parameters_on_meta()

    def __init__(self, config: ShardConfig, precision: PrecisionPolicy, run: RunContext) -> None:
        self.config = config
        self.precision = precision
        self.run = run

    #: ``compile=...``: dynamo's recompile count when the blocks were compiled (set by ``prepare``).
    compile_baseline: int | None = None
    #: Compiled blocks are marked as ZeRO-3 leaves (DeepSpeed gathers each in its own hook).
    compiles_zero3_leaves: bool = False

    def check_module(self, module: nn.Module) -> None:  # noqa: B027  # optional: most engines take any module
        """Refuse a module this engine cannot set up, before any transform touches it."""

    #: Routes ``training_step`` & co. through the wrapper's forward (:mod:`._redirect`).
    forward_redirection: Any = ForwardRedirection()

    def routes_through_forward(self, model: nn.Module, module: nn.Module) -> bool:
        """Whether a step must run inside ``model``'s forward (its hooks gather, reduce, count)."""
        return model is not module

    @property
    def stage(self) -> int:
        return self.config.resolved_stage

    # --- set-up ----------------------------------------------------------------------------------

    @abstractmethod
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Return the module to run, wrapped for data parallelism and allocated; a module this engine already
        wrapped is returned as it is."""

    @abstractmethod
    def setup_optimizers(
        self, model: nn.Module, optimizers: list[Optimizer], schedulers: list[Any], settings: TrainSettings
    ) -> tuple[nn.Module, list[Optimizer]]:
        """Return the model to train and the optimizers to step (the user's, sharded or replaced);
        LR ``schedulers`` of a replaced optimizer are pointed at its replacement."""

    # --- training --------------------------------------------------------------------------------

    def pre_backward(self, model: nn.Module, loss: torch.Tensor, manual: bool) -> None:  # noqa: B027
        """Called before every backward (``manual``: inside ``training_step``, manual optimization)."""

    def post_backward(self, model: nn.Module, manual: bool) -> None:  # noqa: B027
        """Called after every backward (``manual``: inside ``training_step``, manual optimization)."""

    def backward(self, model: nn.Module, loss: torch.Tensor, manual: bool) -> None:
        """Run backward on ``loss`` (only called when ``owns_step``)."""
        raise NotImplementedError(f"{type(self).__name__} does not own backward")

    def step(self, model: nn.Module, optimizer: Optimizer) -> None:
        """Step the optimizer (only called when ``owns_step``)."""
        raise NotImplementedError(f"{type(self).__name__} does not own the optimizer step")

    def after_manual_step(self, model: nn.Module) -> None:  # noqa: B027
        """An optimizer stepped inside ``training_step`` (manual optimization): whatever the rest of the step
        runs must see the new weights."""

    @contextmanager
    def no_sync(self, model: nn.Module) -> Generator[None, None, None]:
        """No gradient communication inside: a non-final accumulation micro-batch."""
        yield

    # --- state -----------------------------------------------------------------------------------

    @abstractmethod
    def save_checkpoint(
        self,
        model: nn.Module,
        optimizers: list[Optimizer],
        checkpoint: dict[str, Any],
        path: Location,
        exception: bool = False,
    ) -> None:
        """Write ``checkpoint`` (Lightning's dict, model and optimizer state filled in) under ``path``,
        visible under that name only once complete on every rank. ``exception``: an exception checkpoint
        (``OnExceptionCheckpoint``, SIGTERM), written in full, never a link to another checkpoint."""

    @abstractmethod
    def load_checkpoint(
        self, model: nn.Module, optimizers: list[Optimizer], path: Location, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load model (and, where given, optimizer) state from ``path``; return Lightning's remaining dict.

        ``weights_only`` as Lightning passes it (``None``: torch's default, ``True``): only ``False`` lets the
        checkpoint's pickles name globals beyond torch's allowlist."""

    def remove_checkpoint(self, path: Location) -> None:
        if self.run.is_global_zero:
            remove(path)

    @abstractmethod
    def model_state_dict(self, model: nn.Module, full: bool) -> dict[str, Any]:
        """The model's state dict: this rank's shards, or (``full``) the whole model."""

    @abstractmethod
    def optimizer_state_dict(self, model: nn.Module, optimizer: Optimizer, full: bool) -> dict[str, Any]:
        """An optimizer's state keyed by parameter name: this rank's shards, or (``full``) all of it."""

    @abstractmethod
    def state_bytes(self, model: nn.Module, optimizers: list[Optimizer]) -> StateBytes:
        """Bytes of parameters, gradients and optimizer state this rank holds, by place."""

    def load_full_weights(self, module: nn.Module, path: str) -> None:
        """Fill ``module`` (set up, its parameters allocated) from the full weights at ``path``, each rank
        reading only its own part."""
        on_every_rank_init(path, lambda: load_full_weights(module, path))

    def wait_for_checkpoints(self) -> None:  # noqa: B027
        """Block until every checkpoint this engine started writing is committed (raise its error)."""

    def teardown(self) -> None:  # noqa: B027
        """Commit pending checkpoints, join the engine's threads, remove its swap and temporary files.

        Process groups outlive it (collectives after a Trainer call, as under ``DDPStrategy``): the
        strategy destroys them at exit, through :meth:`destroy_world`.
        """

    def replica_sync(self, model: nn.Module) -> ReplicaSync:
        """The in-group reduction and the rank's own optimizer state fault tolerance builds on (engines with a
        replicate dimension; the flags refuse ``fault_tolerance`` for the others before this is reached)."""
        raise NotImplementedError(f"{type(self).__name__} has no replica groups (fault_tolerance).")

    @classmethod
    def destroy_world(cls) -> None:
        """Destroy the default process group and every group made after it (the strategy's teardown)."""
        dist.destroy_process_group()
