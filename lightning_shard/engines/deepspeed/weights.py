"""Full weights into the parameters ``deepspeed.zero.Init`` partitioned, and ZeRO-3's partitions pointed at a
default process group made again since they were partitioned."""

from __future__ import annotations

import torch
from torch import nn

from lightning_shard.checkpoint.init_weights import match_keys, open_weights, tied_names


def load_partitioned(module: nn.Module, path: str, is_rank0: bool) -> None:
    """Full weights into parameters deepspeed.zero.Init partitioned: one parameter gathered at a time,
    filled on rank 0 from the file, partitioned again (no rank holds more than one whole parameter)."""
    import deepspeed  # optional: DeepSpeed

    state = module.state_dict(keep_vars=True)
    targets = {
        key: (getattr(t, "ds_shape", t.shape), t.dtype)
        for key, t in state.items()
        if isinstance(t, torch.Tensor)
    }
    with open_weights(path) as source:
        mapping = match_keys(source, targets, tied_names(module, targets))
        done: set[int] = set()
        for key, tensor in state.items():
            if id(tensor) in done:
                continue
            done.add(id(tensor))
            if not hasattr(tensor, "ds_tensor"):  # a buffer: whole on every rank
                with torch.no_grad():
                    tensor.copy_(source.read(mapping[key]))
                continue
            with deepspeed.zero.GatheredParameters([tensor], modifier_rank=0), torch.no_grad():
                if is_rank0:
                    tensor.copy_(source.read(mapping[key]))


def rebind_partitioned(module: nn.Module) -> None:
    """Point parameters ZeRO-3 partitioned in an earlier ``fit`` at this call's process group.

    DeepSpeed records the group on each partitioned parameter and skips parameters it already
    partitioned; a default group destroyed and made again since (by the user) leaves the recorded one dead.
    """
    partitioned = [p for p in module.parameters() if hasattr(p, "ds_process_group")]
    if not partitioned:
        return
    from deepspeed.utils import groups  # optional: DeepSpeed

    group = groups._get_sequence_data_parallel_group()
    for param in partitioned:
        param.ds_process_group = group
