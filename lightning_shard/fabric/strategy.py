"""ShardFabricStrategy: the Fabric front door to the core behind ShardStrategy.

``L.Fabric(strategy=ShardFabricStrategy(stage=3))`` (or ``strategy="zero3"``) validates the same flags into the
same :class:`~lightning_shard.ShardConfig`; its processes and collectives are the core's
:class:`~lightning_shard.core.ProcessGroups`, beside Fabric's own ``ParallelStrategy``. ``fabric.setup`` runs
:func:`~lightning_shard.core.prepare`, and every call after it (backward, step, clipping, accumulation, the
pipeline and context-parallel calls, checkpoints) forwards to the run's :class:`~lightning_shard.core.Session`;
checkpoints are the Trainer strategy's format (:mod:`._checkpoint`), written by either door, read by both."""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack
from typing import Any

import torch
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.strategies.strategy import _Sharded
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_shard import _ddp
from lightning_shard.checkpoint.storage import follow_alias, resolve
from lightning_shard.config import ShardConfig
from lightning_shard.context_parallel.batch import group_mean
from lightning_shard.core import ProcessGroups, Session, guarded, transform
from lightning_shard.core.lifecycle import EngineLifecycle
from lightning_shard.core.process_groups import reduce_tensor
from lightning_shard.core.registry import register_names
from lightning_shard.core.transform import LossFn
from lightning_shard.engines import Engine, TrainSettings, configure
from lightning_shard.fabric import _checkpoint, _data, _fault_tolerance
from lightning_shard.fabric._context_parallel import cuts
from lightning_shard.fabric._pipeline import as_tuple, check_pipeline_call, refuse_backward_under_pipeline
from lightning_shard.fabric._precision import FabricShardPrecision
from lightning_shard.fabric._setup import (
    EngineNoSync,
    FabricLauncher,
    check_optimizer_alone,
    parameter_names,
    rebind,
    refuse_clip_on_owned_step,
    refuse_trainer_only,
)
from lightning_shard.flags import args_doc, bind, takes_flags


class ShardFabricStrategy(ProcessGroups, ParallelStrategy, _Sharded):
    """ZeRO stages 0-3 for a Lightning Fabric loop, over the engines :class:`~lightning_shard.ShardStrategy` uses.

    Takes ShardStrategy's arguments (``stage``, ``engine``, ``offload_*``, ``activation_checkpointing``,
    ``replicate_size``, ``tensor_parallel_size``, ``checkpoint``, ``async_checkpoint``, ``init_weights``,
    ``timeout``, DDP options at stages 0-1, ...) with the same validation; ``ShardStrategy(...).fabric()``
    builds one from a Trainer strategy's flags. With ``pipeline_parallel_size > 1`` each batch goes through
    :meth:`pipeline_step` in place of the forward and ``fabric.backward``. With ``context_parallel_size > 1``
    the loop passes each batch through :meth:`cut_batch` before the forward, and ``fabric.backward`` weights
    the loss (:mod:`._context_parallel`). Not available here, because they are Trainer hooks:
    ``stage="auto"`` (it plans from the Trainer's batch) and ``skip_nonfinite``. See docs/fabric.md.
    """

    launcher_class = FabricLauncher
    process_dataloader = _data.position_loader  # (fabric/_data.py: resume_dataloader positions it)
    resume_dataloader = _data.resume_dataloader

    @takes_flags
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        flags, kwargs = bind("ShardFabricStrategy", args, kwargs)
        _, ddp_kwargs = _ddp.split_kwargs(kwargs)
        self._init_from(configure(ddp_kwargs=ddp_kwargs, **vars(flags)))

    __doc__ = (__doc__ or "").rstrip() + "\n\n" + args_doc() + "\n"

    @classmethod
    def from_config(cls, config: ShardConfig) -> ShardFabricStrategy:
        """The Fabric strategy for flags already validated (``ShardStrategy(...).fabric()``)."""
        strategy = cls.__new__(cls)
        strategy._init_from(config)
        return strategy

    def _init_from(self, config: ShardConfig) -> None:
        refuse_trainer_only(config)
        self.config = config
        self._engines = EngineLifecycle(config)  # built at launch; the session's from fabric.setup on
        self._fabric_precision: FabricShardPrecision | None = None
        super().__init__()
        self._backward_sync_control = EngineNoSync(self)
        self._session: Session | None = None
        self._module: nn.Module | None = None  # the user's module, sharded in place or wrapped
        self._loss_fn: LossFn | None = None  # pipeline stages: the loss pipeline_step was given
        self._replicas: _fault_tolerance.FabricReplicas | None = None  # fault_tolerance, once set up

    @property
    def engine(self) -> Engine:
        if self._engines.engine is None:
            raise RuntimeError("ShardFabricStrategy.engine is only available after fabric.launch().")
        return self._engines.engine

    # --- precision -------------------------------------------------------------------------------

    @property  # type: ignore[override]
    @override
    def precision(self) -> FabricShardPrecision:
        if self._fabric_precision is None:
            self._fabric_precision = FabricShardPrecision(self._engines.default_precision())
        return self._fabric_precision

    @precision.setter
    def precision(self, precision: Precision | None) -> None:
        # Fabric assigns the plugin it built from Fabric(precision=...): translated here, when Fabric is
        # built, so an unsupported precision fails before any process starts.
        if precision is None or not hasattr(self, "config"):
            self._fabric_precision = None
            return
        engine, stage = self._engines.kind, self.config.stage
        self._fabric_precision = FabricShardPrecision.for_engine(precision, engine, stage)

    # --- processes and engine --------------------------------------------------------------------

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        transform.prepare_precision(self.precision.policy, self)
        self._engines.build(self.config, self.precision.policy, self.run_context())

    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        stack = ExitStack()
        if empty_init:
            # Parameters on the meta device (DeepSpeed ZeRO-3: zero.Init) until setup shards and allocates them.
            stack.enter_context(self.module_sharded_context())
        stack.enter_context(self.root_device)
        stack.enter_context(self.precision.module_init_context())
        return stack

    @override
    def module_sharded_context(self) -> AbstractContextManager:
        return self._engines.construction_context(self.config, self.precision.policy)

    @override
    def module_to_device(self, module: nn.Module) -> None:
        pass  # the engine places the module (each rank's shards only) when it is set up

    # --- model and optimizers --------------------------------------------------------------------

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        if self._module is not None and module is not self._module:
            raise ValueError(
                "ShardFabricStrategy sets up one model per Fabric: fabric.setup was called with a second one"
                f" ({type(module).__name__}). Put the models in one nn.Module, or use one Fabric per model."
            )
        session = transform.prepare(
            module,
            self.config,
            self.precision.policy,
            self,
            engine=self._engines.reusable(),
            loss_fn=self._call_loss,
            owner="ShardFabricStrategy",
        )
        self._session, self.config, self._module = session, session.config, module
        self._engines.adopt(session.engine)
        return session.model

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any = None
    ) -> tuple[nn.Module, list[Optimizer], Any]:
        # The optimizers were made before sharding: they hold the parameters as they were built.
        names = parameter_names(module)
        self.setup_module(module)
        for optimizer in optimizers:
            # With pipeline stages, parameters of the other ranks' stages were cut away: they leave it too.
            rebind(
                optimizer, names, dict(module.named_parameters()), cut=self._running().pipeline is not None
            )
        schedulers = [scheduler] if scheduler is not None else []
        optimizers = self._running().setup_optimizers(list(optimizers), schedulers, TrainSettings())
        self.apply_timeout()
        self._replicas = _fault_tolerance.join(self, self._replicas, optimizers)
        return self._running().model, optimizers, scheduler

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        check_optimizer_alone(self.config, self._module, optimizer, self._engines.owns_step)
        (optimizer,) = self._running().setup_optimizers([optimizer], [], TrainSettings())
        self._replicas = _fault_tolerance.join(self, self._replicas, [optimizer])
        return optimizer

    @property
    def replica_group(self) -> Any:  # fault_tolerance: participants, discarded, heals (None without it)
        return None if self._replicas is None else self._replicas.replicas

    def join_replica_groups(self, state: dict[str, Any]) -> None:
        """``fault_tolerance``: the first quorum, before the loop; a restarted group heals (docs/fault_tolerance.md)."""
        _fault_tolerance.join_replica_groups(self._replicas, state)

    @override
    @guarded
    def all_reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean"
    ) -> Tensor | Any:
        return reduce_tensor(tensor, group, reduce_op)

    # --- the loop's own calls: context parallelism and pipeline stages ---------------------------

    def cut_batch(self, batch: Any) -> Any:
        """This rank's part of ``batch`` (each rank of a context-parallel group calls it on the same batch).

        Every tensor of the batch (in dicts, lists, tuples) whose dim 1 has the sequence length ``T`` keeps
        this rank's two chunks of ``T / 2c`` tokens; a dict batch with ``labels`` gains ``shift_labels``.
        The model then runs its attention over the group, and ``fabric.backward`` weights the loss of this
        batch (:attr:`loss_weight`). Without context parallelism the batch comes back as it is, so one loop
        serves every ``context_parallel_size`` (:mod:`._context_parallel`).
        """
        if not cuts(self.config, self.context_parallel, self._module is not None):
            return batch
        return self._running().cut_batch(batch, owner="ShardFabricStrategy")

    def end_cut(self) -> None:
        """The model runs whole sequences again, as on one process (evaluation after training, say), and
        ``fabric.backward`` stops weighting the loss, until the next :meth:`cut_batch`."""
        if self._session is not None:
            self._session.end_cut()

    @property
    def loss_weight(self) -> float:
        """What ``fabric.backward`` multiplies the loss by: ``c x n_r / N`` for the last cut batch (1 for a
        tuple batch, whose chunks hold equal numbers of targets; 1 outside a cut batch). The rank's loss
        times it, averaged over the group (``fabric.all_reduce``), is the group's mean loss."""
        return 1.0 if self._session is None else self._session.loss_weight

    @guarded
    def pipeline_step(
        self, model: nn.Module, inputs: Any, target: Any, loss_fn: LossFn | None = None, scale: float = 1.0
    ) -> Tensor:
        """Forward and backward of one batch through this rank's pipeline stages; its loss on every stage.

        Args:
            model: the model ``fabric.setup`` returned.
            inputs: the first stage's positional arguments (a tensor or a tuple of them); the last stage
                may pass anything, as only the first stage reads them.
            target: what ``loss_fn`` compares the last stage's output with.
            loss_fn: ``loss_fn(output, target) -> Tensor``, the mean loss of one microbatch; by default the
                model's ``pipeline_loss`` (the Trainer strategy's contract, docs/pipeline.md).
            scale: the gradients are ``scale x`` those of the batch's loss (``1 / accumulate`` under
                accumulation); the returned loss is not scaled.

        With ``context_parallel_size > 1`` the inputs and the target (both ``(batch, sequence, ...)``, the
        target aligned with the inputs position by position) are cut to this rank's chunks, as
        ``cut_batch`` cuts (do not cut them first); each rank's loss is weighted by its share of the
        targets, and the loss returned is the group's: the whole sequences' loss.
        """
        self._loss_fn = check_pipeline_call("pipeline_step", self._session, model, loss_fn)
        loss = self._running().pipeline_train_step(as_tuple(inputs), target, scale)
        return group_mean(self.context_parallel, loss)

    @guarded
    def pipeline_eval_step(
        self, model: nn.Module, inputs: Any, target: Any, loss_fn: LossFn | None = None
    ) -> Tensor:
        """Forward only, through this rank's stages; the batch's loss on every stage."""
        self._loss_fn = check_pipeline_call("pipeline_eval_step", self._session, model, loss_fn)
        return group_mean(self.context_parallel, self._running().pipeline_eval_step(as_tuple(inputs), target))

    def _call_loss(self, output: Any, target: Any) -> Tensor:
        assert self._loss_fn is not None
        return self._loss_fn(output, target)

    # --- training --------------------------------------------------------------------------------

    @override
    @guarded
    def backward(self, tensor: Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        session = self._running()
        refuse_backward_under_pipeline(session)
        tensor = session.weigh(tensor)  # context parallelism: the rank's share of the cut batch's targets
        tensor = self.precision.pre_backward(tensor, module)
        _fault_tolerance.before_backward(self._replicas)  # the step's quorum, unless the forward joined it
        # Fabric steps the optimizer where the user says: an engine's own backward may precede a step.
        session.backward(
            tensor,
            manual=self._engines.owns_step,
            plain=lambda loss: self.precision.backward(loss, module, *args, **kwargs),
        )
        self.precision.post_backward(tensor, module)

    @override
    @guarded
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        if self._engines.owns_step:
            self._running().engine_step(optimizer)
            return None
        return self._running().gated(lambda _: self.precision.optimizer_step(optimizer, **kwargs))

    @override
    @guarded
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        refuse_clip_on_owned_step(self.config, self._engines.capabilities, "max_norm")
        if float(norm_type) != 2.0:
            raise ValueError(
                f"ShardFabricStrategy clips by the global 2-norm over every shard (got norm_type={norm_type})."
                " Use fabric.clip_gradients(model, optimizer, max_norm=..., norm_type=2.0), or clip_val=... by value."
            )
        self.precision.unscale_gradients(optimizer)
        norm = self._running().clip_norm(self.precision.main_params(optimizer), float(max_norm))
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(
                f"The total norm of the gradients is {norm.item()}: fabric.clip_gradients(error_if_nonfinite=True)"
                " refuses it. Pass error_if_nonfinite=False to step anyway."
            )
        return norm

    @override
    @guarded
    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float | int) -> None:
        refuse_clip_on_owned_step(self.config, self._engines.capabilities, "clip_val")
        super().clip_gradients_value(module, optimizer, clip_val)

    def _running(self) -> Session:
        if self._session is None:
            raise RuntimeError(
                "ShardFabricStrategy: no model is set up yet. Call fabric.setup(model, optimizer)."
            )
        return self._session

    @property
    def _model(self) -> nn.Module | None:
        """What runs: the engine's wrapper (DDP, DeepSpeed) or the module itself (``None`` before set-up)."""
        return None if self._session is None else self._session.model

    # --- state and checkpoints -------------------------------------------------------------------

    @override
    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        return self._running().model_state()

    @override
    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return self._running().optimizer_state(optimizer)

    @override
    @guarded
    def save_checkpoint(
        self, path: Any, state: dict[str, Any], storage_options: Any | None = None, filter: Any | None = None
    ) -> None:
        _checkpoint.refuse_save_options(storage_options, filter)
        session = self._running()
        location = resolve(self.broadcast(str(path)), "fabric.save(path)")
        parts = _checkpoint.split_state(state, session.model)
        if self.refuse_write_after_failure(path) or not session.writes_checkpoints():
            return  # (with fault tolerance, the lowest live group writes)
        _checkpoint.save(session, parts, location)

    @override
    @guarded
    def load_checkpoint(
        self, path: Any, state: Any = None, strict: bool = True, weights_only: bool | None = None
    ) -> dict[str, Any]:
        state = _checkpoint.as_state(state)
        session = self._running()
        location = follow_alias(resolve(self.broadcast(str(path)), "fabric.load(path)"))
        return _checkpoint.load(session, state, location, weights_only, strict)

    def wait_for_checkpoints(self) -> None:
        """Block until every checkpoint ``fabric.save`` started writing (``async_checkpoint=True``) is committed."""
        self._engines.wait_for_checkpoints()

    # --- end of the process ----------------------------------------------------------------------

    @override
    def teardown(self) -> None:
        """Pending checkpoints committed and engine files removed; the process groups stay alive until exit."""
        self._engines.teardown()
        super().teardown()

    @override
    def _release_at_exit(self) -> None:
        self._engines.release("ShardFabricStrategy")  # pending checkpoints committed before the groups go
        super()._release_at_exit()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        register_names(strategy_registry, cls)
