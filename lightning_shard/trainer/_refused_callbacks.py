"""Lightning's own callbacks that cannot work under a sharding layout, refused before the run starts.

Lightning's weight-averaging callbacks keep a whole copy of the model and copy tensors in and out of
its parameters; Lightning warns (``WeightAveraging``) or refuses (``StochasticWeightAveraging``, for its
own FSDP and DeepSpeed strategies) but cannot see ShardStrategy's layouts. Checked on 2 gloo ranks
against DDPStrategy (SGD, 2 ranks; tests/test_ema_multirank.py):

=============================  =============================  =================================================
callback                       works                          fails
=============================  =============================  =================================================
``StochasticWeightAveraging``  FSDP engine, stages 0-1: DDP's  stages 2-3 ("got mixed torch.Tensor and DTensor"),
                               weights, resumed runs too      DeepSpeed ("DeepSpeedZeroOptimizer is not an
                                                              Optimizer")
``WeightAveraging``,           FSDP engine, stages 0-1: DDP's  stages 2-3 (DTensor), DeepSpeed (ZeRO-3 parameters
``EMAWeightAveraging``         weights, resumed runs too      are size 0 on every rank)
=============================  =============================  =================================================

A resume reads the averages back from the checkpoint's ``state_dict`` entry, which the strategy's
``load_checkpoint`` fills wherever the parameters are whole (see ``trainer/_checkpoint.py``).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import StochasticWeightAveraging, WeightAveraging

from lightning_shard.engines import Capabilities, declared

_FIX = (
    "Use lightning_shard.EMA(decay=...) instead: it keeps each rank's share of the average beside the weights"
    " that rank holds, and saves it with the optimizer state."
)


def check_callbacks(trainer: Any, strategy_description: str, stage: int, engine: str) -> None:
    """Raise ``ValueError`` for a Lightning callback among ``trainer.callbacks`` that cannot work here.

    ``strategy_description`` is how the user wrote the strategy (``"ShardStrategy(stage=3)"``); ``stage`` the
    resolved ZeRO stage and ``engine`` the resolved engine's name. Tensor parallelism makes parameters DTensors
    at any stage: pass ``stage=3`` for the same answer.
    """
    caps = declared(engine)
    for callback in trainer.callbacks:
        reason = _why_not(callback, stage, caps)
        if reason is not None:
            name = type(callback).__name__
            raise ValueError(
                f"{strategy_description} cannot run Lightning's {name} callback: {reason}. {_FIX}"
            )


def _why_not(callback: Any, stage: int, caps: Capabilities) -> str | None:
    if not isinstance(callback, (StochasticWeightAveraging, WeightAveraging)):
        return None
    if isinstance(callback, StochasticWeightAveraging) and not caps.torch_optimizer:
        return f"it steps the optimizer through torch's SWALR, and {caps.label}'s ZeRO optimizer is not a torch Optimizer"
    if isinstance(callback, WeightAveraging) and not caps.averaging_stages:
        return (
            f"it copies the model's parameters, which {caps.label} partitions (ZeRO-3: size 0 on every rank), and a"
            f" run it checkpointed cannot be resumed ({caps.label} saves the weights apart from Lightning's entries)"
        )
    if stage not in caps.averaging_stages:
        return f"it copies whole tensors into parameters that are FSDP2 shards (DTensor) at stage {stage}"
    return None
