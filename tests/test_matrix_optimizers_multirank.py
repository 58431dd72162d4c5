"""Optimizers that need whole matrices (``torch.optim.Muon``) at every stage, side by side with Lightning's
``DDPStrategy`` on the same ranks and data: the same losses and weights, while at stages 2-3 each matrix's state
lives on one rank only and a sharded checkpoint resumes at stage 0 on another world size.

Muon orthogonalises each matrix's momentum by Newton-Schulz iterations: run on FSDP2's row shards, the update is
another matrix's (each shard orthogonalised alone), and the weights move far from DDP's after one step.
"""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_shard import ShardStrategy
from lightning_shard.demos.ranks import run_ranks
from lightning_shard.engines._named_state import flattened
from lightning_shard.engines.fsdp.whole_matrix import optimizer_state_dict, whole_matrix_step
from lightning_shard.memory import model_state_bytes
from tests.helpers import LossRecorder, full_weights, trainer_kwargs

pytestmark = pytest.mark.multirank

STEPS = 4
CLIP = 1.0
WIDTH = 32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


class MatrixMLP(L.LightningModule):
    """2-D weights only (``torch.optim.Muon`` takes nothing else); ``dead`` gets a zero gradient every step."""

    def __init__(self, optimizer: str = "muon") -> None:
        super().__init__()
        self.optimizer_name = optimizer
        torch.manual_seed(0)
        self.inp = nn.Linear(16, WIDTH, bias=False)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.dead = nn.Linear(WIDTH, WIDTH, bias=False)
        self.out = nn.Linear(WIDTH, 8, bias=False)
        if optimizer == "muonadamw":  # heavyball's MuonAdamW: Muon for the matrices, AdamW for this vector
            self.gain = nn.Parameter(torch.ones(WIDTH))
            # float64: in fp32 heavyball rounds each matrix to bf16 stochastically before Newton-Schulz, from the
            # global generator, so no two layouts (a rank stepping some matrices, or all) draw the same noise.
            self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x.to(self.inp.weight.dtype))
        if self.optimizer_name == "muonadamw":
            h = h * self.gain
        for block in self.blocks:
            h = block(h)
        return self.out(h + 0.0 * self.dead(h))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y.to(self.inp.weight.dtype))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name.startswith("aux"):  # the muon package's Muon + Adam, one optimizer
            import muon

            hidden = [p for n, p in self.named_parameters() if n.startswith(("blocks", "dead"))]
            others = [p for n, p in self.named_parameters() if not n.startswith(("blocks", "dead"))]
            groups = [
                dict(params=hidden, use_muon=True, lr=0.05),
                dict(params=others, use_muon=False, lr=0.01),
            ]
            # Lightning's automatic optimization passes a closure its step() does not take: under DDPStrategy the
            # user runs it (the subclass); ShardStrategy runs it for them ("aux").
            return (
                _with_closure() if self.optimizer_name == "aux ddp" else muon.SingleDeviceMuonWithAuxAdam
            )(groups)
        if self.optimizer_name in ("soap", "muonadamw"):
            import heavyball

            heavyball.utils.compile_mode = (
                None  # eager: its torch.compile takes a minute per run on 2 CPU cores
            )
            if self.optimizer_name == "muonadamw":
                return heavyball.MuonAdamW(self.parameters(), lr=0.01)
            return heavyball.SOAP(
                self.parameters(), lr=0.01
            )  # Adam in the eigenbasis of each matrix's factors
        return torch.optim.Muon(self.parameters(), lr=0.05, weight_decay=0.01)


def _with_closure() -> type:
    import muon

    class WithClosure(muon.SingleDeviceMuonWithAuxAdam):  # type: ignore[misc]
        def step(self, closure: Any = None) -> Any:
            with torch.enable_grad():
                loss = closure() if closure is not None else None
            super().step()
            return loss

    return WithClosure


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 8, generator=g))
    world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False)
    return DataLoader(data, batch_size=4, sampler=sampler)


def _same(run: dict[str, Any], reference: dict[str, Any], where: str, atol: float = 1e-6) -> None:
    """The same losses (rtol 1e-5) and final weights as the ``DDPStrategy`` run."""
    torch.testing.assert_close(run["losses"], reference["losses"], rtol=1e-5, atol=0, msg=where)
    for key, weight in reference["weights"].items():
        torch.testing.assert_close(
            run["weights"][key], weight, rtol=1e-5, atol=atol, msg=lambda m, k=key: f"{where}: {k}: {m}"
        )


def _fit(
    strategy: Any, world: int, steps: int = STEPS, ckpt: str | None = None, optimizer: str = "muon"
) -> dict[str, Any]:
    recorder = LossRecorder()
    trainer = L.Trainer(
        devices=world,
        strategy=strategy,
        callbacks=[recorder],
        **trainer_kwargs(max_steps=steps, gradient_clip_val=CLIP),
    )
    module = MatrixMLP(optimizer)
    trainer.fit(module, _loader(), ckpt_path=ckpt)
    optimizer = trainer.optimizers[0]
    whole = whole_matrix_step(optimizer)
    return {
        "losses": recorder.losses,
        "weights": full_weights(trainer),
        "state_bytes": model_state_bytes(trainer.lightning_module, [optimizer]).optimizer,
        "owned": None if whole is None else len(whole.stand_ins),
        "trainer": trainer,
    }


def _side_by_side(root: str) -> dict[str, Any]:
    from lightning.pytorch.strategies import DDPStrategy

    world = int(os.environ["WORLD_SIZE"])  # read first: a fit can leave the environment without it
    out: dict[str, Any] = {}
    for stage in (0, 1, 2, 3):
        run = _fit(ShardStrategy(stage=stage), world)
        if stage == 3:
            trainer = run["trainer"]
            trainer.save_checkpoint(f"{root}/muon3.ckpt")
            full = optimizer_state_dict(trainer.strategy.model, trainer.optimizers[0], full=True)
            out["saved_momentum"] = {name: entry["momentum_buffer"] for name, entry in full["state"].items()}
        out[stage] = {k: v for k, v in run.items() if k != "trainer"}
    out["ddp"] = {k: v for k, v in _fit(DDPStrategy(), world).items() if k != "trainer"}
    for name, strategy in {"soap 3": ShardStrategy(stage=3), "soap ddp": DDPStrategy()}.items():
        run = _fit(strategy, world, optimizer="soap")
        if name == "soap 3":  # SOAP's nested state (per-parameter dicts, lists of factors, sets) round trip
            run["trainer"].save_checkpoint(f"{root}/soap3.ckpt")
            again = _fit(ShardStrategy(stage=3), world, optimizer="soap", ckpt=f"{root}/soap3.ckpt")
            states = [_full_state(r["trainer"]) for r in (run, again)]
            out["soap states"] = [{k: flattened(v) for k, v in st.items()} for st in states]
        out[name] = {k: v for k, v in run.items() if k != "trainer"}
    for name, (strategy, optimizer) in {
        "aux 3": (ShardStrategy(stage=3), "aux"),
        "aux 0": (ShardStrategy(stage=0), "aux"),
        "aux ddp": (DDPStrategy(), "aux ddp"),
        "muonadamw 3": (ShardStrategy(stage=3), "muonadamw"),
        "muonadamw ddp": (DDPStrategy(), "muonadamw"),
    }.items():
        out[name] = {k: v for k, v in _fit(strategy, world, optimizer=optimizer).items() if k != "trainer"}
    return out


def _full_state(trainer: L.Trainer) -> dict[str, Any]:
    return optimizer_state_dict(trainer.strategy.model, trainer.optimizers[0], full=True)["state"]


def _resume(root: str) -> dict[str, Any]:
    """The 2-rank stage-3 checkpoint resumed at stage 0 on one rank (at its step: loaded, no step taken)."""
    run = _fit(ShardStrategy(stage=0), 1, ckpt=f"{root}/muon3.ckpt")
    optimizer, module = run["trainer"].optimizers[0], run["trainer"].lightning_module
    momentum = {name: optimizer.state[p]["momentum_buffer"] for name, p in module.named_parameters()}
    return {"losses": run["losses"], "weights": run["weights"], "momentum": momentum}


def test_muon_at_every_stage_matches_ddp_with_its_state_on_one_rank_per_matrix(tmp_path):
    ranks = run_ranks(_side_by_side, str(tmp_path))
    reference_state = ranks[0]["ddp"]["state_bytes"]
    for rank, result in enumerate(ranks):
        reference = result["ddp"]
        assert len(reference["losses"]) == STEPS
        for stage in (0, 1, 2, 3):
            _same(result[stage], reference, f"stage {stage}, rank {rank}")
        # Stages 2-3: each matrix's momentum lives on its owner only, the owners spread by size.
        for stage in (2, 3):
            assert result[stage]["owned"] and result[stage]["owned"] < 6, (stage, result[stage]["owned"])
            largest = WIDTH * WIDTH * 4
            assert result[stage]["state_bytes"] <= reference_state / 2 + largest, (stage, rank)
    for stage in (2, 3):
        assert sum(r[stage]["state_bytes"] for r in ranks) == reference_state, stage
    # muon's SingleDeviceMuonWithAuxAdam (a step() without closure) at stages 3 and 0.
    for rank, result in enumerate(ranks):
        reference = result["aux ddp"]
        for name in ("aux 3", "aux 0"):
            _same(result[name], reference, f"{name}, rank {rank}")
        assert result["aux 3"]["owned"], rank
    # heavyball's MuonAdamW (Muon for the matrices, AdamW for the vector, routed by shape) at stage 3.
    for rank, result in enumerate(ranks):
        assert result["muonadamw 3"]["owned"], rank
        _same(result["muonadamw 3"], result["muonadamw ddp"], f"MuonAdamW, rank {rank}")
    # heavyball's SOAP (preconditioners from each whole matrix's Kronecker factors) at stage 3.
    for rank, result in enumerate(ranks):
        saved, resumed = result["soap states"]
        assert saved and saved.keys() == resumed.keys(), rank
        torch.testing.assert_close(resumed, saved, rtol=0, atol=0)
        run, reference = result["soap 3"], result["soap ddp"]
        assert run["owned"], rank
        _same(run, reference, f"SOAP, rank {rank}")
    # Stage 3 on 2 ranks -> stage 0 on 1 rank: every matrix's momentum, saved by its owner, is whole on the one.
    (resumed,) = run_ranks(_resume, str(tmp_path), world_size=1)
    assert resumed["losses"] == []  # resumed at the checkpoint's step
    saved = ranks[0]["saved_momentum"]
    assert saved.keys() == resumed["momentum"].keys()
    for name, value in saved.items():
        torch.testing.assert_close(resumed["momentum"][name], value, rtol=0, atol=0, msg=name)
    for key, value in ranks[0][3]["weights"].items():
        torch.testing.assert_close(resumed["weights"][key], value, rtol=0, atol=0, msg=key)


@pytest.mark.parametrize(
    ("engine", "stage"),
    [("fsdp", 1), ("fsdp", 2), ("fsdp", 3), pytest.param("deepspeed", 2, marks=pytest.mark.deepspeed)],
)
def test_an_optimizer_that_distributes_itself_is_refused_past_stage_0_naming_its_single_device_form(
    engine, stage
):
    import muon

    from lightning_shard.engines import TrainSettings
    from tests.helpers import make_engine

    module = MatrixMLP()
    optimizer = muon.MuonWithAuxAdam([dict(params=list(module.parameters()), use_muon=True)])
    with pytest.raises(
        ValueError, match=r"cannot step muon.MuonWithAuxAdam.*Use muon.SingleDeviceMuonWithAuxAdam"
    ):
        make_engine(engine, stage).setup_optimizers(module, [optimizer], [], TrainSettings(1, None, None))


@pytest.mark.deepspeed
def test_deepspeed_refuses_a_whole_matrix_optimizer_with_expert_parallelism_naming_the_fsdp_engine(
    monkeypatch,
):
    from lightning_shard.engines import TrainSettings
    from lightning_shard.engines.deepspeed import experts
    from tests.helpers import make_engine

    monkeypatch.setattr(
        experts, "has_experts", lambda model: True
    )  # as a model with experts split over ranks
    module = MatrixMLP()
    muon = torch.optim.Muon(module.parameters(), lr=0.05)
    with pytest.raises(
        ValueError, match=r"cannot step Muon, whose update needs whole matrices.*engine='fsdp'"
    ):
        make_engine("deepspeed", 2).setup_optimizers(module, [muon], [], TrainSettings(1, None, None))


def _orthogonalized(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Muon's quintic Newton-Schulz iteration (torch.optim.Muon's coefficients), in the gradient's own dtype
    (torch's runs it in bfloat16, where any two reduction orders' last-bit differences can round apart)."""
    a, b, c = 3.4445, -4.775, 2.0315
    x = g / (g.norm() + eps)
    wide = x.size(0) <= x.size(1)
    x = x if wide else x.T
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x if wide else x.T


class MuonWithAdamW(torch.optim.Optimizer):
    """One optimizer, two updates, as users write it: groups with ``use_muon=True`` (the 2-D hidden weights) take
    Muon's (Nesterov momentum, orthogonalised, scaled by the matrix's aspect), the others AdamW's. Named by
    ``matrix_optimizer=``."""

    def __init__(self, groups: list[dict[str, Any]], lr: float = 0.02) -> None:
        super().__init__(groups, dict(lr=lr, use_muon=False, weight_decay=0.01))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, decay = group["lr"], group["weight_decay"]
            for p in (p for p in group["params"] if p.grad is not None):
                state = self.state[p]
                if group["use_muon"]:
                    buf = state.setdefault("momentum_buffer", torch.zeros_like(p))
                    buf.mul_(0.95).add_(p.grad)
                    update = _orthogonalized(p.grad + 0.95 * buf)
                    p.mul_(1 - lr * decay).add_(update, alpha=-lr * max(1.0, p.size(0) / p.size(1)) ** 0.5)
                    continue
                if not state:
                    state.update(
                        step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p)
                    )
                torch.optim._functional.adamw(
                    [p],
                    [p.grad],
                    [state["exp_avg"]],
                    [state["exp_avg_sq"]],
                    [],
                    [state["step"]],
                    amsgrad=False,
                    beta1=0.9,
                    beta2=0.95,
                    lr=lr,
                    weight_decay=decay,
                    eps=1e-8,
                    maximize=False,
                )
        return loss


class MixedLlama(L.LightningModule):
    """A tiny Hugging Face Llama (its defaults on): hidden matrices to Muon, embeddings, norms (and the tied head)
    to AdamW, in one optimizer."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaForCausalLM

        from tests.helpers import tiny_llama_config

        torch.manual_seed(0)
        # float64: Newton-Schulz multiplies the momentum's small singular values by up to ~500, so the last-bit
        # differences of two reduction orders (tensor-parallel matmuls against DDP's) grow past the tolerances
        # in fp32 within a few steps on a tiny model; in float64 they stay far below them.
        self.model = LlamaForCausalLM(tiny_llama_config()).double()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.model(input_ids=x).logits
        return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        hidden = [
            p for n, p in self.named_parameters() if p.ndim == 2 and "embed" not in n and "lm_head" not in n
        ]
        others = [p for n, p in self.named_parameters() if not any(p is q for q in hidden)]
        return MuonWithAdamW([dict(params=hidden, use_muon=True), dict(params=others, lr=0.01)])


def _mixed(flags: dict[str, dict[str, Any]]) -> dict[str, Any]:
    from lightning.pytorch.strategies import DDPStrategy

    from tests.helpers import loader

    world = int(os.environ["WORLD_SIZE"])
    out = {}
    runs = {}
    for name, f in flags.items():
        runs[name] = (ShardStrategy(matrix_optimizer=[MuonWithAdamW], **f), f.get("tensor_parallel_size", 1))
        # Under DDP each rank reads the batch of its tensor-parallel group: the same mean over the same batches.
        runs[f"ddp {name}"] = (DDPStrategy(), f.get("tensor_parallel_size", 1))
    for name, (strategy, tp) in runs.items():
        recorder = LossRecorder()
        trainer = L.Trainer(
            devices=world,
            strategy=strategy,
            callbacks=[recorder],
            **trainer_kwargs(max_steps=STEPS, gradient_clip_val=CLIP),
        )
        trainer.fit(MixedLlama(), loader(2, tensor_parallel_size=tp))
        whole = whole_matrix_step(trainer.optimizers[0])
        out[name] = {
            "losses": recorder.losses,
            "weights": full_weights(trainer),
            "owned": None if whole is None else len(whole.stand_ins),
        }
    return out


def test_a_muon_and_adamw_mix_on_a_llama_with_tensor_parallelism_and_hsdp_matches_ddp():
    flags = {
        "tp2 stage 3": dict(stage=3, tensor_parallel_size=2),
        "hsdp2 stage 3": dict(stage=3, replicate_size=2),
    }
    for rank, result in enumerate(run_ranks(_mixed, flags, world_size=4)):
        for name in flags:
            run, reference, where = result[name], result[f"ddp {name}"], f"{name}, rank {rank}"
            assert run["owned"], where  # its matrices stepped whole on their owners
            _same(run, reference, where, atol=1e-5)
