"""Context parallelism under the DeepSpeed engine on 2 CPU ranks against one process: the demo GPT (ZeRO-3
with SGD, ZeRO-2 with AdamW and Ulysses, read through Lightning's own sampler) and the tiny Hugging Face
Llama (ZeRO-1, SGD), 3 steps, accumulation 2, clipping on, rtol 1e-5; a ZeRO-3 checkpoint written at cp=2
resumed at cp=1 x dp=2 and at cp=2.

DeepSpeed's data-parallel group is the world (``deepspeed.initialize`` without an ``mpu``), the cp ranks
among it, so its gradient mean over ``dp x cp`` undoes the strategy's loss weight as FSDP2's does.
DeepSpeed's own sequence parallelism stays off: it divides by ``dp`` only, summing over the sequence ranks.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, DistributedSampler

from lightning_shard import ShardStrategy
from lightning_shard.demos.ranks import run_ranks
from tests.helpers import SEQ, loader, token_dataset

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")
pytestmark = [pytest.mark.multirank, pytest.mark.deepspeed]

from tests.test_context_parallel_multirank import (  # noqa: E402  (needs transformers)
    EPOCH,
    TILE_MODULES,
    Llama,
    Seen,
    Tokens,
    _close,
    _fit,
    _gpt,
    _gpt_data,
    _llama_data,
    dict_loader,
)
from tests.test_parity_multirank import sgd_gpt  # noqa: E402

# name -> (model, optimizer, flags)
CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gpt ulysses zero-2 adamw": ("gpt", "adamw", dict(stage=2, context_parallel_method="ulysses")),
    "llama allgather zero-1 sgd": ("llama", "sgd", dict(stage=1)),
    # The tiled MLP and loss under ZeRO-3: DeepSpeed gathers the MLP's and the head's weights per tile.
    "llama allgather zero-3 sgd tiled": ("llama", "sgd", dict(stage=3, tiled_mlp=2, tiled_loss=16)),
}


def _strategy(cp: int = 2, **flags: Any) -> ShardStrategy:
    return ShardStrategy(engine="deepspeed", context_parallel_size=cp, **flags)


def _two_ranks(ckpt_dir: str) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, (model, optimizer, flags) in CASES.items():
        seen, tiles = Seen(), Tokens(*TILE_MODULES[model])
        if model == "gpt":
            # Lightning's DistributedSampler from the strategy's kwargs: both cp ranks read the same rows.
            data = DataLoader(token_dataset(), batch_size=8)
            extra: dict[str, Any] = dict(use_distributed_sampler=True)
            results[name] = _fit(_gpt(optimizer), data, _strategy(**flags), callbacks=[seen, tiles], **extra)
        else:
            results[name] = _fit(
                Llama(optimizer), _llama_data(2), _strategy(**flags), callbacks=[seen, tiles]
            )
        results[f"{name} tokens"] = sorted(set(seen.tokens))
        results[f"{name} tiles"] = (*tiles.seen.values(), sorted(tiles.dims[TILE_MODULES[model][0]]))
    # ZeRO-3 with SGD, written at step 3 (the end of an epoch of 48 rows) and resumed to step 6.
    every3 = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=3, save_top_k=-1)
    seen = Seen()
    results["gpt allgather zero-3 sgd"] = _fit(
        sgd_gpt(),
        _gpt_data(2, EPOCH),
        _strategy(stage=3),
        callbacks=[every3, seen],
        enable_checkpointing=True,
    )
    results["gpt allgather zero-3 sgd tokens"] = sorted(set(seen.tokens))
    ckpt = os.path.join(ckpt_dir, "epoch=0-step=3.ckpt")
    results["resumed at cp=1 x dp=2"] = _fit(
        sgd_gpt(), _gpt_data(1, EPOCH), _strategy(1, stage=3), 6, ckpt_path=ckpt
    )
    results["resumed at cp=2"] = _fit(sgd_gpt(), _gpt_data(2, EPOCH), _strategy(stage=3), 6, ckpt_path=ckpt)
    return results


def _shuffled() -> DataLoader:
    """What Lightning's sampler gives one data-parallel rank: a training sampler shuffles, seeded as
    Lightning seeds it."""
    dataset = token_dataset()
    seed = int(os.getenv("PL_GLOBAL_SEED", 0))
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=seed)
    return DataLoader(dataset, batch_size=8, sampler=sampler)


#: The tiled case's output head and first MLP layer per call on each rank: (the head's tokens, the MLP layer's
#: tokens, the head's input dimensions). Untiled: each rank's 8 rows x 8 tokens = 64, the head given 3-D input.
#: tiled_loss=16: flat (16, width) tiles; tiled_mlp=2: 2 positions x 8 rows.
TILED = {"llama allgather zero-3 sgd tiled": (16, 16, [2])}


def test_deepspeed_cp2_follows_one_process_and_resumes_at_cp1_and_cp2(tmp_path):
    ranks = run_ranks(_two_ranks, str(tmp_path), world_size=2)
    results = ranks[0]
    sgd6 = _fit(sgd_gpt(), loader(8, EPOCH), "auto", 6)
    refs = {
        "gpt adamw": _fit(_gpt("adamw"), _shuffled(), "auto"),
        "llama sgd": _fit(Llama("sgd"), dict_loader(8), "auto"),
    }
    for rank in ranks:
        for name in [*CASES, "gpt allgather zero-3 sgd"]:  # each rank's model read half of each sequence
            assert rank[f"{name} tokens"] == [SEQ // 2], (name, rank[f"{name} tokens"])
        for name, tiles in TILED.items():  # the tiled MLP and loss acted on every rank
            assert rank[f"{name} tiles"] == tiles, (name, rank[f"{name} tiles"])
    for name, (model, optimizer, _flags) in CASES.items():
        _close(results[name], refs[f"{model} {optimizer}"], name)
    _close(results["gpt allgather zero-3 sgd"], sgd6[:6], "gpt allgather zero-3 sgd")
    _close(results["resumed at cp=1 x dp=2"], sgd6[6:], "resumed at cp=1 x dp=2")
    _close(results["resumed at cp=2"], sgd6[6:], "resumed at cp=2")
