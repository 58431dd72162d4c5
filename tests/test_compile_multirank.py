"""``compile=...`` on 2 CPU ranks: ZeRO-1, ZeRO-3 (inductor), tensor parallelism and pipeline stages follow
the same run in eager mode, with no recompiles after the first step; so do DeepSpeed's ZeRO-1 and ZeRO-3
(each block compiled inside DeepSpeed's parameter-gathering hooks)."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from torch._dynamo.utils import counters

from lightning_shard import ShardStrategy
from lightning_shard.demos.ranks import run_ranks
from tests.helpers import LossRecorder, tiny_gpt, trainer_kwargs
from tests.test_pipeline_multirank import BATCH, _loader, _model

pytestmark = pytest.mark.multirank

CASES = {
    "zero1": dict(stage=1, compile={"backend": "aot_eager"}),
    "zero3 inductor": dict(stage=3, compile=True),
    "zero3 x tp2, selective": dict(
        stage=3,
        tensor_parallel_size=2,
        compile={"backend": "aot_eager"},
        activation_checkpointing="selective",
    ),
    "pp2": dict(stage=3, pipeline_parallel_size=2, microbatches=2, compile={"backend": "aot_eager"}),
    "deepspeed zero1": dict(stage=1, engine="deepspeed", compile={"backend": "aot_eager"}),
    "deepspeed zero3 inductor": dict(stage=3, engine="deepspeed", compile=True),
}


def _needs_deepspeed(name: str) -> bool:
    return CASES[name].get("engine") == "deepspeed"


# One test per case, so a case this machine cannot run shows as skipped with the conftest's reason (the
# `deepspeed` marker) instead of dropping out of the list; all runnable cases share one 2-rank job.
_PARAMS = [
    pytest.param(name, marks=pytest.mark.deepspeed) if _needs_deepspeed(name) else name for name in CASES
]


def _fit(flags: dict[str, Any]) -> dict[str, Any]:
    torch._dynamo.reset()
    frames = counters["frames"]["ok"]  # frames dynamo compiled: the feature acted
    recorder = LossRecorder()
    trainer = L.Trainer(
        devices=2, strategy=ShardStrategy(**flags), callbacks=[recorder], **trainer_kwargs(max_steps=3)
    )
    pp, tp = flags.get("pipeline_parallel_size", 1), flags.get("tensor_parallel_size", 1)
    model = _model("sgd", 4) if pp > 1 or tp > 1 else tiny_gpt(n_layers=2)
    trainer.fit(model, _loader(2, pp, BATCH * pp * tp // 2, tp))
    compiled = counters["frames"]["ok"] - frames
    return {"losses": recorder.losses, "recompiles": trainer.strategy.recompiles, "frames": compiled}


def _cases(names: list[str]) -> dict[str, Any]:
    out = {}
    for name in names:
        flags = CASES[name]
        eager = {k: v for k, v in flags.items() if k != "compile"}
        out[name] = {"eager": _fit(eager), "compiled": _fit(flags)}
    return out


@pytest.fixture(scope="module")
def ranks(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    """Every selected, unskipped case of this module, in one 2-rank job."""
    names = [
        item.callspec.params["name"]
        for item in request.session.items
        if item.module is request.module and item.get_closest_marker("skip") is None
    ]
    return run_ranks(_cases, names, world_size=2)


@pytest.mark.parametrize("name", _PARAMS)
def test_compiled_blocks_follow_eager_on_two_ranks(ranks: list[dict[str, Any]], name: str):
    for rank in ranks:
        result = rank[name]
        assert result["compiled"]["recompiles"] == 0, name
        assert result["compiled"]["frames"] > 0, name  # the blocks ran compiled, not eager
        assert result["eager"]["frames"] == 0, name
        torch.testing.assert_close(
            result["compiled"]["losses"],
            result["eager"]["losses"],
            rtol=1e-5,
            atol=0,
            msg=lambda m, name=name: f"{name}: {m}",
        )
