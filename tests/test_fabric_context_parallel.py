"""Context parallelism in a Fabric loop on 2 CPU ranks (CP2) against one process without the strategy.

The loop calls ``fabric.strategy.cut_batch(batch)`` and ``fabric.backward(loss)`` and nothing else: the
demo GPT (a tuple batch, targets aligned) and a tiny Hugging Face Llama (a dict batch, labels shifted by the
model, a prompt without targets: the two ranks hold 4 and 8 targets per row, loss weights 2/3 and 4/3),
each CP method that runs on CPU, stages 0 and 3, plain SGD (gradient-scale sensitive) and AdamW, clipping
on, one case with accumulation. Fabric's sampler gives both ranks the same rows. After training,
``end_cut`` and a whole batch: the model's loss is one process's.

Measured when written: at most 2.3e-7 relative from one process. Skipping the weight in ``fabric.backward``
moves both Llama cases by 1.8e-4 to 4.7e-3 from their second step on; skipping the cut in ``cut_batch``
leaves the losses right (each rank then computes the whole sequence) and fails the tokens each rank's
embedding read.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from lightning_shard import ShardFabricStrategy
from lightning_shard.demos.ranks import run_ranks
from tests.helpers import SEQ, tiny_gpt, tiny_llama_config, token_dataset

pytestmark = pytest.mark.multirank

CLIP = 0.6
STEPS = 3
BATCH = 8
# name -> (model, optimizer, accumulate, flags)
CASES: dict[str, tuple[str, str, int, dict[str, Any]]] = {
    "gpt allgather stage 3 sgd": ("gpt", "sgd", 1, dict(stage=3)),
    "gpt ulysses stage 0 adamw": ("gpt", "adamw", 1, dict(stage=0, context_parallel_method="ulysses")),
    "llama allgather stage 3 sgd": ("llama", "sgd", 1, dict(stage=3)),
    "llama ulysses stage 0 adamw, accumulate 2": (
        "llama",
        "adamw",
        2,
        dict(stage=0, context_parallel_method="ulysses"),
    ),
}


class _PromptDicts(torch.utils.data.Dataset):
    """The test tokens as Hugging Face batches whose first quarter is a prompt without targets (labels -100;
    the model shifts them): rank 0 of 2 holds 4 of each row's 12 targets, rank 1 holds 8."""

    def __init__(self) -> None:
        self.x = token_dataset().tensors[0]

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        labels = self.x[i].clone()
        labels[: SEQ // 4] = -100
        return {"input_ids": self.x[i], "labels": labels}


def _model(name: str) -> nn.Module:
    if name == "gpt":
        return tiny_gpt()
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(tiny_llama_config())


def _data(name: str) -> DataLoader:
    return DataLoader(token_dataset() if name == "gpt" else _PromptDicts(), batch_size=BATCH, shuffle=False)


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The mean over the (rank's) targets."""
    if isinstance(batch, dict):
        return model(**batch).loss
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.5)
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _count_tokens(model: nn.Module) -> list[int]:
    """The sequence length each call of the model's first embedding reads (on this rank)."""
    seen: list[int] = []
    embedding = next(m for m in model.modules() if isinstance(m, nn.Embedding))
    embedding.register_forward_pre_hook(lambda _, args: seen.append(args[0].shape[-1]))
    return seen


def _one_process(name: str, optimizer_name: str, accumulate: int) -> dict[str, Any]:
    """The reference: a plain loop in one process, whole sequences, no Fabric."""
    model = _model(name)
    optimizer = _optimizer(optimizer_name, model)
    losses = []
    for i, batch in enumerate(_data(name)):
        if i == STEPS * accumulate:
            break
        loss = _loss(model, batch) / accumulate
        loss.backward()
        losses.append(loss.item())
        if (i + 1) % accumulate == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
            optimizer.zero_grad()
    with torch.no_grad():
        after = _loss(model, next(iter(_data(name)))).item()
    return {"losses": losses, "after": after}


def _fabric_loop(name: str, optimizer_name: str, accumulate: int, flags: dict[str, Any]) -> dict[str, Any]:
    strategy = ShardFabricStrategy(context_parallel_size=2, **flags)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    model = _model(name)
    seen = _count_tokens(model)
    model, optimizer = fabric.setup(model, _optimizer(optimizer_name, model))
    data = fabric.setup_dataloaders(_data(name))  # the sampler's: both cp ranks read the same rows
    losses = []
    for i, batch in enumerate(data):
        if i == STEPS * accumulate:
            break
        boundary = (i + 1) % accumulate == 0
        batch = fabric.strategy.cut_batch(batch)
        with fabric.no_backward_sync(model, enabled=not boundary):
            loss = _loss(model, batch) / accumulate
            fabric.backward(loss)
        # The rank's mean times its weight, averaged over the group: the group's mean.
        losses.append(fabric.all_reduce(loss.detach() * fabric.strategy.loss_weight).item())
        if boundary:
            fabric.clip_gradients(model, optimizer, max_norm=CLIP)
            optimizer.step()
            optimizer.zero_grad()
    trained = list(seen)
    fabric.strategy.end_cut()  # whole sequences from here on, as on one process
    with torch.no_grad():
        after = _loss(model, next(iter(data))).item()
    return {
        "losses": losses,
        "after": after,
        "tokens": sorted(set(trained)),
        "tokens after": seen[len(trained) :],
    }


def _job() -> dict[str, Any]:
    return {
        case: _fabric_loop(model, optimizer, accumulate, flags)
        for case, (model, optimizer, accumulate, flags) in CASES.items()
    }


def _references() -> dict[str, dict[str, Any]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread, as each rank: on a busy machine two wait on each other for seconds
    try:
        return {
            case: _one_process(model, optimizer, accumulate)
            for case, (model, optimizer, accumulate, _) in CASES.items()
        }
    finally:
        torch.set_num_threads(threads)


def test_a_fabric_loop_with_context_parallelism_follows_one_process():
    pytest.importorskip("transformers")
    ranks = run_ranks(_job, world_size=2)
    references = _references()
    for case, (_, _, accumulate, _) in CASES.items():
        expected = references[case]
        for rank in ranks:
            result = rank[case]
            assert result["tokens"] == [SEQ // 2], (case, result["tokens"])  # each rank read its chunks
            assert set(result["tokens after"]) == {SEQ}, case  # after end_cut: whole sequences
            assert len(result["losses"]) == STEPS * accumulate, case
            torch.testing.assert_close(
                [*result["losses"], result["after"]],
                [*expected["losses"], expected["after"]],
                rtol=1e-5,
                atol=0,
                msg=lambda m, c=case: f"{c}: {m}",
            )


class _MaskedTail(torch.utils.data.Dataset):
    """The test tokens with the last 3 targets of every row ignored (-100): the two cp ranks hold 5 and 8
    targets per row, so their losses weigh 10/13 and 16/13."""

    def __init__(self) -> None:
        self.x, self.y = token_dataset().tensors

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.y[i].clone()
        y[-3:] = -100
        return self.x[i], y


def _pipeline_loop() -> dict[str, Any]:
    """PP2 x CP2 on 4 ranks: pipeline_step cuts each whole batch over the cp group itself."""
    strategy = ShardFabricStrategy(stage=3, pipeline_parallel_size=2, context_parallel_size=2)
    fabric = L.Fabric(accelerator="cpu", devices=4, strategy=strategy)
    fabric.launch()
    model = tiny_gpt()
    seen = _count_tokens(model) if fabric.global_rank < 2 else []  # the first stage holds the embedding
    model, optimizer = fabric.setup(model, _optimizer("sgd", model))
    data = fabric.setup_dataloaders(DataLoader(_MaskedTail(), batch_size=BATCH, shuffle=False))
    losses = []
    for i, (x, y) in enumerate(data):
        if i == STEPS:
            break
        losses.append(fabric.strategy.pipeline_step(model, x, y).item())  # the whole sequences' loss
        fabric.clip_gradients(model, optimizer, max_norm=CLIP)
        optimizer.step()
        optimizer.zero_grad()
    x, y = next(iter(data))
    return {"losses": losses, "eval": fabric.strategy.pipeline_eval_step(model, x, y).item(), "tokens": seen}


def test_pipeline_stages_with_context_parallelism_in_a_fabric_loop_follow_one_process():
    ranks = run_ranks(_pipeline_loop, world_size=4)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = tiny_gpt()
        optimizer = _optimizer("sgd", model)
        expected = []
        for i, batch in enumerate(DataLoader(_MaskedTail(), batch_size=BATCH, shuffle=False)):
            if i == STEPS:
                break
            loss = _loss(model, batch)
            loss.backward()
            expected.append(loss.item())
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
            optimizer.zero_grad()
        with torch.no_grad():
            expected.append(_loss(model, next(iter(DataLoader(_MaskedTail(), batch_size=BATCH)))).item())
    finally:
        torch.set_num_threads(threads)
    for rank, result in enumerate(ranks):
        torch.testing.assert_close([*result["losses"], result["eval"]], expected, rtol=1e-5, atol=0)
        if rank < 2:  # the first stage's embedding read each rank's chunks only
            assert set(result["tokens"]) == {SEQ // 2}, result["tokens"]
