"""The package's shape holds: import layers and no cycles (import-linter), the core and the Fabric door free
of ``lightning.pytorch``, modules of a readable size, and the flag table of the docs derived from the flags."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

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
    assert "BROKEN" not in run.stdout and run.stdout.count("KEPT") >= 4, run.stdout[-4000:]


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
        # A test tool in production code (``mock.patch`` once swapped DeepSpeed's engine class).
        ("engines/deepspeed/experts.py", "def _planted():\n    from unittest import mock  # noqa\n"),
        # A door reaching into an engine's own module past the engines package.
        ("fabric/_setup.py", "def _planted():\n    from lightning_shard.engines import _shm  # noqa\n"),
    ],
)
def test_import_contracts_fail_on_a_planted_violation(tmp_path, module, planted):
    shutil.copytree(PACKAGE, tmp_path / "lightning_shard", ignore=shutil.ignore_patterns("__pycache__"))
    with open(tmp_path / "lightning_shard" / module, "a") as file:
        file.write("\n" + planted)
    run = _lint_imports(tmp_path)
    assert run.returncode != 0 and "BROKEN" in run.stdout, run.stdout[-4000:]


#: The Trainer's side of the package: the Trainer door and the Lightning callbacks (and the demo LightningModule).
#: Everything else (the Fabric door, the core, the engines, every capability package, the leaves) stands on torch
#: and ``lightning.fabric``.
TRAINER_SIDE = (
    "lightning_shard.trainer",
    "lightning_shard.cli",
    "lightning_shard.ray",
    "lightning_shard.callbacks",
    "lightning_shard.averaging",
    "lightning_shard.demos",
    "lightning_shard.activation_checkpointing.callback",
)


def trainer_code_reached(package_parent: str) -> list[str]:
    """Every chain from a module outside :data:`TRAINER_SIDE` to a module that imports ``lightning.pytorch`` (or
    ``import lightning``, whose ``__init__`` loads it): direct imports, imports inside functions, and the parent
    packages whose ``__init__`` an import runs, followed through the package's own modules."""
    sys.path.insert(0, package_parent)
    graph = grimp.build_graph("lightning_shard", include_external_packages=True, cache_dir=None)
    importers = {}
    for module in graph.modules:
        if not module.startswith("lightning_shard"):
            continue
        for detail in graph.get_import_details(importer=module, imported="lightning"):
            line = detail["line_contents"].strip()
            if (
                "lightning.pytorch" in line
                or line == "import lightning"
                or line.startswith("import lightning as")
            ):
                importers[module] = f"{detail['line_number']}: {line}"
    roots = [m for m in graph.modules if m.startswith("lightning_shard") and not m.startswith(TRAINER_SIDE)]
    parent: dict[str, str] = {}
    seen: set[str] = set()
    stack = list(roots)
    while stack:
        module = stack.pop()
        if module in seen:
            continue
        seen.add(module)
        parts = module.split(".")
        reached = set(graph.find_modules_directly_imported_by(module))
        reached |= {".".join(parts[:i]) for i in range(1, len(parts))}  # the packages the import runs first
        for other in reached:
            if other.startswith("lightning_shard") and other not in seen:
                parent.setdefault(other, module)
                stack.append(other)
    chains = []
    for module in sorted(seen & set(importers)):
        chain = [module]
        while chain[-1] in parent:
            chain.append(parent[chain[-1]])
        chains.append(f"{importers[module]} in {' <- '.join(chain)}")
    return chains


def _trainer_code_reached_in(package_parent: Path) -> list[str]:
    run = subprocess.run(
        [sys.executable, __file__, str(package_parent)], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_nothing_below_the_trainer_door_reaches_trainer_code():
    assert _trainer_code_reached_in(ROOT) == []


@pytest.mark.parametrize(
    ("module", "planted"),
    [
        ("core/transform.py", "import lightning.pytorch as _planted  # noqa\n"),
        # through a module the Fabric door imports, inside a function
        ("precision.py", "def _planted():\n    from lightning.pytorch.plugins import Precision  # noqa\n"),
        # an engine importing the Trainer door's own module
        (
            "engines/fsdp/engine.py",
            "def _planted():\n    from lightning_shard.trainer import precision  # noqa\n",
        ),
    ],
)
def test_a_planted_trainer_import_below_the_doors_is_found(tmp_path, module, planted):
    shutil.copytree(PACKAGE, tmp_path / "lightning_shard", ignore=shutil.ignore_patterns("__pycache__"))
    with open(tmp_path / "lightning_shard" / module, "a") as file:
        file.write("\n" + planted)
    found = _trainer_code_reached_in(tmp_path)
    assert found and any(module.replace("/", ".").removesuffix(".py") in chain for chain in found), found


def test_importing_the_fabric_door_the_core_the_engines_and_the_capabilities_loads_no_trainer_code():
    # ``import lightning.fabric`` runs ``lightning/__init__``, which itself imports ``lightning.pytorch``
    # (Trainer, LightningModule, Callback): those modules are Lightning's own. What is asserted is that this
    # package adds none, and that none of its Trainer-side modules load.
    free = [
        "lightning_shard",
        "lightning_shard.fabric",
        "lightning_shard.core",
        "lightning_shard.engines",
        "lightning_shard.engines.fsdp",
        "lightning_shard.engines.deepspeed",
        "lightning_shard.precision",
        *sorted(
            f"lightning_shard.{p.name}"
            for p in PACKAGE.iterdir()
            if p.is_dir() and (p / "__init__.py").exists() and f"lightning_shard.{p.name}" not in TRAINER_SIDE
        ),
    ]
    code = (
        "import json, sys, importlib\n"
        "import lightning.fabric\n"
        "own = {m for m in sys.modules if m.startswith('lightning.pytorch')}\n"
        f"for name in {free!r}: importlib.import_module(name)\n"
        "added = sorted(m for m in sys.modules if m.startswith('lightning.pytorch') and m not in own)\n"
        f"trainer_side = sorted(m for m in sys.modules if m.startswith({TRAINER_SIDE!r}))\n"
        "print(json.dumps([len(own), added, trainer_side]))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    own, added, trainer_side = json.loads(run.stdout.strip().splitlines()[-1])
    assert own > 0  # lightning's own __init__ loads them: the baseline this compares with
    assert added == [] and trainer_side == [], (added, trainer_side)


def test_the_public_names_import_lazily():
    code = (
        "import json, sys\n"
        "import lightning_shard\n"
        "before = 'lightning_shard.trainer.strategy' in sys.modules\n"
        "from lightning_shard import ShardStrategy, ShardPrecision, ActivationCheckpointing\n"
        "import lightning as L\n"
        "trainer = L.Trainer(strategy='zero3', accelerator='cpu', devices=1, logger=False)\n"
        "print(json.dumps([before, type(trainer.strategy) is ShardStrategy, ShardStrategy.__module__]))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    before, registered, module = json.loads(run.stdout.strip().splitlines()[-1])
    assert not before and registered and module == "lightning_shard.trainer.strategy"


def test_no_module_is_longer_than_the_guide():
    long = {
        str(p.relative_to(ROOT)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, long


def test_every_flag_is_read_where_the_flag_table_says():
    import dataclasses

    from lightning_shard.flags import ShardFlags

    missing = []
    for flag in dataclasses.fields(ShardFlags):
        for place in flag.metadata["where"].split(", "):
            path = PACKAGE / place
            files = sorted(path.rglob("*.py")) if place.endswith("/") else [path]
            if not files or not all(f.exists() for f in files):
                missing.append(f"{flag.name}: {place} does not exist")
            elif not any(flag.name in f.read_text() for f in files):
                missing.append(f"{flag.name}: {place} never names it")
    assert not missing, missing


def test_the_docs_trainer_side_list_is_the_one_checked():
    docs = (ROOT / "docs" / "architecture.md").read_text()
    listed = docs.split("<!-- trainer-side: the list tests/test_architecture.py checks -->")[1].split("<!--")[
        0
    ]
    named = {line.split("`")[1] for line in listed.strip().splitlines() if line.startswith("- `")}
    assert named == set(TRAINER_SIDE), named ^ set(TRAINER_SIDE)


def test_the_docs_flag_table_is_the_one_derived_from_the_flags():
    # imported here: run as a script (on a copy of the package), this file must not import the installed one
    from lightning_shard.flags import flag_table

    docs = (ROOT / "docs" / "architecture.md").read_text()
    assert flag_table() in docs, "docs/architecture.md: paste the output of `python -m lightning_shard.flags`"


def engine_name_comparisons(package: Path) -> list[str]:
    """``file:line`` of each comparison, outside ``engines/``, with a registered engine's name as a string
    constant (``engine == "deepspeed"``, ``engine in ("fsdp", ...)``): callers ask the engine's declaration."""
    import ast

    from lightning_shard.engines import NAMES

    def names_an_engine(node: ast.expr) -> bool:
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(names_an_engine(element) for element in node.elts)
        return isinstance(node, ast.Constant) and node.value in NAMES

    found = []
    for path in sorted(package.rglob("*.py")):
        if path.relative_to(package).parts[0] == "engines":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Compare) and any(map(names_an_engine, [node.left, *node.comparators])):
                found.append(f"{path.relative_to(package)}:{node.lineno}")
    return found


def test_nothing_outside_the_engines_compares_an_engine_name():
    # What an engine supports is its ``capabilities`` (lightning_shard/engines/capabilities.py).
    assert engine_name_comparisons(PACKAGE) == []


@pytest.mark.parametrize(
    "planted",
    [
        "def _planted(engine):\n    return engine == 'deepspeed'\n",
        "def _planted(engine):\n    return engine not in ('auto', 'fsdp')\n",
    ],
)
def test_a_planted_engine_name_comparison_is_found(tmp_path, planted):
    shutil.copytree(PACKAGE, tmp_path / "lightning_shard", ignore=shutil.ignore_patterns("__pycache__"))
    with open(tmp_path / "lightning_shard" / "config.py", "a") as file:
        file.write("\n" + planted)
    assert [place.split(":")[0] for place in engine_name_comparisons(tmp_path / "lightning_shard")] == [
        "config.py"
    ]


def engine_calls_from_the_doors(package: Path) -> list[str]:
    """``file:line`` of each attribute a door (``trainer/``, ``fabric/``, ``ray.py``) reads off an engine or its
    class (``self.engine.teardown``, ``session.engine.owns_step``, ``engine_class.capabilities``): the doors
    ask the session and the core's :class:`~lightning_shard.core.lifecycle.EngineLifecycle`."""
    import ast

    engine_names = {"engine", "_engine", "_engine_class", "engine_class"}
    paths = [*sorted((package / "trainer").rglob("*.py")), *sorted((package / "fabric").rglob("*.py"))]
    found = []
    for path in [*paths, package / "ray.py"]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Attribute):
                continue
            receiver = node.value
            name = receiver.attr if isinstance(receiver, ast.Attribute) else getattr(receiver, "id", None)
            if name in engine_names:
                found.append(f"{path.relative_to(package)}:{node.lineno} {name}.{node.attr}")
    return found


def test_the_doors_call_no_engine_method():
    assert engine_calls_from_the_doors(PACKAGE) == []


def test_a_planted_engine_call_from_a_door_is_found(tmp_path):
    shutil.copytree(PACKAGE, tmp_path / "lightning_shard", ignore=shutil.ignore_patterns("__pycache__"))
    with open(tmp_path / "lightning_shard" / "trainer" / "strategy.py", "a") as file:
        file.write("\n\ndef _planted(strategy):\n    return strategy._session.engine.teardown()\n")
    found = engine_calls_from_the_doors(tmp_path / "lightning_shard")
    assert [place.split(" ")[1] for place in found] == ["engine.teardown"], found


if __name__ == "__main__":  # run by _trainer_code_reached_in on a copy of the package
    print(json.dumps(trainer_code_reached(sys.argv[1])))


def test_each_door_is_one_class_over_the_core_process_side():
    # Inheritance only where the frameworks require it: each door subclasses its framework's ParallelStrategy,
    # with the core's ProcessGroups (what both ParallelStrategy bases leave to a subclass) as its one base of
    # ours; every step is the session's (lightning_shard.core.Session), forwarded from the door's hooks.
    from lightning_shard import ShardFabricStrategy, ShardStrategy
    from lightning_shard.core import ProcessGroups

    for door in (ShardStrategy, ShardFabricStrategy):
        own = [c for c in door.__mro__ if c.__module__.startswith("lightning_shard")]
        assert own == [door, ProcessGroups], own


def test_the_config_narrows_the_flags_without_silencing_the_type_checker():
    # ShardConfig re-declares only fields whose resolved type is a subtype of the flag's (mypy checks it in CI).
    assert "type: ignore" not in (ROOT / "lightning_shard" / "config.py").read_text()
