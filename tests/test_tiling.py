"""Tiled MLP and tiled loss (lightning_shard/tiling.py): the same losses and gradients as untiled, only one
tile of the widest activations kept at a time, and what they cannot serve refused with the fix."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

from lightning_shard import ShardStrategy
from lightning_shard.tiling import apply_tiled_loss, apply_tiled_mlp, linear_cross_entropy, loss_tile
from tests.helpers import LossRecorder, loader, tiny_gpt, tiny_llama_config, trainer_kwargs
from tests.test_context_parallel_multirank import Llama, Tokens, dict_loader


def _saved_numels(fn: Any) -> list[int]:
    """The element counts of the tensors autograd keeps for backward while ``fn`` runs forward."""
    seen: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn().backward()
    return seen


def test_linear_cross_entropy_equals_the_whole_logits_and_never_keeps_them():
    torch.manual_seed(0)
    n, d, vocab = 40, 8, 96
    hidden = torch.randn(2, n // 2, d, requires_grad=True)
    head = nn.Linear(d, vocab)
    targets = torch.randint(0, vocab, (2, n // 2))
    targets[0, :3] = -100  # ignored targets left out of the sum
    whole = nn.functional.cross_entropy(head(hidden).flatten(0, 1), targets.flatten(), reduction="sum")
    expected = torch.autograd.grad(whole, [hidden, head.weight, head.bias])
    tiled = linear_cross_entropy(hidden, head, targets, tile=7)
    got = torch.autograd.grad(tiled, [hidden, head.weight, head.bias])
    torch.testing.assert_close(tiled, whole, rtol=1e-6, atol=0)
    for a, b in zip(got, expected, strict=True):  # the gradient's scale included (plain SGD would follow it)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    # What backward keeps: the whole (N, V) logits untiled; tiled, only the tiles' inputs (their logits are
    # recomputed one tile at a time in backward).
    assert sum(_saved_numels(lambda: linear_cross_entropy(hidden, head, targets))) >= n * vocab
    tiled_saved = _saved_numels(lambda: linear_cross_entropy(hidden, head, targets, tile=7))
    assert sum(tiled_saved) <= hidden.numel() + targets.numel()


def test_tiled_mlp_keeps_one_tile_of_hidden_units():
    torch.manual_seed(0)
    block = nn.Module()
    block.mlp = nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 8))
    x = torch.randn(2, 32, 8, requires_grad=True)
    whole = _saved_numels(lambda: block.mlp(x).square().sum())
    expected = torch.autograd.grad(block.mlp(x).square().sum(), [x, block.mlp[0].weight])
    apply_tiled_mlp(block, 4, "ShardStrategy(tiled_mlp=4)")
    tiled = _saved_numels(lambda: block.mlp(x).square().sum())
    got = torch.autograd.grad(block.mlp(x).square().sum(), [x, block.mlp[0].weight])
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert sum(whole) >= 2 * 32 * 64  # the hidden units of the whole sequence
    # The tiles' inputs only (each a view of x, seen twice: by the checkpoint and its first layer), the
    # hidden units recomputed per tile in backward.
    assert sum(tiled) <= 2 * x.numel()


def _fit(model: L.LightningModule, data: Any, strategy: Any, tokens: Tokens | None = None) -> list[float]:
    recorder = LossRecorder()
    callbacks = [recorder] + ([tokens] if tokens is not None else [])
    trainer_args = trainer_kwargs(max_steps=3, accumulate_grad_batches=2, gradient_clip_val=0.6)
    L.Trainer(devices=1, strategy=strategy, callbacks=callbacks, **trainer_args).fit(model, data)
    return recorder.losses


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_tiled_gpt_and_llama_train_as_untiled(optimizer):
    from tests.test_parity_multirank import sgd_gpt

    gpt = (lambda: sgd_gpt()) if optimizer == "sgd" else (lambda: tiny_gpt())
    expected = _fit(gpt(), loader(8), ShardStrategy(stage=3))
    tokens = Tokens("model.head", "blocks.0.mlp.0")
    got = _fit(gpt(), loader(8), ShardStrategy(stage=3, tiled_mlp=4, tiled_loss=8), tokens)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)
    # Untiled: 8 x 16 tokens each. The loss in tiles of 8 tokens, the MLP in tiles of 4 positions x 8 rows.
    assert tokens.seen == {"model.head": 8, "blocks.0.mlp.0": 32}, tokens.seen

    expected = _fit(Llama(optimizer), dict_loader(4), ShardStrategy(stage=2))
    tokens = Tokens("lm_head", "layers.0.mlp.gate_proj")
    got = _fit(Llama(optimizer), dict_loader(4), ShardStrategy(stage=2, tiled_mlp=4, tiled_loss=24), tokens)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)
    # Untiled: 4 x 16 tokens. The loss in tiles of 24 tokens, the MLP in tiles of 4 positions x 4 rows.
    assert tokens.seen == {"lm_head": 24, "layers.0.mlp.gate_proj": 16}, tokens.seen


def test_the_default_tiles():
    # The loss: one tile's logits as large as the hidden states, at least 1024 tokens.
    assert loss_tile(131072, 4096, 128256) == 4186 and loss_tile(16384, 256, 32000) == 1024
    # The MLP: as many positions as the model is wide (ALST's rule).
    block = nn.Module()
    block.mlp = nn.Sequential(nn.Linear(8, 8))
    seen: list[int] = []
    block.mlp[0].register_forward_pre_hook(lambda _, args: seen.append(args[0].size(1)))
    apply_tiled_mlp(block, True, "ShardStrategy(tiled_mlp=True)")
    block.mlp(torch.randn(1, 20, 8))
    assert seen == [8, 8, 4]


@pytest.mark.parametrize(
    "flags, match",
    [
        (dict(tiled_mlp=0), r"tiled_mlp=0\) must be True, False or a number of tokens"),
        (dict(tiled_loss="yes"), r"tiled_loss='yes'\) must be True"),
        (dict(tiled_loss=True, pipeline_parallel_size=2), "the last stage hands the logits to pipeline_loss"),
    ],
)
def test_tiling_flags_it_cannot_serve_are_refused(flags, match):
    with pytest.raises(ValueError, match=match):
        ShardStrategy(**flags)


def test_models_tiling_cannot_serve_get_the_fix():
    with pytest.raises(ValueError, match="found no MLP in Linear"):
        apply_tiled_mlp(nn.Linear(2, 2), True, "ShardStrategy(tiled_mlp=True)")
    with pytest.raises(ValueError, match="found no language-model loss it can tile in Linear"):
        apply_tiled_loss(nn.Linear(2, 2), True, "ShardStrategy(tiled_loss=True)")
    block = nn.Module()
    block.mlp = nn.Linear(4, 4)
    apply_tiled_mlp(block, 2, "ShardStrategy(tiled_mlp=2)")
    with pytest.raises(ValueError, match=r"needs it called with one \(batch, seq, width\) tensor"):
        block.mlp(torch.randn(3, 4))
    import transformers

    capped = transformers.LlamaForCausalLM(tiny_llama_config())
    capped.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match=r"config.final_logit_softcapping=30.0\), which it does not"):
        apply_tiled_loss(capped, True, "ShardStrategy(tiled_loss=True)")
