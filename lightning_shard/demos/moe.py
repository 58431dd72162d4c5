"""The example GPT's mixture-of-experts MLP: a top-k router and experts held as 3-D weights.

The experts follow Hugging Face transformers' layout (``gate_up_proj`` ``[E, 2I, d]``, ``down_proj``
``[E, d, I]``, the forward ``experts(hidden_states, top_k_index, top_k_weights)``), so
``ShardStrategy(expert_parallel_size=...)`` splits them as it splits a Mixtral's. Nothing here knows about
expert parallelism: on one process every expert runs here, in a loop.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from typing_extensions import override


class Experts(nn.Module):
    """``num_experts`` SwiGLU MLPs as two 3-D weights; each token's output is the routing-weighted sum of its
    ``k`` experts'."""

    def __init__(self, num_experts: int, d_model: int, hidden: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * hidden, d_model))
        self.down_proj = nn.Parameter(torch.empty(num_experts, d_model, hidden))
        self.act_fn = nn.SiLU()

    @override
    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for expert in range(self.num_experts):
            token, slot = torch.where(top_k_index == expert)
            gate, up = F.linear(hidden_states[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
            rows = F.linear(self.act_fn(gate) * up, self.down_proj[expert])
            out.index_add_(0, token, (rows * top_k_weights[token, slot, None]).to(out.dtype))
        return out


class MoE(nn.Module):
    """Top-k routing (softmax, the top k renormalised) over :class:`Experts`; keeps the load-balancing loss of
    its last forward (Switch Transformer's: ``E x sum_e fraction_e x mean probability_e``) in ``aux_loss``."""

    def __init__(self, d_model: int, num_experts: int, top_k: int, hidden: int) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"GPT(top_k={top_k}) must be between 1 and n_experts={num_experts}.")
        self.router = nn.Linear(d_model, num_experts, bias=False)
        self.experts = Experts(num_experts, d_model, hidden)
        self.top_k = top_k
        self.aux_loss: torch.Tensor | None = None

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.size(-1))  # (b t, d)
        probs = self.router(tokens).float().softmax(dim=-1)  # (b t, E)
        weights, index = probs.topk(self.top_k, dim=-1)  # (b t, k)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        experts = probs.size(-1)
        fraction = F.one_hot(index, experts).float().sum(dim=1).mean(dim=0) / self.top_k  # (E,)
        self.aux_loss = experts * (fraction * probs.mean(dim=0)).sum()
        return self.experts(tokens, index, weights.to(tokens.dtype)).view_as(x)
