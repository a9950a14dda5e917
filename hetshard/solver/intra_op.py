"""Per-op sharding inside one stage, chosen by CP-SAT (Alpa's intra-op ILP, Zheng et al.
2022, §4, restricted to the stage's ``tensor`` axis; the ``data`` axis always splits the
batch).

Every forward equation of the layer gets a strategy: the layout of its output over the
tensor axis -- replicated (R), split along one dimension (S_d) or partial sums (P) --
and the layouts it needs of its inputs. ``dot_general`` may split a free dimension of
either operand (column/row-style), a batch dimension, or the contracting dimension
(output P). Elementwise ops, reshapes, transposes, broadcasts, reductions, squeezes and
slices (a stacked weight's layer: a dimension kept whole keeps its split) map layouts
through their dimensions; the ``hetshard_attention`` region is one op that
may split the batch or the heads. Edges pay the collective that turns the producer's
layout into the consumer's (S->R all-gather, P->R all-reduce, P->S reduce-scatter,
S->S' all-to-all). A weight that stays replicated while its op's work is split pays a
gradient all-reduce over the tensor group. Objective: forward compute x 3 (forward +
backward) + resharding x 2 (the backward mirrors it) + those gradient all-reduces,
subject to the stage's memory limit.

Size reduction: elementwise followers share their producer's variable, duplicate
strategies keep the cheapest, identical blocks are solved once (``solve_blocks``), the
all-replicated plan (always feasible) is the hint, and a time limit returns the best
plan found with its optimality gap.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from collections.abc import Sequence

from ortools.sat.python import cp_model

from hetshard.cluster.catalog import DeviceType
from hetshard.cost.calibration import DEFAULT, Calibration
from hetshard.cost.comm import Topology, collective_time
from hetshard.ir.graph import ATTENTION, Op

R, P = "R", "P"
_UNARY = {"convert_element_type", "neg", "exp", "log", "tanh", "logistic", "sqrt", "rsqrt",
          "abs", "sign", "erf", "integer_pow", "copy", "copy_p", "square", "sin", "cos",
          "reduce_precision", "stop_gradient", "exp2", "log1p", "expm1"}
_LINEAR = {"add", "sub", "neg", "convert_element_type", "copy", "copy_p", "add_any",
           "reduce_precision"}
_ELEMENTWISE = _UNARY | {"add", "sub", "mul", "div", "max", "min", "pow", "select_n",
                         "add_any", "and", "or", "eq", "ne", "lt", "gt", "le", "ge",
                         "atan2", "rem", "nextafter", "clamp"}


@dataclasses.dataclass(frozen=True)
class Strategy:
    out: object  # R, P or ("S", dim)
    ins: tuple  # required layout per input (None: no requirement, e.g. scalars)
    cost_s: float  # forward compute of this op under the strategy


@dataclasses.dataclass(frozen=True)
class IntraOpResult:
    """Chosen layouts. ``param_specs`` maps a parameter index to its spec: a tuple with
    ``"tensor"`` at the split dimension and None elsewhere (all None: replicated)."""

    param_specs: dict[int, tuple]
    op_layouts: dict[int, object]
    objective_s: float
    status: str
    gap: float
    wall_time_s: float
    num_ops: int
    num_vars: int
    comm_s: float


def _is_scalar(shape) -> bool:
    return len(shape) == 0


class _Node:
    def __init__(self, ops: list[Op], inputs: list[tuple[int, tuple]], out_shape: tuple,
                 strategies: list[Strategy]):
        self.ops = ops
        self.inputs = inputs
        self.out_shape = out_shape
        self.strategies = strategies


def _broadcastable(shape, out_shape) -> bool:
    return len(shape) == len(out_shape) and all(a in (b, 1) for a, b in zip(shape, out_shape,
                                                                            strict=True))


def _split_ok(n: int, tp: int) -> bool:
    return n >= tp and n % tp == 0


def _op_time(op: Op, peak: float, bw: float, split: int) -> float:
    return max(op.flops / peak, op.bytes / bw) / split


def _strategies(op: Op, in_shapes, out_shape, tp: int, peak: float, bw: float):
    """Strategies of one op; see the module docstring for the rules."""
    full = _op_time(op, peak, bw, 1)
    part = _op_time(op, peak, bw, tp)
    n_in = len(in_shapes)
    rep = Strategy(R, tuple(None if _is_scalar(s) else R for s in in_shapes), full)
    out = [rep]
    name = op.primitive
    rank = len(out_shape)
    if name == "dot_general":
        (lc, rc), (lb, rb) = op.params["dimension_numbers"]
        ls, rs = in_shapes
        lfree = [d for d in range(len(ls)) if d not in lc and d not in lb]
        rfree = [d for d in range(len(rs)) if d not in rc and d not in rb]
        for k, (a, b) in enumerate(zip(lb, rb, strict=True)):
            if _split_ok(ls[a], tp):
                out.append(Strategy(("S", k), (("S", a), ("S", b)), part))
        for k, a in enumerate(lfree):
            if _split_ok(ls[a], tp):
                out.append(Strategy(("S", len(lb) + k), (("S", a), R), part))
        for k, b in enumerate(rfree):
            if _split_ok(rs[b], tp):
                out.append(Strategy(("S", len(lb) + len(lfree) + k), (R, ("S", b)), part))
        for a, b in zip(lc, rc, strict=True):
            if _split_ok(ls[a], tp):
                out.append(Strategy(P, (("S", a), ("S", b)), part))
        return out
    if name in _ELEMENTWISE and all(_is_scalar(s) or _broadcastable(s, out_shape)
                                    for s in in_shapes):
        def need(s, lay):
            if _is_scalar(s):
                return None
            if lay in (R, P) or s[lay[1]] == out_shape[lay[1]]:
                return lay
            return R  # a size-1 (broadcast) dimension is replicated
        for d in range(rank):
            if _split_ok(out_shape[d], tp):
                out.append(Strategy(("S", d), tuple(need(s, ("S", d)) for s in in_shapes),
                                    part))
        full_inputs = [i for i, s in enumerate(in_shapes)
                       if not _is_scalar(s) and tuple(s) == tuple(out_shape)]
        if name in _LINEAR and len(full_inputs) == n_in - sum(map(_is_scalar, in_shapes)):
            out.append(Strategy(P, tuple(None if _is_scalar(s) else P for s in in_shapes),
                                part))
        elif name in ("mul", "div") and n_in == 2:
            # Partial sums times (or over) a replicated factor stay partial sums.
            for i in range(2 if name == "mul" else 1):
                if i not in full_inputs:
                    continue
                ins = [R, R]
                ins[i] = P
                out.append(Strategy(P, tuple(None if _is_scalar(in_shapes[j]) else ins[j]
                                             for j in range(2)), part))
        return out
    if name in ("reduce_sum", "reduce_max", "reduce_min", "argmax", "argmin"):
        axes = tuple(op.params.get("axes", ()))
        (shape,) = in_shapes[:1]
        kept = [d for d in range(len(shape)) if d not in axes]
        for d in range(len(shape)):
            if not _split_ok(shape[d], tp):
                continue
            if d in axes:
                if name == "reduce_sum":
                    out.append(Strategy(P, (("S", d),), part))
            else:
                out.append(Strategy(("S", kept.index(d)), (("S", d),), part))
        if name == "reduce_sum":
            out.append(Strategy(P, (P,), part))
        return out
    if name == "transpose":
        perm = op.params["permutation"]
        for j, i in enumerate(perm):
            if _split_ok(out_shape[j], tp):
                out.append(Strategy(("S", j), (("S", i),), part))
        out.append(Strategy(P, (P,), part))
        return out
    if name == "broadcast_in_dim":
        bd = op.params["broadcast_dimensions"]
        (shape,) = in_shapes[:1]
        for j in range(rank):
            if not _split_ok(out_shape[j], tp):
                continue
            if j in bd:
                i = bd.index(j)
                if shape[i] == out_shape[j]:
                    out.append(Strategy(("S", j), (("S", i),) + (None,) * (n_in - 1), part))
            else:  # a new dimension: every device materialises its own slice
                out.append(Strategy(("S", j), (R,) + (None,) * (n_in - 1), part))
        return out
    if name == "reshape":
        (shape,) = in_shapes[:1]
        for i in range(len(shape)):
            pre = math.prod(shape[:i])
            for j in range(rank):
                if math.prod(out_shape[:j]) == pre and _split_ok(out_shape[j], tp) and \
                        _split_ok(shape[i], tp):
                    out.append(Strategy(("S", j), (("S", i),) + (None,) * (n_in - 1), part))
        out.append(Strategy(P, (P,) + (None,) * (n_in - 1), part))
        return out
    if name in ("squeeze", "slice", "dynamic_slice"):
        # A stacked weight's layer (an unrolled scan's slice of its leading axis, then
        # the squeeze dropping it): a dimension kept whole keeps its split.
        (shape,) = in_shapes[:1]
        if name == "squeeze":
            dropped = {d % len(shape) for d in op.params.get("dimensions", ())}
            kept = [d for d in range(len(shape)) if d not in dropped]
        else:
            kept = list(range(len(shape)))
        rest = (None,) * (n_in - 1)  # (dynamic_slice's start indices: scalars)
        for j, i in enumerate(kept):
            if j < rank and out_shape[j] == shape[i] and _split_ok(shape[i], tp):
                out.append(Strategy(("S", j), (("S", i),) + rest, part))
        out.append(Strategy(P, (P,) + rest, part))
        return out
    return out


def _reshard_kind(src, dst):
    """The collective that turns layout ``src`` into ``dst`` (None: free; "x": impossible)."""
    if src == dst or dst is None:
        return None
    if src == R:
        return None if dst != P else "x"
    if src == P:
        return "all_reduce" if dst == R else ("reduce_scatter" if dst[0] == "S" else "x")
    # src is S_d
    if dst == R:
        return "all_gather"
    if dst == P:
        return "x"
    return "all_to_all"


def _attention_node(region_ops: list[Op], tp: int, peak, bw):
    ids = {op.index for op in region_ops}
    ext = []
    for op in region_ops:
        for src, shape in op.inputs:
            if src not in ids and (src, shape) not in ext and len(shape) > 0:
                ext.append((src, shape))
    last = region_ops[-1]
    out_shape = last.out_shapes[0]
    full = sum(_op_time(o, peak, bw, 1) for o in region_ops)
    strategies = [Strategy(R, tuple(R for _ in ext), full)]
    four = [len(s) == 4 for _, s in ext]
    if all(_split_ok(s[0], tp) for _, s in ext):
        strategies.append(Strategy(("S", 0), tuple(("S", 0) for _ in ext), full / tp))
    if all(four[i] and _split_ok(s[2], tp) or len(s) < 4 for i, (_, s) in enumerate(ext)) and \
            len(out_shape) == 4 and _split_ok(out_shape[2], tp):
        strategies.append(Strategy(("S", 2), tuple(("S", 2) if len(s) == 4 else R
                                                   for _, s in ext), full / tp))
    return _Node(region_ops, ext, out_shape, strategies)


def build_nodes(ops: Sequence[Op], tp: int, peak: float, bw: float) -> tuple[list[_Node], dict]:
    """Groups ops into solver nodes (attention region as one; followers merged)."""
    nodes: list[_Node] = []
    owner: dict[int, int] = {}  # op index -> node index
    i = 0
    ops = list(ops)
    while i < len(ops):
        op = ops[i]
        if op.region == ATTENTION:
            j = i
            while j < len(ops) and ops[j].region == ATTENTION:
                j += 1
            node = _attention_node(ops[i:j], tp, peak, bw)
            for o in ops[i:j]:
                owner[o.index] = len(nodes)
            nodes.append(node)
            i = j
            continue
        in_shapes = [s for _, s in op.inputs]
        out_shape = op.out_shapes[0] if op.out_shapes else ()
        # Follower: a unary elementwise op of an in-graph producer keeps its layout.
        srcs = [src for src, s in op.inputs if not _is_scalar(s)]
        if op.primitive in _UNARY and len(srcs) == 1 and srcs[0] in owner and \
                tuple(in_shapes[0]) == tuple(out_shape):
            k = owner[srcs[0]]
            # A non-linear follower cannot take partial sums: it only merges into a
            # producer that never outputs them (else the all-reduce edge is needed).
            linear_ok = op.primitive in _LINEAR or all(s.out != P
                                                       for s in nodes[k].strategies)
            if nodes[k].ops[-1].index == srcs[0] and linear_ok:
                node = nodes[k]
                extra_full = _op_time(op, peak, bw, 1)
                node.strategies = [dataclasses.replace(
                    s, cost_s=s.cost_s + (extra_full if s.out == R else extra_full / tp))
                    for s in node.strategies]
                node.ops.append(op)
                owner[op.index] = k
                i += 1
                continue
        strategies = _strategies(op, in_shapes, out_shape, tp, peak, bw)
        best: dict = {}
        for s in strategies:  # dominated: same layouts, higher cost
            key = (s.out, s.ins)
            if key not in best or s.cost_s < best[key].cost_s:
                best[key] = s
        owner[op.index] = len(nodes)
        nodes.append(_Node([op], list(op.inputs), out_shape, list(best.values())))
        i += 1
    return nodes, owner


def solve(ops: Sequence[Op], *, tp: int, gpu: DeviceType, topo: Topology | None,
          cal: Calibration = DEFAULT, dtype: str = "bfloat16", param_bytes: dict | None = None,
          memory_limit_bytes: float | None = None, time_limit_s: float = 10.0,
          param_is: Sequence[int] = ()) -> IntraOpResult:
    """Chooses a strategy per op of ``ops`` (one layer's forward) on a tensor axis of ``tp``.

    ``param_bytes`` maps parameter index k (inputs with source ``-(2 + k)``) to its size;
    parameters are also recognised through casts. Raises nothing for an infeasible
    memory limit: it returns status ``infeasible`` so the caller can name the stage.
    """
    t0 = time.perf_counter()
    e = cal.for_type(gpu.name)
    peak = gpu.peak_flops(dtype) * e.matmul(gpu)
    bw = gpu.memory_gbs * 1e9 * e.memory_eff
    nodes, owner = build_nodes(ops, tp, peak, bw)
    cast_of: dict[int, int] = {}  # op index of a cast of a parameter -> parameter k
    for op in ops:
        if op.primitive in ("convert_element_type", "copy") and op.inputs and \
                op.inputs[0][0] <= -2:
            cast_of[op.index] = -op.inputs[0][0] - 2
    param_bytes = param_bytes or {}
    scale = 1e9  # objective in nanoseconds (integers)

    def coll(kind, nbytes):
        if topo is None or tp == 1:
            return 0.0
        return collective_time(kind, nbytes, topo, cal, gpu.name)

    m = cp_model.CpModel()
    x = [[m.NewBoolVar(f"x{n}_{s}") for s in range(len(node.strategies))]
         for n, node in enumerate(nodes)]
    for n in range(len(nodes)):
        m.AddExactlyOne(x[n])
    terms = []
    param_choice: dict[int, list[tuple[object, cp_model.IntVar]]] = {}
    comm_terms = []
    for n, node in enumerate(nodes):
        for s, strat in enumerate(node.strategies):
            cost = 3 * strat.cost_s
            for (src, _shape), need in zip(node.inputs, strat.ins, strict=False):
                k = -src - 2 if src <= -2 else cast_of.get(src)
                if k is None or need is None:
                    continue
                param_choice.setdefault(k, []).append((need, x[n][s]))
                if need == R and strat.out != R:
                    # Replicated weight, split work: its gradient is partial per device.
                    cost += coll("all_reduce", param_bytes.get(k, 0.0))
            terms.append((int(cost * scale), x[n][s]))
    # Resharding on edges between nodes.
    for n, node in enumerate(nodes):
        for pos, (src, shape) in enumerate(node.inputs):
            if src < 0 or src not in owner or owner[src] == n or src in cast_of:
                continue
            p = owner[src]
            nbytes = math.prod(shape) * 2 if shape else 0
            prod_layouts = {}
            for s, strat in enumerate(nodes[p].strategies):
                prod_layouts.setdefault(strat.out, []).append(x[p][s])
            cons_layouts = {}
            for s, strat in enumerate(node.strategies):
                need = strat.ins[pos] if pos < len(strat.ins) else None
                cons_layouts.setdefault(need, []).append(x[n][s])
            for lo, xs_p in prod_layouts.items():
                for li, xs_c in cons_layouts.items():
                    kind = _reshard_kind(lo, li)
                    if kind is None:
                        continue
                    a, b = sum(xs_p), sum(xs_c)
                    if kind == "x":
                        m.Add(a + b <= 1)
                        continue
                    z = m.NewBoolVar("")
                    m.Add(z >= a + b - 1)
                    c = 2 * coll(kind, nbytes)
                    terms.append((int(c * scale), z))
                    comm_terms.append((c, z))
    # A parameter read by several ops must have one layout.
    specs_var: dict[int, dict] = {}
    for k, uses in param_choice.items():
        layouts = sorted({str(u) for u, _ in uses})
        lv = {lay: m.NewBoolVar(f"p{k}_{lay}") for lay in layouts}
        m.AddExactlyOne(lv.values())
        for need, var in uses:
            m.AddImplication(var, lv[str(need)])
        specs_var[k] = {lay: v for lay, v in lv.items()}
    if memory_limit_bytes is not None:
        mem_terms = []
        for k, lv in specs_var.items():
            for lay, v in lv.items():
                per = param_bytes.get(k, 0.0) * 4  # params, grads, two Adam moments
                mem_terms.append((int(per / (1 if lay == "'R'" else tp)), v))
        m.Add(sum(c * v for c, v in mem_terms) <= int(memory_limit_bytes))
    m.Minimize(sum(c * v for c, v in terms))
    for n, node in enumerate(nodes):  # hint: everything replicated (always feasible)
        for s, strat in enumerate(node.strategies):
            m.AddHint(x[n][s], strat.out == R and all(i in (R, None) for i in strat.ins))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    # Eight workers run CP-SAT's full portfolio (LNS, core-based and probing workers
    # beside the default search), which proves these models optimal an order of
    # magnitude sooner even on 2 cores (a LLaMA-70B block on H100s: 3.7 s with 2
    # workers, 0.2 s with 8; same optimal specs).
    solver.parameters.num_workers = 8
    solver.parameters.random_seed = 0
    status = solver.Solve(m)
    name = solver.StatusName(status).lower()
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return IntraOpResult({}, {}, float("inf"), name, 1.0, time.perf_counter() - t0,
                             len(ops), sum(len(v) for v in x), 0.0)
    obj = solver.ObjectiveValue() / scale
    bound = solver.BestObjectiveBound() / scale
    gap = 0.0 if status == cp_model.OPTIMAL or obj == 0 else max(0.0, (obj - bound) / obj)
    if status != cp_model.OPTIMAL:
        warnings.warn(f"intra-op solver hit its {time_limit_s:g} s limit: best plan found, "
                      f"gap {gap:.1%}", stacklevel=2)
    layouts = {}
    for n, node in enumerate(nodes):
        s = next(i for i, v in enumerate(x[n]) if solver.Value(v))
        for op in node.ops:
            layouts[op.index] = node.strategies[s].out
    specs = {}
    for k, lv in specs_var.items():
        lay = next(lay for lay, v in lv.items() if solver.Value(v))
        specs[k] = lay
    comm = sum(c for c, z in comm_terms if solver.Value(z))
    return IntraOpResult(specs, layouts, obj, "optimal" if status == cp_model.OPTIMAL
                         else "feasible", gap, time.perf_counter() - t0, len(ops),
                         sum(len(v) for v in x), comm)


def spec_of(layout: str, rank: int) -> tuple:
    """A PartitionSpec-style tuple for a layout string ("'R'" or "('S', d)")."""
    if layout.startswith("('S'"):
        d = int(layout.split(",")[1].strip(" )"))
        return tuple("tensor" if i == d else None for i in range(rank))
    return (None,) * rank
