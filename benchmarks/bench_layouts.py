"""Per-rank bytes and step time of the mesh layouts: FSDP, HSDP, and tensor parallel x FSDP, side by side.

The demo GPT at ZeRO stage 3 on W CPU ranks (gloo), laid out as ``replicate x shard x tp``:

    fsdp       1 x W   x 1   ShardStrategy(stage=3)
    hsdp       2 x W/2 x 1   ShardStrategy(stage=3, replicate_size=2)
    tp_sp      1 x W/2 x 2   ShardStrategy(stage=3, tensor_parallel_size=2)    the GPT's own plan
                                                                               (sequence parallel)
    tp         1 x W/2 x 2   the same plan without its two "sequence" entries

``hsdp`` is the reference for the tensor-parallel layouts: it shards the parameters over the same
number of ranks (W/2; on 2 ranks that is 1: ``hsdp`` is then plain replication), so what ``tp_sp`` and
``tp`` change is the tensor-parallel split alone. Every
rank runs the same micro-batch; the two ranks of a tensor-parallel group read the same one, so the
tensor-parallel layouts take half as many tokens per step (tokens/s is reported beside step time).

Measured on every rank:

    split layers    bytes of the parameters, gradients and AdamW state of the modules the plan splits
                    ("colwise" / "rowwise": qkv, proj, mlp.0, mlp.2), this rank's local shards (DTensor
                    ``to_local()``); target: T=2 holds 0.5 x (+/- 5%) of the reference's.
    state           ShardStrategy.state_bytes(): all parameters, gradients and optimizer state.
    activations     what the blocks' forward leaves for backward, one training step: the tensors saved
                    for backward (``torch.autograd.graph.saved_tensors_hooks`` around the blocks, each
                    storage once, parameters left out, a DTensor's local tensor); cross-checked with
                    torch.profiler memory events (bytes the blocks' forward leaves allocated, less the
                    output of the last block). Target: sequence parallelism >= 35% below the reference.
    step time       wall time of a training step (forward, backward, AdamW), median over the timed
                    steps of a round, then over rounds; layouts interleaved, the order rotated each round.

    python benchmarks/bench_layouts.py --out benchmarks/results/layouts.json     # 2 and 4 ranks
    python benchmarks/bench_layouts.py --smoke --out /tmp/layouts.json           # < 60 s
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from typing import Any

import lightning as L
import torch
from _common import StepTimer, write_report
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_shard import ShardStrategy
from lightning_shard.demos import GPT, GPTModule
from lightning_shard.demos.ranks import run_ranks
from lightning_shard.memory import local_tensor, tensor_bytes
from lightning_shard.parallel import resolve_plan

VOCAB = 256
#: The GPT's plan without sequence parallelism: the same split layers, the norms left whole.
NO_SEQUENCE_PLAN = {k: v for k, v in GPT.tensor_parallel_plan.items() if v != "sequence"}
#: The layers whose weights tensor parallelism splits (the plan's "colwise" / "rowwise" entries).
SPLIT_PLAN = NO_SEQUENCE_PLAN
REFERENCE = "hsdp"
HALF_TOLERANCE = 0.05  # ratio within 0.5 x (1 +/- 5%)
MIN_SP_ACTIVATION_REDUCTION = 0.35
MEASURE_STEP = 1  # step 0 warms up (allocator, gloo buffers), step 1 is measured: neither is timed


def layouts(world_size: int) -> dict[str, dict[str, Any]]:
    """Layout name -> ShardStrategy flags, for ``world_size`` ranks."""
    return {
        "fsdp": dict(stage=3),
        "hsdp": dict(stage=3, replicate_size=2),
        "tp_sp": dict(stage=3, tensor_parallel_size=2),
        "tp": dict(stage=3, tensor_parallel_size=2, tensor_parallel_plan=NO_SEQUENCE_PLAN),
    }


def mesh_of(flags: dict[str, Any], world_size: int) -> dict[str, int]:
    r, t = flags.get("replicate_size", 1), flags.get("tensor_parallel_size", 1)
    return {"replicate": r, "shard": world_size // (r * t), "tp": t, "data_parallel": world_size // t}


# --- measurements ---------------------------------------------------------------------------------


def split_layer_bytes(gpt: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's bytes of the split layers' parameters, gradients and optimizer state."""
    names = resolve_plan(gpt, SPLIT_PLAN, 1)
    params = [p for name in names for p in gpt.get_submodule(name).parameters(recurse=False)]
    inner = getattr(optimizer, "_optimizer", optimizer)
    state = [
        v
        for p in params
        for v in inner.state.get(p, {}).values()
        if torch.is_tensor(v) and v.dim() > 0  # AdamW's step counter is a scalar
    ]
    return {
        "parameters": tensor_bytes(params),
        "gradients": tensor_bytes([p.grad for p in params if p.grad is not None]),
        "optimizer": tensor_bytes(state),
        "modules": len(names),
    }


class BlockActivations:
    """Bytes the blocks' forward keeps for backward, measured between the first block's forward pre-hook
    and the last block's forward hook: saved tensors (each storage once, parameters excluded) and the
    profiler's net allocation (less the last block's output, which the blocks do not keep)."""

    def __init__(self, blocks: nn.ModuleList) -> None:
        self.blocks = blocks
        self.saved: dict[int, int] = {}  # storage data_ptr -> bytes
        self.allocated = 0
        self._stack = contextlib.ExitStack()
        self._handles = [
            # First: before FSDP's all-gather and the sequence split, so the profiler window sees their
            # allocations (and the frees that balance them).
            blocks[0].register_forward_pre_hook(self._enter, prepend=True),
            # Last: after FSDP's reshard and the sequence gather.
            blocks[-1].register_forward_hook(self._exit),
        ]

    def _param_ptrs(self) -> set[int]:
        # During forward FSDP registers the unsharded parameters on the modules: these are what ops save.
        return {local_tensor(p).untyped_storage().data_ptr() for p in self.blocks.parameters()}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        local = local_tensor(t)
        storage = local.untyped_storage()
        ptr = storage.data_ptr()
        if storage.nbytes() and ptr not in self.saved and ptr not in self._param_ptrs():
            self.saved[ptr] = storage.nbytes()
        return t

    def _enter(self, *args: Any) -> None:
        from torch.profiler import ProfilerActivity, profile

        self._profiler = self._stack.enter_context(
            profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        )
        self._stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t))

    def _exit(self, module: nn.Module, args: Any, output: torch.Tensor) -> None:
        self._stack.close()
        for handle in self._handles:
            handle.remove()
        net = sum(event.self_cpu_memory_usage for event in self._profiler.events())
        out = local_tensor(output)
        self.allocated = net - out.numel() * out.element_size()
        self._profiler = None

    @property
    def saved_bytes(self) -> int:
        return sum(self.saved.values())


class Probe(L.Callback):
    """Step times, the block activations of one step, and the state bytes at the end of training."""

    def __init__(self) -> None:
        self.timer = StepTimer()
        self.activations: BlockActivations | None = None
        self.result: dict[str, Any] = {}

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, i: int
    ) -> None:
        if i == MEASURE_STEP:
            self.activations = BlockActivations(pl_module.model.blocks)
        self.timer.on_train_batch_start()

    def on_train_batch_end(self, *args: Any) -> None:
        self.timer.on_train_batch_end()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        assert self.activations is not None, "the measured step did not run: raise --steps"
        self.result = {
            "split_layers": split_layer_bytes(pl_module.model, trainer.optimizers[0]),
            "state_bytes": trainer.strategy.state_bytes(),
            "activation_saved_bytes": self.activations.saved_bytes,
            "activation_allocated_bytes": self.activations.allocated,
        }


# --- the runs -------------------------------------------------------------------------------------


def _loader(cfg: dict[str, Any], world_size: int) -> DataLoader:
    """Random tokens, enough for ``steps`` steps of ``batch_size`` on each of ``world_size`` ranks."""
    g = torch.Generator().manual_seed(0)
    n = cfg["batch_size"] * world_size * cfg["steps"]
    tokens = torch.randint(0, VOCAB, (n, cfg["seq_len"] + 1), generator=g)
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=cfg["batch_size"])


def _fit(flags: dict[str, Any], cfg: dict[str, Any], world_size: int) -> dict[str, Any]:
    probe = Probe()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=ShardStrategy(**flags),
        max_steps=cfg["steps"],
        callbacks=[probe],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    L.seed_everything(0, verbose=False)
    model = GPTModule(
        vocab_size=VOCAB,
        seq_len=cfg["seq_len"],
        d_model=cfg["d_model"],
        n_layers=cfg["n_layers"],
        n_heads=cfg["n_heads"],
        max_steps=cfg["steps"],
    )
    trainer.fit(model, _loader(cfg, world_size))
    timed = probe.timer.times[MEASURE_STEP + 1 :]
    return {**probe.result, "step_s": statistics.median(timed), "steps_timed": len(timed)}


def _bench(cfg: dict[str, Any], world_size: int) -> dict[str, list[dict[str, Any]]]:
    plans = layouts(world_size)
    names = list(plans)
    results: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for r in range(cfg["rounds"]):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # rotate the order each round
            results[name].append(_fit(plans[name], cfg, world_size))
    return results


# --- the report -----------------------------------------------------------------------------------


def _median(values: list[float]) -> float:
    return float(statistics.median(values))


def summarize(per_rank: list[dict[str, list[dict[str, Any]]]], cfg: dict[str, Any], world_size: int) -> dict:
    plans = layouts(world_size)
    out: dict[str, Any] = {"layouts": {}}
    for name, flags in plans.items():
        rounds = [rank[name] for rank in per_rank]  # [rank][round]
        mesh = mesh_of(flags, world_size)
        step_ms = [1000 * run["step_s"] for run in rounds[0]]  # rank 0's clock
        median_ms = _median(step_ms)
        first = [rank_rounds[0] for rank_rounds in rounds]
        entry = {
            "flags": {k: v for k, v in flags.items() if k != "tensor_parallel_plan"},
            "mesh": mesh,
            "sequence_parallel": flags.get("tensor_parallel_size", 1) > 1
            and "tensor_parallel_plan" not in flags,
            "split_layers": {
                key: [r["split_layers"][key] for r in first]
                for key in ("parameters", "gradients", "optimizer")
            },
            "split_modules": first[0]["split_layers"]["modules"],
            "state_bytes": [r["state_bytes"] for r in first],
            "block_activation_bytes": {
                "saved": [_median([run["activation_saved_bytes"] for run in rr]) for rr in rounds],
                "allocated_profiler": [
                    _median([run["activation_allocated_bytes"] for run in rr]) for rr in rounds
                ],
            },
            "median_step_ms": round(median_ms, 2),
            "per_round_step_ms": [round(t, 2) for t in step_ms],
            "tokens_per_step": cfg["batch_size"] * cfg["seq_len"] * mesh["data_parallel"],
        }
        entry["tokens_per_s"] = round(entry["tokens_per_step"] / (median_ms / 1000), 1)
        out["layouts"][name] = entry

    lay, ref = out["layouts"], out["layouts"][REFERENCE]

    def ratios(name: str, get: Any) -> list[float]:
        return [a / b for a, b in zip(get(lay[name]), get(ref), strict=True)]

    out["reference"] = REFERENCE
    out["ratios_vs_reference"] = {
        name: {
            "split_parameters": ratios(name, lambda e: e["split_layers"]["parameters"]),
            "split_optimizer": ratios(name, lambda e: e["split_layers"]["optimizer"]),
            "split_gradients": ratios(name, lambda e: e["split_layers"]["gradients"]),
            "block_activations_saved": ratios(name, lambda e: e["block_activation_bytes"]["saved"]),
            "block_activations_allocated": ratios(
                name, lambda e: e["block_activation_bytes"]["allocated_profiler"]
            ),
            "step_time": lay[name]["median_step_ms"] / ref["median_step_ms"],
        }
        for name in ("tp_sp", "tp")
    }
    rv = out["ratios_vs_reference"]
    lo, hi = 0.5 * (1 - HALF_TOLERANCE), 0.5 * (1 + HALF_TOLERANCE)
    targets = {}
    for kind in ("parameters", "optimizer"):
        values = rv["tp_sp"][f"split_{kind}"] + rv["tp"][f"split_{kind}"]
        targets[f"tp2_halves_split_{kind}"] = {
            "target": f"T=2 / {REFERENCE} (same shard size) in [{lo:.3f}, {hi:.3f}] on every rank",
            "value": [min(values), max(values)],
            "pass": all(lo <= v <= hi for v in values),
        }
    reduction = [1 - r for r in rv["tp_sp"]["block_activations_saved"]]
    targets["sp_block_activation_reduction"] = {
        "target": f"1 - tp_sp / {REFERENCE} block activation bytes >= {MIN_SP_ACTIVATION_REDUCTION} on every rank",
        "value": min(reduction),
        "pass": min(reduction) >= MIN_SP_ACTIVATION_REDUCTION,
    }
    out["tp_without_sp_block_activation_reduction"] = min(1 - r for r in rv["tp"]["block_activations_saved"])
    out["targets"] = targets
    return out


def _mib(n: float) -> str:
    return f"{n / 2**20:8.2f}"


def print_table(world_size: int, summary: dict[str, Any]) -> None:
    print(
        f"\n== {world_size} ranks, mesh replicate x shard x tp; MiB on the rank holding most; rank 0's step time =="
    )
    header = (
        f"{'layout':8} {'mesh':7} {'split params':>13} {'split grads':>12} {'split optim':>12} {'state total':>12}"
        f" {'act saved':>10} {'act prof':>9} {'step ms':>8} {'tok/s':>8}"
    )
    print(header)
    print("-" * len(header))
    for name, e in summary["layouts"].items():
        m = e["mesh"]
        sl, act = e["split_layers"], e["block_activation_bytes"]
        print(
            f"{name:8} {m['replicate']}x{m['shard']}x{m['tp']:<3} {_mib(max(sl['parameters'])):>13}"
            f" {_mib(max(sl['gradients'])):>12}"
            f" {_mib(max(sl['optimizer'])):>12} {_mib(max(s['total'] for s in e['state_bytes'])):>12}"
            f" {_mib(max(act['saved'])):>10} {_mib(max(act['allocated_profiler'])):>9}"
            f" {e['median_step_ms']:8.1f} {e['tokens_per_s']:8.0f}"
        )
    print(
        "act saved: tensors the blocks' forward saves for backward; act prof: bytes it leaves allocated"
        " (torch.profiler), high where collectives free buffers on threads the profiler does not see"
    )
    for name, r in summary["ratios_vs_reference"].items():
        print(
            f"{name} / {summary['reference']}: split params {max(r['split_parameters']):.4f},"
            f" split optim {max(r['split_optimizer']):.4f}, activations saved"
            f" {max(r['block_activations_saved']):.3f} (profiler {max(r['block_activations_allocated']):.3f}),"
            f" step time {r['step_time']:.2f}"
        )
    for key, t in summary["targets"].items():
        value = t["value"]
        shown = (
            f"{value:.3f}" if isinstance(value, float) else "[" + ", ".join(f"{v:.4f}" for v in value) + "]"
        )
        print(f"{'PASS' if t['pass'] else 'FAIL'}  {key}: {shown}  ({t['target']})")
    print(
        f"      tp (no sequence parallel) activation reduction: {summary['tp_without_sp_block_activation_reduction']:.3f}"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--world-sizes", type=int, nargs="+", choices=[2, 4, 8], help="default: 2 4 (--smoke: 4)"
    )
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--n-layers", type=int, default=4)
    parser.add_argument("--n-heads", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=2, help="micro-batch per rank")
    parser.add_argument("--rounds", type=int, default=5, help="runs per layout, interleaved")
    parser.add_argument("--steps", type=int, default=8, help="steps per run (the first two are not timed)")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="a tiny GPT (2 x 64, seq 64), one round of 3 steps, 4 ranks unless --world-sizes says otherwise",
    )
    parser.add_argument("--out", default="benchmarks/results/layouts.json")
    args = parser.parse_args(argv)
    if args.smoke:
        args.d_model, args.n_layers, args.n_heads, args.seq_len = 64, 2, 4, 64
        args.batch_size, args.rounds, args.steps = 2, 1, 3
    if args.world_sizes is None:
        args.world_sizes = [4] if args.smoke else [2, 4]
    if args.steps < MEASURE_STEP + 2:
        parser.error(f"--steps must be at least {MEASURE_STEP + 2} (warm-up, measured, timed)")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    cfg = {
        k: getattr(args, k)
        for k in ("d_model", "n_layers", "n_heads", "seq_len", "batch_size", "rounds", "steps")
    }
    report: dict[str, Any] = {
        "benchmark": "layouts: FSDP, HSDP, tensor parallel x FSDP (stage 3, gloo CPU ranks)",
        "torch": torch.__version__,
        "model": {"vocab_size": VOCAB, **{k: cfg[k] for k in ("d_model", "n_layers", "n_heads", "seq_len")}},
        "batch_size_per_rank": cfg["batch_size"],
        "rounds": cfg["rounds"],
        "steps_per_run": cfg["steps"],
        "smoke": args.smoke,
        "worlds": {},
    }
    for world_size in args.world_sizes:
        per_rank = run_ranks(_bench, cfg, world_size, world_size=world_size)
        summary = summarize(per_rank, cfg, world_size)
        report["worlds"][str(world_size)] = summary
        print_table(world_size, summary)
    report["all_targets_pass"] = all(
        t["pass"] for w in report["worlds"].values() for t in w["targets"].values()
    )
    write_report(report, args.out, printed={"out": args.out, "all_targets_pass": report["all_targets_pass"]})
    return report


if __name__ == "__main__":
    main()
    sys.exit(0)
