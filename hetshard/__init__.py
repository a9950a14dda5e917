"""hetshard: a JAX sharding compiler for clusters that mix GPU generations.

The public surface is what this module exports; everything else is importable
but not promised.
"""

from hetshard import nn
from hetshard.autodiff import value_and_grad
from hetshard.cluster import CATALOG, BoundCluster, Cluster, DeviceType, Group
from hetshard.distributed import init_distributed
from hetshard.errors import (
    DeviceBindingError,
    HetshardError,
    SpecError,
    SpecParseError,
    UnknownNameError,
)
from hetshard.ir.program import Program

# ``hetshard.plan(step, *args, cluster=...)``, the function; the module stays importable
# as ``hetshard.plan`` through ``import``/``from`` statements.
from hetshard.jit import (
    NonFiniteLossError,
    PlanNotExecutableError,
    jit,
    plan,  # noqa: E402, I001
)
from hetshard.plan import Plan

__version__ = "0.1.0"

__all__ = [
    "CATALOG",
    "BoundCluster",
    "Cluster",
    "DeviceBindingError",
    "DeviceType",
    "Group",
    "HetshardError",
    "NonFiniteLossError",
    "Plan",
    "Program",
    "PlanNotExecutableError",
    "SpecError",
    "SpecParseError",
    "UnknownNameError",
    "__version__",
    "init_distributed",
    "jit",
    "plan",
    "nn",
    "value_and_grad",
]
