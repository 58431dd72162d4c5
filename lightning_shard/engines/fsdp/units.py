"""Which blocks FSDP2 shards, all-gathers and reduce-scatters together (its units of communication)."""

from __future__ import annotations

from torch import nn

#: Stage 2 puts consecutive blocks in one unit until their parameters reach this many bytes (DDP's bucket size).
GROUP_BYTES = 25 * 2**20


def sharding_units(blocks: list[nn.Module], group: bool, cap: int = GROUP_BYTES) -> list[list[nn.Module]]:
    """One unit per block, or with ``group`` consecutive blocks packed into units of at most ``cap`` bytes.

    At stage 3 each block is its own unit: its parameters are gathered for its forward and freed after,
    which is what bounds the memory. At stage 2 parameters stay gathered from forward through backward
    anyway, so a unit's size only sets how many collectives a step makes and how many gradient bytes wait
    for their reduce-scatter. Small blocks each paying a collective's fixed cost is what made stage 2
    slower than DeepSpeed's (which reduces in 500M-element buckets): on a 6-block GPT over gloo, one
    all-gather and one reduce-scatter per block (benchmarks/bench_engines.py --profile). Packed up to
    25 MB (DDP's bucket size) the step took 0.90x as long (284 vs 316 ms); a block of 25 MB or more (any
    block of a billion-parameter model) stays alone, so large models shard exactly as at stage 3.
    """
    if not group:
        return [[block] for block in blocks]
    units: list[list[nn.Module]] = []
    size = 0
    for block in blocks:
        nbytes = sum(p.numel() * p.element_size() for p in block.parameters())
        if units and size + nbytes <= cap:
            units[-1].append(block)
            size += nbytes
        else:
            units.append([block])
            size = nbytes
    return units
