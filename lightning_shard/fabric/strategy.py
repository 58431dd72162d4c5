"""ShardFabricStrategy: the Fabric front door to the engines behind ShardStrategy.

``L.Fabric(strategy=ShardFabricStrategy(stage=3))`` (or ``strategy="zero3"``) validates the same flags
into the same :class:`~lightning_shard.ShardConfig`, starts processes and the device mesh as the Trainer
strategy does (:mod:`._processes`), and hands the model, optimizers, backward, step, accumulation and
checkpoints to one engine through the contract in :mod:`lightning_shard.engines.base`. Checkpoints are the
Trainer strategy's format (:mod:`._checkpoint`): written by either front door, read by both.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Any

import torch
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.strategies.strategy import _BackwardSyncControl, _Sharded
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_shard import _ddp
from lightning_shard.checkpoint.storage import follow_alias, resolve
from lightning_shard.config import ShardConfig
from lightning_shard.core import guarded, transform
from lightning_shard.core.registry import register_names
from lightning_shard.engines import Engine, TrainSettings, engine_class
from lightning_shard.fabric import _checkpoint
from lightning_shard.fabric._context_parallel import FabricContextParallel
from lightning_shard.fabric._pipeline import FabricPipeline
from lightning_shard.fabric._precision import FabricShardPrecision, to_policy
from lightning_shard.fabric._processes import FabricProcesses
from lightning_shard.fabric._setup import parameter_names, rebind, refuse_trainer_only
from lightning_shard.flags import args_doc, bind, takes_flags
from lightning_shard.parallel import clip_grad_norm_


class ShardFabricStrategy(FabricContextParallel, FabricPipeline, FabricProcesses, _Sharded):
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

    @takes_flags
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        flags, kwargs = bind("ShardFabricStrategy", args, kwargs)
        _, ddp_kwargs = _ddp.split_kwargs(kwargs)
        self._init_from(ShardConfig.from_flags(ddp_kwargs=ddp_kwargs, **vars(flags)))

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
        self._engine_class: type[Engine] = engine_class(config.engine)
        self._fabric_precision: FabricShardPrecision | None = None
        super().__init__()
        self._backward_sync_control = _EngineNoSync(self)
        self._engine: Engine | None = None
        self._module: nn.Module | None = None  # the user's module, sharded in place or wrapped
        self._model: nn.Module | None = None  # what runs: the engine's wrapper (DDP, DeepSpeed) or the module

    @property
    def stage(self) -> int | str:
        return self.config.stage

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise RuntimeError("ShardFabricStrategy.engine is only available after fabric.launch().")
        return self._engine

    # --- precision -------------------------------------------------------------------------------

    @property  # type: ignore[override]
    @override
    def precision(self) -> FabricShardPrecision:
        if self._fabric_precision is None:
            self._fabric_precision = FabricShardPrecision(self._engine_class.precision_class())
        return self._fabric_precision

    @precision.setter
    def precision(self, precision: Precision | None) -> None:
        # Fabric assigns the plugin it built from Fabric(precision=...): translated here, when Fabric is
        # built, so an unsupported precision fails before any process starts.
        if precision is None or not hasattr(self, "config"):
            self._fabric_precision = None
            return
        shard = self._engine_class.precision_class.from_plugin(to_policy(precision))
        self._engine_class.check_precision(self.config.stage, shard)
        self._fabric_precision = FabricShardPrecision(shard)

    # --- processes and engine --------------------------------------------------------------------

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        transform.prepare_precision(self.precision.shard, self)
        self._engine = self._engine_class(self.config, self.precision.shard, self.run_context())

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
        return self._engine_class.construction_context(self.config, self.precision.shard)

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
        prepared = transform.prepare(
            module,
            self.config,
            self.precision.shard,
            self,
            engine=self.engine,
            loss_fn=self._call_loss,
            owner="ShardFabricStrategy",
        )
        self._session = prepared
        self.config, self._engine, self._pipeline = prepared.config, prepared.engine, prepared.pipeline
        self._module, self._model = module, prepared.model
        return prepared.model

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any = None
    ) -> tuple[nn.Module, list[Optimizer], Any]:
        # The optimizers were made before sharding: they hold the parameters as they were built.
        names = parameter_names(module)
        model = self.setup_module(module)
        live = dict(module.named_parameters())
        for optimizer in optimizers:
            # With pipeline stages, parameters of the other ranks' stages were cut away: they leave it too.
            rebind(optimizer, names, live, cut=self._pipeline is not None)
        schedulers = [scheduler] if scheduler is not None else []
        model, optimizers = self.engine.setup_optimizers(model, list(optimizers), schedulers, TrainSettings())
        self._model = model
        self.apply_timeout()
        return model, optimizers, scheduler

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        if self._module is None or self._model is None:
            raise RuntimeError(
                "ShardFabricStrategy: set the model up before its optimizer: model = fabric.setup_module(model),"
                " then build the optimizer from model.parameters() and call fabric.setup_optimizers(optimizer);"
                " or pass both to fabric.setup(model, optimizer)."
            )
        if self._engine_class.owns_step:
            raise RuntimeError(
                f"ShardFabricStrategy(engine={self.config.engine!r}) wraps the model and its optimizer together:"
                " call fabric.setup(model, optimizer) instead of fabric.setup_module + fabric.setup_optimizers."
            )
        held = {id(p) for p in self._module.parameters()}
        if any(id(p) not in held for group in optimizer.param_groups for p in group["params"]):
            raise ValueError(
                f"ShardFabricStrategy(stage={self.stage}): the optimizer holds parameters that are not the set-up"
                " model's (it was built before fabric.setup_module sharded the model). Build it after"
                " fabric.setup_module(model) from model.parameters(), or pass both to fabric.setup(model, optimizer)."
            )
        _, (optimizer,) = self.engine.setup_optimizers(self._model, [optimizer], [], TrainSettings())
        return optimizer

    # --- training --------------------------------------------------------------------------------

    @override
    @guarded
    def backward(self, tensor: Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        model = self._running()
        self._refuse_backward_under_pipeline()
        tensor = self._weigh_loss(tensor)  # context parallelism: the rank's share of the cut batch's targets
        tensor = self.precision.pre_backward(tensor, module)
        if self.engine.owns_step:
            # Fabric steps the optimizer where the user says: every backward may precede a step.
            self.engine.backward(model, tensor, manual=True)
        else:
            self.engine.pre_backward(model, tensor, manual=False)
            self.precision.backward(tensor, module, *args, **kwargs)
            self.engine.post_backward(model, manual=False)
        self.precision.post_backward(tensor, module)

    @override
    @guarded
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        if self.engine.owns_step:
            self.engine.step(self._running(), optimizer)
            return None
        return self.precision.optimizer_step(optimizer, **kwargs)

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
        self._refuse_clip_on_owned_step("max_norm")
        if float(norm_type) != 2.0:
            raise ValueError(
                f"ShardFabricStrategy clips by the global 2-norm over every shard (got norm_type={norm_type})."
                " Use fabric.clip_gradients(model, optimizer, max_norm=..., norm_type=2.0), or clip_val=... by value."
            )
        self.precision.unscale_gradients(optimizer)
        parameters = list(self.precision.main_params(optimizer))
        # One all-reduce of squared norms over every rank and mesh: the norm of the whole model's gradient.
        norm = clip_grad_norm_(parameters, float(max_norm), pipeline_stages=self.layout.pp)
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(
                f"The total norm of the gradients is {norm.item()}: fabric.clip_gradients(error_if_nonfinite=True)"
                " refuses it. Pass error_if_nonfinite=False to step anyway."
            )
        return norm

    @override
    @guarded
    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float | int) -> None:
        self._refuse_clip_on_owned_step("clip_val")
        super().clip_gradients_value(module, optimizer, clip_val)

    def _refuse_clip_on_owned_step(self, argument: str) -> None:
        if self._engine_class.owns_step:
            raise ValueError(
                f"fabric.clip_gradients({argument}=...) cannot reach the gradients under"
                f" ShardFabricStrategy(engine={self.config.engine!r}): DeepSpeed keeps them in its own partitions"
                " and clips inside its step. Use engine='fsdp' to clip from the loop."
            )

    def _running(self) -> nn.Module:
        if self._model is None:
            raise RuntimeError(
                "ShardFabricStrategy: no model is set up yet. Call fabric.setup(model, optimizer)."
            )
        return self._model

    # --- state and checkpoints -------------------------------------------------------------------

    @property
    def _full(self) -> bool:
        return self.config.checkpoint == "full"

    @override
    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        return self.engine.model_state_dict(self._running(), full=self._full)

    @override
    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return self.engine.optimizer_state_dict(self._running(), optimizer, full=self._full)

    @override
    @guarded
    def save_checkpoint(
        self, path: Any, state: dict[str, Any], storage_options: Any | None = None, filter: Any | None = None
    ) -> None:
        if storage_options is not None or filter is not None:
            given = "storage_options" if storage_options is not None else "filter"
            raise TypeError(
                f"fabric.save(..., {given}=...) is not supported by ShardFabricStrategy: every rank writes its own"
                " shards with torch.distributed.checkpoint. Save the whole state, without it."
            )
        model = self._running()
        location = resolve(self.broadcast(str(path)), "fabric.save(path)")
        _, optimizers, others = _checkpoint.split_state(state, model)
        self._mark_pipeline(others)
        engine = self.engine
        checkpoint = _checkpoint.to_checkpoint(
            engine.model_state_dict(model, full=self._full),
            [engine.optimizer_state_dict(model, optimizer, full=self._full) for _, optimizer in optimizers],
            others,
        )
        engine.save_checkpoint(model, [optimizer for _, optimizer in optimizers], checkpoint, location)

    @override
    @guarded
    def load_checkpoint(
        self, path: Any, state: Any = None, strict: bool = True, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if isinstance(state, nn.Module):
            state = {"model": state}
        if not isinstance(state, dict) or not state:
            raise ValueError(
                f"ShardFabricStrategy loads into the set-up model: got fabric.load(path, state={state!r}). Pass"
                " state={'model': model, 'optimizer': optimizer, ...}."
            )
        model = self._running()
        location = follow_alias(resolve(self.broadcast(str(path)), "fabric.load(path)"))
        self._session.refuse_unsharded_checkpoint(location, "ShardFabricStrategy", "fabric.load(path)")
        _, optimizers, others = _checkpoint.split_state(state, model)
        loaded = self.engine.load_checkpoint(
            model, [optimizer for _, optimizer in optimizers], location, weights_only
        )
        return _checkpoint.restore_entries(state, others, loaded, strict)

    def wait_for_checkpoints(self) -> None:
        """Block until every checkpoint ``fabric.save`` started writing (``async_checkpoint=True``) is committed."""
        if self._engine is not None:
            self._engine.wait_for_checkpoints()

    # --- end of the process ----------------------------------------------------------------------

    @override
    def teardown(self) -> None:
        """Pending checkpoints committed and engine files removed; the process groups stay alive until exit."""
        if self._engine is not None:
            self._engine.teardown()
        super().teardown()

    @override
    def _release_at_exit(self) -> None:
        if self._engine is not None:
            engine, self._engine = self._engine, None
            engine.teardown()  # pending checkpoints committed before the groups go
        super()._release_at_exit()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        register_names(strategy_registry, cls)


class _EngineNoSync(_BackwardSyncControl):
    """``fabric.no_backward_sync``: the engine's own way of skipping gradient communication."""

    def __init__(self, strategy: ShardFabricStrategy) -> None:
        self._strategy = strategy

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        if not enabled:
            return nullcontext()
        return self._strategy.engine.no_sync(module)
