"""``ShardStrategy(engine='deepspeed', expert_parallel_size=...)``: DeepSpeed ZeRO-1/2 with the experts split over
the ranks, side by side with Lightning's ``DDPStrategy`` on the same ranks and data, and its checkpoints.

Each rank holds ``E/ep`` experts as plain ``[E/ep, ...]`` blocks that DeepSpeed reduces over the ranks holding
the same block only (its MoE parameter groups); the tokens reach them by all-to-all. Clipping is on and the
router's auxiliary loss is in the loss (``MoELM``), SGD with lr 0.5: a wrong expert-gradient scale, an expert
block averaged with another rank's, or an expert counted twice in the clip norm moves the weights far off (the
losses of 3 steps hardly: each rank's weights are compared, its expert blocks with the whole experts' rows).
"""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import pytest
import torch

from lightning_shard import ShardStrategy
from lightning_shard.demos.ranks import run_ranks
from lightning_shard.expert_parallel import expert_shards
from tests.helpers import LossRecorder, loader, trainer_kwargs
from tests.test_expert_parallel_multirank import CLIP, DEMO, EXPERTS, STEPS, MoELM, SaveAt, fit_moe

pytestmark = [pytest.mark.multirank, pytest.mark.deepspeed]


def _held(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """The expert weights each rank holds (a plain block under DeepSpeed, whole under DDP)."""
    return {name: tuple(p.shape) for name, p in module.named_parameters() if ".experts." in name}


def _weights(module: torch.nn.Module) -> dict[str, tuple[torch.Tensor, int]]:
    """The weights this rank holds, experts as their blocks: ``(name, first expert)`` -> tensor."""
    first = {
        f"{name}.{p}": m.expert_shard.first
        for name, m in module.named_modules()
        if getattr(m, "expert_shard", None) is not None
        for p, _ in m.named_parameters(recurse=False)
    }
    return {k: (v.detach().float().clone(), first.get(k, 0)) for k, v in module.state_dict().items()}


def _adamw_state(trainer: L.Trainer) -> dict[str, torch.Tensor]:
    """This rank's AdamW moments: ZeRO-1/2 step one flat fp32 partition per param group (the expert blocks'
    groups among them), each with its ``exp_avg`` and ``exp_avg_sq``."""
    zero = trainer.strategy.optimizers[0]
    return {
        f"group {i}: {key}": zero.optimizer.state[flat][key].detach().clone()
        for i, flat in enumerate(zero.single_partition_of_fp32_groups)
        for key in ("exp_avg", "exp_avg_sq")
    }


def _fit(
    strategy: Any, world: int, family: str, optimizer: str, accumulate: int, **kwargs: Any
) -> dict[str, Any]:
    trainer, module, losses = fit_moe(strategy, world, family, optimizer, accumulate, **kwargs)
    received = {name: s.received.sum(dim=1).tolist() for name, s in expert_shards(module).items()}
    return {
        "losses": losses,
        "weights": _weights(module),
        "held": _held(module),
        "received": received,
        "trainer": trainer,
        "module": module,
    }


def _assert_weights(
    mine: dict[str, tuple[torch.Tensor, int]],
    reference: dict[str, tuple[torch.Tensor, int]],
    atol: float,
    where: str,
) -> None:
    """This rank's weights equal the reference's (whole under DDP: narrowed to this rank's expert blocks)."""
    assert mine.keys() == reference.keys(), where
    for key, (weight, _) in reference.items():
        held, first = mine[key]
        expected = weight.narrow(0, first, held.shape[0]) if held.shape != weight.shape else weight
        torch.testing.assert_close(
            held, expected, rtol=1e-5, atol=atol, msg=lambda m, k=key, w=where: f"{w}: {k}: {m}"
        )


Case = tuple[str, str, int, int]  # (family, optimizer, accumulate, ZeRO stage)
TWO_RANKS: list[Case] = [("mixtral", "sgd", 1, 2), ("qwen3_moe", "adamw", 2, 2)]
# Each expert block held by 2 ranks: reduced over them only, its ZeRO partitions split between them.
FOUR_RANKS: list[Case] = [("mixtral", "sgd", 2, 2), ("qwen3_moe", "sgd", 1, 1)]
RESUMED_TO = STEPS + 2  # the steps of the uninterrupted run, 2 of them after the resumed run loads


def _side_by_side(root: str, cases: list[Case]) -> dict[str, Any]:
    from lightning.pytorch.strategies import DDPStrategy

    world = int(os.environ["WORLD_SIZE"])  # read first: a fit can leave the environment without it
    out: dict[str, Any] = {"cases": []}
    for family, optimizer, accumulate, stage in cases:
        ds = _fit(
            ShardStrategy(engine="deepspeed", stage=stage, expert_parallel_size=2),
            world,
            family,
            optimizer,
            accumulate,
        )
        ddp = _fit(DDPStrategy(), world, family, optimizer, accumulate)
        out["cases"].append({k: v for k, v in ds.items() if k not in ("trainer", "module")})
        out["cases"][-1]["ddp"] = {k: ddp[k] for k in ("losses", "weights", "held")}
    import deepspeed

    # The expert-parallel engine class stood in for DeepSpeed's during ``deepspeed.initialize`` only.
    out["restored"] = deepspeed.DeepSpeedEngine is deepspeed.runtime.engine.DeepSpeedEngine
    if world > 2:
        return out
    out["demo"] = _demo(root, world)
    out.update(_resume(root, world))
    return out


def _resume(root: str, world: int) -> dict[str, Any]:
    """A ZeRO-2 checkpoint written after ``STEPS`` steps of a run that goes on to ``RESUMED_TO``: resumed on the
    same layout for the remaining steps, and refused on another layout."""
    path = f"{root}/ds_ep.ckpt"

    def fit(**kwargs: Any) -> dict[str, Any]:
        strategy = ShardStrategy(engine="deepspeed", stage=2, expert_parallel_size=2)
        # An epoch of STEPS steps: the checkpoint sits at its end, and the resumed run reads the rows the
        # uninterrupted one reads next.
        run = _fit(strategy, world, "mixtral", "adamw", 1, steps=RESUMED_TO, rows=2 * world * STEPS, **kwargs)
        return {"losses": run["losses"], "weights": run["weights"], "adamw": _adamw_state(run["trainer"])}

    save = SaveAt(STEPS, path, snapshot=_weights)
    out = {"uninterrupted": fit(callbacks=(save,)), "saved": save.saved}
    out["resumed"] = fit(ckpt_path=path)
    try:
        other = L.Trainer(
            devices=world,
            strategy=ShardStrategy(engine="deepspeed", stage=2),
            **trainer_kwargs(max_steps=STEPS),
        )
        other.fit(MoELM("mixtral", "adamw"), loader(2), ckpt_path=path)
        out["refusal"] = None
    except ValueError as err:
        out["refusal"] = str(err)
    return out


def _demo(root: str, world: int) -> dict[str, Any]:
    """The example GPT's MoE variant built on the meta device and read from a weights file (each rank its own
    experts' rows) under DeepSpeed ZeRO-2, against the whole model under DDP: with its own AdamW and cosine
    schedule, and with plain SGD (AdamW divides a gradient's scale out of its step; SGD keeps it in the weights)."""
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_shard.demos.gpt import GPTModule

    path, runs = f"{root}/init.pt", {}
    flags = dict(engine="deepspeed", stage=2, expert_parallel_size=2, init_weights=path)
    for optimizer in ("adamw", "sgd"):
        for name, strategy in {"ds": ShardStrategy(**flags), "ddp": DDPStrategy()}.items():
            recorder = LossRecorder()
            trainer = L.Trainer(
                devices=world,
                strategy=strategy,
                callbacks=[recorder],
                **trainer_kwargs(max_steps=STEPS, gradient_clip_val=CLIP),
            )
            with trainer.init_module(empty_init=name == "ds"):
                module = GPTModule(**DEMO)
            if optimizer == "sgd":
                module.configure_optimizers = lambda m=module: torch.optim.SGD(m.parameters(), lr=0.5)  # type: ignore[method-assign]
            if name == "ddp":
                module.load_state_dict(torch.load(path))
            trainer.fit(module, loader(2))
            runs[f"{optimizer} {name}"] = {"losses": recorder.losses, "weights": _weights(module)}
    return runs


def _check(ranks: list[dict[str, Any]], cases: list[Case]) -> None:
    for rank, result in enumerate(ranks):
        assert result["restored"], rank
        for (family, optimizer, accumulate, stage), run in zip(cases, result["cases"], strict=True):
            where = f"{family}, {optimizer}, accumulate {accumulate}, ZeRO-{stage}, rank {rank}"
            reference = run["ddp"]
            torch.testing.assert_close(run["losses"], reference["losses"], rtol=1e-5, atol=0, msg=where)
            _assert_weights(run["weights"], reference["weights"], 1e-6 if optimizer == "sgd" else 1e-4, where)
            # Each rank holds E/2 experts of each expert weight; DDP holds them all.
            assert run["held"] and {s[0] for s in run["held"].values()} == {EXPERTS // 2}, where
            assert {s[0] for s in reference["held"].values()} == {EXPERTS}, where
            # Tokens crossed ranks: each layer's local experts computed rows sent by both ranks of the group.
            for counts in run["received"].values():
                assert len(counts) == 2 and all(c > 0 for c in counts), (where, counts)


def test_deepspeed_zero2_with_expert_parallelism_matches_ddp_and_resumes(tmp_path):
    from lightning_shard.demos.gpt import GPTModule

    torch.manual_seed(0)
    torch.save(GPTModule(**DEMO).state_dict(), tmp_path / "init.pt")
    ranks = run_ranks(_side_by_side, str(tmp_path), TWO_RANKS)
    _check(ranks, TWO_RANKS)
    for rank, result in enumerate(ranks):
        demo = result["demo"]
        for optimizer, atol in (("adamw", 1e-4), ("sgd", 1e-6)):
            ds, ddp = demo[f"{optimizer} ds"], demo[f"{optimizer} ddp"]
            where = f"demo, {optimizer}, rank {rank}"
            torch.testing.assert_close(ds["losses"], ddp["losses"], rtol=1e-5, atol=0, msg=where)
            _assert_weights(ds["weights"], ddp["weights"], atol, where)
        # The resumed run against the uninterrupted one: the losses after loading, then the weights and AdamW's
        # moments (this rank's partitions, the expert blocks' among them) after the remaining steps.
        uninterrupted, resumed = result["uninterrupted"], result["resumed"]
        assert len(uninterrupted["losses"]) == RESUMED_TO and len(resumed["losses"]) == RESUMED_TO - STEPS
        torch.testing.assert_close(resumed["losses"], uninterrupted["losses"][STEPS:], rtol=1e-5, atol=0)
        _assert_weights(resumed["weights"], uninterrupted["weights"], 1e-6, f"resumed, rank {rank}")
        assert resumed["adamw"].keys() == uninterrupted["adamw"].keys()
        for key, value in uninterrupted["adamw"].items():
            torch.testing.assert_close(
                resumed["adamw"][key], value, rtol=1e-5, atol=1e-9, msg=lambda m, k=key: f"{k}: {m}"
            )
        assert "expert_parallel_size=2" in result["refusal"] and "consolidate" in result["refusal"]
    # Full weights from the checkpoint, without processes: every expert whole, each rank's block in its place.
    one = MoELM.load_from_checkpoint(str(tmp_path / "ds_ep.ckpt"), map_location="cpu")
    whole = one.state_dict()
    assert {tuple(whole[k].shape)[0] for k in whole if ".experts." in k} == {EXPERTS}
    for result in ranks:
        for key, (value, first) in result["saved"].items():
            torch.testing.assert_close(
                whole[key].narrow(0, first, value.shape[0]), value, rtol=0, atol=0, msg=key
            )


def test_deepspeed_zero_1_2_with_expert_parallelism_inside_four_ranks_match_ddp(tmp_path):
    _check(run_ranks(_side_by_side, str(tmp_path), FOUR_RANKS, world_size=4), FOUR_RANKS)
