"""Planners by name. Modules are imported only when their planner is asked for, so a planner
whose module is missing or broken fails with a message naming it, and the others still work."""

from __future__ import annotations

import importlib

from jaxsb.planner.cost import CostModel

# name -> (module, class)
PLANNERS = {
    "static": ("jaxsb.planner.static", "StaticPlanner"),
    "batch-adaptive": ("jaxsb.planner.static", "BatchAdaptivePlanner"),
    "flexsp": ("jaxsb.planner.flexsp", "FlexSPPlanner"),
    "skrull": ("jaxsb.planner.skrull", "SkrullPlanner"),
    "jaxsb": ("jaxsb.planner.joint", "JaxsbPlanner"),
}


def planner_class(name: str):
    if name not in PLANNERS:
        raise ValueError(f"unknown planner {name!r}; known: {', '.join(PLANNERS)}")
    module, cls = PLANNERS[name]
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"planner {name!r} needs module {module}, which cannot be imported: {e}") from e
    try:
        return getattr(mod, cls)
    except AttributeError:
        raise ValueError(f"planner {name!r}: module {module} has no class {cls}") from None


def make_planner(name: str, cost: CostModel, num_devices: int, **options):
    """`Planner(cost, num_devices, **options)` for a planner name (see PLANNERS)."""
    return planner_class(name)(cost, num_devices, **options)
