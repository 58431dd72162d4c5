"""The package's shape holds: import layers and no cycles (import-linter), the core and the Fabric door free
of ``lightning.pytorch``, modules of a readable size, and the flag table of the docs derived from the flags."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

from lightning_shard.flags import flag_table

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_shard"
MAX_LINES = 450


def _lint_imports(package_parent: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(package_parent)}
    lint = Path(sys.executable).with_name("lint-imports")
    return subprocess.run(
        [str(lint), "--config", str(ROOT / ".importlinter"), "--no-cache"],
        cwd=package_parent,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_import_contracts_hold():
    run = _lint_imports(ROOT)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "BROKEN" not in run.stdout and run.stdout.count("KEPT") >= 2, run.stdout[-4000:]


@pytest.mark.parametrize(
    ("module", "planted"),
    [
        # An upward import: the core reaching a door.
        ("core/transform.py", "from lightning_shard.trainer import strategy as _planted  # noqa\n"),
        # A cycle hidden inside a function: a module low in checkpoint/ importing one that imports it.
        (
            "checkpoint/layout.py",
            "def _planted():\n    from lightning_shard.checkpoint import sharded  # noqa\n",
        ),
    ],
)
def test_import_contracts_fail_on_a_planted_violation(tmp_path, module, planted):
    shutil.copytree(PACKAGE, tmp_path / "lightning_shard", ignore=shutil.ignore_patterns("__pycache__"))
    with open(tmp_path / "lightning_shard" / module, "a") as file:
        file.write("\n" + planted)
    run = _lint_imports(tmp_path)
    assert run.returncode != 0 and "BROKEN" in run.stdout, run.stdout[-4000:]


def test_the_core_and_the_fabric_door_import_no_trainer_code():
    graph = grimp.build_graph("lightning_shard", include_external_packages=True, cache_dir=None)
    found = []
    for module in sorted(graph.modules):
        if not module.startswith(("lightning_shard.core", "lightning_shard.fabric")):
            continue
        for detail in graph.get_import_details(importer=module, imported="lightning"):
            if (
                "lightning.pytorch" in detail["line_contents"]
                or "import lightning as" in detail["line_contents"]
            ):
                found.append(f"{module}:{detail['line_number']}: {detail['line_contents']}")
        for trainer in graph.find_modules_directly_imported_by(module):
            if trainer.startswith("lightning_shard.trainer"):
                found.append(f"{module} -> {trainer}")
    assert not found, found


def test_no_module_is_longer_than_the_guide():
    long = {
        str(p.relative_to(ROOT)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, long


def test_the_docs_flag_table_is_the_one_derived_from_the_flags():
    docs = (ROOT / "docs" / "architecture.md").read_text()
    assert flag_table() in docs, "docs/architecture.md: paste the output of `python -m lightning_shard.flags`"
