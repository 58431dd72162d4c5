"""Parameters FSDP gathers in float8 under ``ShardStrategy(fp8=...)``: the weights of the Linears the
strategy converts, where its settings gather them in float8 (stages 2-3, the tensorwise recipe).

With a model, the strategy's own choice (:func:`lightning_shard.fp8.choose`: the size rule, ``modules``,
``skip`` or a filter); with a shape only, the size rule applied to a GPT block's four Linears (hidden x
3 hidden, hidden x hidden, hidden x ffn, ffn x hidden; only the first two with experts), once per layer.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_shard.engines import configure
from lightning_shard.fp8 import choose, fits_scaled_mm, large_enough
from lightning_shard.planner.model import ModelShape


def float8_gathered_params(fp8: Any, stage: int, module: nn.Module | None, shape: ModelShape) -> int:
    """The parameters the all-gathers of ``ShardStrategy(stage=stage, fp8=fp8)`` carry in float8."""
    if fp8 is None or fp8 is False or stage < 2:
        return 0
    settings = configure(stage=stage, fp8=fp8).fp8
    if settings is None or not settings.all_gather:
        return 0
    if module is not None:
        chosen = set(choose(module, settings))
        return sum(sub.weight.numel() for name, sub in module.named_modules() if name in chosen)
    h, ffn = shape.hidden, shape.ffn
    dims = [(h, 3 * h), (h, h), (h, ffn), (ffn, h)]  # (in_features, out_features)
    if shape.experts:  # the experts are 3-D weights, not Linears: only attention's are converted
        dims = dims[:2]
    linears = [nn.Linear(k, n, bias=False, device="meta") for k, n in dims if k and n]
    kept = [
        lin
        for lin in linears
        if fits_scaled_mm(lin) and (settings.filter == "all" or large_enough(lin, settings.recipe))
    ]
    return shape.layers * sum(lin.weight.numel() for lin in kept)


__all__ = ["float8_gathered_params"]
