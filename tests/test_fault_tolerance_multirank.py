"""Replica groups under ``ShardStrategy(fault_tolerance=...)``: 2 groups x 2 CPU ranks, a Lighthouse, the demo
GPT of ``examples/fault_tolerance/train.py`` with AdamW and a cosine schedule. The failure run is launched as
users launch it (``examples/fault_tolerance/launch.py``: one ``torchrun`` per group, the killed group restarted
alone), beside the others; the runs without failure are 4 spawned processes, each given its group's world as a
``torchrun`` per group would (its own port, ranks and ``REPLICA_GROUP_ID``).

- Without failure the groups give the losses and weights of one 4-rank job (``replicate_size=2``, HSDP, at stages
  2-3; DDP over the 4 ranks at stages 0-1): the cross-group average is HSDP's replicate all-reduce, and each rank of each group reads the
  batch slice that rank of the HSDP job reads (a sampler ignoring the groups reads other data). Their
  checkpoint (written by group 0 alone) resumes in the plain job at an epoch's end (stages 2-3): the next
  steps' losses and the final weights are the groups'.
- Every rank of one group killed mid-run, and only that group restarted, at each stage 0-3 (one launch fits
  the stages in turn; the group dies once in each): the other group's processes run every step to
  ``max_steps`` (its record holds all of them: it never restarted, and no checkpoint exists), some steps with
  it alone; the restarted group heals from it (model, AdamW state, ZeRO-1's partitions, loops, scheduler) and
  both end at the same step with equal weights and optimizer state, to 1e-6 (a heal without the optimizer
  state differs; at stages 0-1 a cross-group mean taken per DDP bucket differs: a restarted group's first
  buckets are not the live one's rebuilt ones). From its heal on, each rank of the healed group reads the rows
  the plain job's rank reads at those steps (torch's ``DistributedSampler`` computed in the test), as the live
  group's ranks do at every step.
  A collective of the live group failed at a later step: that step is discarded on both groups (their weights
  unchanged by it; a step not gated on the commit changes them) and training goes on.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.multirank
pytest.importorskip("torchft")

EXAMPLE = Path(__file__).parents[1] / "examples" / "fault_tolerance"
RANKS = 2
STEPS, FAIL = 16, 12  # the failure run's steps, and the step whose cross-group collective breaks
KILL, REJOIN = 2, 6  # group 1 dies in step 2 (after its backward); the live group waits for its restart at 6
WAIT_STEPS, WAIT_ACCUMULATE = 6, 2  # the run in which every step needs both groups: 12 batches
STAGES = [0, 1, 2, 3]


def _fit_as_group(root: str, lighthouse: str, ports: list[int], plain: bool, stages: list[int]) -> None:
    """One of 4 processes: rank ``r`` of one 4-rank job (``plain``), or rank ``r % 2`` of group ``r // 2``."""
    import argparse
    import importlib.util
    import os

    spec = importlib.util.spec_from_file_location("fault_tolerance_train", EXAMPLE / "train.py")
    assert spec is not None and spec.loader is not None
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    os.environ["NUM_REPLICA_GROUPS"] = "2"
    if not plain:
        group, rank = divmod(int(os.environ["RANK"]), RANKS)
        world = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": RANKS, "LOCAL_WORLD_SIZE": RANKS}
        os.environ.update({k: str(v) for k, v in world.items()}, MASTER_PORT=str(ports[group]))
        os.environ.update(
            REPLICA_GROUP_ID=str(group), TORCHFT_LIGHTHOUSE=lighthouse, TORCHFT_MIN_REPLICAS="2"
        )
    args = argparse.Namespace(
        max_steps=4, die_at_step=None, fail_at_step=None, rejoin_by_step=None, term_at_step=None, step_time=0.0,
        plain=plain, d_model=32, epoch_steps=2, ckpt_every=0 if plain else 2, ft_timeout=20.0, accumulate=1,
    )  # fmt: skip
    for stage in stages:
        train.fit(args, stage, Path(root) / ("plain" if plain else "ft") / f"stage{stage}")
        if plain and stage >= 2:  # again from the groups' checkpoint at step 2
            checkpoint = Path(root) / "ft" / f"stage{stage}" / "ckpt" / "step=2.ckpt"
            train.fit(args, stage, Path(root) / "plain" / f"stage{stage}", resume=checkpoint)


def _records(folder: Path, name: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    ranks = [json.loads((folder / f"{name}.rank{r}.json").read_text()) for r in range(RANKS)]
    return ranks, torch.load(folder / f"{name}.pt", weights_only=True)


def _plain(folder: Path, name: str = "plain") -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The 4-rank HSDP job's records (rank ``g * 2 + r`` reads what rank ``r`` of group ``g`` reads)."""
    ranks = [json.loads((folder / f"{name}.rank{r}.json").read_text()) for r in range(2 * RANKS)]
    return ranks, torch.load(folder / f"{name}.pt", weights_only=True)


def _flat(state: dict[Any, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = value
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``ft``: 2 groups without failure, a checkpoint at step 2; ``plain``: the same as one HSDP job, then again
    from that checkpoint; ``failure``: group 1 killed and restarted at each stage, a collective broken later;
    ``waits``: group 1 killed while group 0 waits for it, and the same as one plain job."""
    from lightning_shard.demos.ranks import free_port, run_ranks
    from lightning_shard.fault_tolerance import serve_lighthouse

    root = tmp_path_factory.mktemp("fault_tolerance")
    kill = ["--kill-group", "1", "--kill-at-step", str(KILL), "--rejoin-by-step", str(REJOIN)]
    failure = [*kill, "--fail-group", "0", "--fail-at-step", str(FAIL), "--step-time", "0.1"]
    failure += ["--ft-timeout", "60"]
    command = [sys.executable, str(EXAMPLE / "launch.py"), "--groups", "2", "--ranks", str(RANKS)]
    # Every step of ``waits`` needs both groups (min_replicas=2): the live group waits in its quorum for the
    # restart, so the run is one plain job's, step for step; that plain job (4 ranks, HSDP) beside it.
    waits = [*command, "--out", str(root / "waits"), "--max-steps", str(WAIT_STEPS), "--stage", "3"]
    waits += ["--accumulate", str(WAIT_ACCUMULATE)]
    plain = [*waits, "--plain"]
    waits += ["--kill-group", "1", "--kill-at-step", str(KILL), "--min-replicas", "2", "--ft-timeout", "120"]
    command += ["--out", str(root / "failure"), "--max-steps", str(STEPS), "--stage", "0,1,2,3", *failure]
    # The launched runs mostly wait (restarts, quorums, a broken collective): beside the spawned ones.
    with open(root / "failure.log", "w") as log, open(root / "waits.log", "w") as waits_log:
        launched = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        waiting = subprocess.Popen(waits, stdout=waits_log, stderr=subprocess.STDOUT)
        port = free_port()
        lighthouse = serve_lighthouse(2, port, join_timeout_ms=2000, heartbeat_timeout_ms=2000)
        try:
            ports = [free_port(), free_port()]
            run_ranks(
                _fit_as_group, str(root), f"http://localhost:{port}", ports, False, STAGES, world_size=4
            )
        finally:
            lighthouse.shutdown()
        run_ranks(_fit_as_group, str(root), "", [], True, STAGES, world_size=4)
        assert subprocess.run(plain, stdout=waits_log, stderr=subprocess.STDOUT, timeout=400).returncode == 0
        assert launched.wait(timeout=400) == 0, (root / "failure.log").read_text()[-6000:]
        assert waiting.wait(timeout=400) == 0, (root / "waits.log").read_text()[-6000:]
    return root


def test_two_groups_without_failure_equal_one_job_at_every_stage(runs):
    tmp_path = runs
    for stage in STAGES:
        # Stages 0-1 average each bucket in the group, then over the groups: another summation order than DDP's
        # one mean over the 4 ranks (HSDP's at stages 2-3 is the same order), so its last bits may differ.
        atol = 1e-6 if stage < 2 else 0
        plain_ranks, plain = _plain(tmp_path / "plain" / f"stage{stage}")
        for group in range(2):
            ranks, saved = _records(tmp_path / "ft" / f"stage{stage}", f"group{group}")
            for rank, record in enumerate(ranks):
                where = f"stage {stage}, group {group}, rank {rank}"
                assert record["participants"] == [2] * 4, where  # every step averaged over both groups
                # Each step's quorum asked for when the step before it committed; none after the last (max_steps).
                assert record["asked_ahead"] == 3, where
                reference = plain_ranks[group * RANKS + rank]["losses"]
                torch.testing.assert_close(record["losses"], reference, rtol=1e-5, atol=0, msg=where)
            for key, weight in plain["weights"].items():
                torch.testing.assert_close(saved["weights"][key], weight, rtol=1e-5, atol=atol, msg=key)
            assert all(r["writes_checkpoints"] == (group == 0) for r in ranks)  # the lowest live group only
        if stage < 2:
            continue
        # The checkpoint the groups wrote at step 2 resumes in a plain run: steps 3-4 as the groups took them.
        resumed_ranks, resumed = _plain(tmp_path / "plain" / f"stage{stage}", "resumed")
        for rank, record in enumerate(resumed_ranks):
            group_record = _records(tmp_path / "ft" / f"stage{stage}", f"group{rank // RANKS}")[0][
                rank % RANKS
            ]
            assert len(record["losses"]) == 2, record
            torch.testing.assert_close(record["losses"], group_record["losses"][2:], rtol=1e-5, atol=0)
        for key, weight in plain["weights"].items():
            torch.testing.assert_close(resumed["weights"][key], weight, rtol=1e-5, atol=atol, msg=key)


def _expected_rows(global_rank: int, steps: range) -> list[list[list[int]]]:
    """The rows rank ``global_rank`` of one plain job of 2 x 2 ranks reads at ``steps`` (all in epoch 0): torch's
    own ``DistributedSampler`` over the demo's data set, seed 0, as Lightning injects it, batches of 4."""
    from torch.utils.data import DistributedSampler

    from lightning_shard.demos.gpt import TextDataModule

    data = TextDataModule(seq_len=32, batch_size=4, n_sentences=400)
    data.setup()
    order = list(
        DistributedSampler(data.dataset, num_replicas=2 * RANKS, rank=global_rank, shuffle=True, seed=0)
    )
    return [[data.dataset[i][0][:8].tolist() for i in order[4 * step : 4 * step + 4]] for step in steps]


@pytest.mark.parametrize("stage", STAGES)
def test_a_killed_group_restarts_alone_and_heals_from_the_live_one_while_it_trains_on(runs, stage):
    """Group 1 killed at step 2 of each stage's fit, restarted alone, healed from group 0: both end with equal
    weights and optimizer state (ZeRO-1's gathered at stage 1), and from its heal on each rank of the healed
    group reads the rows the plain job's rank reads at those steps, as the live group does throughout."""
    steps, fail = STEPS, FAIL
    survivor, survivor_state = _records(runs / "failure" / f"stage{stage}", "group0")
    healed, healed_state = _records(runs / "failure" / f"stage{stage}", "group1")
    # The step at which the healed group took part again. Step KILL is the last with both: group 1 died after its
    # backward, and the next step's quorum is asked for once a step commits. The live group waits at REJOIN
    # until the restart has set up, but the restarted group's first quorum may still land some steps later on a
    # busy machine (its start is seconds of imports and set-up against 0.1 s steps): any step before the broken
    # collective at FAIL, which both groups must take part in, is a heal this test can check.
    back = next(i for i in range(KILL + 1, steps) if survivor[0]["participants"][i] == 2)
    assert KILL + 1 < back < fail, survivor[0]["participants"]
    # A fit's first quorums may come before the other group's set-up has reached the Lighthouse (the groups are
    # separate launches; on a busy machine their imports end seconds apart): the live group trains alone until
    # the other joins by a heal. Both must hold step KILL, where group 1 dies.
    late = next(i for i, n in enumerate(survivor[0]["participants"]) if n == 2)
    assert late <= KILL, survivor[0]["participants"]
    for rank, record in enumerate(survivor):
        assert len(record["losses"]) == steps and record["global_step"] == steps  # one process, every step
        expected = [1] * late + [2] * (KILL + 1 - late) + [1] * (back - KILL - 1) + [2] * (steps - back)
        assert record["asked_ahead"] == steps - 1, record["asked_ahead"]
        assert record["participants"] == expected, (stage, record["participants"])
        # The failed collective: that step discarded (the weights untouched), every other one taken.
        assert record["discarded"] == 1 and record["changed"] == [i != fail for i in range(steps)], record
        assert record["rows"] == _expected_rows(rank, range(steps)), f"stage {stage}, group 0, rank {rank}"
    for rank, record in enumerate(healed):  # it took part in that step, so its step was discarded too
        assert record["discarded"] == 1 and record["changed"][fail - steps] is False, record
        assert record["global_step"] == steps and record["heals"], record  # healed, at the survivor's step
        taken = len(record["losses"])
        assert taken == steps - back  # it ran only the steps after its heal
        assert record["participants"] == [2] * taken, record
        # At the heal it reads on from the batch the live group was at, as one plain job's rank 2 + r does.
        expected = _expected_rows(RANKS + rank, range(steps - taken, steps))
        assert record["rows"] == expected, f"stage {stage}, group 1, rank {rank}: other rows after the heal"
    assert survivor_state["weights"].keys() == healed_state["weights"].keys()
    for key, weight in survivor_state["weights"].items():
        # Equal to the last bits but for the tied embedding / head weight, seen once (1 run in 8) 6e-7 apart.
        torch.testing.assert_close(healed_state["weights"][key], weight, rtol=0, atol=1e-6, msg=key)
    mine, theirs = _flat(survivor_state["optimizer"]), _flat(healed_state["optimizer"])
    assert mine.keys() == theirs.keys() and any(k.endswith("exp_avg_sq") for k in mine)
    for key, value in mine.items():
        if torch.is_tensor(value):
            torch.testing.assert_close(theirs[key], value, rtol=0, atol=1e-6, msg=key)
        else:
            assert theirs[key] == value, key


def test_a_group_killed_while_the_other_waits_for_it_ends_as_one_plain_job(runs):
    """min_replicas=2: no step runs without both groups, so after group 1's death and heal the run is the plain
    job's, step for step: the same rows on every rank and the same final weights (stage 3, AdamW). With
    ``accumulate_grad_batches=2``: group 1 dies after step KILL's second backward, group 0 commits that step and
    waits at the next step's quorum, and the healed group starts at that step's first micro-batch (a heal at
    the second would average one micro-batch's gradient with the live group's two: other weights)."""
    folder = runs / "waits" / "stage3"
    plain_ranks, plain = _plain(folder)
    batches = WAIT_STEPS * WAIT_ACCUMULATE
    for group in range(2):
        ranks, saved = _records(folder, f"group{group}")
        for rank, record in enumerate(ranks):
            taken = len(record["losses"])  # batches
            assert record["global_step"] == WAIT_STEPS, record
            assert record["participants"] == [2] * (taken // WAIT_ACCUMULATE), record
            # (either group may be healed at step 0: torchft's first quorum syncs the groups' initial weights)
            assert (group == 0) == (taken == batches) and (group == 0 or record["heals"]), record
            assert group == 0 or taken == batches - (KILL + 1) * WAIT_ACCUMULATE, record  # the window's start
            reference = plain_ranks[group * RANKS + rank]
            assert record["rows"] == reference["rows"][batches - taken :], f"group {group}, rank {rank}"
            losses = reference["losses"][batches - taken :]
            torch.testing.assert_close(record["losses"], losses, rtol=1e-5, atol=0)
        for key, weight in plain["weights"].items():
            torch.testing.assert_close(saved["weights"][key], weight, rtol=1e-5, atol=1e-7, msg=key)


def test_bench_fault_tolerance_reports_these_runs(runs, tmp_path):
    """``benchmarks/bench_fault_tolerance.py --from`` on the runs above (its full run: docs/benchmarks.md)."""
    from tests.helpers import run_benchmark

    out = tmp_path / "report.json"
    run = run_benchmark(
        "bench_fault_tolerance.py", "--from", str(runs), "--kill-at", str(KILL), "--out", str(out)
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["median_step_seconds"]["ratio"] > 0
    failure = report["failure"]
    assert failure["death_to_rejoin_seconds"] > failure["heal_seconds"] > 0
    assert (
        0 < failure["steps_with_one_group"] <= REJOIN - KILL + 2 and failure["live_group_steps_lost"] == 1
    )  # the broken step


#: Groups of one rank: group 1 preempted (SIGTERM) at step 3 of a Trainer run at stage 2; group 1 of a Fabric
#: loop at stage 3 killed at step 2 and restarted alone, the live group waiting for it at step 6.
TERM_AT, FABRIC_STEPS, FABRIC_FAIL = 3, 10, 8


@pytest.fixture(scope="module")
def groups_of_one(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("groups_of_one")
    launch = [
        sys.executable,
        str(EXAMPLE / "launch.py"),
        "--groups",
        "2",
        "--ranks",
        "1",
        "--step-time",
        "0.1",
    ]
    runs = {
        "sigterm": [*launch, "--stage", "2", "--max-steps", "10", "--term-group", "1"]
        + ["--term-at-step", str(TERM_AT), "--out", str(root / "sigterm")],
        "fabric": [*launch, "--fabric", "--stage", "3", "--max-steps", str(FABRIC_STEPS), "--kill-group", "1"]
        + ["--kill-at-step", str(KILL), "--rejoin-by-step", str(REJOIN), "--out", str(root / "fabric")]
        + ["--fail-group", "0", "--fail-at-step", str(FABRIC_FAIL)],
        # The Fabric loop as one 2-rank HSDP job (replicate_size=2), its first steps both groups' reference.
        "fabric_plain": [*launch, "--fabric", "--plain", "--stage", "3", "--max-steps", str(FABRIC_STEPS)]
        + ["--out", str(root / "fabric")],
    }
    logs = {name: open(root / f"{name}.log", "w") for name in runs}
    try:
        started = {
            name: subprocess.Popen(command, stdout=logs[name], stderr=subprocess.STDOUT)
            for name, command in runs.items()
        }
        for name, process in started.items():
            assert process.wait(timeout=400) == 0, (root / f"{name}.log").read_text()[-6000:]
    finally:
        for log in logs.values():
            log.close()
    return root


def test_sigterm_to_one_group_ends_it_with_its_exception_checkpoint_while_the_other_trains_on(groups_of_one):
    run = groups_of_one / "sigterm" / "stage2"
    # The preempted group: every rank stopped by Lightning's SIGTERMException after the step it was told at,
    # the process exiting 0, its exception checkpoint committed (written though group 0 is the lowest group).
    stopped = json.loads((run / "group1.rank0.stopped.json").read_text())
    assert stopped["exception"] == "SIGTERMException" and stopped["global_step"] >= TERM_AT + 1, stopped
    assert (run / "group1.rank0.exit").read_text() == "0"
    checkpoint = run / "exception" / "group1_on_exception.ckpt"
    assert (checkpoint / ".metadata").is_file() and any(checkpoint.glob("*.distcp")), list(
        checkpoint.iterdir()
    )
    assert not list(run.rglob("*.tmp"))
    assert torch.load(checkpoint / "meta.pt", weights_only=True)["global_step"] == stopped["global_step"]
    # The other group: one process, every step to max_steps, alone from the step after the preemption.
    record = json.loads((run / "group0.rank0.json").read_text())
    assert record["global_step"] == 10 and len(record["losses"]) == 10, record
    alone = record["participants"][stopped["global_step"] :]
    assert alone and set(alone) == {1} and record["participants"][: TERM_AT + 1] == [2] * (TERM_AT + 1), (
        record
    )
    assert not (run / "group0.rank0.stopped.json").exists()
    # Group 1 agreed to stop before its last step, so it asked for no quorum after it: group 0 lost no step.
    assert record["discarded"] == 0, record


def test_a_fabric_loop_heals_a_restarted_group_of_one_rank_from_the_live_one(groups_of_one):
    run = groups_of_one / "fabric" / "fabric"
    live = json.loads((run / "group0.rank0.json").read_text())
    healed = json.loads((run / "group1.rank0.json").read_text())
    # Before the kill both groups average over both (each reads its half of every batch): the 2-rank HSDP job's
    # losses, rank by rank (a sampler ignoring the groups, or no cross-group average, differs).
    died = json.loads((run / "group1.rank0.died.json").read_text())  # what group 1 ran before it was killed
    for group, record in enumerate((live, died)):
        plain = json.loads((run / f"plain.rank{group}.json").read_text())
        torch.testing.assert_close(record["losses"][:KILL], plain["losses"][:KILL], rtol=1e-5, atol=0)
    assert live["started_at"] == 0 and live["step"] == FABRIC_STEPS and len(live["losses"]) == FABRIC_STEPS
    # Step KILL is the last with both: group 1 died after its backward.
    assert live["participants"][: KILL + 1] == [2] * (KILL + 1), live
    assert live["participants"][KILL + 1 : REJOIN] == [1] * (REJOIN - KILL - 1), live
    assert live["participants"][REJOIN:] == [2] * (FABRIC_STEPS - REJOIN), live
    assert live["asked_ahead"] == FABRIC_STEPS, live  # a Fabric loop asks after its last step too
    # The restarted group returned from join_replica_groups at the live group's step, with its schedule.
    assert healed["started_at"] == REJOIN and healed["heals"] and healed["step"] == FABRIC_STEPS, healed
    assert live["scheduler"] == healed["scheduler"] == FABRIC_STEPS
    # Group 0's end of the cross-group collective broken at step 8: both optimizers' steps discarded on both
    # groups (their weights untouched by it), every other step taken.
    assert live["discarded"] == healed["discarded"] == 1, (live, healed)
    assert live["changed"] == [i != FABRIC_FAIL for i in range(FABRIC_STEPS)], live
    assert healed["changed"] == [i != FABRIC_FAIL for i in range(REJOIN, FABRIC_STEPS)], healed
    live_state = torch.load(run / "group0.pt", weights_only=True)
    healed_state = torch.load(run / "group1.pt", weights_only=True)
    for key, weight in live_state["weights"].items():
        torch.testing.assert_close(healed_state["weights"][key], weight, rtol=0, atol=1e-6, msg=key)
    # Both optimizers' state: AdamW's shards and Muon's momentum, kept whole by name on each matrix's owner.
    mine, theirs = _flat(live_state["optimizer"]), _flat(healed_state["optimizer"])
    assert mine.keys() == theirs.keys() and any(
        k.startswith("adamw/") and k.endswith("exp_avg_sq") for k in mine
    )
    assert len([k for k in mine if k.startswith("muon/model.blocks.") and k.endswith("momentum_buffer")]) == 8
    for key, value in mine.items():
        if torch.is_tensor(value):
            torch.testing.assert_close(theirs[key], value, rtol=0, atol=1e-6, msg=key)
