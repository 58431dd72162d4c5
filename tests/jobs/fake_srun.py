#!/usr/bin/env python
"""``srun`` for a machine without SLURM: starts the job step's tasks on this host, each its own process with the
variables SLURM gives a task (``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NODEID``, ...), from the job's
allocation as ``sbatch`` exports it (``SLURM_NNODES``, ``SLURM_NTASKS_PER_NODE``, ``SLURM_JOB_NODELIST``). Every
"node" is this host. Exits with the first non-zero exit code of a task."""

from __future__ import annotations

import os
import subprocess
import sys


def main() -> int:
    nodes = int(os.environ["SLURM_NNODES"])
    per_node = int(os.environ["SLURM_NTASKS_PER_NODE"])
    ntasks = nodes * per_node
    procs = []
    for rank in range(ntasks):
        env = {
            **os.environ,
            "SLURM_NTASKS": str(ntasks),
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank % per_node),
            "SLURM_NODEID": str(rank // per_node),
            "SLURM_NODELIST": os.environ.get("SLURM_JOB_NODELIST", "localhost"),
            "SLURM_STEP_NUM_TASKS": str(ntasks),
        }
        procs.append(subprocess.Popen(sys.argv[1:], env=env))
    codes = [proc.wait() for proc in procs]
    return next((code for code in codes if code), 0)


if __name__ == "__main__":
    sys.exit(main())
