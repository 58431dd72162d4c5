"""Context parallelism on 2 and 4 CPU ranks against one process: the demo GPT (a tuple batch, targets
aligned) and a tiny Hugging Face Llama with its defaults (a dict batch, labels shifted by the model), each
method that runs on CPU, plain SGD (gradient-scale sensitive) and AdamW, accumulation 2, clipping on.

One 2-rank job (CP2 at stages 0-3, a checkpoint written at cp=2 and resumed at cp=1 x dp=2, validation) and
one 4-rank job (CP2 x DP2, and the cp=2 checkpoint resumed there).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_shard import ShardStrategy
from lightning_shard.demos.ranks import run_ranks
from tests.helpers import (
    SEQ,
    LossRecorder,
    loader,
    tiny_gpt,
    tiny_llama_config,
    token_dataset,
    trainer_kwargs,
)
from tests.helpers import _world as world_of
from tests.test_parity_multirank import CLIP, reference, sgd_gpt

pytestmark = pytest.mark.multirank

_transformers = pytest.importorskip("transformers")


class TokenDicts(Dataset):
    """The test tokens as Hugging Face batches: ``labels`` equal to ``input_ids`` (the model shifts them)."""

    def __init__(self, n: int = 64) -> None:
        self.x = token_dataset(n).tensors[0]

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def dict_loader(batch_size: int, data_parallel: int = 1, rank: int = 0) -> DataLoader:
    dataset = TokenDicts()
    if data_parallel == 1:
        return DataLoader(dataset, batch_size=batch_size, shuffle=False)
    sampler = DistributedSampler(dataset, num_replicas=data_parallel, rank=rank, shuffle=False)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)


class Llama(L.LightningModule):
    """A tiny Hugging Face Llama trained on its own loss (``model(**batch).loss``)."""

    def __init__(self, optimizer: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = _transformers.LlamaForCausalLM(tiny_llama_config())
        self.optimizer_name = optimizer

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.5)
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class ValidatedGPT(L.LightningModule):
    """The tiny GPT with a validation loss, logged as the mean over ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = tiny_gpt()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("val_loss", loss, sync_dist=True)


def _world() -> int:
    return (world_of() or (0, 1))[1]


def _rank() -> int:
    return (world_of() or (0, 1))[0]


def _fit(
    model: L.LightningModule, data: DataLoader, strategy: Any, max_steps: int = 3, **extra: Any
) -> list[float]:
    recorder = LossRecorder()
    ckpt_path = extra.pop("ckpt_path", None)
    trainer = L.Trainer(
        devices=_world() if strategy != "auto" else 1,
        strategy=strategy,
        callbacks=[recorder, *extra.pop("callbacks", [])],
        **trainer_kwargs(
            max_steps=max_steps,
            accumulate_grad_batches=2,
            gradient_clip_val=CLIP,
            gradient_clip_algorithm="norm",
            **extra,
        ),
    )
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return recorder.losses


def _gpt_data(cp: int, n: int = 64, tp: int = 1) -> DataLoader:
    group = cp * tp  # the ranks of a cp x tp group read the same rows
    return loader(8 * group // _world(), n, tensor_parallel_size=group)


def _llama_data(cp: int, tp: int = 1) -> DataLoader:
    dp = _world() // (cp * tp)
    return dict_loader(8 // dp, dp, _rank() // (cp * tp))


class Seen(L.Callback):
    """What acted on rank 0's model: the tokens its first embedding read per step (the cut sequence), and the
    mesh dimensions its 2-D weights are split over (tensor parallelism's ``tp`` among them)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.tp_weights = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        embedding = next(m for m in pl_module.modules() if isinstance(m, torch.nn.Embedding))
        embedding.register_forward_pre_hook(lambda _, args: self.tokens.append(args[0].shape[-1]))
        for p in pl_module.parameters():
            mesh = getattr(p, "device_mesh", None)
            if mesh is not None and p.dim() == 2 and "tp" in (mesh.mesh_dim_names or ()):
                self.tp_weights += 1


class Tokens(L.Callback):
    """Rank's largest token counts seen per call by the output head (a tile of the tiled loss) and by an MLP's
    first layer (a tile of the tiled MLP: positions x rows), as that layer is called (before any tensor-parallel
    input style), and the ranks of the tensors each was given (the tiled loss gives the head flat tiles)."""

    def __init__(self, head: str, mlp: str) -> None:
        self.names, self.seen = (head, mlp), {head: 0, mlp: 0}
        self.dims: dict[str, set[int]] = {head: set(), mlp: set()}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for name, module in pl_module.named_modules():
            for key in self.names:
                if name.endswith(key):
                    module.register_forward_pre_hook(functools.partial(self._record, key), prepend=True)

    def _record(self, key: str, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        x = args[0].to_local() if isinstance(args[0], DTensor) else args[0]
        self.seen[key] = max(self.seen[key], x.shape[:-1].numel())
        self.dims[key].add(x.dim())


#: The modules :class:`Tokens` watches, per model.
TILE_MODULES = {"gpt": ("model.head", "blocks.0.mlp.0"), "llama": ("lm_head", "layers.0.mlp.gate_proj")}


def _gpt(optimizer: str) -> L.LightningModule:
    return sgd_gpt() if optimizer == "sgd" else tiny_gpt()


def _validate(strategy: Any) -> float:
    trainer = L.Trainer(devices=_world() if strategy != "auto" else 1, strategy=strategy, **trainer_kwargs())
    cp = getattr(strategy, "config", None)
    data = _gpt_data(cp.context_parallel_size) if cp is not None else loader(8)
    return trainer.validate(ValidatedGPT(), data, verbose=False)[0]["val_loss"]


#: Rows of one epoch in the checkpoint runs: 3 steps of 2 x 8, so the checkpoint at step 3 ends an epoch.
EPOCH = 48
# name -> (model, optimizer, flags)
TWO_RANKS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gpt allgather stage 3 sgd": ("gpt", "sgd", dict(stage=3)),
    "gpt ulysses stage 2 sgd": ("gpt", "sgd", dict(stage=2, context_parallel_method="ulysses")),
    "gpt allgather stage 0 adamw": ("gpt", "adamw", dict(stage=0)),
    "gpt ulysses stage 3 adamw": ("gpt", "adamw", dict(stage=3, context_parallel_method="ulysses")),
    "llama allgather stage 3 sgd": ("llama", "sgd", dict(stage=3)),
    "llama ulysses stage 1 sgd": ("llama", "sgd", dict(stage=1, context_parallel_method="ulysses")),
    "llama allgather stage 2 adamw": ("llama", "adamw", dict(stage=2)),
    # Activation checkpointing: the recompute runs the group's collectives again.
    "gpt allgather stage 3 sgd full checkpointing": (
        "gpt",
        "sgd",
        dict(stage=3, activation_checkpointing="full"),
    ),
    "llama ulysses stage 2 adamw selective checkpointing": (
        "llama",
        "adamw",
        dict(stage=2, context_parallel_method="ulysses", activation_checkpointing="selective"),
    ),
    # With the tiled MLP and loss (lightning_shard/tiling.py) over each rank's 8 tokens.
    "gpt ulysses stage 3 sgd tiled": (
        "gpt",
        "sgd",
        dict(stage=3, context_parallel_method="ulysses", tiled_mlp=2, tiled_loss=16),
    ),
    "llama allgather stage 2 adamw tiled": ("llama", "adamw", dict(stage=2, tiled_mlp=4, tiled_loss=True)),
}


def _run(model: str, optimizer: str, flags: dict[str, Any], cp: int = 2) -> dict[str, Any]:
    """The losses, the token counts each step's embedding read on this rank (its cut of each sequence), the
    tensor-parallel weights, and what the output head and an MLP's first layer were given (their tiles)."""
    strategy = ShardStrategy(context_parallel_size=cp, **flags)
    tp = flags.get("tensor_parallel_size", 1)
    seen, tiles = Seen(), Tokens(*TILE_MODULES[model])
    module = _gpt(optimizer) if model == "gpt" else Llama(optimizer)
    data = _gpt_data(cp, tp=tp) if model == "gpt" else _llama_data(cp, tp)
    losses = _fit(module, data, strategy, callbacks=[seen, tiles])
    return {
        "losses": losses,
        "tokens": sorted(set(seen.tokens)),
        "tp weights": seen.tp_weights,
        "tiles": tiles.seen,
        "head dims": sorted(tiles.dims[TILE_MODULES[model][0]]),
    }


def _check_run(
    ranks: list[dict[str, Any]], name: str, flags: dict[str, Any], tiles: Any = None
) -> list[float]:
    """Every rank's model read only its cut of each sequence (half of it: the ranks of a group read the same
    rows), its weights split where tensor parallelism is on, and its head and MLPs tiled as ``tiles`` says
    (``(head tile, MLP tile, head dims)``); rank 0's losses."""
    for rank, result in enumerate(r[name] for r in ranks):
        assert result["tokens"] == [SEQ // 2], (name, rank, result["tokens"])
        assert (result["tp weights"] > 0) == ("tensor_parallel_size" in flags), (name, rank, result)
        if tiles is not None:
            head, mlp, dims = tiles
            assert list(result["tiles"].values()) == [head, mlp], (name, rank, result["tiles"])
            assert result["head dims"] == dims, (name, rank, result["head dims"])
    return ranks[0][name]["losses"]


def _two_ranks(ckpt_dir: str) -> dict[str, Any]:
    results: dict[str, Any] = {name: _run(*case) for name, case in TWO_RANKS.items()}
    # Written at cp=2 (step 3 of 6: the end of an epoch of 48 rows), read at cp=1 x dp=2.
    every3 = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=3, save_top_k=-1)
    seen = Seen()
    results["saved"] = _fit(
        sgd_gpt(),
        _gpt_data(2, EPOCH),
        ShardStrategy(context_parallel_size=2),
        6,
        callbacks=[every3, seen],
        enable_checkpointing=True,
    )
    results["saved tokens"] = sorted(set(seen.tokens))
    ckpt = os.path.join(ckpt_dir, "epoch=0-step=3.ckpt")
    results["resumed at cp=1 x dp=2"] = _fit(
        sgd_gpt(), _gpt_data(1, EPOCH), ShardStrategy(), 6, ckpt_path=ckpt
    )
    results["validate"] = _validate(ShardStrategy(context_parallel_size=2))
    # compile=: each block compiled with the group's collectives inside (Ulysses' all-to-alls).
    from torch._dynamo.utils import counters

    frames = counters["frames"]["ok"]
    compiled = ShardStrategy(
        stage=3, context_parallel_size=2, context_parallel_method="ulysses", compile=_COMPILE
    )
    seen = Seen()
    results["compiled"] = _fit(sgd_gpt(), _gpt_data(2), compiled, callbacks=[seen])
    results["compiled tokens"] = sorted(set(seen.tokens))
    results["compiled frames"], results["recompiles"] = counters["frames"]["ok"] - frames, compiled.recompiles
    results["mfu"] = _mfu(ShardStrategy(stage=3, context_parallel_size=2), _gpt_data(2))
    # Built on the meta device, sharded, then allocated and initialised: as over the same ranks without CP.
    results["meta cp2"] = _fit_on_meta(ShardStrategy(stage=3, context_parallel_size=2), _gpt_data(2))
    results["meta dp2"] = _fit_on_meta(ShardStrategy(stage=3), _gpt_data(1))
    return results


def _fit_on_meta(strategy: ShardStrategy, data: DataLoader) -> list[float]:
    recorder = LossRecorder()
    trainer = L.Trainer(
        devices=_world(), strategy=strategy, callbacks=[recorder], **trainer_kwargs(max_steps=3)
    )
    with trainer.init_module(empty_init=True):
        model = sgd_gpt()
    assert next(model.parameters()).is_meta
    L.seed_everything(0)
    trainer.fit(model, data)
    return recorder.losses


def _mfu(strategy: Any, data: DataLoader) -> tuple[float, float]:
    """MFUMonitor's count on this rank: the model FLOPs of one batch, and the tokens of one step."""
    from lightning_shard.callbacks import MFUMonitor

    mfu = MFUMonitor(peak_flops=1e12, log_every_n_steps=1)
    trainer = L.Trainer(
        devices=_world() if strategy != "auto" else 1,
        strategy=strategy,
        callbacks=[mfu],
        **trainer_kwargs(max_steps=2, log_every_n_steps=1),
    )
    trainer.fit(sgd_gpt(), data)
    assert mfu.counted is not None
    metrics = mfu.metrics
    return mfu.counted["model_flops"], metrics["perf/tokens_per_sec"] * metrics["perf/step_time_s"]


_COMPILE = {"backend": "aot_eager"}


def _references() -> dict[str, list[float]]:
    return {
        "gpt sgd": reference("sgd", 2, CLIP),
        "gpt adamw": reference("adamw", 2, CLIP),
        "llama sgd": _fit(Llama("sgd"), dict_loader(8), "auto"),
        "llama adamw": _fit(Llama("adamw"), dict_loader(8), "auto"),
        "gpt sgd 6": _fit(sgd_gpt(), loader(8, EPOCH), "auto", 6),
    }


def _close(actual: list[float], expected: list[float], name: str) -> None:
    assert len(actual) == len(expected), name
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=0, msg=lambda m: f"{name}: {m}")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[list[dict[str, Any]], str]:
    ckpt_dir = str(tmp_path_factory.mktemp("cp2"))
    return run_ranks(_two_ranks, ckpt_dir, world_size=2), ckpt_dir


@pytest.fixture(scope="module")
def refs() -> dict[str, list[float]]:
    return _references()


#: What the tiled cases' output head and first MLP layer were given per call on each rank: (the head's tokens,
#: the MLP layer's tokens, the head's input dimensions). Untiled, each rank's 8 rows x 8 tokens (half of each
#: sequence) = 64 tokens, the head given (rows, tokens, width).
TILES = {
    # tiled_loss=16: (16, width) tiles of the 64; tiled_mlp=2: 2 positions x 8 rows
    "gpt ulysses stage 3 sgd tiled": (16, 16, [2]),
    # tiled_loss=True: ceil(64 x width / vocab) < 1024 tokens, so one flat tile of all 64; tiled_mlp=4: 4 x 8
    "llama allgather stage 2 adamw tiled": (64, 32, [2]),
}


def test_cp2_follows_one_process_and_resumes_at_cp1(two_ranks, refs):
    ranks, _ = two_ranks
    results = ranks[0]
    for name, (model, optimizer, flags) in TWO_RANKS.items():
        _close(_check_run(ranks, name, flags, TILES.get(name)), refs[f"{model} {optimizer}"], name)
    for rank in ranks:  # each rank's model read half of each sequence
        assert rank["saved tokens"] == rank["compiled tokens"] == [SEQ // 2], rank
    _close(results["saved"], refs["gpt sgd 6"], "saved at cp=2")
    _close(results["resumed at cp=1 x dp=2"], refs["gpt sgd 6"][6:], "resumed at cp=1 x dp=2")
    torch.testing.assert_close(results["validate"], _validate("auto"), rtol=1e-5, atol=0)
    _close(results["compiled"], refs["gpt sgd"], "ulysses stage 3 compiled")
    # MFUMonitor: each cp rank counts the FLOPs of its half of the sequence (its FLOPs, not the group's),
    # and the batch's tokens once per group (8 rows x 16).
    _close(results["meta cp2"], results["meta dp2"], "built on the meta device")
    flops, tokens = results["mfu"]
    one_flops, one_tokens = _mfu("auto", loader(8))
    assert flops * 2 == one_flops and one_tokens == pytest.approx(8 * SEQ)
    assert tokens == pytest.approx(8 * SEQ, rel=0.1)  # the ranks' step times differ a little
    assert results["compiled frames"] > 0 and results["recompiles"] == 0, results


FOUR_RANKS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gpt allgather cp2 x dp2 stage 3 sgd": ("gpt", "sgd", dict(stage=3)),
    "gpt ulysses cp2 x dp2 stage 0 sgd": ("gpt", "sgd", dict(stage=0, context_parallel_method="ulysses")),
    "gpt allgather cp2 x dp2 stage 2 adamw": ("gpt", "adamw", dict(stage=2)),
    "llama allgather cp2 x dp2 stage 3 sgd": ("llama", "sgd", dict(stage=3)),
    # HSDP: 2 replicas, each sharding over its own cp ranks.
    "gpt allgather cp2 x hsdp2 stage 3 sgd": ("gpt", "sgd", dict(stage=3, replicate_size=2)),
    # CP2 x TP2: tensor parallelism (sequence-parallel norms in the GPT) inside each cp rank's chunks.
    "gpt allgather cp2 x tp2 stage 3 sgd": ("gpt", "sgd", dict(stage=3, tensor_parallel_size=2)),
    "gpt allgather cp2 x tp2 stage 2 adamw": ("gpt", "adamw", dict(stage=2, tensor_parallel_size=2)),
    "llama allgather cp2 x tp2 stage 3 sgd": ("llama", "sgd", dict(stage=3, tensor_parallel_size=2)),
    "llama allgather cp2 x tp2 stage 0 adamw": ("llama", "adamw", dict(stage=0, tensor_parallel_size=2)),
    # The tiled MLP on the sequence-parallel split (the MLP's input a DTensor split along the sequence).
    "gpt allgather cp2 x tp2 stage 3 sgd tiled": (
        "gpt",
        "sgd",
        dict(stage=3, tensor_parallel_size=2, tiled_mlp=2, tiled_loss=16),
    ),
}


#: As :data:`TILES`, 4 ranks: tiled_mlp=2 on the sequence-parallel split of each rank's 8 positions (its 4):
#: 2 positions x 8 rows.
TILES_FOUR = {"gpt allgather cp2 x tp2 stage 3 sgd tiled": (16, 16, [2])}


def _four_ranks(ckpt: str) -> dict[str, Any]:
    results: dict[str, Any] = {name: _run(*case) for name, case in FOUR_RANKS.items()}
    results["resumed at cp=2 x dp=2"] = _fit(
        sgd_gpt(), _gpt_data(2, EPOCH), ShardStrategy(context_parallel_size=2), 6, ckpt_path=ckpt
    )
    return results


def test_cp2_x_dp2_follows_one_process_and_resumes_a_cp2_checkpoint(two_ranks, refs):
    _, ckpt_dir = two_ranks
    ranks = run_ranks(_four_ranks, os.path.join(ckpt_dir, "epoch=0-step=3.ckpt"), world_size=4)
    results = ranks[0]
    for name, (model, optimizer, flags) in FOUR_RANKS.items():
        _close(_check_run(ranks, name, flags, TILES_FOUR.get(name)), refs[f"{model} {optimizer}"], name)
    _close(results["resumed at cp=2 x dp=2"], refs["gpt sgd 6"][6:], "resumed at cp=2 x dp=2")


def _ring_on_cuda() -> list[float]:
    """CUDA only (tests/test_context_parallel.py): the ring method's losses on the demo GPT, 2 GPUs."""
    strategy = ShardStrategy(context_parallel_size=2, context_parallel_method="ring")
    kwargs = dict(accelerator="cuda", max_steps=3, accumulate_grad_batches=2, gradient_clip_val=CLIP)
    recorder = LossRecorder()
    trainer = L.Trainer(devices=2, strategy=strategy, callbacks=[recorder], **trainer_kwargs(**kwargs))
    trainer.fit(sgd_gpt(), _gpt_data(2))
    return recorder.losses
