"""Planners by name, and the one mapping from run settings to a planner's options.

`planner_options` is used by both the trainer (`parallel.*` config) and the simulator (its
flags), so a setting means the same to every planner wherever it is given. A planner's module
is imported when it is asked for (python-mip only for flexsp)."""

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
# SparseBalance's DP x PP setting (a cost model with setting == "pipeline", the simulator's
# sparsebalance-h200 presets) has its own planners; training plans sequence-parallel groups.
PIPELINE_PLANNERS = {
    "sparsebalance": ("jaxsb.planner.sparsebalance", "SparseBalancePlanner"),
    "jaxsb": ("jaxsb.planner.sparsebalance", "JaxsbPipelinePlanner"),
}


def planner_class(name: str, setting: str = ""):
    """The class of planner `name`; `setting` "pipeline" picks from PIPELINE_PLANNERS."""
    if name not in PLANNERS and name not in PIPELINE_PLANNERS:
        raise ValueError(f"unknown planner {name!r}; known: {', '.join(dict.fromkeys([*PLANNERS, *PIPELINE_PLANNERS]))}")
    table = PIPELINE_PLANNERS if setting == "pipeline" else PLANNERS
    if name not in table and setting == "pipeline":
        raise ValueError(f"planner {name!r} plans sequence-parallel groups; SparseBalance's DP x PP setting "
                         f"is planned by {', '.join(PIPELINE_PLANNERS)}")
    if name not in table:
        raise ValueError(f"planner {name!r} plans SparseBalance's DP x PP pipelines: use a sparsebalance-h200 "
                         f"preset in the simulator; sequence-parallel planners: {', '.join(PLANNERS)}")
    module, cls = table[name]
    try:
        mod = importlib.import_module(module)
    except ImportError as e:  # a registered name whose module is gone: say which
        raise ValueError(f"planner {name!r} needs module {module}, which cannot be imported: {e}") from e
    try:
        return getattr(mod, cls)
    except AttributeError:
        raise ValueError(f"planner {name!r}: module {module} has no class {cls}") from None


def planner_options(name: str, num_devices: int, *, time_limit_s: float | None = None, scheme: str | None = None,
                    degree: int | None = None, dp: int | None = None, cp: int | None = None,
                    runnable=None) -> dict:
    """Constructor options of planner `name` from run settings (None / 0: the planner's default).

    `degree`: the static planner's single SP degree; `dp` x `cp`: Skrull's mesh (cp alone: dp
    = num_devices // cp); `runnable`: what the executor runs (jaxsb.plan.Runnable), for training."""
    planner_class(name)  # unknown names fail here, naming the known ones
    opts: dict = {}
    if time_limit_s is not None:
        opts["time_limit_s"] = float(time_limit_s)
    if scheme is not None:
        opts["scheme"] = scheme
    if runnable is not None:
        opts["runnable"] = runnable
    if name == "static" and degree:
        opts["degree"] = int(degree)
    if name == "skrull" and (dp or cp):
        cp = int(cp or num_devices // dp)
        opts.update(dp=int(dp or num_devices // cp), cp=cp)
    return opts


def make_planner(name: str, cost: CostModel, num_devices: int, **options):
    """`Planner(cost, num_devices, **options)` for a planner name (see PLANNERS)."""
    return planner_class(name, getattr(cost, "setting", ""))(cost, num_devices, **options)
