"""Models larger than one device: meta-device construction at every stage and both engines.

``trainer.init_module(empty_init=True)`` (and ``configure_model`` of a module made under it) leave parameters on the meta device;
set-up shards them, allocates each rank's part and initialises it (``reset_parameters``, then the
LightningModule's ``init_weights``). Checked: nothing is allocated before set-up, the losses match a
normally built model's scale, the same seed gives the same run, sharded parameters are not copies
of one another, and a module nothing can initialise is a clear error.
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

from lightning_shard import ShardStrategy
from lightning_shard.demos.gpt import GPT, GPTModule
from lightning_shard.demos.ranks import run_ranks
from tests.helpers import ENGINES, VOCAB, LossRecorder, full_weights, loader, tiny_gpt, trainer_kwargs

STAGES = (0, 1, 2, 3)


class ConfigureModelGPT(GPTModule):
    """Builds its network in configure_model (idempotent: once per module)."""

    def __init__(self) -> None:
        L.LightningModule.__init__(self)
        self.save_hyperparameters(dict(lr=1e-2, weight_decay=0.1, max_steps=50))
        self.model: Any = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = GPT(VOCAB, 16, 32, 2, 2, 0.0)


def _fit(engine: str, stage: int, build: str, seed: int) -> dict[str, Any]:
    L.seed_everything(seed)
    recorder = LossRecorder()
    trainer = L.Trainer(
        devices=2,
        strategy=ShardStrategy(stage=stage, engine=engine),
        callbacks=[recorder],
        **trainer_kwargs(max_steps=3),
    )
    model: L.LightningModule
    if build == "init_module":
        with trainer.init_module(empty_init=True):
            model = tiny_gpt()
        on_meta = all(p.is_meta for p in model.parameters())
    else:
        # Asked for: a module made under init_module(empty_init=True) builds configure_model's layers empty too.
        with trainer.init_module(empty_init=True):
            model = ConfigureModelGPT()
        on_meta = True
    trainer.fit(model, loader(4))
    gpt = model.model
    out: dict[str, Any] = {
        "on_meta_before_fit": on_meta,
        "losses": recorder.losses,
        "tied": gpt.head.weight is gpt.tok_emb.weight,  # the tied embedding survives allocation
        "parameters": len(list(model.parameters())),
    }
    if engine == "fsdp":
        out["head"] = full_weights(trainer)["model.tok_emb.weight"]
    return out


def _matrix(engine: str) -> dict[tuple[int, str, int], Any]:
    stages = STAGES if engine == "fsdp" else (0, 1, 2)
    runs = {(stage, "init_module", 0): _fit(engine, stage, "init_module", 0) for stage in stages}
    runs[(3, "init_module", 0, "again")] = _fit(engine, 3, "init_module", 0) if engine == "fsdp" else None  # type: ignore[index]
    runs[(3, "init_module", 1)] = _fit(engine, 3, "init_module", 1) if engine == "fsdp" else None
    runs[(3, "configure_model", 0)] = _fit(engine, 3, "configure_model", 0)
    return runs


@pytest.mark.parametrize("engine", ENGINES)
def test_meta_construction_trains_at_every_stage_from_one_seed(engine):
    ranks = run_ranks(_matrix, engine)
    for key, out in ranks[0].items():
        if out is None:
            continue
        assert out["on_meta_before_fit"], key
        losses = out["losses"]
        assert all(math.isfinite(x) for x in losses), (key, losses)
        if engine == "deepspeed" and key[1] == "configure_model":
            # deepspeed.zero.Init: each module initialised by its own constructor (init_weights is not run).
            assert losses[-1] < losses[0], (key, losses)
        else:
            # GPT-2's init (init_weights), not garbage or N(0, 1) embeddings: the loss on random tokens is ln(vocab).
            assert all(abs(x - math.log(VOCAB)) < 0.05 for x in losses), (key, losses)
        assert ranks[1][key]["losses"] == losses  # both ranks report the same averaged loss
        assert out["tied"] and out["parameters"] == len(list(tiny_gpt().parameters())), key
    if engine == "fsdp":
        first, again, other = (
            ranks[0][(3, "init_module", 0)],
            ranks[0][(3, "init_module", 0, "again")],
            ranks[0][(3, "init_module", 1)],
        )
        assert first["losses"] == again["losses"]  # same seed, same world size: the same run
        torch.testing.assert_close(first["head"], again["head"], rtol=0, atol=0)
        assert first["losses"] != other["losses"]
        # The two ranks' shards of the embedding are not copies of each other (per-rank seeds).
        head = first["head"]
        half = head.shape[0] // 2
        assert not torch.allclose(head[:half], head[half : 2 * half])


class Scale(nn.Module):
    """A parameter with no reset_parameters(): nothing can initialise it after meta construction."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


class Uninitialisable(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)
        self.scale = Scale()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.scale(self.layer(batch[0].float()[:, :4])).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class WithHook(Uninitialisable):
    def init_weights(self) -> None:
        nn.init.ones_(self.scale.gain)


def _uninitialisable(hooks: tuple[bool, ...]) -> list[str]:
    """Per case, on the same ranks: a model without (False) and with (True) an ``init_weights`` hook."""
    out = []
    for hook in hooks:
        trainer = L.Trainer(devices=2, strategy=ShardStrategy(stage=3), **trainer_kwargs(max_steps=1))
        with trainer.init_module(empty_init=True):
            model = WithHook() if hook else Uninitialisable()
        try:
            trainer.fit(model, loader(4))
        except ValueError as err:
            out.append(str(err))
        else:
            out.append("trained")
    return out


def test_a_parameter_nothing_can_initialise_is_an_error_naming_it_and_init_weights_fixes_it():
    (message, rank0_with_hook), (_, rank1_with_hook) = run_ranks(_uninitialisable, (False, True))
    assert "scale (Scale: gain)" in message and "init_weights" in message and "reset_parameters" in message
    assert [rank0_with_hook, rank1_with_hook] == ["trained", "trained"]


def _deepspeed_stage3_meta() -> str:
    trainer = L.Trainer(
        devices=2, strategy=ShardStrategy(stage=3, engine="deepspeed"), **trainer_kwargs(max_steps=1)
    )
    with trainer.init_module(empty_init=True):
        model = tiny_gpt()
    try:
        trainer.fit(model, loader(4))
    except ValueError as err:
        return str(err)
    return "trained"


@pytest.mark.deepspeed
def test_deepspeed_stage3_names_the_fsdp_engine_for_a_model_built_on_meta():
    message = run_ranks(_deepspeed_stage3_meta)[0]
    assert "engine='fsdp'" in message and "meta device" in message


def _materialized_shards() -> list[torch.Tensor]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_shard._meta import materialize, parameters_on_meta

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    with parameters_on_meta():
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    assert materialize(model, torch.device("cpu"), dist.get_rank())
    return [p.to_local().detach().clone() for p in model.parameters()]  # type: ignore[attr-defined]


def test_sharded_parameters_are_initialised_per_shard_not_copied():
    # On CPU, DTensor's random ops draw each local shard from the rank's own generator: with one seed
    # every rank's shard would be a copy of the others'.
    rank0, rank1 = run_ranks(_materialized_shards)
    for a, b in zip(rank0, rank1, strict=True):
        if a.numel() and a.shape == b.shape and a.abs().sum() > 0:
            assert not torch.equal(a, b)
    assert run_ranks(_materialized_shards)[0][0].equal(rank0[0])  # same seed, same world size: same weights
