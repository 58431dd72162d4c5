"""The torch-native engine: DDP (stage 0), DDP + ZeroRedundancyOptimizer (stage 1), FSDP2 (stages 2-3).

ZeRO stage to torch building block:

=====  ===========================================  =================================================
stage  what is sharded over N ranks                 torch
=====  ===========================================  =================================================
0      nothing                                      ``DistributedDataParallel``
1      optimizer state                              DDP + ``ZeroRedundancyOptimizer``
2      optimizer state, gradients                   ``fully_shard(reshard_after_forward=False)``
3      optimizer state, gradients, parameters       ``fully_shard(reshard_after_forward=True)``
=====  ===========================================  =================================================

FSDP2 keeps parameters sharded between steps at stage 2 as well; what stage 2 saves over stage 3 is
the second all-gather in backward (parameters stay gathered from forward to backward).
"""

from __future__ import annotations

import logging
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.optim import Optimizer

from lightning_shard import _compat
from lightning_shard._meta import materialize
from lightning_shard._optim import rebind_schedulers
from lightning_shard.checkpoint.storage import Location
from lightning_shard.engines import _shm
from lightning_shard.engines._matrix_optimizers import check_own_distribution, needs_whole_matrices
from lightning_shard.engines._redirect import prepare_for_backward
from lightning_shard.engines.base import Engine, ReplicaSync, RunContext, StateBytes, TrainSettings
from lightning_shard.engines.fsdp import checkpoint as checkpoints
from lightning_shard.engines.fsdp import compression, experts, fp8, whole_matrix, zero
from lightning_shard.engines.fsdp import state as state_dicts
from lightning_shard.engines.fsdp.capabilities import FSDP
from lightning_shard.engines.fsdp.local_step import step_on_local_shards
from lightning_shard.engines.fsdp.sharding import ForwardRedirection, fully_shard_model
from lightning_shard.memory import model_state_bytes

log = logging.getLogger(__name__)


class FSDPEngine(Engine):
    """Stages 0-3 on torch's own data-parallel building blocks, on any device mesh (gloo or nccl)."""

    capabilities = FSDP  # what it serves: engines/fsdp/capabilities.py

    compression_state: compression.CompressionState = None
    """``gradient_compression='powersgd'``: the hook and torch's ``PowerSGDState`` (in sharded checkpoints)."""

    def __init__(self, config: Any, precision: Any, run: RunContext) -> None:
        super().__init__(config, precision, run)
        self.async_checkpointer = checkpoints.async_checkpointer(config, run)

    # With manual optimization the backward runs inside the step, before DDP's forward returns: this
    # redirection keeps DDP from arming its reducer a second time after the step.
    forward_redirection = ForwardRedirection()

    def routes_through_forward(self, model: nn.Module, module: nn.Module) -> bool:
        # DDP wraps the module; FSDP2 shards it in place but hooks the root module's forward.
        return True

    @property
    def mesh(self) -> Any:
        return self.run.mesh

    # --- set-up ----------------------------------------------------------------------------------

    def check_module(self, module: nn.Module) -> None:
        if not any(p.requires_grad for p in module.parameters()):
            raise ValueError(
                f"ShardStrategy(stage={self.stage}) found no trainable parameters in {type(module).__name__}:"
                " there is nothing to shard or synchronise. Check requires_grad, or train without a strategy."
            )

    def setup_module(self, module: nn.Module) -> nn.Module:
        """The data-parallel wrap (FSDP2, FSDP2's ``replicate()``, or DDP) and the allocation from meta; the
        transforms before it (precision, fp8, tensor parallelism, compile) are ``core.transform.prepare``'s."""
        if self.stage >= 2:
            wrapped = self._fully_shard(module)
            self._materialize(module)
            if self.run.dims.tp_enabled:
                # torchao's cast at the gather reduces a weight's maximum over the data-parallel shards, not
                # the tensor-parallel slices: the first step's scales are computed from the whole weight too.
                fp8.refresh_scales(self.config, self.stage, module)
        elif self._replicates:
            self._materialize(module)
            module.to(self.run.device)
            wrapped = self._replicate(module)
        else:
            self._materialize(module)
            module.to(self.run.device)
            wrapped = self._ddp(module)
        return wrapped

    def _materialize(self, module: nn.Module) -> None:
        run = self.run
        materialize(module, run.device, run.global_rank, self.config.init_weights, run.world_mesh)

    def _replicate(self, module: nn.Module) -> nn.Module:
        """Stage 0 with tensor parallelism: every data-parallel rank holds the whole (split) model and
        gradients are all-reduced: DDP, built on FSDP2's parameter handling so that it takes DTensors."""
        # optional: a private torch module a release may lack (only this stage-0 + TP path needs it)
        from torch.distributed._composable.replicate_with_fsdp import replicate

        if isinstance(module, FSDPModule):  # an earlier Trainer call's: point it at this call's groups
            _compat.refresh_fsdp_groups(module)
            return module
        experts.replicate_experts(module, self.run, replicate, self.precision.fsdp_mp_policy())
        replicate(module, mesh=self.mesh, mp_policy=self.precision.fsdp_mp_policy())
        return module

    def setup_optimizers(
        self, model: nn.Module, optimizers: list[Optimizer], schedulers: list[Any], settings: TrainSettings
    ) -> tuple[nn.Module, list[Optimizer]]:
        whole = [needs_whole_matrices(opt, self.config.matrix_optimizer) for opt in optimizers]
        closures = [whole_matrix.takes_closure(opt) for opt in optimizers]
        for optimizer in optimizers:
            check_own_distribution(optimizer, self.stage)
        if self.stage == 1:
            blocks = experts.expert_blocks(model, self.run)
            sharded: list[Optimizer] = [
                zero.shard_optimizer(opt, self.mesh.get_group(), blocks) for opt in optimizers
            ]
            rebind_schedulers(schedulers, optimizers, sharded)
            optimizers = sharded
        for optimizer, needs, closure in zip(optimizers, whole, closures, strict=True):
            if self.stage != 1 and needs and whole_matrix.step_whole_matrices(optimizer) is not None:
                continue  # each split matrix stepped whole on its owner (the closure run first)
            step_on_local_shards(optimizer)  # DTensor parameters: stages 2-3, tensor parallel
            if not closure:
                whole_matrix.run_closure_first(optimizer)
        fp8.precompute_after_steps(self.config, self.stage, model, optimizers)
        compression.attach_optimizers(self.compression_state, optimizers)
        _compat.optimizers_to_device(optimizers, self.run.device)
        return model, optimizers

    def _fully_shard(self, module: nn.Module) -> nn.Module:
        plain = not (self.run.dims.tp_enabled or self.run.dims.pp_enabled)
        return fully_shard_model(
            module,
            self.config,
            self.mesh,
            self.precision.fsdp_mp_policy(),
            self.stage,
            group=self.stage == 2 and plain,
            experts=experts.experts_of(module, self.run),
        )

    def _ddp(self, module: nn.Module) -> nn.Module:
        wrapped, self.compression_state = compression.wrap_ddp(module, self.config, self.precision, self.mesh)
        return wrapped

    # --- training --------------------------------------------------------------------------------

    def pre_backward(self, model: nn.Module, loss: torch.Tensor, manual: bool) -> None:
        """Ready DDP's reducer for a backward that runs inside ``training_step`` (manual optimization).

        DDP arms its reducer when its own forward returns; with manual optimization the backward runs
        before the step (routed through that forward) has returned, so the reducer is armed here, as
        Lightning's DDP strategy does. FSDP2 needs nothing: its hooks sit on the modules themselves.
        """
        if manual and self._gathers_across_step and loss.requires_grad:
            # Inside the root's forward: FSDP2 would not reduce the root's gradients before the step.
            def queue(grad: torch.Tensor) -> torch.Tensor:
                _compat.queue_fsdp_post_backward(model)
                return grad

            loss.register_hook(queue)
        elif manual and self.stage < 2:
            prepare_for_backward(model, loss)  # type: ignore[arg-type]

    @property
    def _gathers_across_step(self) -> bool:
        """FSDP2 wraps the model (stages 2-3, or stage 0 with tensor parallelism through replicate())."""
        return self.stage >= 2 or self._replicates

    @property
    def _replicates(self) -> bool:
        """Stage 0 runs on FSDP2's replicate() rather than DDP wherever the model is split over more than its
        data-parallel ranks: tensor parallelism (DTensor parameters), pipeline stages (DDP's reducer cannot follow
        a schedule's backward per microbatch), expert-parallel blocks (replicated over their own mesh)."""
        return self.run.dims.model_split

    def post_backward(self, model: nn.Module, manual: bool) -> None:
        if manual and self._gathers_across_step and not _compat.fsdp_is_unsharded(model):
            model.unshard()  # type: ignore[operator]  # the rest of training_step runs in the root's forward

    def after_manual_step(self, model: nn.Module) -> None:
        """Gather again what FSDP2 holds gathered across the step: the root's parameters for the whole
        ``training_step`` (it runs inside the root's forward), stage 2's blocks from forward to backward.
        Those copies predate the step; a second forward in the same ``training_step`` (a GAN's generator
        through the just-stepped discriminator) would otherwise run on the old weights."""
        if not self._gathers_across_step:
            return  # DDP's parameters are the optimizer's own tensors

        for sub in model.modules():
            if isinstance(sub, FSDPModule) and _compat.fsdp_is_unsharded(sub):
                sub.reshard()
                sub.unshard()

    @contextmanager
    def no_sync(self, model: nn.Module) -> Generator[None, None, None]:
        if self.stage < 2 and not self._replicates:
            with model.no_sync():  # type: ignore[operator]
                yield
            return
        model.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)  # type: ignore[operator]

    # --- checkpoints -----------------------------------------------------------------------------

    def save_checkpoint(
        self,
        model: nn.Module,
        optimizers: list[Optimizer],
        checkpoint: dict[str, Any],
        path: Location,
        exception: bool = False,
    ) -> None:
        writer, powersgd = self.async_checkpointer, self.compression_state
        checkpoints.save(self.config, self.run, writer, checkpoint, path, powersgd, exception)

    def load_checkpoint(
        self, model: nn.Module, optimizers: list[Optimizer], path: Location, weights_only: bool | None = None
    ) -> dict[str, Any]:
        loaded = checkpoints.load(self, self.async_checkpointer, model, optimizers, path, weights_only)
        fp8.refresh_scales(self.config, self.stage, model)
        return loaded

    def load_full_weights(self, module: nn.Module, path: str) -> None:
        super().load_full_weights(module, path)
        fp8.refresh_scales(self.config, self.stage, module)

    def communication_load_target(self, metadata: Any) -> dict[str, torch.Tensor] | None:
        """Where a sharded checkpoint's PowerSGD state is read to (None: nothing to read)."""
        return compression.load_target(self.compression_state, metadata, self.run)

    def load_communication_state(self, saved: dict[str, torch.Tensor]) -> None:
        compression.load_state(self.compression_state, saved, self.run)

    def remove_checkpoint(self, path: Location) -> None:
        if self.async_checkpointer is not None:
            self.async_checkpointer.remove(path)  # deferred while a save is pending
        else:
            super().remove_checkpoint(path)

    def state_bytes(self, model: nn.Module, optimizers: list[Optimizer]) -> StateBytes:
        counted = model_state_bytes(model, optimizers)
        held = StateBytes()
        place = "host" if self.run.device.type == "cpu" or self.config.offload_params else "accelerator"
        for kind, nbytes in (
            ("parameters", counted.parameters),
            ("gradients", counted.gradients),
            ("optimizer", counted.optimizer),
        ):
            held.held[kind][place] += nbytes
        return held

    def replica_sync(self, model: nn.Module) -> ReplicaSync:
        # DDP's buckets averaged inside the group through shared memory first; whole-matrix state by name.
        return ReplicaSync(within=_shm.allreduce_hook, own_state=whole_matrix.WholeMatrixState(model))

    def wait_for_checkpoints(self) -> None:
        if self.async_checkpointer is not None:
            self.async_checkpointer.wait()

    def teardown(self) -> None:
        if self.async_checkpointer is not None:
            self.async_checkpointer.close()
        _shm.release()  # this call's process groups are destroyed next; a later call maps new files

    # --- state dicts -----------------------------------------------------------------------------

    def model_state_dict(self, model: nn.Module, full: bool) -> dict[str, Any]:
        return state_dicts.model_state_dict(model, self.config, full)

    def load_model_state_dict(self, model: nn.Module, state: dict[str, Any], full: bool) -> None:
        state_dicts.load_model_state_dict(model, state, full)

    def optimizer_state_dict(self, model: nn.Module, optimizer: Optimizer, full: bool) -> dict[str, Any]:
        return state_dicts.optimizer_state_dict(model, optimizer, self.stage, full)

    def optimizer_load_target(
        self, model: nn.Module, optimizer: Optimizer, meta: Any, key: str
    ) -> dict[str, Any]:
        return state_dicts.optimizer_load_target(model, optimizer, self.stage, meta, key)

    def load_optimizer_state_dict(
        self, model: nn.Module, optimizer: Optimizer, state: dict[str, Any], full: bool
    ) -> None:
        state_dicts.load_optimizer_state_dict(model, optimizer, self.stage, state, full)
