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
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule
from torch.optim import Optimizer

import lightning_shard.engines.fsdp.whole_matrix as _whole_matrix
import lightning_shard.engines.fsdp.zero as _zero
from lightning_shard import _compat, _ddp, compression, fp8
from lightning_shard import checkpoint as ckpt
from lightning_shard._meta import materialize
from lightning_shard._optim import rebind_schedulers
from lightning_shard.checkpoint.deepspeed_interop import load_into_fsdp
from lightning_shard.checkpoint.storage import Location, Remote
from lightning_shard.compression import hook_and_state
from lightning_shard.engines import _shm
from lightning_shard.engines._ddp import wrap as wrap_ddp
from lightning_shard.engines._redirect import prepare_for_backward
from lightning_shard.engines.base import Engine, ReplicaSync, RunContext, StateBytes, TrainSettings
from lightning_shard.engines.fsdp.capabilities import FSDP
from lightning_shard.engines.fsdp.local_step import step_on_local_shards
from lightning_shard.engines.fsdp.sharding import ForwardRedirection, fully_shard_model
from lightning_shard.expert_parallel import expert_modules
from lightning_shard.memory import model_state_bytes

log = logging.getLogger(__name__)


class FSDPEngine(Engine):
    """Stages 0-3 on torch's own data-parallel building blocks, on any device mesh (gloo or nccl)."""

    capabilities = FSDP  # what it serves: engines/fsdp/capabilities.py

    compression_state: Any = None
    """``gradient_compression='powersgd'``: the hook and torch's ``PowerSGDState`` (in sharded checkpoints)."""

    def __init__(self, config: Any, precision: Any, run: RunContext) -> None:
        super().__init__(config, precision, run)
        # Background checkpoint writes run on a process group of their own, made here on every rank.
        self.async_checkpointer = (
            ckpt.AsyncCheckpointer(run.is_global_zero, ckpt.new_checkpoint_group(config.timeout))
            if config.async_checkpoint
            else None
        )

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
                self._refresh_fp8_scales(module)
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
        experts = self._experts(module)
        if experts is not None:  # each expert block replicated over the ranks left, before the rest
            for unit in experts[0]:
                replicate(unit, mesh=experts[1], mp_policy=self.precision.fsdp_mp_policy())
        replicate(module, mesh=self.mesh, mp_policy=self.precision.fsdp_mp_policy())
        return module

    def setup_optimizers(
        self, model: nn.Module, optimizers: list[Optimizer], schedulers: list[Any], settings: TrainSettings
    ) -> tuple[nn.Module, list[Optimizer]]:
        whole = [_whole_matrix.needs_whole_matrices(opt, self.config.matrix_optimizer) for opt in optimizers]
        closures = [_whole_matrix.takes_closure(opt) for opt in optimizers]
        for optimizer in optimizers:
            _whole_matrix.check_own_distribution(optimizer, self.stage)
        if self.stage == 1:
            experts = self._expert_blocks(model)
            sharded: list[Optimizer] = [
                _zero.shard_optimizer(opt, self.mesh.get_group(), experts) for opt in optimizers
            ]
            rebind_schedulers(schedulers, optimizers, sharded)
            optimizers = sharded
        for optimizer, needs, closure in zip(optimizers, whole, closures, strict=True):
            if self.stage != 1 and needs and _whole_matrix.step_whole_matrices(optimizer) is not None:
                continue  # each split matrix stepped whole on its owner (the closure run first)
            step_on_local_shards(optimizer)  # DTensor parameters: stages 2-3, tensor parallel
            if not closure:
                _whole_matrix.run_closure_first(optimizer)
        if self._precomputes_fp8_scales:
            fp8.precompute_after_steps(model, optimizers)
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
            experts=self._experts(module),
        )

    def _experts(self, module: nn.Module) -> tuple[list[nn.Module], Any] | None:
        """Expert parallelism: the experts modules, and the mesh their blocks are sharded or replicated over."""
        if not self.run.dims.ep_enabled:
            return None
        assert self.run.meshes is not None
        return expert_modules(module), self.run.meshes.expert_data_parallel

    def _expert_blocks(self, model: nn.Module) -> _zero.ExpertBlocks | None:
        """Stage 1 under expert parallelism: the expert blocks, whose optimizer state is partitioned over the
        ranks holding the same block (the mesh ``_replicate`` replicates them over), not the whole group."""
        experts = self._experts(model)
        if experts is None:
            return None
        assert self.run.meshes is not None
        ep = self.run.meshes.expert_parallel
        modules, data = experts
        params = frozenset(p for module in modules for p in module.parameters())
        return _zero.ExpertBlocks(params, ep, data.get_group())

    def _ddp(self, module: nn.Module) -> nn.Module:
        device = self.mesh.device_type
        device_ids = (
            None if device == "cpu" else [torch.device(device, torch.accelerator.current_device_index())]
        )
        options = dict(self.config.ddp_kwargs)
        reduce_dtype = self.precision.reduce_dtype
        compression = self.config.gradient_compression
        named = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(reduce_dtype)  # type: ignore[arg-type]
        if compression is None and named is not None:
            # ShardPrecision(reduce_dtype=...) at stages 0-1 is the same cast-and-all-reduce hook.
            _ddp.check_comm_hook(options, reduce_dtype)
            compression = {"method": named}
        elif compression is not None and reduce_dtype is not None and named != compression["method"]:
            raise ValueError(
                f"ShardStrategy(gradient_compression={compression['method']!r}) and ShardPrecision("
                f"reduce_dtype={reduce_dtype}) both set how gradients are all-reduced at stages 0-1. Keep one."
            )
        if compression is not None:
            hook, state = hook_and_state(compression, self.mesh.get_group(), module)
            options["ddp_comm_hook"], options["ddp_comm_state"] = hook, state
            self.compression_state = (hook, state) if compression["method"] == "powersgd" else None
        return wrap_ddp(module, self.mesh.get_group(), device_ids, options)

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
        """Stage 0 runs on FSDP2's replicate() rather than DDP: with tensor parallelism (DTensor parameters)
        and with pipeline stages (DDP's reducer cannot follow a schedule's backward per microbatch)."""
        dims = self.run.dims
        return dims.tp_enabled or dims.pp_enabled or dims.ep_enabled

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
        if self.config.checkpoint == "full":
            if self.run.is_global_zero:
                ckpt.save_file(checkpoint, path)
            self.run.barrier()
            return
        state = {ckpt.MODEL_KEY: checkpoint.pop("state_dict")}
        for i, opt_state in enumerate(checkpoint.pop("optimizer_states", [])):
            state[ckpt.optimizer_key(i)] = opt_state
        if self.compression_state is not None:
            hook, powersgd = self.compression_state
            state[compression.STATE_KEY] = compression.state_dict(
                hook, powersgd, self.run.global_rank, self.run.world_size
            )
        if self.async_checkpointer is not None and not self.async_checkpointer.closed:
            self.async_checkpointer.save(state, checkpoint, path, self.run.barrier, alias=not exception)
        else:
            ckpt.save_sharded(path, state, checkpoint, self.run.is_global_zero, self.run.barrier)

    def load_checkpoint(
        self, model: nn.Module, optimizers: list[Optimizer], path: Location, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if self.async_checkpointer is not None:
            self.async_checkpointer.wait()
        if not isinstance(path, Remote) and ckpt.is_deepspeed_checkpoint(path):
            loaded = load_into_fsdp(self, model, optimizers, path, weights_only)
        elif path.is_dir():
            loaded = ckpt.load_sharded_into(self, model, optimizers, path, weights_only)
        else:
            loaded = ckpt.load_full_into(self, model, optimizers, path, weights_only)
        self._refresh_fp8_scales(model)
        return loaded

    def load_full_weights(self, module: nn.Module, path: str) -> None:
        super().load_full_weights(module, path)
        self._refresh_fp8_scales(module)

    @property
    def _precomputes_fp8_scales(self) -> bool:
        settings = self.config.fp8
        return settings is not None and settings.all_gather and settings.precompute_scales and self.stage >= 2

    def _refresh_fp8_scales(self, model: nn.Module) -> None:
        """New weights: the float8 gathers' scales computed after the last step are stale."""
        if self._precomputes_fp8_scales:
            fp8.precompute_scales(model)

    def communication_load_target(self, metadata: Any) -> dict[str, torch.Tensor] | None:
        """Where a sharded checkpoint's PowerSGD state is read to (None: nothing to read)."""
        if self.compression_state is None:
            return None
        return compression.load_target(metadata, self.run.global_rank)

    def load_communication_state(self, saved: dict[str, torch.Tensor]) -> None:
        hook, powersgd = self.compression_state
        compression.load_state_dict(hook, powersgd, saved, self.run.global_rank, self.run.world_size)

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
        return ReplicaSync(within=_shm.allreduce_hook, own_state=_whole_matrix.WholeMatrixState(model))

    def wait_for_checkpoints(self) -> None:
        if self.async_checkpointer is not None:
            self.async_checkpointer.wait()

    def teardown(self) -> None:
        if self.async_checkpointer is not None:
            self.async_checkpointer.close()
        _shm.release()  # this call's process groups are destroyed next; a later call maps new files

    # --- state dicts -----------------------------------------------------------------------------

    def model_state_dict(self, model: nn.Module, full: bool) -> dict[str, Any]:
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=full, cpu_offload=True))
        return state if self.config.fp8 is None else fp8.plain_state_dict(state)

    def load_model_state_dict(self, model: nn.Module, state: dict[str, Any], full: bool) -> None:
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=full, strict=True))

    def optimizer_state_dict(self, model: nn.Module, optimizer: Optimizer, full: bool) -> dict[str, Any]:
        if self.stage == 1:
            return _zero.optimizer_state_dict(model, optimizer, full)
        if _whole_matrix.whole_matrix_step(optimizer) is not None:
            return _whole_matrix.optimizer_state_dict(model, optimizer, full)
        return get_optimizer_state_dict(
            model, optimizer, options=StateDictOptions(full_state_dict=full, cpu_offload=full)
        )

    def optimizer_load_target(
        self, model: nn.Module, optimizer: Optimizer, meta: Any, key: str
    ) -> dict[str, Any]:
        if self.stage == 1:
            return _zero.load_target(model, optimizer, meta, key)
        if _whole_matrix.whole_matrix_step(optimizer) is not None:
            return _whole_matrix.load_target(model, optimizer, meta, key)
        return get_optimizer_state_dict(model, optimizer)

    def load_optimizer_state_dict(
        self, model: nn.Module, optimizer: Optimizer, state: dict[str, Any], full: bool
    ) -> None:
        if self.stage == 1:
            _zero.load_optimizer_state_dict(model, optimizer, state)
            return
        if _whole_matrix.whole_matrix_step(optimizer) is not None:
            _whole_matrix.load_optimizer_state_dict(model, optimizer, state)
            return
        if full and not any(state.get("state", {}).values()):
            # A stateless optimizer (SGD without momentum) saved nothing per parameter; torch's full-state
            # loader cannot place "nothing" on a device, so only the hyperparameters are restored.
            for group, saved in zip(optimizer.param_groups, state.get("param_groups", []), strict=False):
                group.update({k: v for k, v in saved.items() if k != "params"})
            return
        if not full:
            state = _with_live_params(model, optimizer, state)
        set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=full))


def _with_live_params(model: nn.Module, optimizer: Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with each param group listing this optimizer's own parameter names, group by group.

    Each rank saves its param groups; DCP keeps one rank's copy of each entry. Under pipeline stages each
    stage's groups list only its own parameters, so the copy kept lists one stage's: torch would then map
    no other stage's parameters to a group. Hyperparameters are the same on every stage and come from
    the checkpoint by group index, per-parameter state by name; the names come from the live optimizer.
    """
    live: list[Any] = list(get_optimizer_state_dict(model, optimizer)["param_groups"])
    saved = state.get("param_groups", [])
    if len(saved) != len(live):
        raise ValueError(
            f"The checkpoint's optimizer has {len(saved)} param groups but configure_optimizers() made"
            f" {len(live)}. Resume with the same optimizer set-up."
        )
    groups = [{**group, "params": own["params"]} for group, own in zip(saved, live, strict=True)]
    return {**state, "param_groups": groups}
