"""Exit-code stress: many consecutive 2-rank jobs, launched as users launch them, judged by exit code.

Each job is ``python tests/jobs/exit_job.py`` (Lightning's launcher starts rank 1; both ranks leave
through normal interpreter shutdown), training a small GPT for a few steps with checkpoints every
2 steps. For every engine and stage, N jobs run one after the other (FSDP engine: alternating async
checkpoints off and on). A job fails when it exits non-zero or does not finish within ``--job-timeout``; the
report lists each failure's exit code and the last lines it printed.

    python benchmarks/stress_exit.py                      # N=25 per engine and stage
    python benchmarks/stress_exit.py --runs 100 --engines fsdp --stages 1 --out stress.json
    python benchmarks/stress_exit.py --runs 20 --stages 1 3 --after-fit     # collectives after fit and test
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

JOB = Path(__file__).resolve().parent.parent / "tests" / "jobs" / "exit_job.py"


def run_job(
    engine: str, stage: int, async_checkpoint: bool, job_timeout: float, after_fit: bool = False
) -> dict:
    root = tempfile.mkdtemp(prefix="stress_exit_")
    cmd = [sys.executable, str(JOB), "--root", root, "--engine", engine, "--stage", str(stage)]
    if async_checkpoint:
        cmd.append("--async-checkpoint")
    if after_fit:
        cmd += ["--then-test", "--collectives"]
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=job_timeout, stdin=subprocess.DEVNULL
        )
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:
        rc = "timeout"
        out = (err.stdout or b"").decode(errors="replace") + (err.stderr or b"").decode(errors="replace")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    seconds = time.perf_counter() - start
    finished = out.count("finished fit at step")
    return {
        "engine": engine,
        "stage": stage,
        "async_checkpoint": async_checkpoint,
        "rc": rc,
        "seconds": round(seconds, 2),
        "ranks_finished_training": finished,
        "tail": out.strip().splitlines()[-6:] if rc != 0 else [],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=25, help="jobs per engine and stage")
    parser.add_argument("--engines", nargs="+", default=["fsdp", "deepspeed"])
    parser.add_argument("--stages", nargs="+", type=int, default=[0, 1, 2, 3])
    parser.add_argument("--job-timeout", type=float, default=300.0)
    parser.add_argument(
        "--after-fit",
        action="store_true",
        help="each job also fits again, tests, and runs collectives after each call before it exits",
    )
    parser.add_argument("--out", default=None, help="write the JSON report here")
    args = parser.parse_args()

    jobs = []
    for engine in args.engines:
        for stage in args.stages:
            for i in range(args.runs):
                # DeepSpeed writes its own checkpoints (async_checkpoint is an FSDP-engine flag).
                async_checkpoint = bool(i % 2) and engine == "fsdp"
                result = run_job(
                    engine, stage, async_checkpoint, job_timeout=args.job_timeout, after_fit=args.after_fit
                )
                jobs.append(result)
                status = "ok" if result["rc"] == 0 else f"FAILED rc={result['rc']}"
                print(
                    f"{engine} stage {stage} async={result['async_checkpoint']} run {i + 1}: {status}"
                    f" ({result['seconds']} s)",
                    flush=True,
                )
    failures = [j for j in jobs if j["rc"] != 0]
    report = {
        "jobs": len(jobs),
        "failures": len(failures),
        "exit_codes": dict(Counter(str(j["rc"]) for j in jobs)),
        "median_seconds": sorted(j["seconds"] for j in jobs)[len(jobs) // 2] if jobs else None,
        "failed": failures,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
