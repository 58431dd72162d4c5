"""Elementwise optimizers stepped on FSDP2's local shards: bit-equal to the DTensor step, state kept as
DTensors, and the DTensor step wherever the shards would not be exact (2 gloo ranks, uneven shards)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from lightning_shard.demos.ranks import run_ranks

OPTIMIZERS: dict[str, Any] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1, amsgrad=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05),  # state made at construction
}


def _model() -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    # Odd widths: dim 0 of every parameter splits unevenly over 2 ranks (FSDP2 pads the last shard).
    model = torch.nn.Sequential(
        torch.nn.Linear(7, 5), torch.nn.LayerNorm(5), torch.nn.GELU(), torch.nn.Linear(5, 3)
    )
    fully_shard(model[0])
    fully_shard(model)
    return model


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int = 4) -> list[float]:
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(6, 7, generator=g)

        def closure(x: torch.Tensor = x) -> torch.Tensor:
            optimizer.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            return loss

        losses.append(float(optimizer.step(closure)))
    return losses


def _job() -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torch.distributed.tensor import DTensor

    from lightning_shard.engines.fsdp.local_step import _on_shards, step_on_local_shards

    dist.init_process_group("gloo")
    out: dict[str, Any] = {}
    for name, make in OPTIMIZERS.items():
        runs = {}
        for local in (False, True):
            model = _model()
            optimizer = make(model.parameters())
            if local:
                assert step_on_local_shards(optimizer)
            losses = _train(model, optimizer)
            state = get_optimizer_state_dict(model, optimizer)["state"]
            runs[local] = {
                "losses": losses,
                "params": [p.full_tensor() for p in model.parameters()],
                "state": {
                    k: {n: v.full_tensor() for n, v in s.items() if isinstance(v, DTensor)}
                    for k, s in state.items()
                },
                "placements": sorted(
                    {str(v.placements) for s in optimizer.state.values() for v in s.values() if v.dim() > 0}
                ),
                "all_dtensor": all(
                    isinstance(v, DTensor)
                    for s in optimizer.state.values()
                    for v in s.values()
                    if v.dim() > 0
                ),
            }
        out[name] = runs

    # Not elementwise as far as we know (a subclass may change step): left alone.
    class Custom(torch.optim.AdamW):
        pass

    out["subclass"] = step_on_local_shards(Custom(_model().parameters()))

    # Step hooks see what the optimizer holds: with one registered, the step stays on DTensors.
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step_on_local_shards(optimizer)
    seen: list[str] = []
    optimizer.register_step_pre_hook(
        lambda opt, *_: seen.append(type(opt.param_groups[0]["params"][0]).__name__)
    )
    _train(model, optimizer, steps=1)
    out["hooked"] = seen

    # An error inside the step leaves the groups and state as they were (DTensors, keyed by parameter).
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    step_on_local_shards(optimizer)
    _train(model, optimizer, steps=1)
    params = list(optimizer.param_groups[0]["params"])
    with pytest.raises(RuntimeError, match="inside"), _on_shards(optimizer):
        raise RuntimeError("inside")
    out["restored"] = params == optimizer.param_groups[0]["params"] and all(
        isinstance(optimizer.state[p]["exp_avg"], DTensor) for p in params
    )

    # An LR scheduler built after the set-up wraps the step as usual, without torch's warning.
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step_on_local_shards(optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train(model, optimizer, steps=1)
        scheduler.step()
    out["lr"] = optimizer.param_groups[0]["lr"]
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(_job)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_step_on_local_shards_is_bit_equal_to_the_dtensor_step(ranks, name):
    for out in ranks:
        dtensor, local = out[name][False], out[name][True]
        assert dtensor["losses"] == local["losses"]
        assert len(dtensor["losses"]) == 4 and dtensor["losses"][-1] < dtensor["losses"][0]
        for a, b in zip(dtensor["params"], local["params"], strict=True):
            assert torch.equal(a, b)
        assert dtensor["state"].keys() == local["state"].keys() and dtensor["state"]
        for key, entries in dtensor["state"].items():
            assert entries.keys() == local["state"][key].keys() and entries
            for n, v in entries.items():
                assert torch.equal(v, local["state"][key][n]), (key, n)
        # State stays in the parameters' placement between steps, as torch's DTensor step leaves it.
        assert local["all_dtensor"] and local["placements"] == dtensor["placements"] == ["(Shard(dim=0),)"]


def test_other_optimizers_and_hooked_steps_stay_on_dtensors(ranks):
    for out in ranks:
        assert out["subclass"] is False
        assert out["hooked"] == ["DTensor"]
        assert out["restored"] is True
        assert out["lr"] == pytest.approx(0.05)
