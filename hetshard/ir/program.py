"""The user's train step and its arguments: what hetshard plans, prices and runs.

``Program(step, args)`` takes a train step exactly as the user wrote it, with the
arguments of one call: NNX objects (a model, an ``nnx.Optimizer``) or pytrees (a params
dict, an optax state), and a batch. Any of them may be shape-only
(``nnx.eval_shape``/``jax.eval_shape``/``jax.ShapeDtypeStruct``), so a 175B model is
planned without weights. The program

* flattens the step's non-batch arguments to state leaves with paths
  (``layers/3/attn/q_proj/kernel``), and the batch to batch leaves; ``trees``
  (``hetshard.ir.trees.StepTrees``) rebuilds the step's arguments from them;
* records the step's ``hetshard.value_and_grad`` call (:class:`~hetshard.autodiff.
  LossCall`), which isolates the loss (the per-micro-batch part) from the optimizer
  update, and the state leaves it differentiates;
* traces the loss of one micro-batch on flat leaves (:meth:`loss_jaxpr`) and finds its
  layers there (:meth:`layering`, ``hetshard.ir.layers``): the planner prices them and
  the runtime cuts stages between them, both from this one function;
* answers how the loss treats its samples (``samples``:
  ``hetshard.ir.loss_samples.LossSamples``): whether a plan may cut the batch, and how
  the pieces' outputs then make the whole batch's.

A step without ``hetshard.value_and_grad``, or whose loss reads values the step computes
(so that it cannot be cut per micro-batch), is still planned and run, as one layer
(single-stage plans only; ``call_error`` says why).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.extend import core as ext

from hetshard._plan import DTYPES
from hetshard.autodiff import LossCall, LossCallError, Recorded, entered, is_graph, user_step
from hetshard.errors import HetshardError, SpecError, StepTraceError
from hetshard.ir.attention_patterns import dead_equations
from hetshard.ir.dependencies import output_dependencies
from hetshard.ir.graph import OpGraph
from hetshard.ir.interpret import eval_equations, named_attention
from hetshard.ir.layers import Layering, discover, eqn_flops, eqn_signature
from hetshard.ir.loss_samples import LossSamples
from hetshard.ir.moe import MoeLayer, expert_regions, moe_layers
from hetshard.ir.paths import path_string  # noqa: F401 (re-exported)
from hetshard.ir.trace import trace
from hetshard.ir.trees import StepTrees, batch_of
from hetshard.ir.unroll import unroll_scans, unrolled_jaxpr

_INT_KINDS = ("i", "u")
# How a loss's values reduced over the batch and put through a non-linear function (a
# mixture-of-experts balance loss of batch means) are taken when a plan cuts the batch:
# "whole" (such a loss keeps its step whole) or "per_piece" (each micro-batch or batch
# share computes them from its own samples: Megatron-LM's per-micro-batch aux loss).
BATCH_REDUCTIONS = ("whole", "per_piece")


def _aval(x) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(np.shape(x)), jnp.result_type(x))


def check_batch(batch, where: str = "hetshard.jit") -> int:
    """The batch's leading size; every leaf must have one and they must agree.

    Raises:
      SpecError: naming the leaf without a batch dimension, or the two leaves whose
      leading sizes differ.
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(batch)
    if not flat:
        raise SpecError("batch", type(batch).__name__,
                        "a pytree of arrays with a leading batch dimension", where=where)
    size, first = None, None
    for path, x in flat:
        name = f"batch[{path_string(path)!r}]" if path else "batch"
        if not hasattr(x, "shape") or not np.ndim(x):
            raise SpecError(name, f"shape {tuple(np.shape(x))}",
                            "an array with a leading batch dimension (the batch is the "
                            "step's last argument unless batch_argnums says which)",
                            where=where)
        n = int(np.shape(x)[0])
        if size is None:
            size, first = n, name
        elif n != size:
            raise SpecError(name, f"leading size {n}",
                            f"the leading size {size} of {first} (every batch leaf holds "
                            f"the same samples)", where=where)
    return size


def _leading(x) -> int | None:
    """The leading size of a plain array argument (None for anything else: an NNX
    object, a pytree, a scalar)."""
    if isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)) and len(x.shape):
        return int(x.shape[0])
    return None


def _scalar(x) -> bool:
    """A scalar argument, or a raw PRNG key (``jax.random.PRNGKey``: uint32[2]): never
    a batch."""
    if not isinstance(x, (int, float, jax.Array, np.ndarray, np.generic,
                          jax.ShapeDtypeStruct)):
        return False
    shape = tuple(np.shape(x))
    return not shape or (shape == (2,) and jnp.result_type(x) == jnp.uint32)


def batch_positions(args, batch_argnums, where: str = "hetshard.jit") -> tuple[int, ...]:
    """The positions of the batch among the step's ``args``: ``batch_argnums`` (an index
    or a tuple of them), or by default the last argument that is not a scalar (an RNG
    key, raw or typed, a step counter) together with the plain arrays just before it
    that share its leading size, when it is a plain array itself (``step(model,
    optimizer, x, y)``).

    Raises:
      SpecError: an index that is not one of the arguments', or none at all.
    """
    n = len(args)
    if batch_argnums is None:
        last = n - 1  # (a scalar after the batch, a step's RNG key or counter, is not it)
        while last > 0 and _scalar(args[last]):
            last -= 1
        pos = [last]
        lead = _leading(args[last])
        while lead is not None and pos[0] > 0 and _leading(args[pos[0] - 1]) == lead:
            pos.insert(0, pos[0] - 1)
        return tuple(pos)
    given = batch_argnums if isinstance(batch_argnums, (tuple, list)) else (batch_argnums,)
    if not given or any(isinstance(i, bool) or not isinstance(i, int) or not -n <= i < n
                        for i in given):
        raise SpecError("batch_argnums", batch_argnums,
                        f"an argument index below {n}, or a tuple of them", where=where)
    pos = sorted({i % n for i in given})
    if len(pos) == n:
        raise SpecError("batch_argnums", batch_argnums,
                        "indices leaving the step's state among its arguments", where=where)
    return tuple(pos)


@contextlib.contextmanager
def user_errors(step, batch, where: str):
    """Re-raises an exception from the user's own code, while hetshard traces the step,
    as a StepTraceError naming the step and the batch's shapes (hetshard's own errors and
    failures inside hetshard pass unchanged)."""
    try:
        yield
    except HetshardError:
        raise
    except Exception as e:
        if not _raised_in_user_code(e):
            raise
        shapes = {path_string(p) or "batch": tuple(np.shape(x)) for p, x in
                  jax.tree_util.tree_flatten_with_path(batch)[0]}
        name = getattr(step, "__qualname__", type(step).__name__)
        raise StepTraceError(
            f"{where}: the step {name!r} raised while hetshard traced it with batch shapes "
            f"{shapes}: {type(e).__name__}: {e} (the step must run on these arguments "
            f"under jax.jit; the traceback above is the step's)") from e


_LIBRARIES = tuple(os.path.dirname(m.__file__) + os.sep for m in (jax, nnx, np)) + (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,)  # hetshard/


def _raised_in_user_code(e: BaseException) -> bool:
    """Whether a frame of ``e``'s traceback is the user's: not hetshard's, JAX's, Flax's,
    NumPy's or the standard library's."""
    stdlib = os.path.dirname(os.__file__) + os.sep
    tb = e.__traceback__
    while tb is not None:
        f = tb.tb_frame.f_code.co_filename
        if not f.startswith(_LIBRARIES + (stdlib,)) and not f.startswith("<"):
            return True
        tb = tb.tb_next
    return False




class Program:
    """A train step with one call's arguments (see the module docstring).

    Args:
      step: the train step, ``step(*args)``.
      args: its arguments; ``args[batch_argnums]`` is the batch (an index or a tuple of
        them: several arguments make one batch; default: ``batch_positions``).
      name: a label for plans and tables (default: the step's qualified name).
      batch_reductions: ``"whole"`` or ``"per_piece"`` (``hetshard.jit``'s).

    Raises:
      SpecError: a batch without one common leading size, a batch_argnums out of range.
      LossCallError: a ``hetshard.value_and_grad`` call whose loss cannot be cut per
        micro-batch.
    """

    def __init__(self, step, args, *, batch_argnums: int | None = None,
                 name: str | None = None, batch_reductions: str = "whole"):
        if batch_reductions not in BATCH_REDUCTIONS:
            raise SpecError("batch_reductions", batch_reductions,
                            f"one of {BATCH_REDUCTIONS}", where="hetshard.jit")
        self.batch_reductions = batch_reductions
        args = tuple(args)
        if not args:
            raise SpecError("args", "()", "the step's arguments, the batch among them",
                            where="hetshard.plan")
        self.batch_positions = batch_positions(args, batch_argnums)
        self.step = user_step(step)
        self.name = name or getattr(step, "__qualname__", None) or type(step).__name__
        batch = batch_of(args, self.batch_positions)
        self.global_batch = check_batch(batch)
        others = tuple(a for i, a in enumerate(args) if i not in self.batch_positions)
        self.kind = "nnx" if any(is_graph(a) for a in others) else "tree"
        if self.kind == "nnx":
            graphdef, state = nnx.split(others)
        else:
            graphdef, state = None, others
        flat, state_tree = jax.tree_util.tree_flatten_with_path(state)
        self.paths = [path_string(p) for p, _ in flat]
        self._param_paths = None if self.kind != "nnx" else {
            path_string(p) for p, _ in
            jax.tree_util.tree_flatten_with_path(nnx.state(others, nnx.Param))[0]}
        self.state_avals = [_aval(x) for _, x in flat]
        batch_leaves, batch_tree = jax.tree.flatten(batch)
        self.batch_avals = [_aval(x) for x in batch_leaves]
        # how the arguments flatten and come back (the runtime's tree plumbing)
        self.trees = StepTrees(self.kind, graphdef, state_tree, batch_tree,
                               self.batch_positions, tuple(self.batch_avals))
        self.batch_paths = [path_string(p) for p, _ in
                            jax.tree_util.tree_flatten_with_path(batch)[0]]
        self.call = self._record()
        self.diff, self.diff_prefix = self._differentiated(state)
        if self.call is not None and self._differentiations() > 1:
            self.call = None
            self.call_error = (
                "the step differentiates more than once (two value_and_grad or grad "
                "calls, or one in a loop); hetshard cuts one loss per micro-batch, so it "
                "plans the step whole")
            self.diff, self.diff_prefix = self._differentiated(state)
            self.__dict__.pop("loss_flat", None)
            self.__dict__.pop("samples", None)
            self._update_traced = None
            self.loss_jaxpr.cache_clear()

    @functools.cached_property
    def changes_parameters(self) -> bool:
        """Whether the step changes any ``nnx.Param`` it is given (an evaluation step
        changes none: only metrics, or nothing). A pytree step, whose parameters cannot
        be told apart, is taken to."""
        if self.kind != "nnx":
            return True

        def run(state_leaves, batch_leaves):
            return self.trees.updated_state(self.call_step(state_leaves, batch_leaves)[1])
        closed = jax.make_jaxpr(run)(self.state_avals, self.trees.batch_at(2))
        ins, outs = closed.jaxpr.invars, closed.jaxpr.outvars
        return any(outs[i] is not ins[i] for i, path in enumerate(self.paths)
                   if path in self._param_paths)

    def call_step(self, state_leaves, batch_leaves):
        """``step(*args)`` on flat leaves; returns (output, the objects after the step)."""
        return self.trees.call(self.step, state_leaves, batch_leaves)

    def _record(self) -> LossCall | None:
        """The step's one loss call (``hetshard.value_and_grad``, or the plain
        ``nnx``/``jax`` transforms hetshard answers), or None with ``call_error`` saying
        why the loss cannot be cut per micro-batch."""
        seen = []

        def probe(state_leaves, batch_leaves):
            objs = self.trees.merge(state_leaves)
            batch = self.trees.batch(batch_leaves)
            with entered(mode="record", record_args=tuple(objs),
                         record_state=tuple(state_leaves), record_batch=batch,
                         calls=seen):
                self.step(*self.trees.with_batch(objs, batch))

        self.call_error = ("it differentiates no loss with hetshard.value_and_grad or "
                           "nnx/jax value_and_grad or grad called in the step")
        try:
            jax.eval_shape(probe, self.state_avals, self.batch_avals)
        except Recorded as rec:
            self.call_error = ""
            return rec.call
        except LossCallError as e:
            # The loss cannot be cut per micro-batch: single-stage plans only.
            self.call_error = str(e)
            return None
        if seen:  # differentiations hetshard's transforms do not take
            self.call_error = ("it differentiates with arguments hetshard.value_and_grad "
                               "does not take (several argnums, holomorphic, allow_int)")
        return None

    def _differentiations(self) -> int:
        """How many times the whole step differentiates (its loss call answered, the rest
        of the step traced: a second loss, a sharpness-aware step's second gradient).
        Where the step cannot be traced with a micro-batch's loss outputs (per-sample
        aux: it is planned whole anyway), the differentiations seen up to there."""
        self.loss_jaxpr(2)  # a loss that cannot be traced raises here, as the user's error
        self._update_seen = []
        try:
            return self._update()[1]
        except Exception:  # noqa: BLE001 (traced again, and raising, where it is used)
            return len(self._update_seen)

    def _recorded_call(self, state_leaves, batch_leaves) -> Recorded:
        """The step run on these leaves up to its loss call: what it passes the loss."""
        objs = self.trees.merge(state_leaves)
        batch = self.trees.batch(batch_leaves)
        with entered(mode="record", record_args=tuple(objs),
                     record_state=tuple(state_leaves), record_batch=batch, calls=[]):
            try:
                self.step(*self.trees.with_batch(objs, batch))
            except Recorded as rec:
                return rec
        raise LossCallError("the step did not reach its loss call on this trace (it "
                            "differentiates only under a condition?)")

    def _differentiated(self, state) -> tuple[list[int], str]:
        """State indices of the leaves the loss is differentiated in (the gradient's
        leaves, in its order), and their common path prefix."""
        call = self.call
        if call is None:
            # Without the loss call: the NNX parameters, or the first argument's leaves.
            if self.kind == "nnx":
                params = nnx.state(tuple(self.trees.merge(self.state_avals)), nnx.Param)
                wanted = {path_string(p) for p, _ in
                          jax.tree_util.tree_flatten_with_path(params)[0]}
                return [i for i, p in enumerate(self.paths) if p in wanted], ""
            first = len(jax.tree.leaves(state[0])) if state else 0
            return list(range(first)), "0" if first else ""
        kind, *rest = call.differentiated
        where = {p: i for i, p in enumerate(self.paths)}
        if kind == "state":
            return list(rest[1]), ""
        j = rest[0]
        objs = self.trees.merge(self.state_avals)
        target = objs[j]
        prefix = str(j)
        if self.kind == "nnx" and is_graph(target):
            tree = nnx.state(target, call.wrt)
        else:
            tree = target
        out = []
        for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
            rel = path_string(p)
            key = f"{prefix}/{rel}" if rel else prefix
            if key not in where:
                raise SpecError("model", key, "a parameter the step receives in its "
                                "arguments", where="hetshard.plan")
            out.append(where[key])
        return out, prefix

    @functools.lru_cache(maxsize=8)  # noqa: B019
    def layer_params(self, mbs: int = 2, split_blocks: bool = False) -> list[list[int]]:
        """Per layer, the state leaves its equations read, in the order first read: the
        same position in two layers of one kind is the same parameter of each."""
        closed, _ = self.loss_jaxpr(mbs)
        lay = self.layering(mbs, split_blocks)
        pos = {v: i for i, v in enumerate(closed.jaxpr.invars[:len(self.state_avals)])}
        out: list[list[int]] = [[] for _ in range(lay.num_layers)]
        seen: list[set] = [set() for _ in range(lay.num_layers)]
        for i, eqn in enumerate(closed.jaxpr.eqns):
            k = lay.eqn_layer[i]
            for v in eqn.invars:
                if not isinstance(v, ext.Literal) and v in pos and pos[v] not in seen[k]:
                    seen[k].add(pos[v])
                    out[k].append(pos[v])
        return out

    @functools.lru_cache(maxsize=8)  # noqa: B019
    def layer_param_sizes(self, mbs: int = 2, split_blocks: bool = False
                          ) -> list[tuple[tuple[str, int, int, int], ...]]:
        """Per layer, ``(path, bytes, elements, rank)`` of each parameter it owns (by
        ``param_path``, in leaf order; ``rank``: its dimensions longer than 1, the layer's
        slice's for a stacked weight): a parameter belongs to the first layer reading it
        whole; a stacked weight that layers read slice by slice (an unrolled scan's) gives
        each layer its slices."""
        closed, _ = self.loss_jaxpr(mbs)
        lay = self.layering(mbs, split_blocks)
        n_state = len(self.state_avals)
        pos = {v: i for i, v in enumerate(closed.jaxpr.invars[:n_state])}
        params = set(self.diff)
        whole: dict[int, int] = {}  # leaf -> first layer reading it whole
        # leaf -> (layer, bytes, elements, rank) of each slice a layer reads
        slices: dict[int, list[tuple[int, int, int, int]]] = {}
        for i, eqn in enumerate(closed.jaxpr.eqns):
            k = lay.eqn_layer[i]
            for v in eqn.invars:
                if isinstance(v, ext.Literal) or pos.get(v) not in params:
                    continue
                if eqn.primitive.name in ("slice", "dynamic_slice") and v is eqn.invars[0]:
                    out = eqn.outvars[0].aval
                    n = math.prod(out.shape)
                    slices.setdefault(pos[v], []).append(
                        (k, n * out.dtype.itemsize, n, sum(x > 1 for x in out.shape)))
                else:
                    whole.setdefault(pos[v], k)
        out: list[list[tuple[str, int, int, int]]] = [[] for _ in range(lay.num_layers)]
        for j in sorted(params):
            a = self.state_avals[j]
            path = self.param_path(j)
            if j in whole:
                n = math.prod(a.shape)
                out[whole[j]].append((path, int(n * a.dtype.itemsize), int(n),
                                      sum(x > 1 for x in a.shape)))
            else:
                for k, nbytes, n, rank in slices.get(j, ()):
                    out[k].append((path, int(nbytes), int(n), rank))
        return [tuple(own) for own in out]

    def param_path(self, i: int) -> str:
        """Path of state leaf ``i`` inside the differentiated argument (the model's own
        path: ``layers/3/attn/q_proj/kernel``), the full path for other leaves."""
        p = self.paths[i]
        pre = self.diff_prefix
        if pre and (p == pre or p.startswith(pre + "/")):
            return p[len(pre) + 1:]
        return p

    # ---- the loss -------------------------------------------------------------------
    @functools.cached_property
    def loss_flat(self):
        """The recorded loss on flat leaves (what ``hetshard.value_and_grad``
        differentiates), for one micro-batch: ``loss_flat(state_leaves, batch_leaves)``,
        its stacks of scanned blocks unrolled (``hetshard.ir.unroll``)."""
        return unroll_scans(self._loss_flat)

    def _loss_flat(self, state_leaves, batch_leaves):
        # The step up to its loss call, then the loss on what the step passed it: the
        # batch or parts of it, values computed from it, closures over it.
        rec = self._recorded_call(state_leaves, batch_leaves)
        out = rec.call.fn(*rec.args, **rec.kwargs)
        # One value returned twice (the loss as its own aux: ``return loss, {"loss":
        # loss}``) is copied, so that each output of the traced loss is its own variable.
        leaves, tree = jax.tree.flatten(out)
        seen: set[int] = set()
        for i, x in enumerate(leaves):
            if id(x) in seen:
                leaves[i] = jnp.copy(x)
            seen.add(id(x))
        return jax.tree.unflatten(tree, leaves)

    @functools.lru_cache(maxsize=8)  # noqa: B019 (one program, a few batch sizes)
    def loss_jaxpr(self, mbs: int):
        """``(ClosedJaxpr, output shape)`` of the loss on flat leaves at ``mbs`` samples."""
        if self.call is None:
            def whole(state_leaves, batch_leaves):
                return self.call_step(state_leaves, batch_leaves)[0]
            return jax.make_jaxpr(whole, return_shape=True)(self.state_avals,
                                                            self.trees.batch_at(mbs))
        batch = self.trees.batch_at(mbs)
        closed, shape = jax.make_jaxpr(self._loss_flat, return_shape=True)(
            self.state_avals, batch)
        unrolled = unrolled_jaxpr(closed, shape)
        if unrolled[0] is closed:  # the runtime's traces of loss_flat need not look again
            leaves, tree = jax.tree.flatten((self.state_avals, batch))
            self.loss_flat.scan_free.add(
                (tree, tuple((jnp.shape(x), jnp.result_type(x)) for x in leaves)))
        return unrolled

    @functools.cached_property
    def samples(self) -> LossSamples:
        """How the loss treats its samples: whether a plan may cut the batch, and how
        the pieces' outputs make the whole batch's (``hetshard.ir.loss_samples``)."""
        return LossSamples(None if self.call is None else self.loss_jaxpr,
                           len(self.state_avals), self.batch_reductions == "per_piece")

    @functools.lru_cache(maxsize=8)  # noqa: B019
    def layering(self, mbs: int = 2, split_blocks: bool = False) -> Layering:
        """The loss's layers at ``mbs`` samples (one layer for a step without
        ``hetshard.value_and_grad``)."""
        closed, _ = self.loss_jaxpr(mbs)
        if self.call is None:
            n = len(closed.jaxpr.eqns)
            return Layering(names=("step",), kinds=("step",), eqn_layer=(0,) * n,
                            stacks=(-1,), positions=(0,), source="single",
                            split_blocks=split_blocks)
        if not split_blocks:
            return self.layering(mbs, True).whole()
        if mbs != 2:
            # Another batch size traces to the same equations: the layers are the same.
            base, other = self.loss_jaxpr(2)[0].jaxpr.eqns, closed.jaxpr.eqns
            if [e.primitive for e in base] == [e.primitive for e in other]:
                return self.layering(2, True)
        return discover(closed, True, range(len(self.state_avals), len(closed.jaxpr.invars)))

    # ---- facts the planner reads ------------------------------------------------------
    @functools.cached_property
    def seq_len(self) -> int:
        """Tokens per sample: dimension 1 of the first integer batch leaf of rank >= 2
        (the tokens); 1 for a batch without tokens (images: throughput in samples)."""
        for a in self.batch_avals:
            if len(a.shape) >= 2 and getattr(a.dtype, "kind", "") in _INT_KINDS:
                return int(a.shape[1])
        return 1

    @functools.cached_property
    def heads(self) -> int | None:
        """What a tensor degree must divide: the attention heads (greatest common divisor
        over the loss's attention ops); without attention, the greatest common divisor of
        the last dimensions of the blocks' weight matrices (their output features).
        None for a program with neither."""
        found: list[int] = []
        _attention_heads(self.loss_jaxpr(2)[0].jaxpr, found)
        if found:
            return math.gcd(*found)
        lay = self.layering(2)
        reads = self.layer_params(2)
        blocks = [k for k in range(lay.num_layers) if lay.stacks[k] >= 0] or \
            list(range(lay.num_layers))
        params = set(self.diff)
        dims = [self.state_avals[i].shape[-1] for k in blocks for i in reads[k]
                if i in params and len(self.state_avals[i].shape) >= 2]
        return math.gcd(*dims) if dims else None

    @functools.cached_property
    def moe_layers(self) -> list[MoeLayer]:
        """The loss's mixture-of-experts layers (``hetshard.ir.moe``), found in its trace;
        their router and expert weights are indices of state leaves
        (:meth:`param_path` names them)."""
        return moe_layers(self.loss_jaxpr(2)[0].jaxpr)

    @functools.cached_property
    def moe_traffic(self) -> list[dict]:
        """Per mixture-of-experts layer, what expert parallelism moves and keeps (at a
        micro-batch of 2 samples, per sample): ``paths`` (its stacked expert weights'
        ``param_path``s), ``experts``, ``dispatch``, ``rows`` (routed rows per sample:
        tokens x top-k for a dropless layer, experts x capacity for a capacity one, none
        for a dense one), ``row_bytes`` and ``out_bytes`` (a routed row's bytes as sent
        and as returned) and ``chain_bytes`` (per routed row, what its expert equations
        make: the values their backward may keep); ``parallel``: whether expert
        parallelism runs the layer as priced (a dropless layer the exchange reaches and
        can run; every capacity and dense layer), so the planner offers it."""
        from hetshard.errors import PlanNotExecutableError
        jaxpr = self.loss_jaxpr(2)[0].jaxpr
        try:
            regions, runnable = expert_regions(jaxpr), True
        except PlanNotExecutableError:
            regions, runnable = [], False  # (a pinned plan is told why: expert_shardings)
        out = []
        for layer in self.moe_layers:
            mine = [r for r in regions if layer.level == () and r.sort > layer.top_k]
            info = dict(paths=tuple(self.param_path(w) for w in layer.expert_weights),
                        experts=layer.experts, dispatch=layer.dispatch, rows=0.0,
                        row_bytes=0.0, out_bytes=0.0, chain_bytes=0.0,
                        parallel=runnable and (layer.dispatch != "dropless" or bool(mine)))
            if layer.dispatch == "dropless" and mine:
                r = min(mine, key=lambda r: r.sort)
                eqns = jaxpr.eqns

                def row(aval):
                    return math.prod(aval.shape[1:]) * aval.dtype.itemsize
                info.update(rows=r.rows.aval.shape[0] / 2, row_bytes=row(r.rows.aval),
                            out_bytes=row(r.result.aval),
                            chain_bytes=sum(row(v.aval) for i in r.chain
                                            for v in eqns[i].outvars if v.aval.shape))
            elif layer.dispatch == "capacity" and layer.capacity:
                w = self.state_avals[layer.expert_weights[0]] if layer.expert_weights \
                    else None
                width = (w.shape[1] if w is not None and len(w.shape) >= 3 else 0)
                size = np.dtype(self.dtype).itemsize if self.dtype in DTYPES else 4
                info.update(rows=layer.experts * layer.capacity / 2,
                            row_bytes=width * size, out_bytes=width * size)
            out.append(info)
        return out

    @functools.cached_property
    def dtype(self) -> str:
        """The compute dtype: that of the matmuls with the most flops."""
        weights: dict[str, float] = {}
        _matmul_dtypes(self.loss_jaxpr(2)[0].jaxpr, weights, 1.0)
        if not weights:
            return "float32"
        dtype = max(weights, key=lambda d: (weights[d], d))
        if dtype not in DTYPES:
            raise SpecError("dtype", dtype, f"matmuls mostly in one of {DTYPES} (the compute "
                            f"dtypes hetshard prices)", where=self.name)
        return dtype

    @functools.cached_property
    def opt_state_bytes(self) -> int:
        """Bytes of the optimizer's per-parameter state: every state leaf with a shape
        outside the differentiated argument (AdamW's moments, Lion's momentum,
        Adafactor's factored second moments; a masked transform's masked-out leaves hold
        none)."""
        pre, diff = self.diff_prefix, set(self.diff)
        total = 0
        for i, (p, a) in enumerate(zip(self.paths, self.state_avals, strict=True)):
            inside = i in diff or (pre and (p == pre or p.startswith(pre + "/")))
            if not inside and a.shape:
                total += math.prod(a.shape) * a.dtype.itemsize
        return int(total)

    @functools.cached_property
    def param_bytes(self) -> int:
        return int(sum(math.prod(self.state_avals[i].shape) *
                       self.state_avals[i].dtype.itemsize for i in self.diff))

    @functools.cached_property
    def model_fingerprint(self) -> str:
        """A hash of the model a plan is made for: its parameters' paths, shapes and
        dtypes, one sample's batch shapes and dtypes, and the layers found in its loss
        (what ``Plan.fingerprint`` records and a pinned plan is checked against: another
        optimizer, global batch or loss over the same model is the same model)."""
        h = hashlib.blake2b(digest_size=16)
        for i in self.diff:
            a = self.state_avals[i]
            h.update(f"{self.paths[i]}:{a.shape}:{a.dtype};".encode())
        for p, a in zip(self.batch_paths, self.batch_avals, strict=True):
            h.update(f"batch {p}:{a.shape[1:]}:{a.dtype};".encode())  # per sample
        h.update(f"layers {self.layering(2).names}".encode())
        return h.hexdigest()

    @functools.cached_property
    def fingerprint(self) -> str:
        """A hash of everything a plan depends on: ``model_fingerprint``, the loss's
        equations and every state leaf's shape, dtype and path (the optimizer's state
        among them: its kind and size, not its hyperparameters, which no plan depends
        on), and ``batch_reductions`` where it is not the default. The plan cache's
        key."""
        h = hashlib.blake2b(digest_size=16)
        h.update(self.model_fingerprint.encode())
        closed, _ = self.loss_jaxpr(2)
        for eqn in closed.jaxpr.eqns:
            h.update(eqn_signature(eqn).encode())
        for p, a in zip(self.paths, self.state_avals, strict=True):
            h.update(f"{p}:{a.shape}:{a.dtype};".encode())
        h.update(f"call {self.call is not None}".encode())
        if self.batch_reductions != "whole":  # (it decides which plans may cut the batch)
            h.update(f"batch_reductions {self.batch_reductions}".encode())
        return h.hexdigest()

    def update_jaxpr(self):
        """The step with its ``hetshard.value_and_grad`` answered (the optimizer update
        and whatever else the step does besides the loss), traced."""
        if self.call is None:
            return self.loss_jaxpr(2)[0]
        return self._update()[0]

    @functools.cached_property
    def update_batch_reads(self) -> list[int]:
        """The batch leaves the step reads besides its loss call (a count of tokens
        returned, metrics of the labels): the update must see the whole batch's
        values for them, not a piece's (positions in the flat batch)."""
        if self.call is None:
            return []
        closed = self.update_jaxpr()
        nb = len(self.batch_avals)
        first = len(closed.jaxpr.invars) - nb
        reads = set().union(*output_dependencies(closed))
        return sorted(i - first for i in reads if i >= first)

    def _update(self) -> tuple:
        """(``update_jaxpr``, how many times the step differentiates while traced: its
        loss call, and any other), traced once."""
        if getattr(self, "_update_traced", None) is None:
            closed, shape = self.loss_jaxpr(2)
            # the loss's outputs as the update sees them: the whole batch's (a per-sample
            # output joined from the pieces)
            leaves, tree = jax.tree.flatten(shape)
            loss_avals = jax.tree.unflatten(tree, self.samples.outputs_for(leaves,
                                                                   self.global_batch))
            seen: list = []
            self._update_seen = seen

            def update(state_leaves, grad_leaves, loss, batch_leaves):
                grads = self.trees.gradients(self.call, self.state_avals, grad_leaves)
                with entered(mode="provide", provided=(loss, grads), calls=seen):
                    out, objs = self.call_step(state_leaves, batch_leaves)
                return out, (self.trees.updated_state(objs) if self.kind == "nnx" else None)

            grads = [self.state_avals[i] for i in self.diff]
            traced = jax.make_jaxpr(update)(self.state_avals, grads, loss_avals,
                                            self.trees.batch_at(self.global_batch))
            self._update_traced = (traced, len(seen))
        return self._update_traced

    @functools.cached_property
    def output_shape(self):
        """The step's output, shapes only (with the gradients ``hetshard.value_and_grad``
        would provide, where the step calls it)."""
        if self.call is None:
            return jax.eval_shape(lambda s, b: self.call_step(s, b)[0], self.state_avals,
                                  self.batch_avals)
        loss_shape = self.loss_jaxpr(2)[1]

        def run(state_leaves, grad_leaves, loss, batch_leaves):
            grads = self.trees.gradients(self.call, self.state_avals, grad_leaves)
            with entered(mode="provide", provided=(loss, grads)):
                return self.call_step(state_leaves, batch_leaves)[0]
        return jax.eval_shape(run, self.state_avals, [self.state_avals[i] for i in self.diff],
                              loss_shape, self.trees.batch_at(self.global_batch))

    @functools.cached_property
    def _state_outputs(self):
        out = self.output_shape
        tree = jax.tree.structure(out)
        candidates = list(_subtrees(out, 0))
        used: list[tuple[int, int]] = []
        mapping: list[int | None] = []
        others = jax.tree.unflatten(self.trees.state_tree, self.state_avals)
        for arg in others:
            leaves, arg_tree = jax.tree.flatten(arg)
            sig = (arg_tree, [(a.shape, a.dtype) for a in leaves])
            hit = None
            for start, sub in candidates:
                sub_leaves, sub_tree = jax.tree.flatten(sub)
                span = (start, start + len(sub_leaves))
                if (sub_tree, [(a.shape, a.dtype) for a in sub_leaves]) == sig and leaves \
                        and not any(a < span[1] and span[0] < b for a, b in used):
                    hit = span
                    break
            if hit is None:
                mapping += [None] * len(leaves)
            else:
                used.append(hit)
                mapping += list(range(*hit))
        return tree, mapping

    def state_outputs(self) -> tuple[object, list[int | None]]:
        """For a pytree step (``step(params, opt_state, batch) -> (loss, params,
        opt_state)`` and the like): the output's treedef and, per state leaf, the output
        leaf that is its new value (None: the step does not return it; it is kept). An
        argument's new value is the first output subtree of its structure, shapes and
        dtypes."""
        return self._state_outputs


def _subtrees(x, start: int):
    """``(leaf offset, subtree)`` of ``x`` and of every tuple, list or dict inside it, in
    pre-order."""
    yield start, x
    if isinstance(x, (tuple, list)):
        children = list(x)
    elif isinstance(x, dict):
        children = [x[k] for k in sorted(x)]
    else:
        return
    for c in children:
        yield from _subtrees(c, start)
        start += len(jax.tree.leaves(c))


def _inner(eqn):
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        if key in eqn.params:
            j = eqn.params[key]
            return getattr(j, "jaxpr", j)
    if eqn.primitive.name == "scan":
        return eqn.params["jaxpr"].jaxpr
    return None


def _attention_heads(jaxpr, found: list[int]) -> None:
    for eqn in jaxpr.eqns:
        name = eqn.params.get("name", "") if eqn.primitive.name in ("jit", "pjit") else ""
        if str(name).startswith("hetshard_attention"):
            found.append(int(eqn.invars[0].aval.shape[2]))
            continue
        if eqn.primitive.name == "dot_general":
            (_, _), (lb, rb) = eqn.params["dimension_numbers"]
            lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
            # Attention's scores or weighted values: batched over (batch, heads) on
            # rank-4 operands ([b, s, h, d] . [b, s, h, d]).
            if len(lb) == 2 and len(lhs) == 4 and len(rhs) == 4 and lb[0] == 0:
                found.append(int(lhs[lb[1]]))
            continue
        inner = _inner(eqn)
        if inner is not None:
            _attention_heads(inner, found)


def _matmul_dtypes(jaxpr, weights: dict, mult: float) -> None:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("dot_general", "conv_general_dilated"):
            d = str(np.dtype(eqn.invars[0].aval.dtype))
            weights[d] = weights.get(d, 0.0) + mult * eqn_flops(eqn)
            continue
        inner = _inner(eqn)
        if inner is not None:
            m = float(eqn.params["length"]) if eqn.primitive.name == "scan" else 1.0
            _matmul_dtypes(inner, weights, mult * m)


# ---- the step traced per layer, for the cost model ------------------------------------

_LAYER_TAG = "hs_layer"


def _tagged_layer(names: tuple[str, ...]):
    """``layer_name`` for ``hetshard.ir.trace.trace``: the layer an injected
    ``hs_layer<k>`` scope names ('' outside every layer)."""
    import re
    pattern = re.compile(rf"{_LAYER_TAG}(\d+)")

    def name(stack: str) -> str:
        found = pattern.findall(stack)
        return names[int(found[-1])] if found else ""
    return name


def representatives(layering: Layering) -> dict[int, int]:
    """Layer -> the layer whose costs stand for it: every layer of a stack after its
    second block is priced as the second block (their equations are identical); other
    layers stand for themselves."""
    unit = 2 if layering.split_blocks else 1
    first: dict[tuple[int, int], int] = {}
    for k, (s, p) in enumerate(zip(layering.stacks, layering.positions, strict=True)):
        if s >= 0 and p < 2 * unit:
            first[(s, p)] = k
    out = {}
    for k, (s, p) in enumerate(zip(layering.stacks, layering.positions, strict=True)):
        out[k] = k if s < 0 or p < 2 * unit else first[(s, unit + p % unit)]
    return out


def reduced_graph(program: Program, mbs: int, split_blocks: bool = False):
    """Cached :func:`_reduced_graph` (see there). Traced once per micro-batch size, with
    blocks as halves; the whole-block graph is that trace with each block's halves
    relabelled as the block (the same equations either way)."""
    key = (mbs, split_blocks)
    cache = program.__dict__.setdefault("_reduced", {})
    if key not in cache:
        if split_blocks or program.call is None:
            cache[key] = _reduced_graph(program, mbs, split_blocks)
        else:
            graph, halves, _, diff = reduced_graph(program, mbs, True)
            whole = halves.whole()
            rename = {halves.names[k]: whole.names[whole.eqn_layer[i]]
                      for i, k in enumerate(halves.eqn_layer)}
            cache[key] = (_relabelled(graph, rename), whole, representatives(whole), diff)
    return cache[key]


def _relabelled(graph, rename: dict):
    """``graph`` with its layer names mapped through ``rename``."""
    ops = [dataclasses.replace(op, layer=rename.get(op.layer, op.layer)) for op in graph.ops]
    return OpGraph(ops, graph.edges, [rename.get(x, x) for x in graph.param_layers],
                   graph.param_bytes, graph.param_sizes, graph.opt_state_bytes,
                   frozenset(rename.get(x, x) for x in graph.causal_layers))


def traced_graph(program: Program, mbs: int, split_blocks: bool = False):
    """The whole loss of ``mbs`` samples differentiated, every layer traced (no block
    priced for another): the reference the reduced trace stands for (tests)."""
    return _reduced_graph(program, mbs, split_blocks, reduce=False)[0]


def _reduced_graph(program: Program, mbs: int, split_blocks: bool = False,
                   reduce: bool = True):
    """``(OpGraph, Layering, representatives, param_index)``: the loss of ``mbs``
    samples with every stack cut to its first two blocks, differentiated (forward and
    backward equations tagged with their layer), as ``hetshard.ir.trace`` sees it.
    ``param_index[k]`` is the state leaf of the graph's parameter ``k``.

    A dropped block's results are the kept second block's (same equations, same
    shapes), so what follows the stack reads values of the right shapes; a step without
    ``hetshard.value_and_grad`` is traced whole, as one layer.
    """

    closed, out_shape = program.loss_jaxpr(mbs)
    lay = program.layering(mbs, split_blocks)
    rep = representatives(lay) if reduce else {k: k for k in range(lay.num_layers)}
    jaxpr = closed.jaxpr
    segments = [lay.equations(k) for k in range(lay.num_layers)]
    read_by_kept: set[int] = set()
    invar_pos = {v: i for i, v in enumerate(jaxpr.invars)}
    for k, seg in enumerate(segments):
        if rep[k] != k:
            continue
        for i in seg:
            for v in jaxpr.eqns[i].invars:
                if not isinstance(v, ext.Literal) and v in invar_pos:
                    read_by_kept.add(invar_pos[v])
    diff = [i for i in program.diff
            if (program.call is None or i in read_by_kept) and
            jnp.issubdtype(program.state_avals[i].dtype, jnp.inexact)]
    diff_set = set(diff)
    rest = [i for i in range(len(program.state_avals)) if i not in diff_set]
    n_state = len(program.state_avals)

    # A user's Flax attention is traced as the named call the runtime's kernel replaces
    # (its mask's computation dropped, as XLA drops it once nothing reads it).
    dead = dead_equations(jaxpr)

    def reduced(diff_vals, rest_vals, batch_leaves):
        env = dict(zip(jaxpr.constvars, closed.consts, strict=True))
        state = [None] * n_state
        for i, x in zip(diff, diff_vals, strict=True):
            state[i] = x
        for i, x in zip(rest, rest_vals, strict=True):
            state[i] = x
        env.update(zip(jaxpr.invars, [*state, *batch_leaves], strict=True))
        for k, seg in enumerate(segments):
            if rep[k] == k:
                with jax.named_scope(f"{_LAYER_TAG}{k}"):
                    eval_equations(jaxpr, env, named_attention,
                                   [i for i in seg if i not in dead])
                continue
            for i, j in zip(seg, segments[rep[k]], strict=True):
                for a, b in zip(jaxpr.eqns[i].outvars, jaxpr.eqns[j].outvars, strict=True):
                    if b in env:
                        env[a] = env[b]
        outs = [v.val if isinstance(v, ext.Literal) else env[v] for v in jaxpr.outvars]
        out = jax.tree.unflatten(jax.tree.structure(out_shape), outs)
        return out[0] if program.call.has_aux else out

    def step(diff_vals, rest_vals, batch_leaves):
        with jax.named_scope("hs"):
            if program.call is None:  # the whole step, its own differentiation inside
                with jax.named_scope(f"{_LAYER_TAG}0"):
                    return reduced_whole(diff_vals, rest_vals, batch_leaves)
            return jax.value_and_grad(reduced)(diff_vals, rest_vals, batch_leaves)

    def reduced_whole(diff_vals, rest_vals, batch_leaves):
        state = [None] * n_state
        for i, x in zip(diff, diff_vals, strict=True):
            state[i] = x
        for i, x in zip(rest, rest_vals, strict=True):
            state[i] = x
        return program.call_step(state, batch_leaves)[0]

    diff_avals = [program.state_avals[i] for i in diff]
    rest_avals = [program.state_avals[i] for i in rest]
    graph = trace(step, diff_avals, rest_avals, program.trees.batch_at(mbs), param_argnum=0,
                  layer_name=_tagged_layer(lay.names))
    if program.call is None and not any(op.phase in ("fwd", "bwd") for op in graph.ops):
        for op in graph.ops:  # a step without autodiff: all of it is a forward pass
            op.phase = "fwd"
    return graph, lay, rep, diff
