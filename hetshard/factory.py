"""Programs from model factories: what ``--model file.py:factory`` names.

A factory is a function in a Python file (``path/to/train.py:make``) or an importable
module (``mypkg.models:make``). Called with the keyword arguments the command line was
given (``seq_len``, ``dtype``: only those the factory accepts; a flag it does not accept
is an error), it returns one of

* a :class:`hetshard.Program`;
* ``(step, args)``: the train step and the arguments of one call, the batch last (NNX
  objects or pytrees; shape-only ones from ``nnx.eval_shape`` / ``jax.eval_shape`` /
  ``jax.ShapeDtypeStruct`` plan without weights);
* a dict with ``loss`` (``loss(model_or_params, batch) -> scalar``), ``batch`` (arrays
  or ShapeDtypeStructs), ``optimizer`` (an ``optax.GradientTransformation``) and either
  ``model`` (an NNX module) or ``params`` (a pytree): hetshard builds the usual step,
  ``hetshard.value_and_grad(loss)`` then the optimizer's update (``nnx.Optimizer`` for
  a model, ``optax`` for params).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys

import jax
import optax
from flax import nnx

from hetshard.autodiff import value_and_grad
from hetshard.errors import SpecError
from hetshard.ir.program import Program


def is_factory(ref: str) -> bool:
    """``file.py:name`` or ``package.module:name`` (a zoo spec ``gpt:layers=...`` has
    ``=`` after its colon)."""
    if ":" not in ref:
        return False
    left, _, right = ref.rpartition(":")
    return right.isidentifier() and (left.endswith(".py") or all(
        p.isidentifier() for p in left.split(".")))


def _function(ref: str):
    left, _, name = ref.rpartition(":")
    where = f"--model {ref}"
    if left.endswith(".py"):
        if not os.path.isfile(left):
            raise SpecError("--model", ref, f"a readable Python file before ':' ({left!r} "
                            "does not exist)")
        spec = importlib.util.spec_from_file_location(f"_hetshard_factory_{abs(hash(left))}",
                                                      left)
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, os.path.dirname(os.path.abspath(left)))
        try:
            spec.loader.exec_module(module)
        finally:
            sys.path.pop(0)
    else:
        try:
            module = importlib.import_module(left)
        except ImportError as e:
            raise SpecError("--model", ref, f"an importable module before ':' ({e})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise SpecError("--model", ref, f"a function {name!r} in {left!r}", where=where)
    return fn


def load_program(ref: str, *, implied: tuple[str, ...] = (), **given) -> Program:
    """The program the factory ``ref`` returns (see the module docstring); ``given``:
    keyword arguments for it, None values left out; those named in ``implied`` (filled
    in by hetshard, not given by the user: a pinned plan's sequence length) only where
    the factory takes them.

    Raises:
      SpecError: a missing file or function, a keyword the factory does not take, or a
      return value of none of the accepted forms (naming ``--model``).
    """
    fn = _function(ref)
    given = {k: v for k, v in given.items() if v is not None}
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
    given = {k: v for k, v in given.items() if k not in implied or k in params or takes_any}
    for k in given:
        if k not in params and not takes_any:
            flag = "--" + k.replace("_", "-")
            raise SpecError(flag, given[k], f"a flag the factory {ref} accepts (it takes "
                            f"{sorted(params) or 'no arguments'})")
    made = fn(**given)
    return program_of(made, name=ref)


def program_of(made, name: str = "program") -> Program:
    """A :class:`Program` from a factory's return value."""
    if isinstance(made, Program):
        return made
    if isinstance(made, tuple) and len(made) == 2 and callable(made[0]):
        step, args = made
        return Program(step, tuple(args), name=name)
    if isinstance(made, dict):
        missing = [k for k in ("loss", "batch", "optimizer") if k not in made]
        if missing or ("model" in made) == ("params" in made):
            raise SpecError("--model", name, "a factory returning a dict with 'loss', "
                            "'batch', 'optimizer' and one of 'model' or 'params'")
        step, args = standard_step(made["loss"], made["optimizer"], made["batch"],
                                   model=made.get("model"), params=made.get("params"))
        return Program(step, args, name=name)
    raise SpecError("--model", name, "a factory returning a hetshard.Program, (step, args) "
                    f"or a dict of loss, batch, optimizer and model or params; got "
                    f"{type(made).__name__}")


def standard_step(loss, optimizer: optax.GradientTransformation, batch, *, model=None,
                  params=None):
    """``(step, args)``: ``hetshard.value_and_grad(loss)`` and the optimizer's update, for
    an NNX ``model`` (with an ``nnx.Optimizer``) or a ``params`` pytree (with optax)."""
    if model is not None:
        abstract = any(isinstance(x, jax.ShapeDtypeStruct)
                       for x in jax.tree.leaves(nnx.state(model)))
        make = lambda m: nnx.Optimizer(m, optimizer, wrt=nnx.Param)  # noqa: E731
        opt = nnx.eval_shape(make, model) if abstract else make(model)

        def step(model, opt, batch):
            value, grads = value_and_grad(loss)(model, batch)
            opt.update(model, grads)
            return value
        return step, (model, opt, batch)
    state = jax.eval_shape(optimizer.init, params) if any(
        isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params)) else \
        optimizer.init(params)

    def tree_step(params, opt_state, batch):
        value, grads = value_and_grad(loss)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return value, optax.apply_updates(params, updates), opt_state
    return tree_step, (params, state, batch)
