"""Expert parallelism against plain ZeRO-3: a mixture-of-experts GPT (8 experts per block, top-2) on 4 CPU ranks.

    zero3        ShardStrategy(stage=3)                            every rank gathers all 8 experts per layer
    zero3_ep2    ShardStrategy(stage=3, expert_parallel_size=2)    4 experts per rank, sharded over 2 ranks
    zero3_ep4    ShardStrategy(stage=3, expert_parallel_size=4)    2 experts per rank, whole: never gathered

Every expert is a SwiGLU MLP of hidden width 2 d (``6 d^2`` weights), so the experts are 48 d^2 of a block's
52 d^2 (attention 4 d^2): 90% or more of the weights, as in Mixtral or Qwen3-MoE.

Measured per rank, over the timed steps (the first two are warm-up):

    step time           rank 0's training step (forward, backward, AdamW), median over the timed steps of a
                        run, then over rounds; configurations interleaved over rounds in one set of 4
                        processes, the order rotated each round. ``speedup_over_zero3``: zero3's median over
                        this configuration's, from the same run.
    all-gather bytes    FSDP2's all-gather output per step (every rank's chunk; the unsharded parameters),
                        counted twice: by the engine's gloo counter (``engines._gloo.traffic``) and per
                        parameter at FSDP2's ``foreach_all_gather``, which splits it into experts / the rest
                        (the two totals must agree). Groups of one rank move nothing and are not counted.
    reduce-scatter      the gradient bytes FSDP2 reduce-scatters per step (``foreach_reduce``'s input), split
                        the same way.
    all-to-all bytes    what the expert dispatch puts into its all-to-alls per step (the per-expert counts, the
                        token rows forward and their gradients backward: ``expert_parallel.dispatch.traffic``);
                        ``crossed``: the chunks addressed to other ranks.
    parameter bytes     local shards (DTensor ``to_local()``) of the experts' weights and of everything else,
                        at rest; ``expert_block_bytes``: the experts' weights this rank computes with in a
                        forward (the gathered tensors, read in a hook after FSDP2's unshard), all layers.

At stage 3 every configuration keeps 1/4 of the expert weights per rank at rest (EP e: E/e experts per rank,
each sharded over the 4/e ranks left); what expert parallelism changes is the block a rank gathers and computes
with (all experts -> 1/e of them) and so the bytes gathered and reduce-scattered, for an all-to-all of the
tokens instead.

    python benchmarks/bench_moe.py --out benchmarks/results/moe.json
    python benchmarks/bench_moe.py --smoke --out /tmp/moe.json          # GPT 2 x 64, one round, < 30 s
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from collections.abc import Iterator
from typing import Any

import lightning as L
import torch
from _common import StepTimer, cpu_trainer, interleaved, token_loader, write_report
from torch import nn

from lightning_shard import ShardStrategy
from lightning_shard.demos import GPTModule
from lightning_shard.demos.moe import Experts
from lightning_shard.demos.ranks import run_ranks
from lightning_shard.engines import _gloo
from lightning_shard.expert_parallel import dispatch, expert_shards
from lightning_shard.memory import local_tensor

WORLD = 4
EXPERTS, TOP_K = 8, 2
WARMUP = 2  # steps not timed or counted: allocator, gloo and shared-memory buffers
CONFIGS: dict[str, dict[str, Any]] = {
    "zero3": {"stage": 3},
    "zero3_ep2": {"stage": 3, "expert_parallel_size": 2},
    "zero3_ep4": {"stage": 3, "expert_parallel_size": 4},
}
REFERENCE = "zero3"
TARGET_SPEEDUP = 1.25  # the goal: EP 4 at least 1.25x faster than ZeRO-3 without EP


# --- counting -------------------------------------------------------------------------------------


class FsdpBytes:
    """FSDP2's all-gather output and reduce-scatter input bytes, per parameter, split into the experts'
    weights and the rest. Counted where FSDP2's parameter groups call ``foreach_all_gather`` /
    ``foreach_reduce`` (torch-private names, patched in this process only while :meth:`installed`)."""

    def __init__(self) -> None:
        self.gathered = {"experts": 0, "other": 0}
        self.reduced = {"experts": 0, "other": 0}

    def reset(self) -> None:
        self.gathered = dict.fromkeys(self.gathered, 0)
        self.reduced = dict.fromkeys(self.reduced, 0)

    @staticmethod
    def _kind(fsdp_param: Any) -> str:
        return "experts" if isinstance(fsdp_param._module_info.module, Experts) else "other"

    def _all_gather(self, original: Any) -> Any:
        def counted(fsdp_params: list[Any], group: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(fsdp_params, group, *args, **kwargs)
            if result is not None and group.size() > 1:
                splits = iter(result.all_gather_input_split_sizes)  # per parameter, in the output's dtype
                item = result.all_gather_output.element_size() * group.size()
                for param, numels in zip(fsdp_params, result.param_all_gather_input_numels, strict=True):
                    self.gathered[self._kind(param)] += sum(next(splits) for _ in numels) * item
            return result

        return counted

    def _reduce(self, original: Any) -> Any:
        def counted(
            fsdp_params: list[Any], grads: list[torch.Tensor], group: Any, *args: Any, **kwargs: Any
        ) -> Any:
            if group is not None and group.size() > 1:
                for param, grad in zip(fsdp_params, grads, strict=True):
                    self.reduced[self._kind(param)] += grad.nbytes
            return original(fsdp_params, grads, group, *args, **kwargs)

        return counted

    @contextlib.contextmanager
    def installed(self) -> Iterator[FsdpBytes]:
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group as groups

        gather, reduce = groups.foreach_all_gather, groups.foreach_reduce
        groups.foreach_all_gather, groups.foreach_reduce = self._all_gather(gather), self._reduce(reduce)
        try:
            yield self
        finally:
            groups.foreach_all_gather, groups.foreach_reduce = gather, reduce


class Probe(L.Callback):
    """Step times; the collectives' bytes summed over the timed steps; parameter bytes at rest; the expert
    weights each forward computes with; the rows this rank's experts received from other ranks."""

    def __init__(self, fsdp: FsdpBytes) -> None:
        self.fsdp, self.timer = fsdp, StepTimer()
        self.result: dict[str, Any] = {}
        self.block_bytes: dict[str, int] = {}

    def _block(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any) -> None:  # after FSDP2's pre-forward (prepended): gathered
            self.block_bytes[name] = sum(local_tensor(p).nbytes for p in module.parameters(recurse=False))

        return hook

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        experts = {name: m for name, m in pl_module.named_modules() if isinstance(m, Experts)}
        for name, module in experts.items():
            module.register_forward_pre_hook(self._block(name))
        ids = {id(p) for m in experts.values() for p in m.parameters(recurse=False)}
        params = list(pl_module.parameters())  # each once (the tied embedding and head are one)
        self.result["param_bytes"] = {
            "experts": sum(local_tensor(p).nbytes for p in params if id(p) in ids),
            "other": sum(local_tensor(p).nbytes for p in params if id(p) not in ids),
        }

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, i: int
    ) -> None:
        if i == WARMUP:
            _gloo.traffic.reset()
            dispatch.traffic.reset()
            self.fsdp.reset()
        self.timer.on_train_batch_start()

    def on_train_batch_end(self, *args: Any) -> None:
        self.timer.on_train_batch_end()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        steps = len(self.timer.times) - WARMUP
        shards = expert_shards(pl_module).values()
        from_others = sum(
            int(s.received.sum() - s.received[s.ep_rank].sum()) for s in shards if s.received is not None
        )
        self.result |= {
            "step_s": statistics.median(self.timer.times[WARMUP:]),
            "all_gather_bytes": _gloo.traffic.all_gather_bytes / steps,
            "all_gather_bytes_by_kind": {k: v / steps for k, v in self.fsdp.gathered.items()},
            "reduce_scatter_bytes_by_kind": {k: v / steps for k, v in self.fsdp.reduced.items()},
            "all_to_all_bytes": dispatch.traffic.bytes / steps,
            "all_to_all_crossed_bytes": dispatch.traffic.crossed_bytes / steps,
            "expert_block_bytes": sum(self.block_bytes.values()),
            "experts_per_rank": next(iter(shards)).num_local if shards else EXPERTS,
            "rows_from_other_ranks_last_step": from_others,
        }


# --- the runs -------------------------------------------------------------------------------------


def _run(flags: dict[str, Any], cfg: dict[str, Any], fsdp: FsdpBytes) -> dict[str, Any]:
    probe = Probe(fsdp)
    trainer = cpu_trainer(ShardStrategy(**flags), cfg["steps"], [probe], devices=WORLD)
    L.seed_everything(0, verbose=False)
    module = GPTModule(**cfg["model"], n_experts=EXPERTS, top_k=TOP_K, max_steps=cfg["steps"])
    trainer.fit(module, token_loader(cfg["steps"], cfg["batch_size"], WORLD, cfg["model"]))
    return probe.result


def _bench(cfg: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    with FsdpBytes().installed() as fsdp:
        return interleaved(CONFIGS, cfg["rounds"], lambda flags: _run(flags, cfg, fsdp))


# --- the report -----------------------------------------------------------------------------------


def _per_rank(per_rank: list[dict[str, list[dict[str, Any]]]], name: str, key: str) -> list[Any]:
    """``key`` of configuration ``name``'s last round on each rank (the bytes are the same every round)."""
    return [rank[name][-1][key] for rank in per_rank]


def summarize(per_rank: list[dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in CONFIGS:
        step_ms = [1000 * run["step_s"] for run in per_rank[0][name]]  # rank 0's clock
        by_kind = _per_rank(per_rank, name, "all_gather_bytes_by_kind")
        out[name] = {
            "flags": CONFIGS[name],
            "median_step_ms": round(statistics.median(step_ms), 2),
            "step_ms_per_round": [round(t, 2) for t in step_ms],
            "experts_per_rank": _per_rank(per_rank, name, "experts_per_rank"),
            "param_bytes": _per_rank(per_rank, name, "param_bytes"),
            "expert_block_bytes": _per_rank(per_rank, name, "expert_block_bytes"),
            "all_gather_bytes_per_step": _per_rank(per_rank, name, "all_gather_bytes"),
            "all_gather_bytes_per_step_by_kind": by_kind,
            "all_gather_counters_agree": all(
                sum(k.values()) == total
                for k, total in zip(by_kind, _per_rank(per_rank, name, "all_gather_bytes"), strict=True)
            ),
            "reduce_scatter_bytes_per_step_by_kind": _per_rank(
                per_rank, name, "reduce_scatter_bytes_by_kind"
            ),
            "all_to_all_bytes_per_step": _per_rank(per_rank, name, "all_to_all_bytes"),
            "all_to_all_crossed_bytes_per_step": _per_rank(per_rank, name, "all_to_all_crossed_bytes"),
            "rows_from_other_ranks_last_step": _per_rank(per_rank, name, "rows_from_other_ranks_last_step"),
        }
    reference = out[REFERENCE]
    for entry in out.values():
        entry["speedup_over_zero3"] = round(reference["median_step_ms"] / entry["median_step_ms"], 3)
        entry["speedup_over_zero3_per_round"] = [
            round(a / b, 3)
            for a, b in zip(reference["step_ms_per_round"], entry["step_ms_per_round"], strict=True)
        ]
    return out


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def print_table(results: dict[str, Any]) -> None:
    print(f"\n== {WORLD} ranks (gloo); MiB per rank (rank 0; all-to-all: mean over ranks) ==")
    header = (
        f"{'config':10} {'step ms':>8} {'speedup':>8} {'experts':>8} {'expert shard':>13} {'other shard':>12}"
        f" {'expert block':>13} {'AG total':>9} {'AG experts':>11} {'RS experts':>11} {'A2A':>7} {'A2A crossed':>12}"
    )
    print(header)
    print("-" * len(header))
    for name, e in results.items():
        print(
            f"{name:10} {e['median_step_ms']:8.1f} {e['speedup_over_zero3']:8.3f} {e['experts_per_rank'][0]:>8}"
            f" {_mib(e['param_bytes'][0]['experts']):>13} {_mib(e['param_bytes'][0]['other']):>12}"
            f" {_mib(e['expert_block_bytes'][0]):>13} {_mib(e['all_gather_bytes_per_step'][0]):>9}"
            f" {_mib(e['all_gather_bytes_per_step_by_kind'][0]['experts']):>11}"
            f" {_mib(e['reduce_scatter_bytes_per_step_by_kind'][0]['experts']):>11}"
            f" {_mib(statistics.mean(e['all_to_all_bytes_per_step'])):>7}"
            f" {_mib(statistics.mean(e['all_to_all_crossed_bytes_per_step'])):>12}"
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--n-layers", type=int, default=4)
    parser.add_argument("--n-heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=2, help="micro-batch per rank")
    parser.add_argument("--rounds", type=int, default=5, help="runs per configuration, interleaved")
    parser.add_argument("--steps", type=int, default=8, help=f"steps per run; the first {WARMUP} are warm-up")
    parser.add_argument("--smoke", action="store_true", help="GPT 2 x 64, seq 64, one round of 3 steps")
    parser.add_argument("--out", default="benchmarks/results/moe.json")
    args = parser.parse_args(argv)
    if args.smoke:
        args.d_model, args.n_layers, args.n_heads, args.seq_len = 64, 2, 4, 64
        args.rounds, args.steps = 1, WARMUP + 1
    if args.steps <= WARMUP:
        parser.error(
            f"--steps {args.steps}: the first {WARMUP} steps are warm-up; use --steps {WARMUP + 1} or more"
        )
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    model = dict(
        vocab_size=256,
        seq_len=args.seq_len,
        d_model=args.d_model,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
    )
    cfg = {"model": model, "batch_size": args.batch_size, "rounds": args.rounds, "steps": args.steps}
    results = summarize(run_ranks(_bench, cfg, world_size=WORLD))
    ep = results[f"zero3_ep{WORLD}"]["speedup_over_zero3"]
    report = {
        "benchmark": f"expert parallelism vs ZeRO-3, {WORLD} CPU ranks (gloo), MoE GPT {args.n_layers} x"
        f" {args.d_model} ({EXPERTS} experts, top-{TOP_K}), seq {args.seq_len}, batch {args.batch_size}/rank",
        "torch": torch.__version__,
        "model": cfg["model"] | {"n_experts": EXPERTS, "top_k": TOP_K},
        "batch_size_per_rank": args.batch_size,
        "rounds": args.rounds,
        "steps_per_run": args.steps,
        "timed_steps_per_run": args.steps - WARMUP,
        "smoke": args.smoke,
        "results": results,
        "target": {
            "what": f"zero3_ep{WORLD} at least {TARGET_SPEEDUP}x faster than {REFERENCE}",
            "value": ep,
            "pass": ep >= TARGET_SPEEDUP,
        },
    }
    print_table(results)
    write_report(report, args.out, printed={"out": args.out, "target": report["target"]})
    return report


if __name__ == "__main__":
    main()
