"""A small GPT-style language model as a plain LightningModule, and a data module that needs no download.

Nothing here knows about sharding: ShardStrategy, activation checkpointing and the monitors are
applied from the outside, by flag.
"""

from __future__ import annotations

import math
import random

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lightning_shard.demos.moe import MoE
from lightning_shard.tiling import mean_cross_entropy

_SUBJECTS = ["the miller", "a sailor", "the old king", "my sister", "the river", "a grey fox", "the clerk"]
_VERBS = ["carried", "remembered", "watched", "painted", "followed", "forgot", "praised"]
_OBJECTS = ["the lantern", "a letter", "the harbour", "seven stones", "the winter road", "a silver cup"]
_ENDS = ["before dawn", "in the rain", "without a word", "at the fair", "for a long time", "again"]


def generate_text(n_sentences: int = 4000, seed: int = 0) -> str:
    """A deterministic English-like corpus from a small grammar (no download, no licence question)."""
    rng = random.Random(seed)
    sentences = []
    for _ in range(n_sentences):
        words = [rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS), rng.choice(_ENDS)]
        sentences.append(" ".join(words).capitalize() + ".")
    return " ".join(sentences)


class CharDataset(Dataset):
    """Byte-level next-token prediction windows over a text (vocabulary: 256 byte values)."""

    def __init__(self, text: str, seq_len: int) -> None:
        self.data = torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq_len

    @override
    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.seq_len : (i + 1) * self.seq_len + 1]
        return chunk[:-1], chunk[1:]


class TextDataModule(L.LightningDataModule):
    def __init__(
        self, seq_len: int = 128, batch_size: int = 8, n_sentences: int = 4000, seed: int = 0
    ) -> None:
        super().__init__()
        self.seq_len, self.batch_size, self.n_sentences, self.seed = seq_len, batch_size, n_sentences, seed

    @override
    def setup(self, stage: str | None = None) -> None:
        self.dataset = CharDataset(generate_text(self.n_sentences, self.seed), self.seq_len)

    @override
    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=True, drop_last=True)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0, scale: float | None = None
) -> torch.Tensor:
    """Causal softmax attention on ``(b, h, t, d)`` tensors: the default of ``CausalSelfAttention.attend``."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p, scale=scale)


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention. The fused ``qkv`` projection's outputs are laid out head by head
    (``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]``), so splitting its columns across tensor-parallel ranks gives
    each rank whole heads; the head count is read from the width the projection returns.

    The attention itself is the ``attend`` call (:func:`causal_attention`): context parallelism replaces it
    with attention over the whole sequence held by its group of ranks.
    """

    attend = staticmethod(causal_attention)

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"GPT(d_model={d_model}) must be divisible by n_heads={n_heads}.")
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.dropout = dropout

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.qkv(x)  # (b, t, 3 h d), h = the heads this rank holds
        heads = qkv.size(-1) // (3 * self.head_dim)
        q, k, v = qkv.view(b, t, heads, 3, self.head_dim).permute(3, 0, 2, 1, 4)  # 3 x (b, h, t, d)
        p = self.dropout if self.training else 0.0
        y = self.attend(q, k, v, dropout_p=p)  # (b, h, t, d)
        return self.proj(y.transpose(1, 2).reshape(b, t, heads * self.head_dim))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x)) (a mixture of experts with ``n_experts``)."""

    def __init__(
        self, d_model: int, n_heads: int, dropout: float, n_experts: int = 0, top_k: int = 2
    ) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp: nn.Module = (
            MoE(d_model, n_experts, top_k, 2 * d_model)
            if n_experts
            else nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))
        )
        self.drop = nn.Dropout(dropout)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    #: How ``ShardStrategy(tensor_parallel_size=T)`` splits the blocks when no plan is given: attention by
    #: heads and the MLP by hidden units (Megatron's column / row pairs), with the norms on the sequence
    #: split between them (sequence parallelism). Embeddings and the tied head stay whole.
    tensor_parallel_plan = {
        "blocks.*.ln1": "sequence",
        "blocks.*.attn.qkv": "colwise",
        "blocks.*.attn.proj": "rowwise",
        "blocks.*.ln2": "sequence",
        "blocks.*.mlp.0": "colwise",
        "blocks.*.mlp.2": "rowwise",
    }
    #: What ``ShardStrategy(expert_parallel_size=E)`` splits when no plan is given (the MoE variant's experts).
    expert_parallel_plan = {"blocks.*.mlp.experts": "experts"}

    def __init__(
        self,
        vocab_size: int = 256,
        seq_len: int = 128,
        d_model: int = 128,
        n_layers: int = 4,
        n_heads: int = 4,
        dropout: float = 0.0,
        tie_embeddings: bool = True,
        n_experts: int = 0,
        top_k: int = 2,
    ) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(
            Block(d_model, n_heads, dropout, n_experts, top_k) for _ in range(n_layers)
        )
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        if tie_embeddings:  # pipeline stages keep a copy each, their gradients summed (docs/pipeline.md)
            self.head.weight = self.tok_emb.weight
        self.n_layers = n_layers
        #: Tokens per tile of the loss given labels (None: the logits whole); set by the tiled_loss flag.
        self.loss_tile: int | bool | None = None
        self.init_weights()

    def init_weights(self) -> None:
        """GPT-2's initialisation; also run on allocated shards after meta-device construction."""
        for module in self.modules():
            if isinstance(module, MoE):
                nn.init.normal_(module.experts.gate_up_proj, std=0.02)
                nn.init.normal_(module.experts.down_proj, std=0.02 / math.sqrt(2 * self.n_layers))
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
        for name, p in self.named_parameters():
            # GPT-2: residual projections scaled down with depth so the residual stream's variance stays put.
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * self.n_layers))

    @override
    def forward(
        self, idx: torch.Tensor, position_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The logits ``(b, t, vocab)``, or given ``labels`` (``(b, t)``, aligned with the outputs) the mean
        cross-entropy over them, computed ``loss_tile`` tokens at a time when it is set
        (``ShardStrategy(tiled_loss=...)``)."""
        # A pipeline stage holds only its own modules (the others are None, docs/pipeline.md): stages
        # after the first receive the previous stage's hidden states, stages before the last return theirs.
        # position_ids: (t,) or (b, t), default 0 .. t-1 (context parallelism gives each chunk its own).
        x = idx
        if self.tok_emb is not None:
            pos = torch.arange(idx.size(1), device=idx.device) if position_ids is None else position_ids
            x = self.tok_emb(idx) + self.pos_emb(pos)  # (b, t, d)
        for block in self.blocks:
            x = block(x)
        if self.head is None:
            return x
        if labels is not None:
            return mean_cross_entropy(self.ln_f(x), self.head, labels, self.loss_tile)
        return self.head(self.ln_f(x))  # (b, t, vocab)

    def aux_loss(self) -> torch.Tensor | None:
        """The MoE blocks' load-balancing losses of the last forward, summed (``None``: a dense model)."""
        losses = [
            b.mlp.aux_loss
            for b in self.blocks
            if b is not None and isinstance(b.mlp, MoE) and b.mlp.aux_loss is not None
        ]
        return torch.stack(losses).sum() if losses else None


class GPTModule(L.LightningModule):
    """Next-byte prediction with AdamW and a cosine schedule; a plain LightningModule."""

    def __init__(
        self,
        vocab_size: int = 256,
        seq_len: int = 128,
        d_model: int = 128,
        n_layers: int = 4,
        n_heads: int = 4,
        dropout: float = 0.0,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        max_steps: int = 1000,
        tie_embeddings: bool = True,
        n_experts: int = 0,
        top_k: int = 2,
        aux_loss_coef: float = 0.01,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = GPT(
            vocab_size, seq_len, d_model, n_layers, n_heads, dropout, tie_embeddings, n_experts, top_k
        )

    def init_weights(self) -> None:
        """ShardStrategy runs this after allocating a model built on the meta device
        (``trainer.init_module(empty_init=True)``)."""
        self.model.init_weights()

    @override
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        # Under ShardStrategy(tiled_loss=...) the model computes its loss from the hidden states, tile by
        # tile, so the logits are never whole; otherwise the loss is pipeline_loss's, as with stages.
        loss = self.model(x, labels=y) if self.model.loss_tile else self.pipeline_loss(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        aux = self.model.aux_loss()  # the MoE variant: its routers' load balance, on this rank's tokens
        return loss if aux is None else loss + self.hparams["aux_loss_coef"] * aux

    def pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-byte cross-entropy; with pipeline stages, the last stage's loss per microbatch."""
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))

    @override
    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": self.hparams.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=self.hparams.lr,
        )
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
            optimizer, T_max=max(1, self.hparams.max_steps)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
