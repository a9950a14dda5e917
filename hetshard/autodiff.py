"""``hetshard.value_and_grad``: the marked per-micro-batch region of a train step.

A step that differentiates its loss with :func:`value_and_grad` (a drop-in for
``nnx.value_and_grad`` and ``jax.value_and_grad``) tells hetshard where its loss is. The
compiler then plans and runs that loss in pieces: per pipeline stage, per micro-batch,
per batch share. What the wrapper does depends on the :class:`StepContext` the caller
(``hetshard.jit``, the program tracer, the pipeline runtime) has entered:

* ``record``: the call is captured as a :class:`LossCall` (how the loss reads the step's
  state and batch) and tracing stops there;
* ``capture``: the value and gradients are computed and kept for the caller;
* ``provide``: the caller's value and gradients are returned instead (the pipeline
  computed them stage by stage), so the rest of the step (the optimizer update) runs on
  them;
* ``rewrite``: the loss is replaced by ``rewrite(loss)`` before it is differentiated
  (the attention swap, the SPMD layouts, the tracer's layer scopes).

A step written with the plain transforms needs no change: while hetshard runs the step
(:func:`user_step`), ``nnx.value_and_grad``, ``nnx.grad``, ``jax.value_and_grad`` and
``jax.grad`` called from it (in its thread: the ``jax`` and ``nnx`` modules answer those
names per thread while a step runs, every other thread getting JAX's and Flax's own
functions) are :func:`value_and_grad` and :func:`grad` wherever their
arguments are ones these take (one argnum, no ``holomorphic``, ``allow_int`` or
``reduce_axes``) and are made by the user's code; other calls, those made by JAX, Flax
or optax themselves, and every call made inside a loss being differentiated (a gradient
penalty), are the originals. A transform the step holds by a name of its own (``from
flax.nnx import value_and_grad`` in its module, a variable it closes over) is answered
the same way (that binding is swapped while the step runs and restored after); one made
outside the step and passed in is not seen: the step is then planned without stages,
with a warning.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import sys
import threading
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from hetshard.errors import LossCallError


@dataclasses.dataclass(frozen=True)
class LossCall:
    """How the step called ``hetshard.value_and_grad(fn)``: ``args`` holds, per argument,
    ``("object", i)`` (the step's i-th non-batch argument itself, an NNX object or a
    pytree), ``("state", treedef, leaf_indices)`` (a pytree of the step's state leaves)
    or ``("given", i)`` (another value: the batch, a part of it, something the step
    computes; the loss is traced with what the step passes). The differentiated
    argument is never ``given``."""

    fn: Callable
    argnums: int
    has_aux: bool
    args: tuple
    # which of an NNX model's variables are differentiated (an NNX filter: the
    # ``nnx.DiffState`` the step passed, else ``nnx.Param``)
    wrt: object = nnx.Param

    @property
    def differentiated(self) -> tuple:
        return self.args[self.argnums]


Mode = Literal["record", "capture", "provide"]
MODES = ("record", "capture", "provide")


@dataclasses.dataclass
class StepContext:
    """What ``value_and_grad`` does in the current thread (see the module docstring).
    Callers set fields only through :func:`entered`, which restores them after."""

    mode: Mode | None = None  # None: the loss computed and returned as it is
    rewrite: Callable | None = None  # loss -> loss, applied before differentiation
    provided: object = None
    captured: object = None
    used: bool = False
    # set by each call (outside record mode): whether its loss and gradients are finite
    finite: object = None
    value: object = None  # ... and its loss
    # the loss scale (a scalar; None: unscaled): the loss is differentiated times it and
    # the gradients returned divided by it (float16 stages, hetshard.runtime.precision)
    loss_scale: object = None
    # record mode: the step's non-batch arguments (as the step sees them) and batch
    record_args: tuple = ()
    record_state: tuple = ()
    record_batch: object = None
    # each differentiation the step makes (not inside a loss): hetshard's transforms
    # append True, one it does not take (several argnums, ...) False
    calls: list = dataclasses.field(default_factory=list)
    # set while hetshard runs the user's step (user_step) and while a loss, or a
    # transform's own body, is being differentiated (nested calls are the originals)
    in_step: bool = False
    inside: int = 0


_LOCAL = threading.local()


def context() -> StepContext:
    ctx = getattr(_LOCAL, "ctx", None)
    if ctx is None:
        ctx = _LOCAL.ctx = StepContext()
    return ctx


@contextlib.contextmanager
def entered(**fields):
    """Sets fields of the thread's :class:`StepContext` for the block, restoring them
    after; a name that is not a field, or a mode not among ``MODES``, is a TypeError (a
    typo would otherwise set an attribute nothing reads)."""
    names = {f.name for f in dataclasses.fields(StepContext)}
    unknown = sorted(set(fields) - names)
    if unknown:
        raise TypeError(f"StepContext has no field {unknown[0]!r} (fields: {sorted(names)})")
    if fields.get("mode") not in (None, *MODES):
        raise TypeError(f"StepContext.mode {fields['mode']!r}: one of {MODES} or None")
    ctx = context()
    previous = {k: getattr(ctx, k) for k in fields}
    for k, v in fields.items():
        setattr(ctx, k, v)
    try:
        yield ctx
    finally:
        for k, v in previous.items():
            setattr(ctx, k, v)


class Recorded(Exception):  # noqa: N818 (control flow, never escapes hetshard)
    """The step's loss call: how it reads the step's arguments (``call``) and the
    arguments it was given in this trace (``args``, ``kwargs``)."""

    def __init__(self, call, args=(), kwargs=None):
        super().__init__("recorded")
        self.call, self.args, self.kwargs = call, args, kwargs or {}


def _is_graph(x) -> bool:
    return isinstance(x, (nnx.Module, nnx.Optimizer)) or isinstance(
        x, nnx.Variable) or _graph_node(x)


def _graph_node(x) -> bool:
    fn = getattr(nnx, "is_graph_node", None) or getattr(nnx.graph, "is_graph_node", None)
    return bool(fn(x)) if fn is not None else False


def is_graph(x) -> bool:
    """An NNX object (module, optimizer or other graph node)."""
    return _is_graph(x)


def value_and_grad(fn, argnums: int | nnx.DiffState = 0, has_aux: bool = False):
    """Drop-in for ``nnx.value_and_grad`` (an NNX model at ``argnums``: gradients of its
    ``nnx.Param`` state, or of the variables an ``nnx.DiffState(argnum, filter)`` names,
    as for LoRA: ``nnx.DiffState(0, nnx.LoRAParam)``) and ``jax.value_and_grad`` (a
    pytree at ``argnums``) that marks the per-micro-batch region of the step for hetshard
    (see the module docstring)."""
    wrt = nnx.Param
    diff_state = isinstance(argnums, nnx.DiffState)
    if diff_state:
        argnums, wrt = argnums.argnum, argnums.filter
    if isinstance(argnums, bool) or not isinstance(argnums, int):
        raise LossCallError(f"hetshard.value_and_grad takes one integer argnums or one "
                            f"nnx.DiffState(argnum, filter), got {argnums!r}")

    def plain(*args, **kwargs):
        if _is_graph(args[argnums]):
            which = nnx.DiffState(argnums, wrt) if diff_state else argnums
            return _ORIGINAL["nnx.value_and_grad"](fn, argnums=which, has_aux=has_aux)(
                *args, **kwargs)
        return _ORIGINAL["jax.value_and_grad"](fn, argnums=argnums, has_aux=has_aux)(
            *args, **kwargs)

    def check_filter(args):
        if diff_state and not _is_graph(args[argnums]):
            raise LossCallError(
                f"hetshard.value_and_grad got nnx.DiffState({argnums}, {wrt!r}), but "
                f"argument {argnums} of the loss is not an NNX object (a filter picks "
                f"variables of an NNX model; pass the integer {argnums} for a pytree)")

    def rewritten(rewrite, args, kwargs):
        # The loss as a function of the differentiated leaves, rewritten, then
        # differentiated: gradients keep the structure nnx/jax.value_and_grad return.
        # An NNX model's other state (RNG streams, batch statistics) goes in as an
        # argument and comes out updated, as nnx.value_and_grad does: a dropout layer
        # advances its RNG count inside the loss, which NNX allows only at the trace
        # level the state entered.
        target = args[argnums]
        others = args[:argnums] + args[argnums + 1:]
        graph = _is_graph(target)
        if graph:
            graphdef, params, rest = nnx.split(target, wrt, ...)
        else:
            params, rest = target, None

        def loss_of(params, rest, *others):
            model = nnx.merge(graphdef, params, rest) if graph else params
            full = list(others)
            full.insert(argnums, model)
            out = fn(*full, **kwargs)
            loss, aux = out if has_aux else (out, None)
            return loss, (aux, nnx.split(model, wrt, ...)[2] if graph else None)
        scale = context().loss_scale
        if scale is None:
            (loss, (aux, after)), grads = _ORIGINAL["jax.value_and_grad"](
                rewrite(loss_of), has_aux=True)(params, rest, *others)
        else:
            def scaled(p, r, *o):
                loss, extra = rewrite(loss_of)(p, r, *o)
                return loss * jnp.asarray(scale, jnp.result_type(loss)), (loss, extra)
            (_, (loss, (aux, after))), grads = _ORIGINAL["jax.value_and_grad"](
                scaled, has_aux=True)(params, rest, *others)
            inverse = 1.0 / jnp.asarray(scale, jnp.float32)
            grads = jax.tree.map(lambda g: g * inverse.astype(g.dtype), grads)
        if after is not None:
            nnx.update(target, after)
        return ((loss, aux) if has_aux else loss), grads

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        check_filter(args)
        ctx = context()
        if ctx.inside:  # a loss differentiated inside the loss: not the step's
            return plain(*args, **kwargs)
        ctx.used = True
        ctx.calls.append(True)
        if ctx.mode == "record":
            raise Recorded(_loss_call(fn, argnums, has_aux, args, ctx, wrt), args, kwargs)
        if ctx.mode == "provide":
            return ctx.provided
        with _inside(ctx):
            out = (plain(*args, **kwargs) if ctx.rewrite is None
                   else rewritten(ctx.rewrite, args, kwargs))
        if ctx.mode == "capture":
            ctx.captured = out
        value, grads = out
        ctx.value = value[0] if has_aux else value
        ctx.finite = all_finite((ctx.value, grads))
        return out

    return wrapped


def grad(fn, argnums: int | nnx.DiffState = 0, has_aux: bool = False):
    """Drop-in for ``nnx.grad`` and ``jax.grad``: :func:`value_and_grad` without the
    value (``(grads, aux)`` with ``has_aux``)."""
    both = value_and_grad(fn, argnums, has_aux)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        value, grads = both(*args, **kwargs)
        return (grads, value[1]) if has_aux else grads
    return wrapped


@contextlib.contextmanager
def _inside(ctx: StepContext):
    ctx.inside += 1
    try:
        yield
    finally:
        ctx.inside -= 1


# ---- the plain transforms, answered by hetshard's while the user's step runs ----------

_ORIGINAL = {"jax.value_and_grad": jax.value_and_grad, "jax.grad": jax.grad,
             "nnx.value_and_grad": nnx.value_and_grad, "nnx.grad": nnx.grad}
_MODULES = {"jax": jax, "nnx": nnx}
_LIBRARIES = ("jax.", "jaxlib.", "flax.", "optax.", "hetshard.")
_PATCHED = {"lock": threading.Lock(), "depth": 0}


def _ours(name: str, original, args, kwargs):
    """hetshard's transform for ``original(*args, **kwargs)``, or None where it takes
    arguments ours do not (those calls stay the originals')."""
    try:
        bound = inspect.signature(original).bind(*args, **kwargs)
    except TypeError:
        return None
    p = bound.arguments
    fn = p.get("fun", p.get("f"))
    argnums = p.get("argnums", 0)
    plain_argnum = isinstance(argnums, int) and not isinstance(argnums, bool)
    if (not callable(fn) or isinstance(fn, type) or p.get("holomorphic") or
            p.get("allow_int") or tuple(p.get("reduce_axes", ())) or
            p.get("graph") is not None or p.get("graph_updates") is not None or
            not (plain_argnum or (name.startswith("nnx") and
                                  isinstance(argnums, nnx.DiffState)))):
        return None
    make = grad if name.endswith(".grad") else value_and_grad
    return make(fn, argnums, bool(p.get("has_aux", False)))


def _dispatcher(name: str):
    original = _ORIGINAL[name]

    @functools.wraps(original)
    def dispatch(*args, **kwargs):
        ctx = context()
        if not args and "f" not in kwargs and "fun" not in kwargs:  # nnx's decorator form
            return functools.partial(dispatch, **kwargs)
        # A library's own call (Flax's nnx.value_and_grad calls jax.value_and_grad) is
        # the original: only the user's code is answered.
        user = not sys._getframe(1).f_globals.get("__name__", "").startswith(_LIBRARIES)
        if ctx.in_step and not ctx.inside and user:
            ours = _ours(name, original, args, kwargs)
            if ours is not None:
                return ours
        transformed = original(*args, **kwargs)
        if not ctx.in_step:
            return transformed

        @functools.wraps(transformed)
        def run(*a, **k):
            c = context()
            if not c.inside and user:
                c.calls.append(False)  # a differentiation hetshard does not take
            with _inside(c):
                return transformed(*a, **k)
        return run
    return dispatch


_DISPATCHERS = {name: _dispatcher(name) for name in _ORIGINAL}


def _bound_by_name(step: Callable) -> list[tuple[object, object, str]]:
    """Where ``step`` holds a plain transform by a name of its own (``from flax.nnx
    import value_and_grad`` in its module, which its helpers there share, or a variable
    it closes over): (namespace or cell, key or None, the transform's ``_ORIGINAL``
    name), so that it too is answered while the step runs. (Outside a step's run the
    answering transform is the original.)"""
    fn = getattr(step, "__func__", step)
    names = {id(f): name for name, f in _ORIGINAL.items()}
    found = []
    space = getattr(fn, "__globals__", None)
    if isinstance(space, dict):
        found += [(space, key, names[id(value)]) for key, value in list(space.items())
                  if id(value) in names]
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if id(value) in names:
            found.append((cell, None, names[id(value)]))
    return found


def _answer_by_name(found, answer: bool) -> None:
    """Each binding of ``found`` (:func:`_bound_by_name`) set to hetshard's dispatcher,
    or back to the original."""
    for where, key, name in found:
        value = (_DISPATCHERS if answer else _ORIGINAL)[name]
        if key is None:
            where.cell_contents = value
        else:
            where[key] = value


def _resolver(module: str, previous):
    """A module ``__getattr__`` answering the transforms' names per thread: hetshard's
    dispatcher in a thread running a step (``StepContext.in_step``), JAX's or Flax's own
    function in every other; other names go to the module's own ``__getattr__``."""
    def __getattr__(name: str):
        key = f"{module}.{name}"
        if key in _ORIGINAL:
            return _DISPATCHERS[key] if context().in_step else _ORIGINAL[key]
        if previous is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        return previous(name)
    return __getattr__


def _install() -> None:
    """While any step runs: the transforms' names on ``jax`` and ``nnx`` resolved per
    thread (:func:`_resolver`). The resolver is in place before the attributes leave
    the module, and they are back before it goes, so no read ever misses."""
    for module, mod in _MODULES.items():
        previous = mod.__dict__.get("__getattr__")
        _PATCHED.setdefault("previous", {})[module] = previous
        mod.__getattr__ = _resolver(module, previous)
    for name in _ORIGINAL:
        module, attr = name.split(".")
        _MODULES[module].__dict__.pop(attr, None)


def _uninstall() -> None:
    for name, fn in _ORIGINAL.items():
        module, attr = name.split(".")
        setattr(_MODULES[module], attr, fn)
    for module, mod in _MODULES.items():
        previous = _PATCHED["previous"].pop(module)
        if previous is None:
            del mod.__getattr__
        else:
            mod.__getattr__ = previous


@contextlib.contextmanager
def _intercepting(step: Callable | None = None):
    found = _bound_by_name(step) if step is not None else []
    with _PATCHED["lock"]:
        if _PATCHED["depth"] == 0:
            _install()
        _PATCHED["depth"] += 1
        _answer_by_name(found, True)
    ctx = context()
    before = ctx.in_step
    ctx.in_step = True
    try:
        yield
    finally:
        ctx.in_step = before
        with _PATCHED["lock"]:
            _answer_by_name(found, False)
            _PATCHED["depth"] -= 1
            if _PATCHED["depth"] == 0:
                _uninstall()


# The wrappers of ``jax.jit`` and ``nnx.jit``: a step already under one is planned as the
# function it wraps (hetshard compiles the step itself; the wrapper's trace, cached
# after its first call, would hide the step's loss call from hetshard).
_JIT_WRAPPERS = ("PjitFunction", "JitWrapped")


def unjitted(step: Callable) -> Callable:
    """The function under ``step``'s ``jax.jit`` / ``nnx.jit`` wrappers (``step`` itself
    when it has none; other decorators are the user's code and stay)."""
    while type(step).__name__ in _JIT_WRAPPERS and getattr(step, "__wrapped__", None):
        step = step.__wrapped__
    return step


def user_step(step: Callable) -> Callable:
    """``step`` as hetshard runs it (:func:`unjitted`): the plain ``nnx``/``jax``
    ``value_and_grad`` and ``grad`` it calls are hetshard's (see the module
    docstring)."""
    step = unjitted(step)

    @functools.wraps(step)
    def run(*args, **kwargs):
        with _intercepting(step):
            return step(*args, **kwargs)
    return run


def all_finite(tree) -> jax.Array:
    """Whether every floating-point leaf of ``tree`` is finite (a scalar bool)."""
    leaves = [x for x in jax.tree.leaves(tree)
              if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    ok = jnp.asarray(True)
    for x in leaves:
        ok = ok & jnp.all(jnp.isfinite(x))
    return ok


def _merged_from(obj, wrt, state_ids: dict):
    """``(treedef, state indices)`` of ``obj``'s ``wrt`` state when every leaf of it is
    one of the step's state leaves (by identity), else None."""
    leaves, tree = jax.tree.flatten(nnx.state(obj, wrt))
    if leaves and all(id(x) in state_ids for x in leaves):
        return tree, [state_ids[id(x)] for x in leaves]
    return None


def _loss_call(fn, argnums, has_aux, args, ctx, wrt=nnx.Param) -> LossCall:
    """How the step called the loss, relative to its arguments and batch. Only the
    differentiated argument must be one the step receives; the others (the batch, parts
    of it, values the step computes from it, keywords) are taken as the step passes them
    each time the loss is traced (``Program.loss_flat`` runs the step up to the call)."""
    state_ids = {id(x): k for k, x in enumerate(ctx.record_state)}
    spec = []
    for i, a in enumerate(args):
        j = next((j for j, o in enumerate(ctx.record_args) if o is a), None)
        if j is not None:
            spec.append(("object", j))
            continue
        leaves, tree = jax.tree.flatten(a)
        if i != argnums:
            spec.append(("given", i))
        elif _is_graph(a) and _merged_from(a, wrt, state_ids) is not None:
            # An NNX object the step built from the state it received (nnx.merge of the
            # split state, Flax's functional pattern): its parameters are those leaves.
            spec.append(("state", *_merged_from(a, wrt, state_ids)))
        elif _is_graph(a):
            raise LossCallError(
                f"the loss is differentiated in argument {i}, an NNX object the step does "
                f"not receive as an argument (a part of the model?); differentiate in the "
                f"model the step receives, which hetshard plans and updates")
        elif leaves and all(id(x) in state_ids for x in leaves):
            spec.append(("state", tree, [state_ids[id(x)] for x in leaves]))
        else:
            raise LossCallError(
                f"the loss is differentiated in argument {i}, which is not an NNX model or "
                f"a pytree of parameters the step receives as an argument")
    return LossCall(fn, argnums, has_aux, tuple(spec), wrt)
