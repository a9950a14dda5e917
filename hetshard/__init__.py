"""hetshard: a JAX sharding compiler for clusters that mix GPU generations.

The core, in the order a user meets it:

* ``jit(step, cluster=...)``: plan and run an ordinary NNX train step;
* ``plan(step, *args, cluster=...)``: the plan ``jit`` would run, without running it;
* ``Plan`` (the one contract between planner, simulator and runtime; JSON),
  ``PlannerOptions`` (what the planner may choose, and how long it may take) and
  ``SearchEffort`` (how hard its search works);
* ``Cluster``: the GPUs, from a preset name or a spec file;
* ``value_and_grad`` / ``grad``: the loss spelled out, where a step's own transform is
  not seen.

Then the periphery: ``Program`` (a traced step) and ``profile_program`` (its per-layer
costs, what the planner and simulator price), the cluster's parts, the ``nn``,
``data`` and ``checkpoint`` modules, ``init_distributed``, and the errors and warnings
(all from ``hetshard.errors``). ``__all__`` lists them in that order.

The public surface is what this module exports; everything else is importable
but not promised. Exports load on first use (PEP 562), so ``hetshard --help`` and the
plan/cluster file tools start without importing JAX.

The modules behind the core are private (``hetshard._jit``, ``hetshard._plan``): no
submodule shares a name with an export, so ``hetshard.jit`` and ``hetshard.plan`` are
only ever the functions.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from hetshard._version import __version__ as __version__

_EXPORTS = {
    # the core
    "jit": "hetshard._jit",
    "plan": "hetshard._jit",
    "Plan": "hetshard._plan",
    "PlannerOptions": "hetshard.solver.options",
    "SearchEffort": "hetshard.solver.options",
    "Cluster": "hetshard.cluster",
    "value_and_grad": "hetshard.autodiff",
    "grad": "hetshard.autodiff",
    # the periphery
    "Program": "hetshard.ir.program",
    "profile_program": "hetshard.cost.profile",
    "CATALOG": "hetshard.cluster",
    "BoundCluster": "hetshard.cluster",
    "DeviceType": "hetshard.cluster",
    "Group": "hetshard.cluster",
    "nn": None,  # the submodule itself
    "data": None,
    "checkpoint": None,
    "init_distributed": "hetshard.distributed",
    # errors and warnings (all defined in hetshard.errors)
    "HetshardError": "hetshard.errors",
    "SpecError": "hetshard.errors",
    "SpecParseError": "hetshard.errors",
    "UnknownNameError": "hetshard.errors",
    "DeviceBindingError": "hetshard.errors",
    "PlanNotExecutableError": "hetshard.errors",
    "PipelineSetupError": "hetshard.errors",
    "StageSplitError": "hetshard.errors",
    "LayerDiscoveryError": "hetshard.errors",
    "LossCallError": "hetshard.errors",
    "StepTraceError": "hetshard.errors",
    "NonFiniteLossError": "hetshard.errors",
    "NoFeasiblePlanError": "hetshard.errors",
    "CheckpointError": "hetshard.errors",
    "CheckpointCorruptError": "hetshard.errors",
    "DistributedError": "hetshard.errors",
    "PlannerTimeLimitWarning": "hetshard.errors",
    "PlannerMemoryWarning": "hetshard.errors",
    "PrecisionWarning": "hetshard.errors",
    "StragglerWarning": "hetshard.errors",
}

__all__ = [*_EXPORTS, "__version__"]  # (core first, as listed above)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hetshard' has no attribute {name!r}")
    where = _EXPORTS[name]
    if where is None:
        value = importlib.import_module(f"hetshard.{name}")
    else:
        value = getattr(importlib.import_module(where), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__


if TYPE_CHECKING:  # for type checkers and IDEs: the eager imports
    from hetshard import nn  # noqa: F401
    from hetshard._jit import jit, plan  # noqa: F401
    from hetshard._plan import Plan  # noqa: F401
    from hetshard.autodiff import grad, value_and_grad  # noqa: F401
    from hetshard.cluster import CATALOG, BoundCluster, Cluster, DeviceType, Group  # noqa: F401
    from hetshard.cost.profile import profile_program  # noqa: F401
    from hetshard.distributed import init_distributed  # noqa: F401
    from hetshard.errors import (  # noqa: F401
        CheckpointCorruptError,
        CheckpointError,
        DeviceBindingError,
        DistributedError,
        HetshardError,
        LayerDiscoveryError,
        LossCallError,
        NoFeasiblePlanError,
        NonFiniteLossError,
        PipelineSetupError,
        PlannerMemoryWarning,
        PlannerTimeLimitWarning,
        PlanNotExecutableError,
        PrecisionWarning,
        SpecError,
        SpecParseError,
        StageSplitError,
        StepTraceError,
        StragglerWarning,
        UnknownNameError,
    )
    from hetshard.ir.program import Program  # noqa: F401
    from hetshard.solver.options import PlannerOptions, SearchEffort  # noqa: F401
