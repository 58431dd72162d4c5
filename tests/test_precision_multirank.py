"""Precision on 2 gloo ranks: what dtype compute, master weights and optimizer state really have,
loss parity with a one-process run under the same precision, and loss scaling.

Loss parity alone cannot show that compute ran in low precision: on the tiny GPT a bf16-mixed run and
an fp32 run differ by ~2.4e-5 over six steps, below the ranks' own noise. So every run here also
records the dtype of every ``nn.Linear`` output (what the matmuls produced) and of the tensors the
optimizer steps, and the losses are compared with plain SGD, which sees a wrong gradient scale
(AdamW hides it; see ``tests/test_parity_multirank.py``).

Tolerances, from measured maximum relative deviations of the six losses (SGD, lr 0.5; 2 ranks x
batch 4 against one process x batch 8 under the same precision; torch 2.13 CPU, DeepSpeed 0.19):

============================================  ==========  ==========  ==========
                                              bf16-mixed  bf16-true   16-mixed
============================================  ==========  ==========  ==========
2 ranks, every stage, FSDP and DeepSpeed      3.5e-5      3.8e-5      6.1e-6
an fp32 run                                   2.4e-5      2.0e-5      3.9e-6
loss x1.1 in ShardStrategy.backward           1.5e-3      1.5e-3      1.5e-3
loss x2 in ShardStrategy.backward             1.5e-2      1.5e-2      1.5e-2
weights that never change (lr 0)             2.0e-2      2.0e-2      2.0e-2
============================================  ==========  ==========  ==========

bf16 runs use rtol 3e-4: ~9x the worst measured noise, 5x below a 10% gradient scale error and 50x
below a 2x one. fp16 (10 mantissa bits to bf16's 7) is ~6x quieter: rtol 1e-4, 15x below 10%.
(The bf16-mixed case of ``test_strategy_multirank.test_loss_parity_every_stage``, rtol 2e-2, also
passes for weights that never move.)
"""

from __future__ import annotations

import importlib.util
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn

from lightning_shard import ShardPrecision, ShardStrategy
from lightning_shard.demos.ranks import run_ranks
from lightning_shard.memory import local_tensor
from tests.helpers import LossRecorder, full_weights, loader, tiny_gpt, trainer_kwargs
from tests.test_parity_multirank import sgd_gpt

pytestmark = pytest.mark.multirank

STEPS = 6
BF16_RTOL = 3e-4
FP16_RTOL = 1e-4
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
_HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
needs_deepspeed = pytest.mark.skipif(not _HAS_DEEPSPEED, reason="needs DeepSpeed")
DEEPSPEED = [pytest.mark.deepspeed, needs_deepspeed]


# --- what a run really used -------------------------------------------------------------------


def _optimizer_tensors(trainer: L.Trainer) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """This rank's master weights (the tensors the optimizer updates) and its optimizer state."""
    strategy = trainer.strategy
    optimizer = strategy.optimizers[0]
    if getattr(strategy, "engine_name", None) == "deepspeed":
        # Its fp32 copy: this rank's partition at ZeRO 1-2 and 3; all of it in the optimizer of stage 0.
        names = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups")
        groups = next(getattr(optimizer, n) for n in names if getattr(optimizer, n, None))
        masters = [t for group in groups for t in (group if isinstance(group, list) else [group])]
        inner = optimizer.optimizer
    else:
        masters = [local_tensor(p) for group in optimizer.param_groups for p in group["params"]]
        inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer: this rank's partition
    state = [
        v for s in inner.state.values() for v in s.values() if torch.is_tensor(v) and v.is_floating_point()
    ]
    return list(masters), state


class _DtypeProbe(L.Callback):
    """Records the dtypes of every nn.Linear output in forward, the gradients the optimizer steps
    with (FSDP engine; DeepSpeed keeps its own), the master weights and the optimizer state."""

    def __init__(self) -> None:
        self.compute: set[torch.dtype] = set()
        self.grads: set[torch.dtype] = set()
        self.masters: set[torch.dtype] = set()
        self.state: set[torch.dtype] = set()
        self.module_params: set[torch.dtype] = set()
        self._hooks: list[Any] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for module in pl_module.modules():
            if isinstance(module, nn.Linear):
                self._hooks.append(module.register_forward_hook(self._record))

    def _record(self, module: nn.Module, args: Any, output: torch.Tensor) -> None:
        self.compute.add(output.dtype)

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any
    ) -> None:
        for group in optimizer.param_groups:
            self.grads.update(local_tensor(p.grad).dtype for p in group["params"] if p.grad is not None)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        masters, state = _optimizer_tensors(trainer)
        assert masters, "found no master weights"
        self.masters = {t.dtype for t in masters}
        self.state = {t.dtype for t in state}
        self.module_params = {local_tensor(p).dtype for p in pl_module.parameters()}
        for hook in self._hooks:
            hook.remove()

    def result(self) -> dict[str, set[torch.dtype]]:
        return {k: getattr(self, k) for k in ("compute", "grads", "masters", "state", "module_params")}


def _fit(
    strategy: Any,
    devices: int = 2,
    optimizer: str = "sgd",
    steps: int = STEPS,
    probe: L.Callback | None = None,
    **trainer_flags: Any,
) -> dict[str, Any]:
    """Train the tiny GPT on 8 samples per step (split over the ranks); the losses and what it used."""
    recorder, dtypes = LossRecorder(), _DtypeProbe()
    callbacks = [recorder, dtypes] + ([probe] if probe is not None else [])
    trainer = L.Trainer(
        devices=devices,
        strategy=strategy,
        callbacks=callbacks,
        **trainer_kwargs(max_steps=steps),
        **trainer_flags,
    )
    model = sgd_gpt() if optimizer == "sgd" else tiny_gpt()
    trainer.fit(model, loader(8 // devices))
    return {"losses": recorder.losses, "trainer": trainer, **dtypes.result()}


def _reference(**trainer_flags: Any) -> list[float]:
    return _fit("auto", devices=1, **trainer_flags)["losses"]


def _check_losses(losses: list[float], reference: list[float], rtol: float, what: str) -> None:
    assert len(reference) == STEPS
    torch.testing.assert_close(losses, reference, rtol=rtol, atol=0, msg=lambda m: f"{what}: {m}")


# --- mixed precision: low-precision compute, fp32 master weights and optimizer state -----------


class _ReductionDtypes(L.Callback):
    """The dtypes DeepSpeed reduces gradients in: what reaches ``all_reduce`` / ``reduce_scatter_tensor``
    during backward. Call :meth:`install` in a rank before its first Trainer (DeepSpeed keeps a reference
    to ``reduce_scatter_tensor`` from its first ``init_distributed``); the patch ends with the process."""

    active = False
    seen: set[torch.dtype] = set()

    @classmethod
    def install(cls) -> None:
        for name in ("all_reduce", "reduce_scatter_tensor"):
            original = getattr(dist, name)

            def wrapper(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
                if cls.active:
                    cls.seen.update(t.dtype for t in (*args, *kwargs.values()) if torch.is_tensor(t))
                return _original(*args, **kwargs)

            setattr(dist, name, wrapper)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        type(self).seen = set()

    def on_before_backward(
        self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor
    ) -> None:
        type(self).active = True

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        type(self).active = False


def _precision_flags(precision: str, reduce_dtype: torch.dtype | None = None) -> dict[str, Any]:
    # On CPU Lightning turns precision="16-mixed" into bf16-mixed: fp16 needs the plugin itself.
    if precision == "16-mixed" or reduce_dtype is not None:
        return {"plugins": [ShardPrecision(precision, reduce_dtype=reduce_dtype)]}  # type: ignore[arg-type]
    return {"precision": precision}


def _fit_mixed(engine: str, configs: list[tuple[str, int]]) -> dict[tuple[str, int], dict[str, Any]]:
    if engine == "deepspeed":
        _ReductionDtypes.install()
    out = {}
    for precision, stage in configs:
        reductions = _ReductionDtypes()
        run = _fit(ShardStrategy(stage=stage, engine=engine), probe=reductions, **_precision_flags(precision))
        optimizer = run.pop("trainer").strategy.optimizers[0]
        run["reductions"] = set(reductions.seen)
        if precision == "16-mixed" and engine == "deepspeed":
            run["scaler"] = (
                type(optimizer.loss_scaler).__name__,
                optimizer.dynamic_loss_scale,
                optimizer.cur_scale,
            )
        # AdamW for two steps: optimizer state to look at (SGD without momentum has none).
        adamw = _fit(
            ShardStrategy(stage=stage, engine=engine),
            optimizer="adamw",
            steps=2,
            **_precision_flags(precision),
        )
        run["adamw_state"], run["adamw_masters"] = adamw["state"], adamw["masters"]
        out[precision, stage] = run
    if engine == "deepspeed" and ("bf16-mixed", 2) in configs:  # an explicit reduce_dtype is honoured
        reductions = _ReductionDtypes()
        _fit(
            ShardStrategy(stage=2, engine=engine),
            probe=reductions,
            steps=1,
            **_precision_flags("bf16-mixed", BF16),
        )
        out["bf16 reduce_dtype", 2] = {"reductions": set(reductions.seen)}
    return out


MIXED = [
    pytest.param("fsdp", [(p, s) for p in ("bf16-mixed", "16-mixed") for s in (0, 1, 2, 3)], id="fsdp"),
    pytest.param(
        "deepspeed", [("bf16-mixed", s) for s in (0, 1, 2, 3)], id="deepspeed-bf16", marks=DEEPSPEED
    ),
    pytest.param(
        "deepspeed",
        [("16-mixed", s) for s in (1, 2, 3)],
        id="deepspeed-fp16",
        marks=[*DEEPSPEED, pytest.mark.needs_fp16_cpu],
    ),
]


@pytest.mark.parametrize("engine, configs", MIXED)
def test_mixed_precision_computes_low_keeps_fp32_masters_and_matches_one_process(engine, configs):
    references = {
        "bf16-mixed": _reference(precision="bf16-mixed"),
        "16-mixed": _reference(plugins=[MixedPrecision("16-mixed", "cpu")]),
    }
    low = {"bf16-mixed": BF16, "16-mixed": FP16}
    results = run_ranks(_fit_mixed, engine, configs)
    for rank, by_config in enumerate(results):
        explicit = by_config.pop(("bf16 reduce_dtype", 2), None)
        if engine == "deepspeed" and ("bf16-mixed", 2) in configs:
            assert explicit == {"reductions": {BF16}}, f"rank {rank}: reduce_dtype=bf16 gave {explicit}"
        for (precision, stage), run in by_config.items():
            where = f"{engine} {precision} stage {stage} rank {rank}"
            assert run["compute"] == {low[precision]}, f"{where}: nn.Linear outputs were {run['compute']}"
            assert run["masters"] == run["adamw_masters"] == {FP32}, (
                f"{where}: master weights {run['masters']}"
            )
            assert run["adamw_state"] == {FP32}, f"{where}: optimizer state {run['adamw_state']}"
            if engine == "fsdp":
                assert run["grads"] == {FP32}, f"{where}: gradients {run['grads']}"
            else:  # DeepSpeed computes with a low-precision copy and reduces gradients in fp32
                assert run["module_params"] == {low[precision]}, (
                    f"{where}: module parameters {run['module_params']}"
                )
                assert run["reductions"] == {FP32}, f"{where}: gradients reduced in {run['reductions']}"
            if precision == "16-mixed" and engine == "deepspeed":
                # dynamic, 2**16 to start, and no overflow on this model: the scale never moved
                assert run["scaler"] == ("DynamicLossScaler", True, 2.0**16), f"{where}: {run['scaler']}"
            rtol = BF16_RTOL if precision == "bf16-mixed" else FP16_RTOL
            _check_losses(run["losses"], references[precision], rtol, where)


# --- bf16-true: bf16 parameters, no master copy ------------------------------------------------


class _Weights(L.Callback):
    """The full weights when training starts and when it ends."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start = full_weights(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.end = full_weights(trainer)


def _fit_bf16_true(stages: tuple[int, ...]) -> dict[int, dict[str, Any]]:
    out = {}
    for stage in stages:
        weights = _Weights()
        run = _fit(ShardStrategy(stage=stage), precision="bf16-true", probe=weights)
        run.pop("trainer")
        run["moved"] = max((weights.end[k] - weights.start[k]).abs().max().item() for k in weights.start)
        out[stage] = run
    return out


def test_bf16_true_has_bf16_parameters_trains_and_matches_one_process():
    reference = _reference(precision="bf16-true")
    results = run_ranks(_fit_bf16_true, (0, 3))
    for rank, by_stage in enumerate(results):
        for stage, run in by_stage.items():
            where = f"bf16-true stage {stage} rank {rank}"
            assert run["compute"] == run["module_params"] == run["masters"] == run["grads"] == {BF16}, (
                f"{where}: {run}"
            )
            # lr 0.5 x gradients move some weight by ~0.08 in six steps; bf16 rounding of the update
            # must not swallow it (one bf16 ulp at 0.02 is ~1e-4).
            assert run["moved"] > 0.01, f"{where}: the weights moved at most {run['moved']}"
            _check_losses(run["losses"], reference, BF16_RTOL, where)


# --- 16-mixed: the FSDP engine's sharded loss scaler -------------------------------------------


class _OverflowOnRank1(L.Callback):
    """Makes rank 1's loss infinite at step 1, and snapshots the full weights around it."""

    def __init__(self) -> None:
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {}
        self.scales: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.snapshots[batch_idx] = full_weights(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.scales.append(trainer.strategy.precision_plugin.scaler.get_scale())


def _inf_loss_on_rank1_at_step_1(module: L.LightningModule) -> L.LightningModule:
    original = module.training_step

    def training_step(batch, batch_idx):
        loss = original(batch, batch_idx)
        if batch_idx == 1 and dist.get_rank() == 1:
            loss = loss * float("inf")
        return loss

    module.training_step = training_step  # type: ignore[method-assign]
    return module


def _fit_fp16(stages: tuple[int, ...]) -> dict[int, tuple[Any, list[float]]]:
    out = {}
    for stage in stages:
        callback = _OverflowOnRank1()
        trainer = L.Trainer(
            devices=2,
            strategy=ShardStrategy(stage=stage),
            plugins=[ShardPrecision("16-mixed")],
            callbacks=[callback],
            **trainer_kwargs(max_steps=4),
        )
        trainer.fit(_inf_loss_on_rank1_at_step_1(tiny_gpt()), loader(4))
        out[stage] = (callback.snapshots, callback.scales)
    return out


@pytest.fixture(scope="module")
def fp16_overflow_runs() -> list[dict[int, tuple[Any, list[float]]]]:
    """Both stages' overflow runs, one after the other on the same 2 ranks."""
    return run_ranks(_fit_fp16, (1, 3))


@pytest.mark.parametrize("stage", [1, 3])
def test_fp16_overflow_on_one_rank_skips_the_step_everywhere(fp16_overflow_runs, stage):
    results = [by_stage[stage] for by_stage in fp16_overflow_runs]
    for snapshots, scales in results:
        for name, before in snapshots[1].items():
            torch.testing.assert_close(
                snapshots[2][name], before, rtol=0, atol=0, msg=f"{name} changed in the skipped step"
            )
        assert any((snapshots[3][n] != snapshots[2][n]).any() for n in snapshots[2]), "training did not go on"
        assert scales[1] == scales[0] / 2  # the scaler backed off once, on every rank
    assert results[0][1] == results[1][1]


# --- 16-mixed on DeepSpeed: its loss scaler agrees across ranks; no fp16 without ZeRO ------------


class _DeepSpeedOverflowProbe(L.Callback):
    """This rank's fp32 master partition before each step; the loss scale and skipped steps after it."""

    def __init__(self) -> None:
        self.masters: dict[int, list[torch.Tensor]] = {}
        self.scales: list[tuple[float, int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.masters[batch_idx] = [t.detach().clone() for t in _optimizer_tensors(trainer)[0]]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        engine = trainer.strategy.model
        self.scales.append((trainer.strategy.optimizers[0].cur_scale, engine.skipped_steps))


def _fit_deepspeed_fp16() -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for stage in (2, 3):
        probe = _DeepSpeedOverflowProbe()
        trainer = L.Trainer(
            devices=2,
            strategy=ShardStrategy(stage=stage, engine="deepspeed"),
            plugins=[ShardPrecision("16-mixed")],
            callbacks=[probe],
            **trainer_kwargs(max_steps=4),
        )
        trainer.fit(_inf_loss_on_rank1_at_step_1(sgd_gpt()), loader(4))
        out[stage] = (probe.masters, probe.scales)
    try:
        _fit(ShardStrategy(stage=0, engine="deepspeed"), steps=1, **_precision_flags("16-mixed"))
    except ValueError as err:
        out["stage 0"] = str(err)
    return out


@pytest.mark.deepspeed
@pytest.mark.needs_fp16_cpu
@needs_deepspeed
def test_deepspeed_fp16_overflow_on_one_rank_skips_everywhere_and_stage_0_is_refused():
    results = run_ranks(_fit_deepspeed_fp16)
    for rank, result in enumerate(results):
        for stage in (2, 3):
            masters, scales = result[stage]
            where = f"stage {stage} rank {rank}"
            for before, after in zip(masters[1], masters[2], strict=True):
                torch.testing.assert_close(
                    after, before, rtol=0, atol=0, msg=f"{where} stepped on an overflow"
                )
            assert any((a != b).any() for a, b in zip(masters[2], masters[3], strict=True)), (
                f"{where}: training did not go on"
            )
            # DeepSpeed's scaler has hysteresis 2: one overflow skips the step and keeps the scale.
            assert scales == [(2.0**16, n) for n in (0, 1, 1, 1)], f"{where}: (scale, skipped) {scales}"
        # Refused at set-up, naming precision, engine and the fix (DeepSpeed's fp16 optimizer without
        # ZeRO unscales gradients it never scaled: measured, the weights never moved).
        assert "stage=0, engine='deepspeed') cannot run precision='16-mixed'" in result["stage 0"]
        assert "Use stage=1 or higher" in result["stage 0"]


# --- DeepSpeed parameter offload ---------------------------------------------------------------

OFFLOAD = {
    "none": {},
    "params": {"offload_params": "cpu"},
    "params+optimizer": {"offload_params": "cpu", "offload_optimizer": "cpu"},
}


def _fit_deepspeed_offload() -> dict[str, dict[str, Any]]:
    out = {}
    for name, flags in OFFLOAD.items():
        run = _fit(ShardStrategy(stage=3, engine="deepspeed", **flags))
        trainer = run.pop("trainer")
        optimizer = trainer.strategy.optimizers[0]
        run["offload"] = (optimizer.offload_param, optimizer.offload_optimizer)
        run["bytes"] = trainer.strategy.state_bytes()
        out[name] = run
    return out


@pytest.mark.deepspeed
@needs_deepspeed
def test_deepspeed_param_offload_matches_no_offload_and_one_process():
    """On a CPU-only machine "offload to cpu" moves nothing (everything already lives on the host):
    what can be checked is that DeepSpeed's ZeRO-3 optimizer took the offload path, that parameters
    and master weights stay partitioned, and that the losses do not change (SGD: a wrong gradient
    scale would show; a 2x gradient moves them by 1.5e-2, measured deviation ~1e-7)."""
    reference = _reference()
    numel = sum(p.numel() for p in sgd_gpt().parameters())
    expected_offload = {"none": (False, False), "params": (True, False), "params+optimizer": (True, True)}
    for rank, by_flags in enumerate(run_ranks(_fit_deepspeed_offload)):
        for name, run in by_flags.items():
            where = f"offload {name} rank {rank}"
            assert run["offload"] == expected_offload[name], f"{where}: (offload_param, offload_optimizer)"
            for kind in ("parameters", "optimizer"):  # fp32 parameter shard; fp32 master partition
                held = run["bytes"][kind]
                assert held["accelerator"] == held["nvme"] == 0, f"{where}: {kind} {held}"
                assert held["host"] == pytest.approx(4 * numel / 2, rel=0.05), f"{where}: {kind} {held}"
            _check_losses(run["losses"], reference, 1e-5, where)
            _check_losses(run["losses"], by_flags["none"]["losses"], 1e-6, f"{where} vs no offload")
