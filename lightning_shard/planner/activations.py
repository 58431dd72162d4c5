"""The activation bytes the forward pass leaves for backward on one device, from a model's shape (:mod:`.model`)
and the run's recompute mode, dtypes, tensor- and context-parallel sizes and tiling: per block, per token, counted
on the demo GPT and checked against Korthikanti et al.'s formula.
"""

from __future__ import annotations

from lightning_shard.planner.model import Checkpointing, ModelShape


def block_activation_bytes(shape: ModelShape, mode: Checkpointing, r: int, c: int) -> float:
    """Bytes one block keeps for backward, per token (GPT-2-style block, fused attention).

    Counted on ``lightning_shard/demos/gpt.py`` with saved-tensor hooks, h = hidden, f = ffn, a = heads, r = bytes of
    the residual stream (fp32 in mixed precision), c = bytes of compute outputs::

        none:      2h·r  (the two layer-norm inputs: the block input and the mid-block residual)
                 + (6h + 2f)·c  (norm outputs h + h, qkv 3h, attention output h, MLP in f and out f)
                 + 4a + 16  (attention log-sum-exp, layer-norm mean/rstd, fp32)
        selective: h·r  (the checkpoint's input) + (4h + f)·c  (the outputs of the 1st and 3rd matmuls,
                   qkv 3h and MLP in f, and the attention output h; the default recomputes every second
                   matmul) + 4a
        full:      h·r  (only the input)

    This is Korthikanti et al.'s 34·s·b·h bytes per layer (16-bit, with dropout masks) without masks
    and with flash attention (no a·s² attention-score term).

    A mixture of experts (f = its k experts' widths) also keeps each token's k routed rows, none and
    selective: k·h·(r + c), the experts' input (the normed residual stream, r) and output (c) per (token,
    expert) pair, the same with or without expert parallelism (there, what the all-to-alls delivered):
    counted on the demo's MoE GPT, 1 process and 2 gloo ranks of ``expert_parallel_size=2``, within 15%
    and 4%. Averaged over the blocks when only some have experts.
    """
    h, f, a = shape.hidden, shape.ffn, shape.heads
    routed = shape.moe_layers / shape.layers * shape.top_k * h * (r + c) if shape.layers else 0.0
    if mode == "full":
        return h * r
    if mode == "selective":
        return h * r + (4 * h + f) * c + 4 * a + routed
    return 2 * h * r + (6 * h + 2 * f) * c + 4 * a + 16 + routed


def tiled_mlp_saving(shape: ModelShape, mode: Checkpointing, c: int) -> float:
    """Bytes per token a block no longer keeps under ``ShardStrategy(tiled_mlp=...)``: the MLP's hidden units
    (``2f·c`` without recompute, the first matmul's ``f·c`` under selective recompute, none under full
    recompute, which keeps only the block's input); each tile's are recomputed in backward."""
    return {"none": 2 * shape.ffn * c, "selective": shape.ffn * c}.get(mode, 0)


def activation_bytes(
    shape: ModelShape,
    micro_batch: int,
    seq_len: int,
    mode: Checkpointing,
    r: int,
    c: int,
    tp: int = 1,
    cp: int = 1,
    cp_method: str = "allgather",
    tiled_mlp: bool = False,
    tiled_loss: bool = False,
) -> float:
    """Bytes the forward pass leaves for backward on one device.

    ``tokens x (L x block + outside)`` where outside is the final norm's input h·r, its statistics,
    its output h·c and the logits V·c. With tensor parallelism ``tp`` (and sequence parallelism) every
    term is split ``tp`` ways. With a 1F1B pipeline the first stage holds ``p`` micro-batches of
    ``L / p`` layers, so the total is the same as without a pipeline. Context parallelism ``cp`` cuts
    the sequence: every term is for ``T / cp`` tokens, plus what attention across the group keeps
    (:func:`context_parallel_attention_bytes`).
    """
    tokens = micro_batch * seq_len / cp
    # ShardStrategy(tiled_loss=...): the logits are recomputed tile by tile in backward, never kept.
    outside = shape.hidden * (r + c) + 8 + (0 if tiled_loss else shape.vocab * c)
    block = block_activation_bytes(shape, mode, r, c) - (tiled_mlp_saving(shape, mode, c) if tiled_mlp else 0)
    local = tokens * (shape.layers * block + outside) / tp
    return local + context_parallel_attention_bytes(shape, micro_batch, seq_len, mode, c, cp, cp_method)


def context_parallel_attention_bytes(
    shape: ModelShape, micro_batch: int, seq_len: int, mode: Checkpointing, c: int, cp: int, method: str
) -> float:
    """What attention across a context-parallel group of ``cp`` ranks keeps per rank beyond its ``T / cp``
    tokens' share (none under full recompute, which keeps only each block's input):

        allgather: L·b·2h·c·T  (each layer's gathered keys and values: T tokens, as many heads as queries)
                   + (T / cp)·T·c  (the additive causal mask of this rank's queries over the global
                   positions, one for every layer of the step)
        ulysses:   0  (the all-to-all trades T / cp tokens of h heads for T tokens of h / cp heads, and the
                   attention runs causal in position order, with no mask)
        ring:      0  (the blocks of keys and values pass through; torch keeps only its own chunk's)
    """
    if cp == 1 or mode == "full" or method != "allgather":
        return 0.0
    return shape.layers * micro_batch * 2 * shape.hidden * c * seq_len + seq_len / cp * seq_len * c
