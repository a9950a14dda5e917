"""OpGraph: one node per jaxpr equation, with flops, bytes, layer and phase.

Built by :func:`hetshard.ir.trace.trace`. Layers come from the models'
``jax.named_scope``\\ s (``decoder/layer_7``); the phase from JAX's autodiff
name-stack wrappers: ``jvp(...)`` is the forward pass, ``transpose(jvp(...))``
the backward pass, and anything outside ``value_and_grad`` (the optimizer
update) is ``opt``.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import numpy as np

from hetshard.remat import ATTENTION as ATTENTION_NODE
from hetshard.remat import OTHER, WEIGHT, kept_projections, projection_roles

PHASES = ("fwd", "bwd", "opt")
ATTENTION = "hetshard_attention"  # the region the models' attention is traced in


@dataclasses.dataclass
class Op:
    """One equation. ``flops`` and ``bytes`` already include scan trip counts."""

    index: int
    primitive: str
    layer: str
    phase: str
    flops: float
    bytes: float
    out_bytes: float
    region: str  # innermost named jit call, e.g. "hetshard_attention" ("" if none)
    signature: tuple
    # Inputs as (source, shape): source is a producing op index, -1 for a non-parameter
    # input or constant, and -(2 + k) for parameter k of the traced function.
    inputs: tuple = ()
    out_shapes: tuple = ()
    params: dict = dataclasses.field(default_factory=dict)  # dims/axes the sharding rules read
    repeat: float = 1.0  # the enclosing scans' trip counts (flops and bytes include it)


@dataclasses.dataclass
class OpGraph:
    """Ops in program order plus tensor edges ``(producer, consumer, bytes)``.

    ``param_layers`` maps each parameter (by flat index) to the layer that
    first reads it; ``param_bytes`` and ``param_sizes`` give its bytes and elements.
    """

    ops: list[Op]
    edges: list[tuple[int, int, float]]
    param_layers: list[str]
    param_bytes: list[int]
    param_sizes: list[int]
    opt_state_bytes: int
    # Layers whose attention (a ``hetshard_attention`` call) is causal: a flash kernel
    # skips the masked half of the scores the traced reference computes.
    causal_layers: frozenset = frozenset()

    @property
    def layers(self) -> list[str]:
        """Layer tags in forward program order (untagged ops are attached to a neighbour)."""
        seen: dict[str, None] = {}
        for op in self.ops:
            if op.phase == "fwd" and op.layer:
                seen.setdefault(op.layer, None)
        return list(seen)

    def total_flops(self, phase: str | None = None) -> float:
        return float(sum(op.flops for op in self.ops if phase in (None, op.phase)))

    def layer_totals(self) -> dict[str, dict[str, float]]:
        """Per layer: ``{fwd,bwd}_{flops,bytes}``, ``residual_bytes`` (forward values the
        backward reads: the activation memory of a micro-batch without remat),
        ``attention_residual_bytes`` (the part produced inside attention),
        ``attention_input_residual_bytes`` (values made outside attention that only
        attention's backward reads), ``flash_residual_bytes`` (what the flash kernel keeps
        instead of attention's residuals: see :meth:`flash_residuals`),
        ``fused_residual_bytes`` and ``fused_attention_residual_bytes`` (the residuals, and
        attention's, as XLA keeps them in one program: :meth:`residuals`) and ``params``
        (bytes of parameters first read by the layer)."""
        out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for op in self.ops:
            if op.phase in ("fwd", "bwd"):
                out[op.layer][f"{op.phase}_flops"] += op.flops
                out[op.layer][f"{op.phase}_bytes"] += op.bytes
        consumed_by_bwd, read_outside = self.residuals(fused=False)
        for src, nbytes in consumed_by_bwd.items():
            s = self.ops[src]
            out[s.layer]["residual_bytes"] += nbytes
            if s.region == ATTENTION:
                out[s.layer]["attention_residual_bytes"] += nbytes
            elif src not in read_outside:
                out[s.layer]["attention_input_residual_bytes"] += nbytes
        for src, nbytes in self.residuals(fused=True)[0].items():
            s = self.ops[src]
            out[s.layer]["fused_residual_bytes"] += nbytes
            if s.region == ATTENTION:
                out[s.layer]["fused_attention_residual_bytes"] += nbytes
        for layer, nbytes in self.flash_residuals().items():
            out[layer]["flash_residual_bytes"] += nbytes
        for layer, nbytes in zip(self.param_layers, self.param_bytes, strict=True):
            out[layer]["params"] += nbytes
        return {k: dict(v) for k, v in out.items()}

    def residuals(self, fused: bool) -> tuple[dict[int, float], set[int]]:
        """The forward values the backward reads: op index -> bytes, and the indices some
        backward op outside attention reaches. Unfused, every one (what ``jax.vjp``
        keeps: a pipeline's forward program returns them to its backward). Fused, as XLA
        keeps them when the forward and backward are one program: a value XLA does not
        write (:meth:`written`: an elementwise value its readers recompute, the
        backward's kernels included) is not kept; its operands are, followed back the
        same way (a SwiGLU's gate keeps its two projections, not its activations)."""
        ops = self.ops
        written = self.written() if fused else [True] * len(ops)
        operands: dict[int, list[tuple[int, float]]] = defaultdict(list)
        for src, dst, nbytes in self.edges:
            operands[dst].append((src, nbytes))
        kept: dict[int, float] = {}
        outside: set[int] = set()
        seen: set[tuple[int, bool]] = set()
        stack = [(src, nbytes, ops[dst].region != ATTENTION)
                 for src, dst, nbytes in self.edges
                 if ops[src].phase == "fwd" and ops[dst].phase == "bwd"]
        while stack:
            i, nbytes, out = stack.pop()
            if written[i]:
                kept[i] = max(kept.get(i, 0.0), nbytes)
                if out:
                    outside.add(i)
                continue
            if (i, out) in seen:
                continue
            seen.add((i, out))
            stack.extend((src, b, out) for src, b in operands[i]
                         if ops[src].phase == "fwd")
        return kept, outside

    def flash_residuals(self) -> dict[str, float]:
        """Per layer, the bytes the flash kernel keeps for its backward per micro-batch
        (``flash_attention``'s custom VJP): its inputs q, k and v and its output, in its
        own layout (same bytes), the float32 log-sum-exp per query row and head, and the
        int32 query and key positions and segment ids per token. Read off the reference
        attention's region: its inputs are the distinct values made outside it that it
        reads, its output (``[batch, seq, heads, head_dim]``) the value read outside."""
        ops = self.ops
        inputs: set[int] = set()
        outputs: set[int] = set()
        for src, dst, _ in self.edges:
            s, d = ops[src], ops[dst]
            if s.phase != "fwd" or d.phase != "fwd":
                continue
            if d.region == ATTENTION and s.region != ATTENTION:
                inputs.add(src)
            elif s.region == ATTENTION and d.region != ATTENTION:
                outputs.add(src)
        out: dict[str, float] = defaultdict(float)
        for i in inputs:
            out[ops[i].layer] += ops[i].out_bytes
        for i in outputs:
            op = ops[i]
            shape = op.out_shapes[0] if op.out_shapes else ()
            out[op.layer] += op.out_bytes
            if len(shape) == 4:  # [batch, seq, heads, head_dim]
                b, sq, h, _ = shape
                out[op.layer] += 4.0 * b * sq * h + 4 * 4.0 * b * sq
        return dict(out)

    def foreign_params(self) -> dict[str, dict[int, tuple[str, float]]]:
        """Per layer, the parameters it reads that another layer owns (reads first; a
        tied embedding read by the head): parameter index -> (owner layer, bytes). A
        pipeline stage without the owner holds a read copy and its gradient."""
        out: dict[str, dict[int, tuple[str, float]]] = defaultdict(dict)
        for op in self.ops:
            # A slice of a stacked weight (an unrolled scan's block) is the reading
            # layer's own, not a copy of another's.
            if op.phase != "fwd" or op.primitive in ("slice", "dynamic_slice"):
                continue
            for src, _ in op.inputs:
                k = -2 - src
                if k >= 0 and self.param_layers[k] != op.layer:
                    out[op.layer][k] = (self.param_layers[k], float(self.param_bytes[k]))
        return dict(out)

    def saved(self, remat: str = "selective") -> tuple[dict[str, float], set[int]]:
        """What each layer keeps when it runs under ``jax.checkpoint`` with the policy of
        ``remat`` (``selective``: ``dots_with_no_batch_dims_saveable``; a named policy of
        ``hetshard.remat.POLICIES``: the projections it names, by
        :meth:`projection_roles`), and what its backward recomputes.

        As JAX's remat does, from every forward value the backward reads: a saveable
        value is kept; any other is recomputed from its operands, followed back the same
        way; an operand made by an earlier layer is that layer's output, the
        checkpoint's input, kept; parameters and the batch are there anyway. Returns
        (per layer, bytes kept per micro-batch; indices of the forward ops recomputed)."""
        keep = kept_projections(remat)
        if keep is None:
            saveable = _saveable_dot
        else:
            roles = self.projection_roles()
            saveable = lambda op: roles.get(op.index) in keep  # noqa: E731
        ops = self.ops
        needed = {src for src, dst, _ in self.edges
                  if ops[src].phase == "fwd" and ops[dst].phase == "bwd"}
        kept: dict[str, float] = defaultdict(float)
        inputs: set[tuple[str, int]] = set()
        recomputed: set[int] = set()
        seen: set[int] = set()
        stack = sorted(needed)
        while stack:
            i = stack.pop()
            if i in seen:
                continue
            seen.add(i)
            op = ops[i]
            if saveable(op):
                kept[op.layer] += op.out_bytes
                continue
            recomputed.add(i)
            for src, _ in op.inputs:
                if src < 0 or ops[src].phase != "fwd":
                    continue
                if ops[src].layer != op.layer:
                    if (op.layer, src) not in inputs:
                        inputs.add((op.layer, src))
                        kept[op.layer] += ops[src].out_bytes
                else:
                    stack.append(src)
        return dict(kept), recomputed

    def projection_roles(self) -> dict[int, str]:
        """Each forward weight projection's role in its layer (``qkv``, ``attn_out``,
        ``mlp_in``; ``hetshard.remat.projection_roles``): op index -> role."""
        by_layer: dict[str, list[int]] = defaultdict(list)
        for k, op in enumerate(self.ops):
            if op.phase == "fwd":
                by_layer[op.layer].append(k)
        roles: dict[int, str] = {}
        for members in by_layer.values():
            local = {k: j for j, k in enumerate(members)}
            kinds = [_node_kind(self.ops[k]) for k in members]
            preds = [[local[src] for src, _ in self.ops[k].inputs if src in local]
                     for k in members]
            for j, role in projection_roles(kinds, preds).items():
                roles[self.ops[members[j]].index] = role
        return roles

    def kernels(self) -> tuple[np.ndarray, np.ndarray]:
        """How XLA runs the equations on a GPU, per op: (HBM bytes, whether the op starts
        a kernel).

        A matmul (``dot_general``, convolution) is a kernel of its own and keeps its
        traced bytes; sort, scatter and cumulative ops run alone too. The other
        equations fuse, as XLA's producer-consumer fusion does: an equation joins the
        kernel of the equations it reads from in the same layer (a block's halves are
        one), phase and region (attention or not), except where it needs a reduction's
        result: a reduction is its kernel's root, and what reads the reduced value runs
        in a later kernel. A reduction along rows of at most ``ROW_FUSION_MAX`` elements
        (softmax, layer norm) stays in one kernel with its readers: XLA's normalization
        fusions keep the row on chip. A fused kernel reads each value it takes from
        outside once and writes each value read outside (or returned) once: its bytes,
        all on its first equation (the kernel's start). An elementwise value read only
        by fusible equations of its layer and region is never written: each kernel
        reading it, the backward's included, recomputes it from its operands (XLA
        duplicates such producers; autodiff's phases are no boundary to it). A kernel of
        reshapes alone is a bitcast: no bytes, no kernel."""
        ops = self.ops
        n = len(ops)
        parent = list(range(n))

        def find(i):
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        def same_kernel(a, b):
            return _same(a, b) and a.phase == b.phase
        # An equation's level: how many reductions it waits for inside its fusible
        # region; a kernel holds one level (what needs a reduced value runs after it).
        cuts = _cuts(ops)
        level = [0] * n
        for src, dst, _ in sorted(self.edges, key=lambda e: e[1]):
            if same_kernel(ops[src], ops[dst]):
                level[dst] = max(level[dst], level[src] + cuts[src])
        for src, dst, _ in self.edges:
            if same_kernel(ops[src], ops[dst]) and not cuts[src] and \
                    level[src] == level[dst]:
                ra, rb = find(src), find(dst)
                if ra != rb:
                    parent[max(ra, rb)] = min(ra, rb)
        written = self.written()
        leaves: dict[int, dict[tuple, float]] = {}

        def reads(i: int) -> dict[tuple, float]:
            """What computing op ``i``'s operands inside a kernel reads from HBM."""
            if i in leaves:
                return leaves[i]
            op, got = ops[i], {}
            dtypes = op.signature[1] if len(op.signature) > 1 else ()
            for k, (src, shape) in enumerate(op.inputs):
                if src >= 0 and not written[src] and _same(ops[src], op):
                    got.update(reads(src))
                else:
                    dtype = dtypes[k][1] if k < len(dtypes) else ""
                    got[(src, tuple(shape), dtype)] = \
                        float(np.prod(shape, dtype=float)) * _itemsize(dtype) * op.repeat
            leaves[i] = got
            return got
        nbytes = np.zeros(n)
        start = np.zeros(n, bool)
        members: dict[int, list[int]] = defaultdict(list)
        for i, op in enumerate(ops):
            if op.primitive in MATMULS or not _fusible(op):
                nbytes[i], start[i] = op.bytes, True
            else:
                members[find(i)].append(i)
        for root, group in members.items():
            outputs = [i for i in group if written[i]]
            if not outputs or all(ops[i].primitive in _BITCASTS for i in group):
                continue  # inlined into its readers, or a bitcast
            read: dict[tuple, float] = {}
            for i in outputs:
                read.update(reads(i))
            nbytes[root] = sum(ops[i].out_bytes for i in outputs) + sum(read.values())
            start[root] = True
        return nbytes, start

    def written(self) -> list[bool]:
        """Per op, whether XLA writes its value to memory (see :meth:`kernels`): a
        reduction makes it, or something outside its fusible domain (a matmul, another
        layer or phase, the step's outputs) reads it. An elementwise value read only by
        fusible neighbours is recomputed inside each kernel that reads it (XLA
        duplicates cheap producers into their consumers), the backward's included."""
        ops = self.ops
        cuts = _cuts(ops)
        consumers: list[list[int]] = [[] for _ in ops]
        for src, dst, _ in self.edges:
            consumers[src].append(dst)
        return [not _fusible(op) or cuts[i] or not consumers[i] or
                any(not _same(op, ops[d]) for d in consumers[i])
                for i, op in enumerate(ops)]

    def layer_signature(self, layer: str) -> tuple:
        """Shapes and primitives of the layer's forward and backward ops, in order."""
        return tuple(op.signature for op in self.ops if op.layer == layer and op.phase != "opt")

    def identical_layers(self) -> list[list[str]]:
        """Layers grouped by identical signature (identical blocks are priced once)."""
        groups: dict[tuple, list[str]] = {}
        for layer in self.layers:
            groups.setdefault(self.layer_signature(layer), []).append(layer)
        return list(groups.values())

    def flops_array(self) -> np.ndarray:
        return np.array([op.flops for op in self.ops])


MATMULS = ("dot_general", "conv_general_dilated", "ragged_dot_general")
# Equations XLA does not fuse with their neighbours (each its own kernel).
_OWN_KERNEL = MATMULS + ("sort", "scatter", "scatter-add", "scatter_add", "scatter-mul",
                          "scatter_mul", "scatter-min", "scatter-max", "cumsum", "cummax",
                          "cummin", "cumprod", "cumlogsumexp", "argsort", "top_k",
                          "custom_call", "pallas_call")
# Equations whose output a new kernel reads (a reduction is its fusion's root).
_REDUCTIONS = ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
               "reduce_or", "reduce_xor", "argmax", "argmin")
# Equations that move no data on their own (XLA emits bitcasts for them).
_BITCASTS = ("reshape", "squeeze", "expand_dims")


def _fusible(op: Op) -> bool:
    return not own_kernel(op.primitive) and op.phase in ("fwd", "bwd", "opt")


def own_kernel(primitive: str) -> bool:
    """Whether XLA runs an equation of ``primitive`` as a kernel of its own (a matmul, a
    sort, a scatter, a custom call): its neighbours are never fused into it."""
    return primitive in _OWN_KERNEL


def _same(a: Op, b: Op) -> bool:
    """Both fusible, in one layer and region: XLA may recompute one inside the other's
    kernel (autodiff's phases are no boundary to it)."""
    return _fusible(a) and _fusible(b) and \
        (_block(a.layer), a.region == ATTENTION) == (_block(b.layer), b.region == ATTENTION)


def _cuts(ops: list[Op]) -> list[bool]:
    """Per op, whether it is a reduction that ends its kernel (:func:`ends_kernel`)."""
    return [ends_kernel(op.primitive, op.params.get("axes"),
                        op.inputs[0][1] if op.inputs else ()) for op in ops]


# Longest row (elements) a normalization fusion keeps on chip: 16K float32 values are
# 64 KiB, a thread block's registers. An assumption; longer rows (a large vocabulary's
# log-sum-exp) take a kernel per reduction.
ROW_FUSION_MAX = 16384


def ends_kernel(primitive: str, axes, shape) -> bool:
    """Whether a ``primitive`` equation reducing ``axes`` of an operand of ``shape`` is a
    reduction that ends its kernel (what reads the reduced value runs in a later one):
    any but a row reduction a normalization fusion keeps on chip (over the operand's
    trailing dimensions, at most ROW_FUSION_MAX elements)."""
    if primitive not in _REDUCTIONS:
        return False
    if not axes or not shape:
        return True
    trailing = tuple(range(len(shape) - len(axes), len(shape)))
    return tuple(sorted(axes)) != trailing or \
        float(np.prod([shape[a] for a in axes], dtype=float)) > ROW_FUSION_MAX


def _block(layer: str) -> str:
    """A block half's block (``decoder/layer_0/half_1`` -> ``decoder/layer_0``): halves
    are priced apart but run as one program, so XLA fuses across them."""
    head, _, tail = layer.rpartition("/half_")
    return head if head and tail.isdigit() else layer


def _itemsize(dtype: str) -> float:
    """Bytes per element of a dtype's name (numpy's, or ml_dtypes' bfloat16, float8...)."""
    try:
        return float(np.dtype(dtype).itemsize)
    except TypeError:
        import ml_dtypes
        return float(np.dtype(getattr(ml_dtypes, dtype, np.float32)).itemsize)


def _node_kind(op: Op) -> str:
    """An op's kind for ``hetshard.remat.projection_roles``: a weight projection (a
    ``dot_general`` without batch dimensions outside attention), attention (its region,
    or a product batched over heads: Flax-style attention as traced), or other."""
    if _saveable_dot(op):
        return WEIGHT
    if op.region == ATTENTION or (op.primitive == "dot_general" and
                                  op.params.get("dimension_numbers") is not None and
                                  op.params["dimension_numbers"][1][0]):
        return ATTENTION_NODE
    return OTHER


def _saveable_dot(op: Op) -> bool:
    """``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``'s test (attention's
    products, batched over heads, never pass it; the flash kernel is one opaque call)."""
    if op.primitive != "dot_general" or op.region == ATTENTION:
        return False
    dims = op.params.get("dimension_numbers")
    return dims is not None and not dims[1][0]
