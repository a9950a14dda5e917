"""Tracing a train step (or a loss) to an :class:`OpGraph` on abstract inputs.

The step is traced with ``jax.make_jaxpr`` on ``jax.ShapeDtypeStruct``\\ s, so
no weight memory is used. Equations are visited recursively: ``jit``,
``custom_jvp_call``/``custom_vjp_call`` and ``remat`` bodies are inlined,
a ``scan`` body is counted ``length`` times, a ``cond`` counts its costliest
branch and a ``while`` body once (its trip count is unknown; a warning says so).
Flops and bytes per equation come from ``jax.experimental.roofline``'s rules.
"""

from __future__ import annotations

import importlib
import math
import re
import warnings
from collections.abc import Callable

import jax
import jax.experimental.roofline  # noqa: F401  (registers the per-primitive rules)
import numpy as np
from jax.extend import core as jcore

from hetshard.ir.graph import Op, OpGraph

_rl = importlib.import_module("jax.experimental.roofline.roofline")

def layer_of(name_stack: str) -> str:
    """The innermost named scope of a name stack, autodiff's wrappers stripped ('' when
    there is none): a plain function's layers for :func:`trace` (programs tag their
    layers themselves: ``hetshard.ir.program.reduced_graph``)."""
    parts = [p for p in re.split(r"[/()]", name_stack) if p and p not in _TRANSFORMS]
    return parts[-1] if parts else ""


_TRANSFORMS = {"jvp", "transpose", "vmap", "checkpoint", "remat"}
_NESTED = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def phase_of(name_stack: str) -> str:
    if "transpose(" in name_stack:
        return "bwd"
    if "jvp(" in name_stack:
        return "fwd"
    return "opt"


def _aval(v):
    return v.aval if isinstance(v, jcore.Var) else jax.typeof(v.val)


def _nbytes(aval) -> float:
    shape = getattr(aval, "shape", ())
    dtype = getattr(aval, "dtype", None)
    if dtype is None:
        return 0.0
    n = 1
    for d in shape:
        n *= d
    return float(n * dtype.itemsize)


def ragged_dims(dn, lhs: tuple, rhs: tuple, groups: int) -> tuple[float, ...]:
    """``(batch, M, N, K)`` of a grouped matmul (``ragged_dot_general`` with dimension
    numbers ``dn``, operand shapes ``lhs`` and ``rhs``, ``groups`` groups) as ``groups``
    matmuls of equal groups (each expert's tokens): its flops are ``2 * batch * M * N *
    K``, whichever dimension is ragged (the rows, as in the forward and the input
    gradient; the contraction, as in the weight gradient)."""
    (lc, rc), (lb, rb) = dn.dot_dimension_numbers

    def size(shape, axes):
        return float(np.prod([shape[a] for a in axes], dtype=float))
    free_l = [a for a in range(len(lhs)) if a not in (*lc, *lb)]
    free_r = [a for a in range(len(rhs)) if a not in (*rc, *rb, *dn.rhs_group_dimensions)]
    m, n, k = size(lhs, free_l), size(rhs, free_r), size(lhs, lc)
    g = float(max(groups, 1))
    if any(a in lc for a in dn.lhs_ragged_dimensions):
        k /= g  # the contraction is split among the groups
    else:
        m /= g  # the rows are
    return size(lhs, lb) * g, m, n, k


def _roofline(eqn, name_stack) -> tuple[float, float]:
    if eqn.primitive.name == "ragged_dot_general":  # (JAX's rule counts no flops)
        b, m, n, k = ragged_dims(eqn.params["ragged_dot_dimension_numbers"],
                                 _aval(eqn.invars[0]).shape, _aval(eqn.invars[1]).shape,
                                 _aval(eqn.invars[2]).shape[-1])
        return 2.0 * b * m * n * k, sum(_nbytes(_aval(v))
                                         for v in (*eqn.invars, *eqn.outvars))
    rule = _rl._rooflines.get(eqn.primitive)
    if rule is None:
        _warn_once(f"no roofline rule for {eqn.primitive.name}: counted as 0 flops, "
                   "its inputs and outputs as bytes")
        return 0.0, sum(_nbytes(_aval(v)) for v in (*eqn.invars, *eqn.outvars))
    avals_in = [_aval(v) for v in eqn.invars]
    avals_out = [_aval(v) for v in eqn.outvars]
    ctx = _rl.RooflineRuleContext(
        name_stack=eqn.source_info.name_stack, primitive=eqn.primitive, avals_in=avals_in,
        avals_out=avals_out, jaxpr_eqn_ctx=eqn.ctx, mesh=None, pin_lhs_in_vmem=False,
        pin_rhs_in_vmem=False)
    shapes = [_rl.RooflineShape.from_aval(a) for a in avals_in]
    try:
        r = rule(ctx, *shapes, **eqn.params)
    except Exception as e:  # a rule that cannot handle these shapes: count bytes only
        _warn_once(f"roofline rule for {eqn.primitive.name} failed ({e}); counted as bytes")
        return 0.0, sum(_nbytes(a) for a in (*avals_in, *avals_out))
    flops = float(max(r.flops, r.unfused_flops))
    nbytes = float(r.unfused_hbm_bytes or r.hbm_bytes or
                   sum(_nbytes(a) for a in (*avals_in, *avals_out)))
    return flops, nbytes


_WARNED: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _WARNED:
        _WARNED.add(msg)
        warnings.warn(msg, stacklevel=3)


_KEPT_PARAMS = ("dimension_numbers", "axes", "new_sizes", "dimensions", "permutation",
                "broadcast_dimensions", "shape", "ragged_dot_dimension_numbers")


def _rule_params(eqn) -> dict:
    """The equation parameters the sharding rules need (dims, axes, shapes)."""
    out = {}
    for k in _KEPT_PARAMS:
        if k in eqn.params:
            v = eqn.params[k]
            out[k] = v if k != "dimension_numbers" or eqn.primitive.name == "dot_general" \
                else None
    return out


class _Builder:
    def __init__(self, layer_name: Callable[[str], str]):
        self.layer_name = layer_name
        self.causal: set[str] = set()  # layers whose attention is causal
        self.ops: list[Op] = []
        self.edges: list[tuple[int, int, float]] = []
        self.producer: dict = {}  # var -> op index (after inlining)

    def visit(self, jaxpr, env: dict, scale: float, outer_stack: str, region: str):
        """Visits ``jaxpr`` whose invars are bound (in ``env``) to producer op indices."""
        for eqn in jaxpr.eqns:
            stack = f"{outer_stack}/{eqn.source_info.name_stack}" if outer_stack else \
                str(eqn.source_info.name_stack)
            sub = self._nested(eqn)
            if sub is not None:
                body, mult, sub_region = sub
                inner_env = {}
                for inner, outer in zip(body.invars, eqn.invars[-len(body.invars):],
                                        strict=False):
                    if isinstance(outer, jcore.Var) and outer in env:
                        inner_env[inner] = env[outer]
                # An enclosing attention region keeps its name over inner helper calls.
                keep = region == "hetshard_attention"
                if sub_region.startswith("hetshard_attention"):
                    if sub_region.endswith("_causal") and not keep:
                        self.causal.add(self.layer_name(stack))
                    sub_region = "hetshard_attention"
                self.visit(body, inner_env, scale * mult, stack,
                           region if keep else (sub_region or region))
                for inner, outer in zip(body.outvars, eqn.outvars, strict=False):
                    if isinstance(inner, jcore.Var) and inner in inner_env:
                        env[outer] = inner_env[inner]
                continue
            flops, nbytes = _roofline(eqn, stack)
            idx = len(self.ops)
            sig = (eqn.primitive.name,
                   tuple((tuple(getattr(_aval(v), "shape", ())),
                          str(getattr(_aval(v), "dtype", ""))) for v in eqn.invars),
                   tuple(tuple(v.aval.shape) for v in eqn.outvars))
            inputs = tuple((env.get(v, -1) if isinstance(v, jcore.Var) else -1,
                            tuple(getattr(_aval(v), "shape", ()))) for v in eqn.invars)
            self.ops.append(Op(idx, eqn.primitive.name, self.layer_name(stack),
                               phase_of(stack),
                               flops * scale, nbytes * scale,
                               sum(_nbytes(v.aval) for v in eqn.outvars) * scale, region, sig,
                               inputs, tuple(tuple(v.aval.shape) for v in eqn.outvars),
                               _rule_params(eqn), scale))
            for v in eqn.invars:
                if isinstance(v, jcore.Var) and v in env:
                    src = env[v]
                    if src >= 0:
                        self.edges.append((src, idx, _nbytes(v.aval)))
            for v in eqn.outvars:
                env[v] = idx

    @staticmethod
    def _nested(eqn):
        name = eqn.primitive.name
        if name == "scan":
            return _open(eqn.params["jaxpr"]), float(eqn.params["length"]), ""
        if name == "while":
            _warn_once("while loop: its body is counted once (trip count unknown)")
            return _open(eqn.params["body_jaxpr"]), 1.0, ""
        if name == "cond":
            branches = [_open(b) for b in eqn.params["branches"]]
            return max(branches, key=lambda j: len(j.eqns)), 1.0, ""
        for key in _NESTED:
            if key in eqn.params and hasattr(_open(eqn.params[key]), "eqns"):
                region = eqn.params.get("name", "") if name in ("jit", "pjit") else ""
                return _open(eqn.params[key]), 1.0, str(region)
        return None


def _open(j):
    return getattr(j, "jaxpr", j)


def trace(fn: Callable, *args, param_argnum: int | None = 0,
          opt_state_argnum: int | None = None,
          layer_name: Callable[[str], str] = layer_of) -> OpGraph:
    """Traces ``fn(*args)`` (arrays or ``ShapeDtypeStruct``\\ s) to an :class:`OpGraph`.

    ``args[param_argnum]`` (a pytree) holds the parameters: each is attributed
    to the layer that first reads it. ``args[opt_state_argnum]``, if given,
    holds optimizer state, whose bytes are recorded. ``layer_name(name_stack)`` names
    each equation's layer ('' for none; default: the scopes ``layer_of`` reads).
    """
    closed = jax.make_jaxpr(fn)(*args)
    jaxpr = closed.jaxpr
    b = _Builder(layer_name)
    env = {v: -1 for v in jaxpr.invars}
    leaves_per_arg = [len(jax.tree.leaves(a)) for a in args]
    if param_argnum is not None:
        start = sum(leaves_per_arg[:param_argnum])
        for k, v in enumerate(jaxpr.invars[start:start + leaves_per_arg[param_argnum]]):
            env[v] = -(2 + k)
    b.visit(jaxpr, env, 1.0, "", "")
    param_layers: list[str] = []
    param_bytes: list[int] = []
    param_sizes: list[int] = []
    if param_argnum is not None:
        start = sum(leaves_per_arg[:param_argnum])
        pvars = jaxpr.invars[start:start + leaves_per_arg[param_argnum]]
        first_reader = _first_readers(jaxpr, b, pvars)
        for v in pvars:
            param_layers.append(first_reader.get(v, ""))
            param_bytes.append(int(_nbytes(v.aval)))
            param_sizes.append(int(math.prod(v.aval.shape)))
    opt_bytes = 0
    if opt_state_argnum is not None:
        # Per-parameter state only: scalar step counters are a few bytes per model.
        opt_bytes = int(sum(math.prod(x.shape) * x.dtype.itemsize
                            for x in jax.tree.leaves(args[opt_state_argnum]) if x.shape))
    _attach_untagged(b.ops)
    return OpGraph(b.ops, b.edges, param_layers, param_bytes, param_sizes, opt_bytes,
                   frozenset(b.causal))


def _first_readers(jaxpr, builder: _Builder, pvars) -> dict:
    """Layer of the first forward op reading each parameter var (through inlining)."""
    # Bind each parameter var to a sentinel and follow it (through inlined calls and
    # casts) to the first equation that reads it.
    marks = {v: -(i + 2) for i, v in enumerate(pvars)}
    readers: dict = {}

    def walk(jx, env, outer):
        for eqn in jx.eqns:
            stack = f"{outer}/{eqn.source_info.name_stack}" if outer else \
                str(eqn.source_info.name_stack)
            sub = _Builder._nested(eqn)
            if sub is not None:
                body = sub[0]
                inner = {}
                for iv, ov in zip(body.invars, eqn.invars[-len(body.invars):], strict=False):
                    if isinstance(ov, jcore.Var) and ov in env:
                        inner[iv] = env[ov]
                walk(body, inner, stack)
                continue
            for v in eqn.invars:
                if isinstance(v, jcore.Var) and v in env and env[v] not in readers:
                    readers[env[v]] = builder.layer_name(stack)
            # Casts and copies of a parameter still identify it.
            if eqn.primitive.name in ("convert_element_type", "copy", "copy_p") and \
                    isinstance(eqn.invars[0], jcore.Var) and eqn.invars[0] in env:
                env[eqn.outvars[0]] = env[eqn.invars[0]]

    walk(jaxpr, dict(marks), "")
    out = {}
    for v, m in marks.items():
        out[v] = readers.get(m, "")
    return out


def _attach_untagged(ops: list[Op]) -> None:
    """Gives untagged forward/backward ops the layer of the nearest tagged op before them
    in the same phase (or after, at the start): loss ops join the head, input
    reshapes join the first layer."""
    for phase in ("fwd", "bwd"):
        idx = [i for i, op in enumerate(ops) if op.phase == phase]
        last = ""
        pending: list[int] = []
        for i in idx:
            if ops[i].layer:
                last = ops[i].layer
                for j in pending:
                    ops[j].layer = last
                pending = []
            elif last:
                ops[i].layer = last
            else:
                pending.append(i)
