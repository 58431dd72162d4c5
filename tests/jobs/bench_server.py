"""Runs benchmark scripts one after another in this one interpreter, as ``python benchmarks/<script> ARGS`` would.

The benchmarks' smoke tests are small runs whose time goes mostly to starting interpreters: this process imports
torch and Lightning once, and the ranks every benchmark spawns fork from one preloaded server
(``lightning_shard.demos.ranks``). Each request is one JSON line on stdin, ``{"script": ..., "args": [...]}``;
each answer one JSON line on the file descriptor given as the first argument, ``{"returncode", "stdout",
"stderr"}``: the exit code ``main()`` ends with (its ``SystemExit``, 1 for an exception with its traceback in
``stderr``, else 0) and what it printed. Output of the ranks goes to this process's own stdout and stderr.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import sys
import traceback
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def run(script: str, args: list[str]) -> dict:
    out, err = io.StringIO(), io.StringIO()
    code: object = 0
    sys.argv = [str(BENCHMARKS / script), *args]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            importlib.import_module(Path(script).stem).main()
        except SystemExit as exit_:
            code = exit_.code
        except BaseException:  # noqa: BLE001  (reported as a script's uncaught exception is)
            traceback.print_exc()
            code = 1
    _end_process_group()
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=err)
        code = 1
    return {"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


def _end_process_group() -> None:
    """A script's process would end with its default process group; the next script starts without one (a dry
    run refuses to play fake ranks in a process that has one)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def main() -> None:
    answers = os.fdopen(int(sys.argv[1]), "w")
    sys.path.insert(0, str(BENCHMARKS))  # as for a script in benchmarks/: `from _common import ...`
    for line in sys.stdin:
        request = json.loads(line)
        answers.write(json.dumps(run(request["script"], request["args"])) + "\n")
        answers.flush()


if __name__ == "__main__":
    main()
