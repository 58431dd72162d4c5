"""A fault-tolerant run on one machine: a Lighthouse and N replica groups of ``train.py`` (one ``torchrun`` each).

    python examples/fault_tolerance/launch.py --groups 2 --ranks 2 --out outputs/ft --kill-group 1 --kill-at-step 8

With ``--kill-group G --kill-at-step K`` every process of group G exits in step K, after its backward (as a lost
host would); the launcher restarts that group alone, and it heals from a live group while the others train on: no process of
theirs restarts, and no checkpoint is read. ``--fail-group G --fail-at-step K`` fails one collective of group G
at step K: that step is discarded on every group taking part, and training goes on. ``--term-group G --term-at-step K`` preempts group G at step K (SIGTERM to its ``torchrun``, as SLURM sends it):
that group writes its exception checkpoint and ends, and the others train on. ``--fabric`` runs each
group as a Fabric loop (``fabric_train.py``) in place of the Trainer. ``--plain`` runs the same model as one HSDP job of
``groups x ranks`` processes instead (the reference a fault-free run equals). Each group writes its losses and
what it did (participants per step, steps discarded, heal time) to ``OUT/stageS/groupG.rankR.json``, its final
weights and optimizer state to ``OUT/stageS/groupG.pt``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from lightning_shard.demos.ranks import free_port
from lightning_shard.fault_tolerance import serve_lighthouse

TRAIN = Path(__file__).with_name("train.py")
FABRIC_TRAIN = Path(__file__).with_name("fabric_train.py")


def torchrun(ranks: int, *args: str, env: dict[str, str], script: Path = TRAIN) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    return subprocess.Popen([*command, str(script), *args], env={**os.environ, **env})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=2, help="processes per group")
    parser.add_argument("--stage", default="3", help="the ZeRO stage, or several fitted in turn (2,3)")
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--kill-group", type=int, default=None)
    parser.add_argument("--kill-at-step", type=int, default=8)
    parser.add_argument(
        "--rejoin-by-step", type=int, default=None, help="live groups wait there for the killed one's restart"
    )
    parser.add_argument("--fail-group", type=int, default=None, help="a group whose collective fails once")
    parser.add_argument("--fail-at-step", type=int, default=12)
    parser.add_argument("--term-group", type=int, default=None, help="a group preempted (SIGTERM) once")
    parser.add_argument("--term-at-step", type=int, default=4)
    parser.add_argument(
        "--min-replicas", type=int, default=1, help="groups each step needs (2: no step alone)"
    )
    parser.add_argument("--step-time", type=float, default=0.0, help="seconds each step sleeps (a demo)")
    parser.add_argument(
        "--ft-timeout", type=float, default=20.0, help="seconds for a quorum (min_replicas groups), a heal"
    )
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches of each group")
    parser.add_argument(
        "--fabric", action="store_true", help="a Fabric loop (fabric_train.py), not the Trainer"
    )
    parser.add_argument("--epoch-steps", type=int, default=None, help="steps per epoch")
    parser.add_argument("--d-model", type=int, default=32, help="the demo GPT's width")
    parser.add_argument(
        "--ckpt-every", type=int, default=0, help="a checkpoint every N steps (OUT/stageS/ckpt)"
    )
    parser.add_argument(
        "--resume", type=Path, help="(--plain) also fit from that run's checkpoint at --resume-step"
    )
    parser.add_argument("--resume-step", type=int, default=2)
    args = parser.parse_args(argv)
    script = FABRIC_TRAIN if args.fabric else TRAIN
    train = ["--stage", args.stage, "--max-steps", str(args.max_steps), "--out", str(args.out)]
    train += ["--step-time", str(args.step_time), "--d-model", str(args.d_model)]
    train += ["--ft-timeout", str(args.ft_timeout), "--accumulate", str(args.accumulate)]
    if args.rejoin_by_step is not None:
        train += ["--rejoin-by-step", str(args.rejoin_by_step)]
    if args.epoch_steps is not None:
        train += ["--epoch-steps", str(args.epoch_steps)]
    train += ["--ckpt-every", str(args.ckpt_every)]
    if args.resume is not None:
        train += ["--resume", str(args.resume), "--resume-step", str(args.resume_step)]
    if args.plain:
        env = {"NUM_REPLICA_GROUPS": str(args.groups)}
        return torchrun(args.groups * args.ranks, *train, "--plain", env=env, script=script).wait()

    port = free_port()
    # A quorum waits up to 2 s for groups that heartbeat but have not asked yet (a restarted one, setting up);
    # a group silent for 2 s is gone.
    lighthouse = serve_lighthouse(args.min_replicas, port, join_timeout_ms=2000, heartbeat_timeout_ms=2000)
    env = {
        "NUM_REPLICA_GROUPS": str(args.groups),
        "TORCHFT_LIGHTHOUSE": f"http://localhost:{port}",
        "TORCHFT_MIN_REPLICAS": str(args.min_replicas),
    }
    try:
        groups = {}
        for g in range(args.groups):
            kill = ["--die-at-step", str(args.kill_at_step)] if g == args.kill_group else []
            kill += ["--fail-at-step", str(args.fail_at_step)] if g == args.fail_group else []
            kill += ["--term-at-step", str(args.term_at_step)] if g == args.term_group else []
            groups[g] = torchrun(
                args.ranks, *train, *kill, env={**env, "REPLICA_GROUP_ID": str(g)}, script=script
            )
        restarts = len(args.stage.split(","))  # the killed group dies once in each stage's fit
        while any(p.poll() is None for p in groups.values()):
            time.sleep(0.5)
            # A preempted group's torchrun ends with its own error after passing SIGTERM on: it is not restarted.
            dead = [g for g, p in groups.items() if p.poll() not in (None, 0) and g != args.term_group]
            if dead == [args.kill_group] and restarts:
                print(f"launch: group {args.kill_group} died; restarting it alone", flush=True)
                kill = ["--die-at-step", str(args.kill_at_step)]  # (in the stages after this one)
                groups[args.kill_group] = torchrun(
                    args.ranks,
                    *train,
                    *kill,
                    env={**env, "REPLICA_GROUP_ID": str(args.kill_group)},
                    script=script,
                )
                restarts -= 1
            elif dead:
                for p in groups.values():
                    p.kill()
                return 1
        return max(p.returncode for g, p in groups.items() if g != args.term_group)
    finally:
        lighthouse.shutdown()


if __name__ == "__main__":
    sys.exit(main())
