"""``core.transform.prepare`` is the only place of the transform order: every step it applies is reached from
both doors (the Trainer's ``ShardStrategy`` and ``ShardFabricStrategy``) and both engines (FSDP2 and DeepSpeed),
in the order docs/architecture.md states, each transform before the engine's data-parallel wrap. The steps
after it are the session's: backward, the optimizer step, save and load, patched on ``core.Session``, are
reached from both doors and both engines too."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_shard import ShardFabricStrategy, ShardStrategy
from lightning_shard.core import Session, transform
from lightning_shard.demos.ranks import run_ranks
from lightning_shard.engines.deepspeed import DeepSpeedEngine
from lightning_shard.engines.fsdp import FSDPEngine
from tests.helpers import loader, tiny_gpt, trainer_kwargs

pytestmark = pytest.mark.multirank

#: (door, engine, stage, flags); ``init_weights``: a file the case writes first. Activation checkpointing and
#: full weights in one case of each door and of each engine, so that steps 1 and 6 are in the recorded order.
CASES = [
    ("trainer", "fsdp", 3, {"activation_checkpointing": "full", "init_weights": True}),
    ("fabric", "fsdp", 2, {}),
    ("trainer", "deepspeed", 2, {}),
    ("fabric", "deepspeed", 1, {"activation_checkpointing": "full", "init_weights": True}),
]

#: Everything ``prepare`` applies, in the order of docs/architecture.md ("One set-up, both doors"), each by the
#: name ``prepare`` reaches it under: a function of ``core/transform.py``, or the engine's method.
ORDER = (
    "apply_activation_checkpointing",  # 1
    "_cut_to_stages",  # 2: the pipeline cut; then context parallelism, the tiled MLP and loss
    "_install_context_parallel",
    "_install_tiling",
    "check_module",  # 3: the engine checks the module; precision, fp8, tp, ep, compile
    "apply_precision",
    "apply_fp8",
    "apply_tensor_parallel_once",
    "apply_expert_parallel_once",
    "apply_compile",
    "setup_module",  # 4: FSDP2's wrap, then the allocation from meta (the DeepSpeed engine: allocation only)
    "_fully_shard",
    "_materialize",
    "_stage_runner",  # 5
    "load_full_weights",  # 6: init_weights
    "Session",  # what prepare returns
    "deepspeed.initialize",  # DeepSpeed's wrap, with its optimizer, when the door sets the optimizer up
)
#: The steps ``prepare`` takes whatever the flags (each transform of step 3 decides inside whether it applies).
ALWAYS = (
    "_install_tiling",
    "check_module",
    "apply_precision",
    "apply_fp8",
    "apply_tensor_parallel_once",
    "apply_expert_parallel_once",
    "apply_compile",
    "setup_module",
    "Session",
)
#: Functions of ``core/transform.py`` that ``prepare`` calls by their module-level names.
TRANSFORM_NAMES = tuple(name for name in ORDER if hasattr(transform, name))
ENGINE_METHODS = {
    FSDPEngine: ("check_module", "setup_module", "_fully_shard", "_materialize", "load_full_weights"),
    DeepSpeedEngine: ("check_module", "setup_module", "load_full_weights"),
}
#: Where each engine's data-parallel wrap happens: after it, the module is seen wrapped.
WRAP = {"fsdp": "_fully_shard", "deepspeed": "deepspeed.initialize"}

#: The session's steps each door must reach (the engine's own step under DeepSpeed, Lightning's otherwise).
SESSION_STEPS = ("backward", "engine_step", "save", "load", "model_state")


def _expected(engine: str, flags: dict[str, Any]) -> list[str]:
    """The steps taken for one of the test's configurations (one rank: no pipeline, no context parallelism)."""
    applied = {*ALWAYS, WRAP[engine]}
    if engine == "fsdp":
        applied.add("_materialize")  # DeepSpeed's engine allocates only a module built on the meta device
    if "activation_checkpointing" in flags:
        applied.add("apply_activation_checkpointing")
    if "init_weights" in flags:
        applied.add("load_full_weights")
    return [name for name in ORDER if name in applied]


class _Recorder:
    """Every step in the order it is reached, with whether its module was wrapped for data parallelism then.

    FSDP2's wrap shows on the module (``fully_shard`` makes it an ``FSDPModule``); DeepSpeed's does not (it
    holds the module in its own engine), so a module is also wrapped once ``deepspeed.initialize`` returned
    an engine over it."""

    def __init__(self) -> None:
        self.events: list[tuple[str, bool | None]] = []
        self._deepspeed_wrapped: list[nn.Module] = []
        self._restore: list[tuple[Any, str, Any]] = []
        self._labels: set[str] = set()

    def wrapped(self, module: nn.Module | None) -> bool | None:
        if module is None:
            return None
        return any(isinstance(m, FSDPModule) for m in module.modules()) or any(
            m is module for m in self._deepspeed_wrapped
        )

    def patch(self, owner: Any, name: str, label: str) -> None:
        original = getattr(owner, name)

        def recorded(*args: Any, **kwargs: Any) -> Any:
            module = next((a for a in (*args, *kwargs.values()) if isinstance(a, nn.Module)), None)
            self.events.append((label, self.wrapped(module)))
            result = original(*args, **kwargs)
            if label == "deepspeed.initialize" and result[0].module is kwargs["model"]:
                self._deepspeed_wrapped.append(kwargs["model"])
            return result

        self._restore.append((owner, name, vars(owner)[name]))
        self._labels.add(label)
        setattr(owner, name, recorded)

    def install(self) -> None:
        import deepspeed  # DeepSpeedEngine._initialize looks initialize up on the module at each call

        for name in TRANSFORM_NAMES:
            self.patch(transform, name, name)
        for cls, names in ENGINE_METHODS.items():
            for name in names:
                self.patch(cls, name, name)
        self.patch(deepspeed, "initialize", "deepspeed.initialize")
        # a step renamed in the package is not silently left out of the order
        assert sorted(self._labels) == sorted(ORDER)

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._restore):
            setattr(owner, name, original)
        self._restore.clear()


def _recording_session(calls: list[str]) -> dict[str, Any]:
    originals = {name: getattr(Session, name) for name in SESSION_STEPS}
    for name, original in originals.items():

        def recorded(
            self: Session, *args: Any, _name: str = name, _original: Any = original, **kwargs: Any
        ) -> Any:
            calls.append(_name)
            return _original(self, *args, **kwargs)

        setattr(Session, name, recorded)
    return originals


def _run_case(door: str, engine: str, stage: int, flags: dict[str, Any], root: str) -> nn.Module:
    """One set-up, a step, a save and a load through ``door``; the user's module, as set up."""
    path = f"{root}/{door}-{engine}.ckpt"
    if flags.get("init_weights"):
        flags = {**flags, "init_weights": f"{root}/{door}-{engine}-init.pt"}
        torch.save(tiny_gpt().state_dict(), flags["init_weights"])
    if door == "trainer":
        strategy = ShardStrategy(stage=stage, engine=engine, **flags)
        trainer = L.Trainer(devices=1, strategy=strategy, **trainer_kwargs(max_steps=1))
        trainer.fit(tiny_gpt(), loader(4))
        trainer.save_checkpoint(path)
        trainer.strategy.load_checkpoint(path)
        return trainer.lightning_module
    fabric_strategy = ShardFabricStrategy(stage=stage, engine=engine, **flags)
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=fabric_strategy)
    fabric.launch()
    module = tiny_gpt()
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    ids = torch.randint(0, 64, (2, 16))
    fabric.backward(torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()))
    optimizer.step()
    fabric.save(path, {"model": model, "optimizer": optimizer})
    fabric.load(path, {"model": model, "optimizer": optimizer})
    return module


def _through_prepare(root: str) -> list[dict[str, Any]]:
    recorder = _Recorder()
    calls: list[str] = []
    recorder.install()
    originals = _recording_session(calls)
    results = []
    try:
        for door, engine, stage, flags in CASES:
            recorder.events.clear()
            calls.clear()
            module = _run_case(door, engine, stage, flags, root)
            results.append(
                {
                    "case": (door, engine, stage),
                    "events": list(recorder.events),
                    "wrapped_after": recorder.wrapped(module),
                    "calls": sorted(set(calls)),
                }
            )
    finally:
        recorder.uninstall()
        for name, method in originals.items():
            setattr(Session, name, method)
    return results


def test_both_doors_and_both_engines_apply_every_transform_in_order_through_prepare(tmp_path):
    (results,) = run_ranks(_through_prepare, str(tmp_path), world_size=1)
    for result, (door, engine, stage, flags) in zip(results, CASES, strict=True):
        assert result["case"] == (door, engine, stage)
        expected = _expected(engine, flags)
        assert [name for name, _ in result["events"]] == expected, result
        # Every transform saw the module before the engine's wrap, and every step after it saw the wrap: the
        # same test under both engines, which holds only where the wrap is seen.
        wrap = expected.index(WRAP[engine])
        assert [seen for _, seen in result["events"]] == [i > wrap for i in range(len(expected))], result
        assert result["wrapped_after"] is True, result
        # Every step after set-up goes through the session: the engine's own optimizer step under DeepSpeed only.
        steps = set(SESSION_STEPS) - ({"engine_step"} if engine == "fsdp" else set())
        assert set(result["calls"]) == steps, result


def test_the_recorded_order_is_the_order_architecture_md_states():
    doc = (Path(__file__).parents[1] / "docs" / "architecture.md").read_text()
    section = doc.split("## One set-up, both doors", 1)[1]
    steps = re.search(r"^1\. .*?(?=\n\n)", section, re.MULTILINE | re.DOTALL)  # the numbered steps
    assert steps is not None
    named = [name for name in re.findall(r"`([\w.]+)`", steps.group()) if name in ORDER]
    assert len(named) >= 8, named  # the doc's step 3 and 4 names: check_module ... setup_module, deepspeed's
    assert named == sorted(named, key=ORDER.index), named
