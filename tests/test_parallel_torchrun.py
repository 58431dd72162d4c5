"""HSDP across 2 "nodes": two torchrun launches on one host (node ranks 0 and 1, 2 processes each, static
rendezvous on loopback) train with ``ShardStrategy(stage=3, replicate_size=2)``. Both exit 0, the losses
follow one process, and the mesh shards within a node and replicates across nodes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lightning_shard.demos.ranks import free_port
from tests.test_parity_multirank import CLIP, reference

pytestmark = pytest.mark.multirank

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "jobs" / "hsdp_job.py"
TIMEOUT = 300
# Set by an enclosing launcher; torchrun sets its workers' own.
_LAUNCH_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def _start(node_rank: int, port: int, out: Path, log: Path) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--node-rank",
        str(node_rank),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        str(JOB),
        "--out",
        str(out),
    ]
    env = {key: value for key, value in os.environ.items() if key not in _LAUNCH_VARS}
    pythonpath = [str(ROOT), *filter(None, [env.get("PYTHONPATH")])]
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(pythonpath))
    with open(log, "w") as f:  # a file, not a pipe: neither launch can block on unread output
        # Its own session, so a launch that overruns is stopped with its workers.
        return subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
        )


def _wait(procs: list[subprocess.Popen], logs: list[Path]) -> list[int]:
    deadline = time.monotonic() + TIMEOUT
    try:
        return [proc.wait(timeout=max(deadline - time.monotonic(), 1)) for proc in procs]
    except subprocess.TimeoutExpired:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        tails = "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in logs)
        pytest.fail(f"the torchrun launches did not finish in {TIMEOUT}s\n{tails}")


def test_hsdp_two_nodes_under_torchrun_follows_one_process_and_shards_within_a_node(tmp_path):
    out = tmp_path / "result.json"
    port = free_port()
    logs = [tmp_path / f"node{n}.log" for n in (0, 1)]
    procs = [_start(n, port, out, logs[n]) for n in (0, 1)]
    codes = _wait(procs, logs)
    for node, code in enumerate(codes):
        assert code == 0, f"node {node} exited {code}\n{logs[node].read_text()[-3000:]}"
    for node, ranks in ((0, (0, 1)), (1, (2, 3))):
        text = logs[node].read_text()
        for rank in ranks:
            assert f"rank {rank} finished fit at step 3" in text, text[-3000:]

    result = json.loads(out.read_text())
    assert result["world"] == 4
    # 4 data-parallel ranks x batch 2 read what one process reads with batch 8.
    expected = reference("sgd", 2, CLIP)
    assert len(expected) == 6
    torch.testing.assert_close(result["losses"], expected, rtol=1e-5, atol=0)

    ranks = {facts["rank"]: facts for facts in result["ranks"]}
    assert sorted(ranks) == [0, 1, 2, 3]
    for rank, facts in ranks.items():
        node = rank // 2
        assert (facts["node_rank"], facts["local_rank"]) == (node, rank % 2)
        assert facts["dim_names"] == ["replicate", "shard", "tp"]
        assert facts["shape"] == [2, 2, 1]
        assert facts["groups"]["shard"] == [2 * node, 2 * node + 1]  # within the node
        assert facts["groups"]["replicate"] == [rank % 2, rank % 2 + 2]  # across the nodes
        assert facts["groups"]["tp"] == [rank]
        assert facts["sampler"] == {"num_replicas": 4, "rank": rank}
        # FSDP2 on the 2-D (replicate, shard) mesh: replicated across nodes, sharded within one.
        assert facts["param_mesh"] == ["replicate", "shard"]
        assert facts["param_placements"] == ["R", "S(0)"]
