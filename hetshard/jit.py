"""``@hetshard.jit``: trace, plan (or load a cached plan), compile and run a train step.

Every plan kind runs:

* one pipeline of one stage: one SPMD program on the stage's mesh (data, FSDP, tensor
  and mixed per-op shardings);
* several single-stage pipelines with uneven batch shares: each computes its share's
  value and gradients on its submesh, combined weighted by share, the update applied once;
* pipelines of several stages (MPMD): ``hetshard.runtime.pipeline`` -- stage programs on
  their own submeshes under 1F1B, per-stage optimizer updates; in a multi-process job
  (``jax.distributed``) several pipelines always take this route, each process running
  the programs of the stages on its devices.

Pipeline plans need the step to call ``hetshard.value_and_grad``; for a step that does
not, the planner is restricted to single-stage plans (a warning says so once).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from hetshard import cache
from hetshard.cluster.spec import Cluster
from hetshard.errors import HetshardError, SpecError
from hetshard.plan import Plan
from hetshard.runtime.spmd import batch_sharding, stage_mesh, state_shardings

_MARK = threading.local()
NAN_POLICIES = ("skip", "apply", "raise")


class PlanNotExecutableError(HetshardError, ValueError):
    """The plan needs something the step does not provide: pipeline plans and several
    pipelines need an NNX step that calls ``hetshard.value_and_grad``."""


class NonFiniteLossError(HetshardError, FloatingPointError):
    """The step's loss was NaN or infinite (``nan_policy="raise"``)."""


def value_and_grad(fn, argnums=0, has_aux: bool = False):
    """Drop-in for ``nnx.value_and_grad`` that marks the per-micro-batch region.

    Under ``hetshard.jit`` it lets the runtime compute the value and gradients per
    pipeline (each on its own batch share and submesh) and hand the step the
    batch-share-weighted combination, so the update equals the global-batch mean
    gradient's.
    """
    inner = nnx.value_and_grad(fn, argnums=argnums, has_aux=has_aux)

    def swapped(impl, args):
        # Functional form of the loss in the model's parameters, with attention rewritten,
        # then differentiated: gradients have nnx.value_and_grad's structure.
        model = args[argnums]
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        others = args[:argnums] + args[argnums + 1:]

        def loss_of(params, *others):
            full = list(others)
            full.insert(argnums, nnx.merge(graphdef, params, rest))
            return fn(*full)

        spmd = getattr(_MARK, "spmd", None)
        if spmd is not None:
            from hetshard.rewrite.spmd import constrain_layers
            mesh, stage, split_blocks, tp_overlap = spmd
            rewritten = constrain_layers(loss_of, mesh, stage, attention=impl or "reference",
                                         split_blocks=split_blocks, tp_overlap=tp_overlap)
        else:
            from hetshard.rewrite import swap_attention
            rewritten = swap_attention(loss_of, impl)
        return jax.value_and_grad(rewritten, has_aux=has_aux)(params, *others)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        _MARK.used = True
        mode = getattr(_MARK, "mode", None)
        if mode == "record":
            raise _Recorded(_loss_call(fn, argnums, has_aux, args, kwargs))
        if mode == "provide":
            return _MARK.provided
        impl = getattr(_MARK, "attention", None)
        plain = impl in (None, "reference") and getattr(_MARK, "spmd", None) is None
        if plain or kwargs or not isinstance(argnums, int):
            out = inner(*args, **kwargs)
        else:
            out = swapped(impl, args)
        if mode == "capture":
            _MARK.captured = out
        return out

    return wrapped


class _Recorded(Exception):  # noqa: N818 (control flow, never escapes hetshard)
    def __init__(self, call):
        super().__init__("recorded")
        self.call = call


def _loss_call(fn, argnums, has_aux, args, kwargs):
    """How the step called the loss, relative to its NNX objects and batch (LossCall)."""
    from hetshard.runtime.pipeline import LossCall, PipelineSetupError
    if kwargs or not isinstance(argnums, int):
        raise PipelineSetupError("under a pipeline plan, hetshard.value_and_grad takes "
                                 "positional arguments and one integer argnums")
    objs, batch = _MARK.record_objs, _MARK.record_batch
    ids = {id(x): k for k, x in enumerate(jax.tree.leaves(batch))}
    spec = []
    for i, a in enumerate(args):
        j = next((j for j, o in enumerate(objs) if o is a), None)
        if j is not None:
            spec.append(("model", j))
            continue
        if i == argnums:
            raise PipelineSetupError("under a pipeline plan, the differentiated argument of "
                                     "hetshard.value_and_grad must be an NNX model the step "
                                     "receives as an argument")
        leaves, tree = jax.tree.flatten(a)
        if leaves and all(id(x) in ids for x in leaves):
            spec.append(("batch", tree, [ids[id(x)] for x in leaves]))
        elif not any(isinstance(x, (jax.Array, np.ndarray)) for x in leaves):
            spec.append(("static", a))
        else:
            raise PipelineSetupError(
                f"argument {i} of the loss is computed inside the step; under a pipeline "
                f"plan the loss's arguments must be the step's model and its batch (or "
                f"parts of it), so each micro-batch can be cut from the batch")
    return LossCall(fn, argnums, has_aux, tuple(spec))


def jit(fn=None, *, cluster, global_batch: int | None = None, batch_argnums: int | None = None,
        plan: Plan | str | None = None, nan_policy: str = "skip", **planner_options):
    """Compiles ``fn`` (a train step) for ``cluster``; usable as ``@hetshard.jit(...)``.

    Args:
      cluster: a Cluster, preset name, spec path or dict; its GPUs are bound to the JAX
        devices (fake CPU devices stand in for them on CPU).
      global_batch: expected leading batch size (checked on every call).
      batch_argnums: index of the batch argument (default: the last positional one).
      plan: a Plan or a plan JSON path; skips planning (and pins the shapes).
      nan_policy: "skip" (default: a non-finite loss is reported and the update not
        applied), "apply" or "raise".
      planner_options: PlannerOptions fields (time_limit_s, dtype, tp_options, ...).
    """
    if fn is None:
        return functools.partial(jit, cluster=cluster, global_batch=global_batch,
                                 batch_argnums=batch_argnums, plan=plan,
                                 nan_policy=nan_policy, **planner_options)
    return HetshardJit(fn, cluster, global_batch, batch_argnums, plan, nan_policy,
                       planner_options)


def _with_attention(fn, plan: Plan, mesh=None):
    """``fn`` traced with the plan's attention choice and, given the stage ``mesh`` of a
    single-stage plan, its layer-boundary layouts (``hetshard.rewrite.spmd``), which
    ``value_and_grad`` applies to the loss before differentiating (rewrites precede
    autodiff)."""
    @functools.wraps(fn)
    def wrapped(*args):
        previous = getattr(_MARK, "attention", None), getattr(_MARK, "spmd", None)
        _MARK.attention = plan.attention
        _MARK.spmd = None if mesh is None else (mesh, plan.pipelines[0].stages[0],
                                                 plan.split_blocks, plan.tp_overlap)
        try:
            return fn(*args)
        finally:
            _MARK.attention, _MARK.spmd = previous
    return wrapped


def _is_graph(x) -> bool:
    return isinstance(x, (nnx.Module, nnx.Optimizer)) or nnx.is_graph_node(x)


def _signature(args) -> str:
    leaves, tree = jax.tree.flatten(jax.tree.map(
        lambda x: (tuple(np.shape(x)), str(jnp.result_type(x))) if hasattr(x, "shape")
        else x, nnx.state(args) if any(_is_graph(a) for a in args) else args))
    return f"{tree}|{leaves}"


class HetshardJit:
    def __init__(self, fn, cluster, global_batch, batch_argnums, plan, nan_policy,
                 planner_options):
        from hetshard.solver import PlannerOptions
        self.fn = fn
        self.cluster = Cluster.load(cluster)
        self.global_batch = global_batch
        self.batch_argnums = batch_argnums
        if nan_policy not in NAN_POLICIES:
            raise SpecError("nan_policy", nan_policy, f"one of {NAN_POLICIES}")
        self.nan_policy = nan_policy
        fields = {f.name for f in dataclasses.fields(PlannerOptions)}
        unknown = set(planner_options) - fields
        if unknown:
            raise SpecError(sorted(unknown)[0], planner_options[sorted(unknown)[0]],
                            f"a PlannerOptions field among {sorted(fields)}",
                            where="hetshard.jit")
        self.options = PlannerOptions(**planner_options)
        self.pinned = Plan.load(plan) if isinstance(plan, str) else plan
        self.plan: Plan | None = self.pinned
        self._compiled: dict[str, tuple] = {}
        self._bound = None
        self._warned_vg = False
        functools.update_wrapper(self, fn)

    # ---- planning --------------------------------------------------------------------
    def _model_config(self, objs):
        import models
        for o in objs:
            for m in ([o] + [getattr(o, "model", None)]):
                cfg = getattr(m, "config", None)
                if cfg is not None:
                    try:
                        return models.resolve(cfg)
                    except HetshardError:
                        continue
        raise SpecError("model", "no hetshard zoo model among the arguments",
                        "an NNX model from models/ (it carries .config), or plan=",
                        where="hetshard.jit")

    def _plan_for(self, args, batch, batch_size: int, signature: str, call) -> Plan:
        if self.pinned is not None:
            if self.pinned.global_batch != batch_size:
                shares = [p.batch_share for p in self.pinned.pipelines]
                raise SpecError("batch", f"leading dimension {batch_size}",
                                f"the pinned plan's global batch {self.pinned.global_batch} "
                                f"(split {shares})", where="hetshard.jit")
            self._check_pinned(args, batch)
            from hetshard.solver.shardings import fill_missing_shardings
            # A stage with a tensor axis and no parameter layouts gets the ones make_plan
            # would write, so it runs tensor-parallel as the simulator prices it.
            self.pinned = fill_missing_shardings(self.pinned, self.cluster)
            return self.pinned
        from hetshard.solver import make_plan
        options = self.options
        if call is None and (options.max_stages != 1 or options.max_pipelines != 1):
            if not self._warned_vg:
                self._warned_vg = True
                warnings.warn("the step does not call hetshard.value_and_grad: hetshard "
                              "restricts itself to single-stage plans for it", stacklevel=4)
            options = dataclasses.replace(options, max_stages=1, max_pipelines=1)
        objs = [a for a in args if _is_graph(a)]
        if not objs and options.distributed_optimizer is not False:
            # Without NNX variables the optimizer's state cannot be told from the
            # parameters: plan (and price) full optimizer state per data way.
            options = dataclasses.replace(options, distributed_optimizer=False)
        config = self._model_config(objs)
        tokens = batch.get("tokens") if isinstance(batch, dict) else None
        seq_len = tokens.shape[1] if tokens is not None else None
        key = cache.fingerprint(signature, self.cluster.to_json(), repr(options),
                                repr(config))
        found = cache.load(key)
        if found is not None:
            return found
        plan = make_plan(config, self.cluster, global_batch=batch_size, seq_len=seq_len,
                         options=options)
        cache.store(key, plan)
        return plan

    def _check_pinned(self, args, batch):
        """A pinned plan made for another model, sequence length or cluster (one whose
        devices have other GPU types, or are missing, here) is an error."""
        import models
        plan = self.pinned
        made_for = Cluster.load(plan.cluster)
        n = self.cluster.num_devices
        for d in sorted({d for pipe in plan.pipelines for st in pipe.stages
                         for d in st.devices}):
            want = made_for.gpu_of(d).name
            here = self.cluster.gpu_of(d).name if d < n else None
            if here != want:
                raise SpecError(
                    "plan.cluster", made_for.name,
                    f"a plan for the cluster hetshard.jit was given ({self.cluster.name!r}); "
                    f"device {d}: {want} in the plan's cluster, "
                    + (f"{here} in {self.cluster.name!r}" if here else
                       f"missing from {self.cluster.name!r} ({n} devices)"),
                    where="hetshard.jit")
        tokens = batch.get("tokens") if isinstance(batch, dict) else None
        if tokens is not None and np.ndim(tokens) == 2 and np.shape(tokens)[1] != plan.seq_len:
            raise SpecError("batch['tokens']", f"sequence length {np.shape(tokens)[1]}",
                            f"the pinned plan's seq_len {plan.seq_len}", where="hetshard.jit")
        try:
            planned = models.resolve(plan.model)
            config = self._model_config([a for a in args if _is_graph(a)])
        except HetshardError:
            return  # a plan for a model outside the zoo: nothing to compare
        if planned != config:
            raise SpecError("plan.model", plan.model,
                            f"a plan made for the step's model {config.name!r}",
                            where="hetshard.jit")

    # ---- execution -------------------------------------------------------------------
    def __call__(self, *args):
        idx = len(args) - 1 if self.batch_argnums is None else self.batch_argnums
        if not -len(args) <= idx < len(args):
            raise SpecError("batch_argnums", idx, f"an argument index below {len(args)}",
                            where="hetshard.jit")
        idx %= len(args)
        batch = args[idx]
        leaves = jax.tree.leaves(batch)
        if not leaves or not hasattr(leaves[0], "shape") or not np.ndim(leaves[0]):
            raise SpecError("batch", type(batch).__name__,
                            "a pytree of arrays with a leading batch dimension",
                            where="hetshard.jit")
        size = int(np.shape(leaves[0])[0])
        if self.global_batch is not None and size != self.global_batch:
            raise SpecError("batch", f"leading dimension {size}",
                            f"global_batch={self.global_batch}", where="hetshard.jit")
        others = tuple(a for i, a in enumerate(args) if i != idx)
        sig = _signature(args)
        entry = self._compiled.get(sig)
        if entry is None:
            call = self._record(others, batch, idx)
            plan = self._plan_for(others, batch, size, sig, call)
            if jax.process_count() > 1:  # every process must run the same plan
                from hetshard.distributed import agree
                agree(plan.what_runs(), "plan")
            if self._bound is None:
                self._bound = self.cluster.bind()
            # Across processes every multi-pipeline plan runs as MPMD: each process runs
            # only its own pipelines' programs.
            multi_stage = any(len(p.stages) != 1 for p in plan.pipelines) or (
                jax.process_count() > 1 and len(plan.pipelines) > 1)
            if multi_stage and call is None:
                raise PlanNotExecutableError(
                    f"this plan has {[len(p.stages) for p in plan.pipelines]} stages per "
                    f"pipeline; pipeline plans need an NNX step that calls "
                    f"hetshard.value_and_grad (or plan with max_stages=1)")
            if multi_stage:
                from hetshard.runtime.pipeline import PipelineRunner
                graphdef, state = nnx.split(others)
                entry = ("mpmd", PipelineRunner(plan, self._bound.devices, self.fn, graphdef,
                                                state, batch, idx, call, _MARK))
            elif len(plan.pipelines) == 1:
                mesh = stage_mesh(plan, self._bound.devices)
                entry = self._compile(plan, mesh, others, batch, idx)
            else:
                entry = self._compile_pipelines(plan, others, batch, idx)
            self._compiled[sig] = entry
            self.plan = plan
        if entry[0] == "mpmd":
            out, new_state = entry[1].step(nnx.state(others), batch, self._check_loss)
            if new_state is not None:
                nnx.update(others, new_state)
            return out
        if entry[0] == "multi":
            return self._run_pipelines(entry, others, batch)
        return self._run(entry, others, batch)

    def _record(self, others, batch, idx):
        """The step's ``hetshard.value_and_grad`` call (a LossCall), or None when the
        step does not use it (then only single-stage plans are possible)."""
        if not any(_is_graph(a) for a in others):
            return None
        graphdef, state = nnx.split(others)

        def probe(state, batch):
            objs = list(nnx.merge(graphdef, state))
            _MARK.record_objs, _MARK.record_batch = tuple(objs), batch
            objs.insert(idx, batch)
            self.fn(*objs)

        previous = getattr(_MARK, "mode", None)
        _MARK.mode = "record"
        try:
            jax.eval_shape(probe, state, batch)
        except _Recorded as rec:
            return rec.call
        finally:
            _MARK.mode = previous
            _MARK.record_objs = _MARK.record_batch = None
        return None

    def _compile_pipelines(self, plan, others, batch, idx):
        """Several single-stage pipelines with (uneven) batch shares: each computes the
        value and gradients of its share on its submesh; the runtime combines them
        weighted by share; each then applies the same update (see value_and_grad)."""
        if not any(_is_graph(a) for a in others):
            raise PlanNotExecutableError("plans with several pipelines need an NNX step "
                                         "using hetshard.value_and_grad")
        fn = self.fn
        graphdef, state = nnx.split(others)
        parts, subs = [], []
        for p in plan.pipelines:
            sub = dataclasses.replace(plan, pipelines=(p,), global_batch=p.batch_share,
                                      grad_sync=())
            mesh = stage_mesh(sub, self._bound.devices)
            s_shard = state_shardings(state, sub, mesh)
            b_shard = batch_sharding(jax.tree.map(lambda x, n=p.batch_share: x[:n], batch),
                                     sub, mesh)
            parts.append((p.batch_share, mesh, s_shard, b_shard))
            subs.append(sub)

        def capture(state, batch):
            _MARK.mode, _MARK.captured, _MARK.used = "capture", None, False
            try:
                objs = list(nnx.merge(graphdef, state))
                objs.insert(idx, batch)
                fn(*objs)
                if _MARK.captured is None:
                    raise PlanNotExecutableError(
                        "plans with several pipelines need the step to call "
                        "hetshard.value_and_grad (it found none)")
                return _MARK.captured
            finally:
                _MARK.mode = None

        def apply(state, batch, provided):
            _MARK.mode, _MARK.provided = "provide", provided
            try:
                objs = list(nnx.merge(graphdef, state))
                objs.insert(idx, batch)
                out = fn(*objs)
                del objs[idx]
                return out, nnx.state(tuple(objs))
            finally:
                _MARK.mode = None

        # Each pipeline's loss with its stage's layouts and remat (the SPMD rewrite).
        cap = [jax.jit(_with_attention(capture, sub, mesh), in_shardings=(s, b))
               for (_, mesh, s, b), sub in zip(parts, subs, strict=True)]
        # The combined update is applied once, on the first pipeline's devices; the next
        # step hands every pipeline a copy of the updated state.
        return ("multi", parts, cap, jax.jit(apply), idx)

    def _run_pipelines(self, entry, others, batch):
        _, parts, cap, app, _idx = entry
        state = nnx.state(others)
        total = sum(share for share, *_ in parts)
        start, results, states, batches = 0, [], [], []
        for (share, _mesh, s_shard, b_shard), f in zip(parts, cap, strict=True):
            sl = jax.tree.map(lambda x, a=start, n=share: x[a:a + n], batch)
            st = jax.device_put(state, s_shard)
            bt = jax.device_put(sl, b_shard)
            results.append(f(st, bt))  # dispatched asynchronously on each submesh
            states.append(st)
            batches.append(bt)
            start += share
        # Weighted sum on the first pipeline's devices: the global-batch mean gradient.
        home = NamedSharding(parts[0][1], PartitionSpec())
        combined = None
        for (share, *_), res in zip(parts, results, strict=True):
            moved = jax.device_put(res, home)
            term = jax.tree.map(lambda x, w=share / total: x * w, moved)
            combined = term if combined is None else jax.tree.map(jnp.add, combined, term)
        out, new_state = app(states[0], batches[0], combined)
        if self._check_loss(out):
            nnx.update(others, new_state)
        return out

    def _compile(self, plan, mesh, others, batch, idx):
        nnx_mode = any(_is_graph(a) for a in others)
        b_shard = batch_sharding(batch, plan, mesh)
        fn = self.fn
        if nnx_mode:
            graphdef, state = nnx.split(others)
            s_shard = state_shardings(state, plan, mesh)

            def pure(state, batch):
                _MARK.used = False
                objs = list(nnx.merge(graphdef, state))
                objs.insert(idx, batch)
                out = fn(*objs)
                del objs[idx]
                new = nnx.state(tuple(objs))
                return (out, jax.lax.with_sharding_constraint(new, s_shard),
                        jnp.asarray(bool(_MARK.used)))
            jitted = jax.jit(_with_attention(pure, plan, mesh), in_shardings=(s_shard, b_shard))
            return ("nnx", jitted, s_shard, b_shard, idx)
        if plan.distributed_optimizer:
            raise PlanNotExecutableError(
                "plan.distributed_optimizer is true but the step takes plain pytrees, whose "
                "optimizer state cannot be told from the parameters; pass NNX objects "
                "(nnx.Optimizer) or a plan with distributed_optimizer false")
        s_shard = tuple(state_shardings(a, plan, mesh) for a in others)

        def pure_tree(state, batch):
            full = list(state)
            full.insert(idx, batch)
            return fn(*full)
        jitted = jax.jit(pure_tree, in_shardings=(s_shard, b_shard))
        return ("tree", jitted, s_shard, b_shard, idx)

    def _run(self, entry, others, batch):
        kind, jitted, s_shard, b_shard, idx = entry
        batch = jax.device_put(batch, b_shard)
        if kind == "tree":
            out = jitted(jax.device_put(others, s_shard), batch)
            self._check_loss(out)
            return out
        state = jax.device_put(nnx.state(others), s_shard)
        out, new_state, used_vg = jitted(state, batch)
        if not bool(used_vg) and not self._warned_vg:
            self._warned_vg = True
            warnings.warn("the step uses plain nnx.value_and_grad: hetshard restricts itself "
                          "to single-stage plans for it (use hetshard.value_and_grad)",
                          stacklevel=3)
        if self._check_loss(out):
            nnx.update(others, new_state)
        return out

    def _check_loss(self, out) -> bool:
        """True when the update may be applied."""
        loss = jax.tree.leaves(out)[0] if jax.tree.leaves(out) else None
        if loss is None or np.ndim(loss) or bool(jnp.isfinite(loss)):
            return True
        if self.nan_policy == "raise":
            raise NonFiniteLossError(f"the step's loss is {float(loss)}")
        if self.nan_policy == "skip":
            warnings.warn(f"non-finite loss {float(loss)}: the step was not applied "
                          f"(nan_policy='skip')", stacklevel=3)
            return False
        warnings.warn(f"non-finite loss {float(loss)} (applied: nan_policy='apply')",
                      stacklevel=3)
        return True
