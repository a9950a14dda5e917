"""The pipeline rewrite: a loss function split at layer boundaries into stage programs.

``split_stages`` traces ``loss(state_leaves, batch_leaves)`` (one micro-batch) to a
jaxpr and assigns every equation to a stage: its layer (``hetshard.ir.layers.discover``,
the same function the planner priced the layers with: named scopes, repeated blocks or
cuts by cost) is looked up in the plan's layer ranges, and an equation never runs
before a stage that produces one of its operands. Each stage then evaluates only its
equations; the values it hands to later stages (the boundary activations, plus
whatever else crosses, such as position ids) are its ``sends``, and what it reads from
earlier stages its ``recvs``.

A :class:`StageProgram` is differentiable on its own: ``forward`` returns the stage's
sends and a ``jax.vjp`` function (a pytree that ``jax.jit`` can return, so residuals
stay on the stage's devices), ``backward`` turns the sends' cotangents into the
cotangents of the received values and of the stage's parameters. Chaining the stages'
forwards reproduces the loss, chaining their backwards in reverse the gradient: the
runtime (``hetshard.runtime.pipeline``) runs them on the stages' submeshes under a
1F1B schedule. Attention equations are evaluated with the plan's implementation.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core as jcore
from jax.extend import core as ext

from hetshard.errors import StageSplitError
from hetshard.ir.attention_patterns import (
    attention_call,
    contains_attention,
    flax_patterns,
    inner_jaxpr,
    reads_of,
    skipped_equations,
)
from hetshard.ir.graph import ends_kernel, own_kernel
from hetshard.ir.interpret import eval_equations
from hetshard.ir.layers import LayerDiscoveryError, discover
from hetshard.offload import check_offload
from hetshard.remat import ATTENTION as ATTENTION_NODE
from hetshard.remat import OTHER, WEIGHT, check_remat, kept_projections, projection_roles
from hetshard.rewrite.attention import attention_runner


def _inexact(aval) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.inexact)


@dataclasses.dataclass(eq=False)
class StageProgram:
    """One stage's slice of the loss jaxpr (see the module docstring).

    Index lists refer to the flat inputs of the traced loss: ``state`` to state leaves,
    ``batch`` to batch leaves. ``params`` are the differentiable state leaves it reads,
    ``frozen`` the other state leaves it reads (non-trainable variables). ``recvs`` and
    ``sends`` are jaxpr variables; ``outputs`` maps final outputs (loss, aux) produced
    here to their position in the loss's flat outputs.
    """

    index: int
    layers: tuple[int, int]
    eqns: list[int]
    params: list[int]
    frozen: list[int]
    batch: list[int]
    recvs: list
    sends: list
    outputs: dict  # send position -> flat output position
    _split: StageSplit
    _memo: dict = dataclasses.field(default_factory=dict)

    @property
    def diff_recvs(self) -> list[int]:
        return [i for i, v in enumerate(self.recvs) if _inexact(v.aval)]

    @property
    def diff_sends(self) -> list[int]:
        return [i for i, v in enumerate(self.sends) if _inexact(v.aval)]

    @functools.cached_property
    def param_dtypes(self) -> list:
        """The dtype of each of ``params``."""
        invars = self._split.closed.jaxpr.invars
        return [invars[idx].aval.dtype for idx in self.params]

    @functools.cached_property
    def cast_params(self) -> dict[int, np.dtype]:
        """Positions in ``params`` of the parameters this stage reads only through one
        cast to another dtype (the compute-dtype copy of a float32 weight), with that
        dtype. Given them already cast, ``evaluate`` skips the cast (so the runtime casts
        once per step, not once per micro-batch, and the vjps share the copy)."""
        jaxpr = self._split.closed.jaxpr
        pos = {jaxpr.invars[idx]: k for k, idx in enumerate(self.params)}
        uses: dict[int, list] = {}
        for i in self.eqns:
            eqn = jaxpr.eqns[i]
            for v in eqn.invars:
                if not isinstance(v, ext.Literal) and v in pos:
                    uses.setdefault(pos[v], []).append(eqn)
        kept = {pos[v] for v in list(self.sends) + list(jaxpr.outvars)
                if not isinstance(v, ext.Literal) and v in pos}
        out = {}
        for k, eqns in uses.items():
            if len(eqns) != 1 or k in kept or eqns[0].primitive.name != \
                    "convert_element_type":
                continue
            src, dst = eqns[0].invars[0].aval.dtype, eqns[0].outvars[0].aval.dtype
            if src != dst and jnp.issubdtype(dst, jnp.inexact):
                out[k] = np.dtype(dst)
        return out

    def evaluate(self, params, frozen, batch, recvs, remat=None, mesh=None,
                 constrain=None, autocast=None, chunk_lengths=None, extras=None) -> list:
        """The stage's sends from its inputs (lists in the orders above). ``remat`` =
        (wrap, count): the equations of each of the stage's first ``count`` layers (None:
        all) run as one function wrapped by ``wrap`` (``jax.checkpoint`` with a policy),
        so that each layer is recomputed on its own in the backward pass. ``mesh``: the
        stage's mesh, on which the flash kernel runs per device; ``constrain``: layouts
        for ``eval_equations`` (``hetshard.rewrite.spmd.stage_sequence_layouts``);
        ``autocast``: the stage's matmul dtype where it differs from the program's
        (``eval_equations``); ``chunk_lengths``: uneven context chunks for attention."""
        sp = self._split
        run = sp.runner(mesh, chunk_lengths)
        jaxpr = sp.closed.jaxpr
        env = dict(zip(jaxpr.constvars, sp.closed.consts, strict=True))
        for idx, val in zip(self.params, params, strict=True):
            env[jaxpr.invars[idx]] = val
        for idx, val in zip(self.frozen, frozen, strict=True):
            env[jaxpr.invars[idx]] = val
        for idx, val in zip(self.batch, batch, strict=True):
            env[jaxpr.invars[sp.num_state + idx]] = val
        for var, val in zip(self.recvs, recvs, strict=True):
            env[var] = val
        env.update(extras or {})
        if remat is None:
            eval_equations(jaxpr, env, run, self.eqns, constrain=constrain,
                           autocast=autocast)
        else:
            # The layers the remat leaves are checkpointed by remat none's policy.
            key = ("segments", remat[1], getattr(remat[0], "remat", None))
            if key not in self._memo:
                self._memo[key] = remat_segments(jaxpr, self.eqns, sp.eqn_layer,
                                                 self.layers, remat[1], self.sends,
                                                 remat[0], rest=True)
            if "static" not in self._memo:
                self._memo["static"] = static_values(jaxpr, jaxpr.invars[:sp.num_state])
            segments, rest = self._memo[key]
            eval_segments(jaxpr, env, run, segments, remat[0], constrain=constrain,
                          autocast=autocast, rest=rest, static=self._memo["static"],
                          extras=tuple(extras or ()))
        return [v.val if isinstance(v, ext.Literal) else env[v] for v in self.sends]

    def forward(self, params, frozen, batch, recvs, remat=None, mesh=None, constrain=None,
                autocast=None, chunk_lengths=None, extra_keys=()):
        """``(float_sends, other_sends, vjp)``; ``vjp(float_send_cts)`` gives
        ``(param_cts, float_recv_cts)``. ``remat`` = (wrap, count): the stage's
        rematerialisation, each of its first ``count`` layers (None: all) wrapped by
        ``wrap``; ``mesh``, ``constrain``, ``autocast`` and ``chunk_lengths``: the
        stage's (see ``evaluate``). ``params`` may end with values the stage's
        ``constrain`` entries read under ``extra_keys`` (one each: the experts a rank
        lacks, brought once per step), differentiated as parameters are."""
        d_in, d_out = self.diff_recvs, self.diff_sends
        fixed = [None if i in d_in else r for i, r in enumerate(recvs)]
        n = len(params) - len(extra_keys)

        def f(p, fr):
            full = list(fixed)
            for i, val in zip(d_in, fr, strict=True):
                full[i] = val
            outs = self.evaluate(p[:n], frozen, batch, full, remat, mesh, constrain,
                                 autocast, chunk_lengths,
                                 dict(zip(extra_keys, p[n:], strict=True)))
            return ([outs[i] for i in d_out],
                    [o for i, o in enumerate(outs) if i not in set(d_out)])
        float_outs, vjp, other = jax.vjp(f, list(params), [recvs[i] for i in d_in],
                                         has_aux=True)
        return float_outs, other, vjp


@dataclasses.dataclass(eq=False)
class StageSplit:
    closed: object  # ClosedJaxpr of loss(state_leaves, batch_leaves)
    num_state: int
    layer_names: list[str]
    stages: list[StageProgram]
    out_tree: object
    run: Callable
    eqn_layer: list[int] = dataclasses.field(default_factory=list)  # layer per equation
    attention: str = "reference"
    attention_options: dict = dataclasses.field(default_factory=dict)
    _runners: dict = dataclasses.field(default_factory=dict)

    def runner(self, mesh=None, chunk_lengths=None) -> Callable:
        """The attention implementation for a stage on ``mesh`` (None: ``run``): a kernel
        (flash, cuDNN, or ``auto``'s choice for the mesh's devices) runs per device there
        (``hetshard.rewrite.attention._flash_on_mesh``); on a mesh with a ``context`` axis
        either runs as a ring over it (``_ring_on_mesh``), with uneven ``chunk_lengths``
        when given."""
        context = mesh is not None and mesh.shape.get("context", 1) > 1
        if mesh is None or (self.attention == "reference" and not context) or \
                "mesh" in self.attention_options:
            return self.run
        key = (mesh, chunk_lengths)
        if key not in self._runners:
            options = dict(self.attention_options)
            if chunk_lengths:
                options["chunk_lengths"] = chunk_lengths
            self._runners[key] = attention_runner(self.attention, mesh=mesh, **options)
        return self._runners[key]

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    def producer(self) -> dict:
        """var -> stage index that sends it."""
        return {v: s.index for s in self.stages for v in s.sends}


class Remat:
    """The checkpoint wrapper of a plan's remat (``hetshard.remat.REMATS``): ``full``
    saves nothing (a layer's input only), ``selective`` the matmuls without batch
    dimensions, a named policy the projections it names. Those are tagged
    (``checkpoint_name``) as :func:`eval_segments` computes them (:meth:`names`), by the
    roles ``hetshard.remat.projection_roles`` reads off the layer's equations, as the
    cost model reads them off its traced graph.

    ``none`` is a pipeline stage's: its forward and backward are separate programs, so
    what ``jax.vjp`` keeps is what the backward gets, every intermediate value included.
    Each layer keeps what XLA writes to memory when the forward and backward are one
    program (:func:`written_values`: matmul, kernel and reduction outputs and what a
    matmul or kernel reads); the elementwise values between them are recomputed by the
    backward, as XLA's fusion recomputes them in one program. That is what the cost
    model prices for remat none (``hetshard.ir.graph.OpGraph.residuals(fused=True)``)."""

    def __init__(self, remat: str, offload: bool = False):
        self.remat = check_remat(remat)
        self.keep = kept_projections(remat)
        if offload:
            # ``Stage.offload`` "activations": what the policy keeps goes to the host's
            # pinned memory in the forward and comes back for the backward.
            check_offload(("activations",), remat)
            policies = jax.checkpoint_policies
            self.policy = _offload_policy(policies.offload_dot_with_no_batch_dims) \
                if self.keep is None else _offload_policy(
                    policies.save_and_offload_only_these_names, names_which_can_be_saved=(),
                    names_which_can_be_offloaded=tuple(_TAG + role for role in self.keep))
        elif self.keep is not None:
            self.policy = jax.checkpoint_policies.save_only_these_names(
                *(_TAG + role for role in self.keep))
        elif remat == "none":
            self.policy = jax.checkpoint_policies.save_only_these_names(_WRITTEN)
        else:
            self.policy = {"full": jax.checkpoint_policies.nothing_saveable,
                           "selective": jax.checkpoint_policies.dots_with_no_batch_dims_saveable
                           }[remat]

    def __call__(self, fn):
        return jax.checkpoint(fn, policy=self.policy)

    def names(self, jaxpr, ids: Sequence[int], static=frozenset()) -> dict | None:
        """The variables of equations ``ids`` (one layer's) the policy saves -> their
        tags: a named policy's projections, remat none's written values but those in
        ``static`` (made from the parameters alone: a weight's cast, kept once per step,
        not per micro-batch); None for the other remats."""
        if self.remat == "none":
            return {v: _WRITTEN for v in written_values(jaxpr, ids) if v not in static}
        if self.keep is None:
            return None
        roles = equation_roles(jaxpr, ids)
        return {jaxpr.eqns[i].outvars[0]: _TAG + role for i, role in roles.items()
                if role in self.keep}


def written_values(jaxpr, ids: Sequence[int]) -> list:
    """The values of equations ``ids`` of ``jaxpr`` (one layer's, in order) that XLA
    writes to memory when a program holds them (the rule of
    ``hetshard.ir.graph.OpGraph.written`` on the jaxpr the runtime evaluates): the
    outputs of a kernel of its own (a matmul, a sort, attention, a call holding one)
    and of a reduction that ends its kernel, and the values such a kernel reads. Other
    values are elementwise ones their readers recompute."""
    eqns = jaxpr.eqns
    patterns = flax_patterns(jaxpr)
    skip = skipped_equations(jaxpr)
    out: dict = {}

    def reads(i):
        if i in patterns:
            pat = patterns[i]
            return [v for v in (pat["q"], pat["k"], pat["v"], pat["seg"])
                    if isinstance(v, ext.Var)]
        return [v for v in eqns[i].invars if isinstance(v, ext.Var)]
    for i in ids:
        if i in skip:
            continue
        eqn = eqns[i]
        if i in patterns or _kernel(eqn):
            out.update(dict.fromkeys(reads(i)))
            out.update(dict.fromkeys(eqn.outvars))
        elif eqn.invars and ends_kernel(eqn.primitive.name, eqn.params.get("axes"),
                                        eqn.invars[0].aval.shape):
            out.update(dict.fromkeys(eqn.outvars))
    made = {v for i in ids if i not in skip for v in eqns[i].outvars}
    return [v for v in out if v in made and not isinstance(v, jcore.DropVar)]


def _kernel(eqn) -> bool:
    """An equation XLA runs apart from its elementwise neighbours: a matmul or other
    kernel of its own, attention, or a call holding one."""
    if own_kernel(eqn.primitive.name) or attention_call(eqn) is not None:
        return True
    inner = inner_jaxpr(eqn)
    if inner is None:
        return False
    return eqn.primitive.name not in _ELEMENTWISE_CALLS or any(
        _kernel(e) or ends_kernel(e.primitive.name, e.params.get("axes"),
                                  e.invars[0].aval.shape if e.invars else ())
        for e in inner[0].eqns)


# Calls that are elementwise when what they hold is (``jax.nn``'s jitted activations).
_ELEMENTWISE_CALLS = ("jit", "pjit", "closed_call", "core_call", "custom_jvp_call")
_WRITTEN = "hetshard_written"


_TAG = "hetshard_remat_"


def _offload_policy(make, **names):
    """``make`` (one of JAX's offloading checkpoint policies) from the device's memory to
    the host's pinned memory, with those of ``names`` it takes (JAX releases differ in
    which arguments these factories keep)."""
    params = inspect.signature(make).parameters
    given = dict(names, offload_src="device", offload_dst="pinned_host")
    return make(**{k: v for k, v in given.items() if k in params})


def equation_roles(jaxpr, ids: Sequence[int]) -> dict[int, str]:
    """The weight projections among equations ``ids`` of ``jaxpr`` (one layer's, in
    order) and their roles (``hetshard.remat.projection_roles``): equation index ->
    ``qkv``, ``attn_out`` or ``mlp_in``. A projection is a ``dot_general`` without batch
    dimensions; attention a ``hetshard.nn.attention`` call, a call holding attention,
    or a product batched over heads (Flax-style attention's)."""
    ids = list(ids)
    local = {}
    kinds, preds = [], []
    for j, i in enumerate(ids):
        eqn = jaxpr.eqns[i]
        dims = eqn.params.get("dimension_numbers") if eqn.primitive.name == \
            "dot_general" else None
        inner = inner_jaxpr(eqn)
        if dims is not None and not dims[1][0]:
            kinds.append(WEIGHT)
        elif dims is not None or attention_call(eqn) is not None or (
                inner is not None and contains_attention(inner[0])):
            kinds.append(ATTENTION_NODE)
        else:
            kinds.append(OTHER)
        preds.append(sorted({local[v] for v in eqn.invars
                             if isinstance(v, ext.Var) and v in local}))
        for v in eqn.outvars:
            local[v] = j
    return {ids[j]: role for j, role in projection_roles(kinds, preds).items()}


def remat_wrap(remat: str, offload: tuple[str, ...] = (),
               checkpoint_none: bool = False) -> Remat | None:
    """The :class:`Remat` of a stage's remat and offload (``Stage.offload``: its kept
    values in host memory where it lists "activations"); for remat none, None (XLA
    keeps what one program needs) or, ``checkpoint_none``, ``Remat("none")``: a pipeline
    stage (its forward a program of its own, whose vjp the backward gets) and an FSDP
    stage (whose backward gathers the weights again)."""
    if remat == "none":
        return Remat(remat) if checkpoint_none else None
    return Remat(remat, "activations" in offload)


def remat_segments(jaxpr, ids: Sequence[int], eqn_layer: Sequence[int],
                   layers: tuple[int, int], count: int | None, live: Sequence, wrap,
                   rest: bool) -> tuple[list, Remat]:
    """:func:`layer_segments` of a stage's layers ``[first, end)`` under ``wrap``, which
    recomputes its first ``count`` (None: all), and the wrapper of the others
    (``rest``: they are checkpointed by remat none's policy): under ``Remat("none")``
    itself every layer is one of the others."""
    first, end = layers
    none = getattr(wrap, "remat", None) == "none"
    last = first if none else end if count is None else first + count
    return (layer_segments(jaxpr, ids, eqn_layer, (first, last), live, rest=rest or none),
            wrap if none else Remat("none"))


def layer_segments(jaxpr, ids: Sequence[int], eqn_layer: Sequence[int],
                   recomputed: tuple[int, int], live: Sequence, rest: bool = False) -> list:
    """Equations ``ids`` of ``jaxpr`` (in order) as runs of one layer each: (equation
    ids, reads, outs, recomputed). A run of a layer in ``recomputed`` = [first, end)
    lists the variables it reads from before and those read after it or in ``live``
    (the values wanted at the end), and is checkpointed by the remat; other runs have
    reads and outs None (evaluated inline). ``rest``: the other layers are checkpointed
    too, by remat none's policy (``Remat("none")``), their attention (:func:`
    attention_equations`) a run of its own evaluated inline between their runs (what
    it keeps for its backward is its kernel's own)."""
    eqns = jaxpr.eqns
    apart = {i for i in attention_equations(jaxpr, ids)
             if not recomputed[0] <= eqn_layer[i] < recomputed[1]} if rest else set()
    runs: list[list[int]] = []
    for i in ids:
        if runs and eqn_layer[runs[-1][-1]] == eqn_layer[i] and \
                i not in apart and runs[-1][-1] not in apart:
            runs[-1].append(i)
        else:
            runs.append([i])
    skip = skipped_equations(jaxpr)
    later: list[set] = [set() for _ in runs]
    seen = {v for v in live if isinstance(v, ext.Var)}
    for r in range(len(runs) - 1, -1, -1):
        later[r] = set(seen)
        for i in runs[r]:
            seen.update(reads_of(jaxpr, i))
    out = []
    for r, run in enumerate(runs):
        inside = recomputed[0] <= eqn_layer[run[0]] < recomputed[1]
        if not (inside or rest) or run[0] in apart:
            out.append((run, None, None, False))
            continue
        made = {v for i in run for v in eqns[i].outvars}
        reads = list(dict.fromkeys(v for i in run for v in reads_of(jaxpr, i)
                                   if v not in made))
        outs = [v for i in run if i not in skip for v in eqns[i].outvars if v in later[r]]
        out.append((run, reads, outs, inside))
    return out


def static_values(jaxpr, inputs: Sequence) -> frozenset:
    """The variables of ``jaxpr`` computed from ``inputs`` (its parameters), constants
    and literals alone."""
    known = set(inputs) | set(jaxpr.constvars)
    for eqn in jaxpr.eqns:
        if all(not isinstance(v, ext.Var) or v in known for v in eqn.invars):
            known.update(eqn.outvars)
    return frozenset(known)


def attention_equations(jaxpr, ids: Sequence[int]) -> set[int]:
    """Those of equations ``ids`` that compute attention when evaluated (a
    ``hetshard.nn.attention`` call, a recognised Flax attention's last equation, a call
    holding attention)."""
    patterns = flax_patterns(jaxpr)
    out = set()
    for i in ids:
        eqn = jaxpr.eqns[i]
        inner = inner_jaxpr(eqn)
        if i in patterns or attention_call(eqn) is not None or (
                inner is not None and contains_attention(inner[0])):
            out.add(i)
    return out


def eval_segments(jaxpr, env: dict, run, segments, wrap, constrain=None,
                  autocast=None, rest=None, static=frozenset(), extras=()) -> None:
    """``eval_equations`` over ``layer_segments``: each recomputed layer's run as one
    function wrapped by ``wrap`` (``remat_wrap``), so the backward recomputes it alone;
    the other checkpointed runs (``layer_segments``' ``rest``) wrapped by ``rest``.
    ``static``: the variables made from the parameters alone (:func:`static_values`);
    ``extras``: keys of ``env`` that ``constrain``'s entries read besides the jaxpr's
    variables (given to every layer function)."""
    for ids, reads, outs, inside in segments:
        if reads is None:
            eval_equations(jaxpr, env, run, ids, constrain=constrain, autocast=autocast)
            continue
        by = wrap if inside else rest
        names = by.names(jaxpr, ids, static) if isinstance(by, Remat) else None
        keys = [*reads, *extras]

        def layer(*values, ids=ids, keys=keys, outs=outs, names=names):
            inner = dict(zip(keys, values, strict=True))
            eval_equations(jaxpr, inner, run, ids, constrain=constrain, autocast=autocast,
                           names=names)
            return [inner[v] for v in outs]
        env.update(zip(outs, by(layer)(*[env[v] for v in keys]), strict=True))


def layer_sequence(closed, split_blocks: bool = False,
                   batch_inputs: Sequence[int] | None = None) -> tuple[list[str], list[int]]:
    """Layer names in execution order and each equation's layer index, as the planner
    found them (``hetshard.ir.layers.discover``: named scopes, repeated blocks, or cuts
    by cost); ``split_blocks``: blocks of repeated stacks are cut in halves;
    ``batch_inputs``: the invars that are batch leaves, where known.

    Raises:
      StageSplitError: the loss has no equations.
    """
    try:
        lay = discover(closed, split_blocks, batch_inputs)
    except LayerDiscoveryError as e:
        raise StageSplitError(str(e)) from None
    return list(lay.names), list(lay.eqn_layer)


def split_stages(loss: Callable, state_leaves: Sequence, batch_leaves: Sequence,
                 ranges: Sequence[tuple[int, int]], diff_state: Sequence[int], *,
                 attention: str = "reference", split_blocks: bool = False,
                 **attention_options) -> StageSplit:
    """Splits ``loss(state_leaves, batch_leaves)`` (arrays or ShapeDtypeStructs) into
    stages with the layer ``ranges`` ([start, end) per stage, contiguous from 0).

    ``diff_state``: indices of the state leaves to differentiate (the parameters).
    ``split_blocks``: the ranges count block halves (``layer_sequence``).

    Raises:
      StageSplitError: ranges that do not cover the loss's layers exactly, or a loss
        without layer scopes.
    """
    closed, out_shape = jax.make_jaxpr(loss, return_shape=True)(list(state_leaves),
                                                               list(batch_leaves))
    jaxpr = closed.jaxpr
    num_state = len(state_leaves)
    names, eqn_layer = layer_sequence(closed, split_blocks,
                                      range(num_state, len(jaxpr.invars)))
    if ranges[0][0] != 0 or ranges[-1][1] != len(names) or any(
            a[1] != b[0] for a, b in zip(ranges, ranges[1:], strict=False)) or any(
            e <= s for s, e in ranges):
        raise StageSplitError(
            f"the plan's stage layer ranges {list(ranges)} must cover the model's "
            f"{len(names)} layers contiguously ({names[0]} ... {names[-1]})")
    stage_of_layer = np.zeros(len(names), int)
    for k, (s, e) in enumerate(ranges):
        stage_of_layer[s:e] = k
    produced: dict = {}
    eqn_stage = []
    for i, eqn in enumerate(jaxpr.eqns):
        k = int(stage_of_layer[eqn_layer[i]])
        for v in eqn.invars:
            if isinstance(v, ext.Var) and v in produced:
                k = max(k, produced[v])
        eqn_stage.append(k)
        for v in eqn.outvars:
            produced[v] = k
    n = len(ranges)
    invar_index = {v: i for i, v in enumerate(jaxpr.invars)}
    diff = set(diff_state)
    reads: list[set] = [set() for _ in range(n)]
    for i in range(len(jaxpr.eqns)):
        reads[eqn_stage[i]].update(reads_of(jaxpr, i))
    final = [v for v in jaxpr.outvars if isinstance(v, ext.Var)]
    stages = []
    for k in range(n):
        eqns = [i for i, s in enumerate(eqn_stage) if s == k]
        mine = [v for i in eqns for v in jaxpr.eqns[i].outvars]
        later = set().union(*reads[k + 1:]) if k + 1 < n else set()
        sends = [v for v in mine if v in later or v in final]
        # A final output that is a plain input (no equation) is sent by the last stage.
        if k == n - 1:
            sends += [v for v in final if v in invar_index and v not in sends]
        recvs = sorted((v for v in reads[k] if v in produced and produced[v] < k),
                       key=lambda v: (produced[v], str(v)))
        ins = sorted(invar_index[v] for v in reads[k] | (set(sends) & set(invar_index))
                     if v in invar_index)
        outputs = {j: pos for j, v in enumerate(sends)
                   for pos, w in enumerate(jaxpr.outvars) if w is v}
        stages.append(StageProgram(
            index=k, layers=tuple(ranges[k]), eqns=eqns,
            params=[i for i in ins if i < num_state and i in diff
                    and _inexact(jaxpr.invars[i].aval)],
            frozen=[i for i in ins if i < num_state and not (
                i in diff and _inexact(jaxpr.invars[i].aval))],
            batch=[i - num_state for i in ins if i >= num_state],
            recvs=recvs, sends=sends, outputs=outputs, _split=None))
    # Every final output must come from some stage.
    sent = {v for s in stages for v in s.sends}
    for pos, v in enumerate(jaxpr.outvars):
        if isinstance(v, ext.Var) and v not in sent:
            raise StageSplitError(f"output {pos} of the loss comes from no stage")
    split = StageSplit(closed, num_state, names, stages, jax.tree.structure(out_shape),
                       attention_runner(attention, **attention_options), eqn_layer,
                       attention, dict(attention_options))
    for s in stages:
        s._split = split
    return split


def run_sequential(split: StageSplit, state_leaves, batch_leaves) -> list:
    """The loss's flat outputs computed stage by stage (no differentiation): a check
    that the split loses nothing."""
    values: dict = {}
    outs: list = [None] * len(split.closed.jaxpr.outvars)
    for st in split.stages:
        sends = st.evaluate([state_leaves[i] for i in st.params],
                            [state_leaves[i] for i in st.frozen],
                            [batch_leaves[i] for i in st.batch],
                            [values[v] for v in st.recvs])
        for j, (v, val) in enumerate(zip(st.sends, sends, strict=True)):
            values[v] = val
            if j in st.outputs:
                outs[st.outputs[j]] = val
    for pos, v in enumerate(split.closed.jaxpr.outvars):
        if isinstance(v, ext.Literal):
            outs[pos] = v.val
    return outs
