"""Fault tolerance without restart (``ShardStrategy(fault_tolerance=...)``): its cost without failures, and what a
lost replica group costs, on 2 groups x 2 CPU ranks (the demo GPT of ``examples/fault_tolerance``).

    plain      one 4-rank job, ``replicate_size=2`` (HSDP): the same model, data and math
    ft         2 replica groups of 2 ranks, a Lighthouse, every step in a quorum of both (min_replicas=2)
    failure    2 replica groups; every process of group 1 exits at ``--kill-at`` and that group alone is restarted

Measured (rank 0 of each run; steps timed end to end, the first two are warm-up):

    median wait seconds     of the ft step: waiting for the quorum, the cross-group all-reduces, the commit
    median step seconds     plain and ft, and their ratio (goal: <= 1.10); ``--rounds R`` runs the two R times,
                            alternately (plain, ft, plain, ft, ...), and takes the median of every round's steps,
                            so that the machine's drift reaches both alike
    death to rejoin         from group 1's death to its first step after healing (its restart: torchrun, imports,
                            set-up, the heal), and the heal alone (``ft/heal_seconds``)
    steps lost              by the live group: the steps it did not take (0 unless one was discarded); a restart
                            from a checkpoint every ``--ckpt-every`` steps would lose ``kill_at mod ckpt_every``
                            steps on every group, plus every group's restart

    python benchmarks/bench_fault_tolerance.py --out benchmarks/results/fault_tolerance.json
    python benchmarks/bench_fault_tolerance.py --d-model 256 --out benchmarks/results/fault_tolerance_256.json
    python benchmarks/bench_fault_tolerance.py --from DIR --out report.json   # report runs already made
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from _common import write_report

LAUNCH = Path(__file__).parents[1] / "examples" / "fault_tolerance" / "launch.py"


def _rank0(folder: Path, name: str) -> dict[str, Any]:
    record: dict[str, Any] = json.loads((folder / f"{name}.rank0.json").read_text())
    return record


def step_seconds(record: dict[str, Any]) -> list[float]:
    times = record["times"][2:]
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def median_step_seconds(record: dict[str, Any]) -> float:
    return statistics.median(step_seconds(record))


def analyze(
    plain: list[Path], ft: list[Path], failure: Path | None, kill_at: int, ckpt_every: int
) -> dict[str, Any]:
    """The report of runs already made by ``examples/fault_tolerance/launch.py`` (each a ``stageS`` folder; the
    plain and ft runs of every round)."""
    report: dict[str, Any] = {}
    if plain and ft:
        base = statistics.median(s for folder in plain for s in step_seconds(_rank0(folder, "plain")))
        tolerant = statistics.median(s for folder in ft for s in step_seconds(_rank0(folder, "group0")))
        report["median_step_seconds"] = {
            "plain": base,
            "ft": tolerant,
            "ratio": tolerant / base,
            "rounds": min(len(plain), len(ft)),
        }
        # Where the fault-tolerant step waits (rank 0 of group 0, the steps timed above): medians per step.
        waits = [w for folder in ft for w in _rank0(folder, "group0").get("waits", [])[2:]]
        if waits:
            report["median_wait_seconds"] = {
                key: statistics.median(w[key] for w in waits) for key in ("quorum", "cross_group", "commit")
            }
    if failure is not None:
        survivor, healed = _rank0(failure, "group0"), _rank0(failure, "group1")
        died = (failure / "group1.died").stat().st_mtime
        steps = survivor["global_step"]
        report["failure"] = {
            "death_to_rejoin_seconds": healed["times"][0] - died,
            "heal_seconds": healed["heals"][-1] if healed["heals"] else None,
            "steps_with_one_group": survivor["participants"].count(1),
            "live_group_steps_lost": steps - (len(survivor["losses"]) - survivor["discarded"]),
            "restart_from_checkpoint_steps_lost_per_group": kill_at % ckpt_every if ckpt_every else kill_at,
        }
    return report


def _launch(out: Path, *args: str) -> None:
    done = subprocess.run(
        [sys.executable, str(LAUNCH), "--groups", "2", "--ranks", "2", "--out", str(out), *args]
    )
    if done.returncode != 0:
        raise SystemExit(f"{LAUNCH} {' '.join(args)} failed ({done.returncode})")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--kill-at", type=int, default=10)
    parser.add_argument("--d-model", type=int, default=32, help="the demo GPT's width (a longer step: 256)")
    parser.add_argument("--ckpt-every", type=int, default=25, help="the restart-from-checkpoint comparison")
    parser.add_argument("--rounds", type=int, default=2, help="plain and ft runs, alternately, R times each")
    parser.add_argument("--work", type=Path, default=Path("outputs/bench_fault_tolerance"))
    parser.add_argument(
        "--from", dest="made", type=Path, help="report the runs already in DIR/{plain,ft,failure}"
    )
    args = parser.parse_args()
    root = args.made or args.work
    if args.made is None:
        steps = ["--max-steps", str(args.steps), "--stage", "3", "--d-model", str(args.d_model)]
        for r in range(args.rounds):
            suffix = "" if r == 0 else f"_{r}"
            _launch(root / f"plain{suffix}", *steps, "--plain")
            _launch(root / f"ft{suffix}", *steps, "--min-replicas", "2")
        kill = [
            "--kill-group",
            "1",
            "--kill-at-step",
            str(args.kill_at),
            "--rejoin-by-step",
            str(args.kill_at + 5),
        ]
        _launch(root / "failure", *steps, *kill)

    def rounds(name: str) -> list[Path]:  # name, name_1, name_2, ...: the rounds made
        made = [root / name, *sorted(root.glob(f"{name}_[0-9]*"), key=lambda p: int(p.name.split("_")[-1]))]
        return [folder / "stage3" for folder in made if (folder / "stage3").exists()]

    failure = root / "failure" / "stage3"
    report = {
        "config": {
            "groups": 2,
            "ranks": 2,
            "stage": 3,
            "steps": args.steps,
            "kill_at": args.kill_at,
            "d_model": args.d_model,
        },
        **analyze(
            rounds("plain"),
            rounds("ft"),
            failure if failure.exists() else None,
            args.kill_at,
            args.ckpt_every,
        ),
    }
    write_report(report, args.out)


if __name__ == "__main__":
    main()
