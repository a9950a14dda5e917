"""Per-layer cost profile of a traced train step, linear in the micro-batch size.

Every quantity ``q`` of a layer (per-op flops and bytes, saved residual bytes,
...) is ``q(b) = q0 + q1 * b`` for micro-batch size ``b``: the step's loss is traced
at b=2 and b=4 and the two traces (same equations, other shapes) are
differenced (b=1 is avoided: size-1 dimensions trace to other equations).
The layers are the program's own (``hetshard.ir.layers``); identical blocks are
differentiated twice at most (the loss with each stack cut to two blocks,
``hetshard.ir.program.reduced_graph``) and replicated, so profiling llama-70b costs a
forward trace of the model and the autodiff of two blocks. The optimizer's state is the
step's own (whatever optax chain it built).
The batch-independent part of the residuals (the compute-dtype copies of the
weights that autodiff keeps) is reported separately.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from hetshard.errors import SpecError
from hetshard.ir.graph import MATMULS, OpGraph
from hetshard.ir.program import reduced_graph
from hetshard.ir.trace import ragged_dims
from hetshard.remat import SAVING


@dataclasses.dataclass(frozen=True, eq=False)
class RematSave:
    """What one layer keeps and recomputes under a remat that keeps some values."""

    kept_bytes_per_sample: float  # saved for the backward
    recomputed: np.ndarray  # bool per forward equation: re-run by the backward
    # Of the values a ZB-H1 W pass reads, those B recomputed: kept until W.
    weight_input_bytes_per_sample: float = 0.0


@dataclasses.dataclass(frozen=True, eq=False)
class LayerProfile:
    """Costs of one layer; arrays have one entry per equation of the layer."""

    name: str
    kind: str  # layers of one kind are identical blocks
    fwd_flops: tuple[np.ndarray, np.ndarray]  # (q0, q1): flops(b) = q0 + q1 * b
    fwd_bytes: tuple[np.ndarray, np.ndarray]
    bwd_flops: tuple[np.ndarray, np.ndarray]
    bwd_bytes: tuple[np.ndarray, np.ndarray]
    fwd_matmul: np.ndarray  # bool per forward equation: dot_general / convolution
    bwd_matmul: np.ndarray
    fwd_attention: np.ndarray  # bool per forward equation: inside hetshard_attention
    bwd_attention: np.ndarray  # bool per backward equation: attention's backward
    residual_bytes_per_sample: float
    attention_residual_bytes_per_sample: float
    weight_copy_bytes: float  # batch-independent saved values (compute-dtype weights)
    boundary_bytes_per_sample: float  # activation handed to the next layer
    param_bytes: int
    param_count: int
    # bool per backward equation: only the layer's parameters' gradients read it (the
    # weight-gradient part ``W`` a zero-bubble schedule defers), none of earlier layers'
    bwd_weight: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, bool))
    weight_carry_bytes_per_sample: float = 0.0  # what W reads from B, per sample
    # Megatron tensor parallelism's activation all-reduces per direction: one per
    # residual branch (after the row-parallel attention output and MLP down projection
    # forward, at the column-parallel inputs backward); a block half has one.
    tp_collectives: int = 2
    # Per remat that keeps some values (``hetshard.remat.SAVING``: ``selective`` and the
    # named policies; ``OpGraph.saved``), what it keeps and recomputes.
    saves: dict = dataclasses.field(default_factory=dict)  # remat -> RematSave
    # Under the flash kernel attention's residuals are the kernel's (``OpGraph.
    # flash_residuals``: q, k, v, its output, log-sum-exp, positions) in place of the
    # reference's, and of the values made before it that only attention's backward reads.
    attention_input_residual_bytes_per_sample: float = 0.0
    flash_residual_bytes_per_sample: float = 0.0
    # The residuals (and attention's) as XLA keeps them when the forward and backward are
    # one program (``OpGraph.residuals``: elementwise values recomputed in the backward's
    # kernels, not kept); the others are what ``jax.vjp`` keeps, as a pipeline's forward
    # program returns them.
    fused_residual_bytes_per_sample: float = 0.0
    fused_attention_residual_bytes_per_sample: float = 0.0
    # Parameters read here that another layer owns (``OpGraph.foreign_params``): a tied
    # embedding's head. (key, owner layer name, bytes); a stage without the owner holds a
    # read copy and its gradient (the owner's optimizer updates it).
    foreign_params: tuple[tuple[int, str, float], ...] = ()
    # The parameters the layer owns: (path, bytes) each (``Program.layer_param_sizes``),
    # which a plan's per-parameter layouts (``Stage.shardings``) name; empty where the
    # profile was not traced from a program (then ``param_bytes`` alone).
    param_shares: tuple[tuple[str, int], ...] = ()
    # Of ``param_bytes``, what every tensor rank holds whole whatever the intra-op solver
    # picks: a layer outside the repeated stacks (an embedding, a head: the solver splits
    # only the stacks' blocks, ``hetshard.solver.shardings``) keeps all of its
    # parameters whole, a block its one-dimensional ones (norm scales, biases). What a
    # stage without solved layouts is priced with.
    tp_whole_bytes: float = 0.0
    # Under ZB-H1 with full remat, the layer's forward values its W pass reads (the
    # weight matmuls' inputs) are recomputed by B and kept until W: bytes per sample
    # (``RematSave.weight_input_bytes_per_sample`` for the other remats).
    weight_input_bytes_per_sample: float = 0.0
    # Per tensor-parallel collective of a block (``tp_collectives`` of them), the forward
    # equations of the matmuls a collective matmul overlaps it with: (column-parallel
    # ones before it: q, k, v or up and gate; the row-parallel one after: the attention
    # output or down projection), and the sequence length of their outputs (dimension
    # 1). Empty for layers that are not blocks or do not have that structure.
    tp_groups: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = ()
    tp_sequence: int = 0
    # A whole block of a repeated stack (not a half, not an embedding or head).
    block: bool = False
    # Its attention is causal (a flash kernel computes half the traced scores).
    attention_causal: bool = False
    # How XLA runs the equations (``OpGraph.kernels``): per equation, whether it starts a
    # kernel (a matmul, a fused elementwise chain); ``*_bytes`` of the other equations are
    # their fused kernel's (on its first equation). And per matmul equation its
    # (batch, M, N, K) as (q0, q1) arrays of shape [equations, 4] (zeros elsewhere).
    fwd_kernels: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, bool))
    bwd_kernels: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, bool))
    fwd_dims: tuple[np.ndarray, np.ndarray] = (np.zeros((0, 4)), np.zeros((0, 4)))
    bwd_dims: tuple[np.ndarray, np.ndarray] = (np.zeros((0, 4)), np.zeros((0, 4)))
    # A mixture-of-experts layer (``Program.moe_traffic``): its expert count (0: none),
    # the bytes of its stacked expert weights, its routed rows per sample and a routed
    # row's bytes as sent to its expert, as returned, and as made by the expert
    # equations; per equation whether it is an expert's grouped matmul
    experts: int = 0
    expert_param_bytes: float = 0.0
    routed_rows_per_sample: float = 0.0
    routed_row_bytes: float = 0.0
    routed_out_bytes: float = 0.0
    routed_chain_bytes: float = 0.0
    fwd_expert: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, bool))
    bwd_expert: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, bool))

    @functools.cached_property
    def _totals(self) -> tuple[float, float, float, float]:
        """(forward q0, forward q1, backward q0, backward q1) summed over equations."""
        return (float(self.fwd_flops[0].sum()), float(self.fwd_flops[1].sum()),
                float(self.bwd_flops[0].sum()), float(self.bwd_flops[1].sum()))

    def flops(self, b: float) -> float:
        """Forward + backward flops for a micro-batch of ``b`` samples (no recompute)."""
        f0, f1, b0, b1 = self._totals
        return f0 + b0 + b * (f1 + b1)

    def fwd_total_flops(self, b: float) -> float:
        f0, f1, _, _ = self._totals
        return f0 + b * f1


@dataclasses.dataclass(frozen=True, eq=False)
class ModelProfile:
    """The layers of a model in execution order, with optimizer-state and token counts."""

    model: str
    seq_len: int
    dtype: str
    layers: tuple[LayerProfile, ...]
    opt_bytes_per_param_byte: float
    opt_update_bytes_per_param_byte: float  # HBM traffic of the optimizer update
    tokens_per_sample: int
    split_blocks: bool = False  # layers are block halves (attention, MLP)
    # What a tensor degree must divide (``Program.heads``), the traced model's
    # fingerprint (``Program.model_fingerprint``: plans record it), how its layers were
    # found (``hetshard.ir.layers``).
    heads: int | None = None
    fingerprint: str = ""
    layering: str = ""
    # The busiest expert's routed tokens over the mean, per mixture-of-experts layer
    # (1: balanced routing): a skew parameter, or ``routing_skew`` of a measured
    # histogram. Expert parallelism's stages run at their busiest rank's pace.
    router_skew: float = 1.0
    # A measured routing histogram, normalised: each expert's share of the routed tokens
    # (empty: unknown). Where it covers a layer's experts it prices each expert rank by
    # the tokens its experts take, in place of ``router_skew``.
    expert_loads: tuple[float, ...] = ()

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def tensor_divisor(self) -> int:
        """What a tensor degree must divide: the attention heads (1 when unknown)."""
        return self.heads or 1

    @property
    def param_bytes(self) -> int:
        return sum(layer.param_bytes for layer in self.layers)

    @property
    def param_count(self) -> int:
        return sum(layer.param_count for layer in self.layers)

    def every_weight_split(self) -> ModelProfile:
        """This profile priced as runtimes that split every weight over ``tensor``
        (Megatron-LM's vocab-parallel embedding and head, torchtitan's tensor plan),
        not as hetshard's, which keeps embeddings, heads and one-dimensional parameters
        whole on each tensor rank (``LayerProfile.tp_whole_bytes``): for pricing
        published runs of those frameworks."""
        return dataclasses.replace(self, layers=tuple(
            dataclasses.replace(layer, tp_whole_bytes=0.0) for layer in self.layers))

    def flops_per_sample(self) -> float:
        """Model flops (forward + backward, no recompute) of one sample."""
        return sum(layer.flops(2) - layer.flops(1) for layer in self.layers) + \
            sum(layer.flops(0) for layer in self.layers)

    def layer_names(self) -> list[str]:
        return [layer.name for layer in self.layers]

    def block_indices(self) -> list[int]:
        """The layers that are whole blocks of a repeated stack; every layer for a program
        without repeats (its layers were cut by cost)."""
        found = [i for i, layer in enumerate(self.layers) if layer.block]
        if found or any(layer.kind.endswith("/0") for layer in self.layers):
            return found
        return list(range(len(self.layers)))


def _split(graph: OpGraph) -> dict[str, dict[str, list]]:
    per: dict[str, dict[str, list]] = {}
    for op in graph.ops:
        if op.phase in ("fwd", "bwd"):
            d = per.setdefault(op.layer, {"fwd": [], "bwd": []})
            d[op.phase].append(op)
    return per


def _weight_only(graph: OpGraph) -> tuple[dict[str, np.ndarray], dict[str, float],
                                          dict[str, dict[int, float]]]:
    """(per layer, a bool per backward op: no path leads from it to the cotangent of the
    layer's input activation; per layer, the bytes W reads from B; per layer, the
    forward values of the layer W reads, index -> bytes: under a remat B recomputes them,
    and they stay until W).

    Ops flagged only feed the layer's own parameters' gradients and the optimizer, so a
    zero-bubble schedule's ``W`` pass can run them after the ``B`` pass has sent the
    input's cotangent back. A backward edge into an earlier layer carries that cotangent
    when its size is that of an activation crossing the layers forward; a tied weight's
    gradient (the head's into the embedding's) does not make ``B``. What W reads from B
    (the output cotangents at the weight matmuls) is kept from a micro-batch's B to its W.
    """
    order = {name: i for i, name in enumerate(graph.layers)}
    pos = {op.index: k for k, op in enumerate(graph.ops)}
    edges = [(pos[s], pos[d], n) for s, d, n in graph.edges if s in pos and d in pos]
    ops = graph.ops
    # (bytes, shapes) of what crosses layers forward: a parameter-shaped gradient of
    # the same size as an activation (vocab x hidden = batch x seq x hidden) is no
    # activation's cotangent.
    crossing = {(n, ops[s].out_shapes) for s, d, n in edges
                if ops[s].phase == ops[d].phase == "fwd" and
                order.get(ops[s].layer, -1) < order.get(ops[d].layer, -1)}
    succ: dict[int, list[tuple[int, float]]] = {}
    for s, d, n in edges:
        succ.setdefault(s, []).append((d, n))
    reaches = [False] * len(ops)  # a path to the layer's input cotangent
    for k in range(len(ops) - 1, -1, -1):
        here = order.get(ops[k].layer, -1)
        reaches[k] = any(
            (reaches[d] and order.get(ops[d].layer, -1) == here) or
            (ops[d].phase == "bwd" and order.get(ops[d].layer, here) < here and
             (n, ops[k].out_shapes) in crossing)
            for d, n in succ.get(k, ()))
    flags: dict[str, list[bool]] = {}
    for k, op in enumerate(ops):
        if op.phase == "bwd":
            flags.setdefault(op.layer, []).append(not reaches[k])
    carry: dict[str, float] = {}
    counted = set()
    for s, d, n in edges:
        if s not in counted and ops[s].phase == ops[d].phase == "bwd" and \
                ops[s].layer == ops[d].layer and reaches[s] and not reaches[d]:
            counted.add(s)
            carry[ops[s].layer] = carry.get(ops[s].layer, 0.0) + n
    reads: dict[str, dict[int, float]] = {}
    for s, d, n in edges:
        if ops[s].phase == "fwd" and ops[d].phase == "bwd" and not reaches[d] and \
                ops[s].layer == ops[d].layer:
            got = reads.setdefault(ops[s].layer, {})
            got[ops[s].index] = max(got.get(ops[s].index, 0.0), n)
    return {name: np.array(f, bool) for name, f in flags.items()}, carry, reads


def _tp_groups(ops) -> tuple[tuple, int]:
    """``(tp_groups, tp_sequence)`` of a block's forward ``ops`` (see ``LayerProfile``):
    Megatron's pattern read off the weight matmuls (``dot_general`` equations without batch
    dimensions, outside attention): the consecutive ones reading one input (q, k, v; up
    and gate) are column-parallel, the next one row-parallel (the attention output, the
    down projection). Empty when the matmuls do not pair up that way."""
    dense = [k for k, o in enumerate(ops) if o.primitive == "dot_general" and
             o.region != "hetshard_attention" and o.params.get("dimension_numbers")
             is not None and not o.params["dimension_numbers"][1][0]]
    groups, i = [], 0
    while i < len(dense):
        source = ops[dense[i]].inputs[0][0] if ops[dense[i]].inputs else None
        j = i + 1
        while j < len(dense) and ops[dense[j]].inputs and \
                ops[dense[j]].inputs[0][0] == source and source is not None and source >= 0:
            j += 1
        if j >= len(dense):
            return (), 0
        groups.append((tuple(dense[i:j]), (dense[j],)))
        i = j + 1
    shapes = [ops[k].out_shapes[0] if ops[k].out_shapes else () for k in dense]
    seqs = {shape[1] for shape in shapes if len(shape) >= 3}
    if not groups or len(seqs) != 1 or any(len(x) < 3 for x in shapes):
        return (), 0
    return tuple(groups), int(seqs.pop())


def _boundary(graph: OpGraph) -> dict[str, float]:
    order = {name: i for i, name in enumerate(graph.layers)}
    seen: dict[str, set[int]] = {}
    out: dict[str, float] = {}
    for src, dst, nbytes in graph.edges:
        s, d = graph.ops[src], graph.ops[dst]
        if s.phase == d.phase == "fwd" and s.layer != d.layer and \
                order.get(d.layer, -1) > order.get(s.layer, -1):
            if src not in seen.setdefault(s.layer, set()):
                seen[s.layer].add(src)
                out[s.layer] = out.get(s.layer, 0.0) + nbytes
    return out


_PROFILES: dict[tuple, ModelProfile] = {}


def profile_program(program, split_blocks: bool = False) -> ModelProfile:
    """The :class:`ModelProfile` of a traced train step (``hetshard.ir.program.Program``):
    its loss differentiated at micro-batches of 2 and 4 samples, every stack cut to two
    blocks (``reduced_graph``; the blocks after the second are priced as the second), the
    optimizer's state read from the step's own state. With ``split_blocks`` each block of
    a stack is two layers (``hetshard.ir.layers``), so a stage boundary may fall inside
    a block. Cached per program fingerprint."""
    key = (program.fingerprint, split_blocks)
    if key not in _PROFILES:
        _PROFILES[key] = _profile(program, split_blocks)
    return _PROFILES[key]


def clear_profiles() -> None:
    """Forgets every cached profile (benchmarks time tracing afresh)."""
    _PROFILES.clear()


def _profile(program, split_blocks: bool) -> ModelProfile:
    g1, lay, rep, _ = reduced_graph(program, 2, split_blocks)
    g2, lay2, _, _ = reduced_graph(program, 4, split_blocks)
    if lay2.kinds != lay.kinds and lay2.names != lay.names:
        raise SpecError("model", program.name, "a step whose layers are the same at every "
                        f"micro-batch size ({lay.describe()} at 2 samples, "
                        f"{lay2.describe()} at 4)")
    p1, p2 = _split(g1), _split(g2)
    t1, t2 = g1.layer_totals(), g2.layer_totals()
    b1, b2 = _boundary(g1), _boundary(g2)
    weight_only, carry1, reads1 = _weight_only(g1)
    _, carry2, reads2 = _weight_only(g2)
    counts = _param_counts(g1)
    saved = {remat: (g1.saved(remat), g2.saved(remat)) for remat in SAVING}

    def w_inputs(reads, only=None) -> dict[str, float]:
        return {name: sum(n for i, n in got.items() if only is None or i in only)
                for name, got in reads.items()}
    w_full1, w_full2 = w_inputs(reads1), w_inputs(reads2)
    w_saved = {remat: (w_inputs(reads1, r1), w_inputs(reads2, r2))
               for remat, ((_, r1), (_, r2)) in saved.items()}
    foreign = g1.foreign_params()
    (fused1, starts1), (fused2, _) = g1.kernels(), g2.kernels()
    priced: dict[str, LayerProfile] = {}
    for k, name in enumerate(lay.names):
        if rep[k] != k:
            continue
        empty = {"fwd": [], "bwd": []}
        q1, q2 = p1.get(name, empty), p2.get(name, empty)
        arrays = {}
        for phase in ("fwd", "bwd"):
            o1, o2 = q1[phase], q2[phase]
            if [o.primitive for o in o1] != [o.primitive for o in o2]:
                raise SpecError("model", program.name, "a step whose traced loss has the "
                                f"same equations at every batch size (layer {name} "
                                "differs)")
            arrays[f"{phase}_flops"] = _linear(np.array([o.flops for o in o1]),
                                               np.array([o.flops for o in o2]))
            arrays[f"{phase}_bytes"] = _linear(np.array([fused1[o.index] for o in o1]),
                                               np.array([fused2[o.index] for o in o2]))
            arrays[f"{phase}_kernels"] = np.array([starts1[o.index] for o in o1], bool)
            arrays[f"{phase}_dims"] = _linear(np.array([_dims(o) for o in o1]).reshape(-1, 4),
                                              np.array([_dims(o) for o in o2]).reshape(-1, 4))
            arrays[f"{phase}_matmul"] = np.array([o.primitive in MATMULS for o in o1], bool)
            arrays[f"{phase}_attention"] = np.array(
                [o.region == "hetshard_attention" for o in o1], bool)
            arrays[f"{phase}_expert"] = np.array(
                [o.primitive == "ragged_dot_general" for o in o1], bool)
        t1n, t2n = t1.get(name, {}), t2.get(name, {})
        res = _linear(t1n.get("residual_bytes", 0.0), t2n.get("residual_bytes", 0.0))
        attn = _linear(t1n.get("attention_residual_bytes", 0.0),
                       t2n.get("attention_residual_bytes", 0.0))
        bnd = _linear(b1.get(name, 0.0), b2.get(name, 0.0))
        block = lay.stacks[k] >= 0
        default = 1 if block and lay.split_blocks else 2
        groups, sequence = _tp_groups(q1["fwd"]) if block else ((), 0)
        collectives = len(groups) if groups else default
        if groups and collectives != default:
            groups, sequence, collectives = (), 0, default
        priced[name] = LayerProfile(
            name=name, kind=lay.kinds[k], **arrays,
            residual_bytes_per_sample=res[1], attention_residual_bytes_per_sample=attn[1],
            weight_copy_bytes=max(res[0], 0.0), boundary_bytes_per_sample=bnd[1],
            param_bytes=int(t1n.get("params", 0)), param_count=counts.get(name, 0),
            bwd_weight=weight_only.get(name, np.zeros(len(q1["bwd"]), bool)),
            weight_carry_bytes_per_sample=_linear(carry1.get(name, 0.0),
                                                  carry2.get(name, 0.0))[1],
            tp_collectives=collectives, tp_groups=groups, tp_sequence=sequence,
            block=block and not lay.split_blocks,
            attention_causal=name in g1.causal_layers,
            saves={remat: RematSave(
                kept_bytes_per_sample=_linear(k1.get(name, 0.0), k2.get(name, 0.0))[1],
                recomputed=np.array([o.index in r1 for o in q1["fwd"]], bool),
                weight_input_bytes_per_sample=_linear(w_saved[remat][0].get(name, 0.0),
                                                      w_saved[remat][1].get(name, 0.0))[1])
                for remat, ((k1, r1), (k2, _)) in saved.items()},
            **{f"{key}_per_sample": _linear(t1n.get(key, 0.0), t2n.get(key, 0.0))[1]
               for key in ("attention_input_residual_bytes", "flash_residual_bytes",
                           "fused_residual_bytes", "fused_attention_residual_bytes")},
            foreign_params=tuple((k2, owner, nbytes) for k2, (owner, nbytes)
                                 in sorted(foreign.get(name, {}).items())),
            weight_input_bytes_per_sample=_linear(w_full1.get(name, 0.0),
                                                  w_full2.get(name, 0.0))[1])
    # What each layer owns, from the program (a stacked weight's slices per layer).
    sizes = program.layer_param_sizes(2, split_blocks)
    layers = tuple(dataclasses.replace(
        priced[lay.names[rep[k]]], name=name,
        param_bytes=sum(b for _, b, _, _ in sizes[k]),
        param_count=sum(n for _, _, n, _ in sizes[k]),
        param_shares=tuple((path, b) for path, b, _, _ in sizes[k]),
        tp_whole_bytes=float(sum(b for _, b, _, rank in sizes[k]
                                 if lay.stacks[k] < 0 or rank <= 1)),
        **_experts_of(program, sizes[k]))
        for k, name in enumerate(lay.names))
    opt_ratio = program.opt_state_bytes / max(program.param_bytes, 1)
    return ModelProfile(
        model=program.name, seq_len=program.seq_len, dtype=program.dtype, layers=layers,
        opt_bytes_per_param_byte=opt_ratio,
        # A fused update reads parameter, gradient and state and writes parameter and
        # state once; the traced (unfused) equation bytes would overcount it ~6x.
        opt_update_bytes_per_param_byte=3.0 + 2.0 * opt_ratio,
        tokens_per_sample=program.seq_len, split_blocks=split_blocks,
        heads=program.heads, fingerprint=program.model_fingerprint, layering=lay.source)


def routing_skew(histogram) -> float:
    """The router's skew from a measured routing histogram (tokens routed to each expert,
    any shape whose last axis is the experts: per layer, per step): the largest count
    over the mean, the worst row's (a layer or step whose busiest expert waits longest)."""
    from hetshard.errors import SpecError
    h = np.asarray(histogram, float)
    if h.ndim == 0 or h.shape[-1] < 2 or not np.isfinite(h).all() or (h < 0).any():
        raise SpecError("routing histogram", h.shape if h.ndim else histogram,
                        "non-negative finite token counts, the experts (2 or more) on "
                        "the last axis")
    rows = h.reshape(-1, h.shape[-1])
    mean = rows.mean(-1)
    if not (mean > 0).all():
        raise SpecError("routing histogram", "a row with no routed token",
                        "at least one routed token per row")
    return float((rows.max(-1) / mean).max())


def _experts_of(program, shares) -> dict:
    """The mixture-of-experts fields of the layer owning parameters ``shares`` (those of
    ``Program.moe_traffic``'s layer whose expert weights it owns; none: not one)."""
    for info in program.moe_traffic:
        owned = sum(b for path, b, _, _ in shares if path in info["paths"])
        if owned and info["parallel"]:  # (one expert parallelism cannot run: none)
            return dict(experts=info["experts"], expert_param_bytes=float(owned),
                        routed_rows_per_sample=info["rows"],
                        routed_row_bytes=info["row_bytes"],
                        routed_out_bytes=info["out_bytes"],
                        routed_chain_bytes=info["chain_bytes"])
    return {}  # (the fields' defaults: no experts)


def _dims(op) -> tuple[float, float, float, float]:
    """(batch, M, N, K) of a ``dot_general`` from its operands' shapes, of a grouped
    matmul its equal groups' (``hetshard.ir.trace.ragged_dims``: the tokens per expert
    set its tiles); zeros otherwise."""
    if op.primitive == "ragged_dot_general" and len(op.inputs) == 3 and \
            op.params.get("ragged_dot_dimension_numbers") is not None:
        b, m, n, k = ragged_dims(op.params["ragged_dot_dimension_numbers"],
                                 op.inputs[0][1], op.inputs[1][1], op.inputs[2][1][-1])
        return (b * op.repeat, m, n, k)
    dims = op.params.get("dimension_numbers") if op.primitive == "dot_general" else None
    if dims is None or len(op.inputs) < 2:
        return (0.0, 0.0, 0.0, 0.0)
    (lc, rc), (lb, rb) = dims
    lhs, rhs = op.inputs[0][1], op.inputs[1][1]

    def size(shape, axes):
        return float(np.prod([shape[a] for a in axes], dtype=float))
    free_l = [a for a in range(len(lhs)) if a not in (*lc, *lb)]
    free_r = [a for a in range(len(rhs)) if a not in (*rc, *rb)]
    return (size(lhs, lb) * op.repeat, size(lhs, free_l), size(rhs, free_r), size(lhs, lc))


def _linear(at2, at4):
    """(q0, q1) with q(b) = q0 + q1 * b from values at b=2 and b=4."""
    q1 = (np.asarray(at4) - np.asarray(at2)) / 2.0
    return np.asarray(at2) - 2.0 * q1, q1


def _param_counts(graph: OpGraph) -> dict[str, int]:
    out: dict[str, int] = {}
    for layer, n in zip(graph.param_layers, graph.param_sizes, strict=True):
        out[layer] = out.get(layer, 0) + n
    return out
