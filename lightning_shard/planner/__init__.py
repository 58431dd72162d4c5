"""Will it fit, and with which flags? Per-device memory of ZeRO stages 0-3 and the cheapest configuration.

For a model (a module, a class path built on the meta device, or a parameter count), a world size,
the memory of one device, a precision, an optimizer and a micro-batch, the plan lists for every stage
the bytes of parameters, gradients, optimizer state, activations and working buffers on one device,
and picks the cheapest configuration that fits ``(1 - margin) x device memory``: the lowest stage,
then the fewest offloads, then the least recompute, among the configurations ``ShardStrategy``
accepts on this machine.

Example::

    from lightning_shard.planner import plan
    print(plan(params=7e9, world_size=8, device_memory="80GB").table())

``ShardStrategy(stage="auto")`` calls :func:`choose_stage` on the real model at setup
(:mod:`.auto_stage`). Modules, each importing only those above it:

===============  ==========================================================================
``units``        sizes, counts and bandwidths as typed (``80GB``, ``7B``, ``200Gb/s``)
``experts``      a mixture of experts: E, k, the experts' parameters; what expert parallelism divides
``model``        a model's shape (from a module, a class path on meta, or a count); activations
``memory``       bytes per device of one configuration (model state, buffers); the search order
``layout``       data-parallel traffic, the pipeline bubble, a TP x PP x DP layout
``accepted``     which configurations the strategy accepts (``ShardConfig.from_flags``)
``mesh``         the layout as ``tensor_parallel_size`` / ``replicate_size`` (HSDP) flags; context parallelism
``render``       rows as JSON, as a text grid, as stacked bars
``result``       :class:`Plan`: the answer, with ``to_dict``, ``table`` and ``plot``
``search``       :func:`plan` and :func:`choose_stage`
``device``       :func:`available_device_memory` of this machine
``auto_stage``   ``ShardStrategy(stage="auto")``: the planner on the Trainer's model and batch
===============  ==========================================================================
"""

from __future__ import annotations

from lightning_shard.planner.activations import activation_bytes
from lightning_shard.planner.device import available_device_memory
from lightning_shard.planner.layout import Communication, Layout, pipeline_bubble, ring_allreduce_seconds
from lightning_shard.planner.memory import Breakdown, Config
from lightning_shard.planner.model import ModelShape, build_on_meta, shape_from_module
from lightning_shard.planner.result import JSON_VERSION, Plan
from lightning_shard.planner.search import choose_stage, plan
from lightning_shard.units import PlanInputError

__all__ = [
    "JSON_VERSION",
    "Breakdown",
    "Communication",
    "Config",
    "Layout",
    "ModelShape",
    "Plan",
    "PlanInputError",
    "activation_bytes",
    "available_device_memory",
    "build_on_meta",
    "choose_stage",
    "pipeline_bubble",
    "plan",
    "ring_allreduce_seconds",
    "shape_from_module",
]
