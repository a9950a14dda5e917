"""Running a per-batch plan: one training step made of every group's micro-steps.

Each micro-step of a :class:`~hetshard.data.planner.BatchPlan` is a set of rows of one
bucket on one group: it runs on that group's devices as a one-stage plan whose mesh is
``fsdp = devices / degree`` by ``context = degree`` (rows split over fsdp, each row's
sequence over context, attention a ring, ``hetshard.kernels.ring_attention``), computing
the value and gradients of the step's ``hetshard.value_and_grad`` loss
(``MicroSteps.grads_under``). The state (weights and optimizer moments) is sharded over
every device of the group, ``fsdp x context`` (ZeRO-3 over the group, as ``group_costs``
prices and memory-checks it; ``Context.shard_state``): a row over the whole group holds
a ``1 / devices`` share of each weight on each device, as a micro-step of one-device
rows does, and both lay a leaf out alike. The rows' loss weights are normalised by the batch's
target count (``packed_arrays(target_tokens=)``), so the micro-steps' values and
gradients *sum* to the whole batch's token-mean loss and gradient. Each group sums its
own micro-steps on its devices, in the layout its first micro-step left them; the
groups' sums are added once and applied once (``MicroSteps.apply_grads``, on the state
as the first group's micro-steps held it). A (group, bucket) pair compiles once: a run
compiles at most as many programs as the groups have buckets.

Multimodal samples (mappings of ``tokens`` and ``images``) run the same way, a row of
each bucket holding the group's ``images_of(bucket)`` images (zero padding). The
vision encoder runs in the micro-step: on a context group, a row's images (and the
encoder's activations, its patch attention whole per image) are split over the group
where its degree divides them (``hetshard.layout.batch_sharding``,
``boundary_layout``), then the decoder's sequence is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp

from hetshard._plan import Context, Pipeline, Plan, Predicted, Stage, data_ways
from hetshard.collectives import put
from hetshard.data.drafts import BatchPlan, MicroStep
from hetshard.data.packing import Row, packed_arrays, target_count
from hetshard.data.pipelines import PipelineCost
from hetshard.data.planner import GroupCost, check_groups
from hetshard.errors import SpecError
from hetshard.runtime.micro_steps import MicroSteps


def micro_steps(step) -> MicroSteps:
    """The per-batch doors of ``step``, a ``@hetshard.jit`` step
    (``HetshardJit.micro_steps``); anything else is a SpecError."""
    got = getattr(step, "micro_steps", None)
    if not isinstance(got, MicroSteps):
        raise SpecError("step", type(step).__name__, "a @hetshard.jit step (its "
                        "micro_steps run the pieces)", where="hetshard.data")
    return got


def micro_step_plan(step, args, group: GroupCost, bucket: int, degree: int,
                    attention: str = "auto") -> Plan:
    """The one-stage plan a micro-step of ``bucket`` rows at ``degree`` runs under on
    ``group``'s devices, under the remat the group prices such rows with
    (``GroupCost.remat_of``; ``step``: the ``hetshard.jit`` step, ``args`` its arguments
    with a batch of that shape)."""
    cluster = step.cluster
    rows = group.n // degree
    program = micro_steps(step).program_for(*args)
    layers = program.layering(2, False).num_layers
    axes = (("fsdp", rows),) + ((("context", degree),) if degree > 1 else ())
    gpu = cluster.gpu_of(group.devices[0]).name
    remat = group.remat_of(bucket) or "none"
    return Plan(program.name, cluster, rows, bucket, (
        Pipeline((Stage(0, layers, tuple(group.devices), gpu, axes, remat=remat),),
                 rows, 1, 1),),
        attention=attention,
        context=Context(degree, shard_state=True) if degree > 1 else Context(),
        fsdp=rows > 1, fingerprint=program.model_fingerprint)


def run_batch_plan(step, args: Sequence, samples: Sequence, plan: BatchPlan,
                   groups: Sequence[GroupCost], *, batch_argnums: int = -1,
                   attention: str = "auto"):
    """One training step of ``step`` (a ``hetshard.jit`` step whose loss reads packed
    rows: ``models.losses.packed_text_loss``, or ``packed_mllm_loss`` for multimodal
    samples) on ``samples`` (1-D token arrays, or mappings ``{"tokens", "images"}`` as
    ``packed_arrays`` takes them) as ``plan`` places them on ``groups``; ``args``: the
    step's other arguments with any batch at ``batch_argnums`` (replaced per
    micro-step). Returns the step's output.

    Raises:
      SpecError: a plan that does not place every sample exactly once, or names a group
        not in ``groups``; multimodal samples on groups priced without a vision encoder.
    """
    groups = check_groups(groups)
    _check_plan(plan, samples)
    by_name = {g.name: g for g in groups}
    placed = sorted(i for gp in plan.groups for st in gp.steps for r in st.rows
                    for i in r.samples)
    if placed != list(range(len(samples))):
        raise SpecError("plan", f"{len(placed)} placed samples",
                        f"every one of the {len(samples)} samples exactly once")
    targets = target_count(samples)
    args = list(args)
    at = batch_argnums % len(args)
    for gp in plan.groups:
        if gp.group not in by_name:
            raise SpecError("plan.groups", gp.group, f"one of {sorted(by_name)}")
    multimodal = bool(samples) and isinstance(samples[0], Mapping)
    if multimodal and any(not by_name[gp.group].image_tokens for gp in plan.groups):
        raise SpecError("samples", "multimodal samples", "groups priced with a vision "
                        "encoder (group_costs(vision=, image_tokens=))")
    # Every group's micro-steps are dispatched (JAX runs them asynchronously, each group
    # on its own devices), round-robin so that no group waits on another's compilation;
    # a group sums its own micro-steps where they ran, and the groups' sums meet once.
    sums: dict[str, object] = {}
    first = None
    queues = [(by_name[gp.group], list(gp.steps)) for gp in plan.groups]
    for k in range(max((len(q) for _, q in queues), default=0)):
        for group, steps in queues:
            if k >= len(steps):
                continue
            ms = steps[k]
            per = group.n // ms.degree
            rows = list(ms.rows) + [Row(ms.bucket, (), ())] * (per - len(ms.rows))
            images = group.images_of(ms.bucket) if multimodal else None
            batch = {name: jnp.asarray(v) for name, v in packed_arrays(
                samples, rows, target_tokens=targets, images_per_row=images,
                image_tokens=group.image_tokens if multimodal else None).items()}
            args[at] = batch
            first = batch if first is None else first
            p = micro_step_plan(step, args, group, ms.bucket, ms.degree, attention)
            got = micro_steps(step).grads_under(p, *args)
            mine = sums.get(group.name)
            # on the group's devices, in the layout its first micro-step left them
            # (sharded over the group as its state is)
            sums[group.name] = got if mine is None else jax.tree.map(
                jnp.add, mine, put(got, _layout(mine)))
    total = None
    for part in sums.values():
        total = part if total is None else jax.tree.map(
            jnp.add, total, put(part, _layout(total)))
    args[at] = first
    return micro_steps(step).apply_grads(total, *args)


def _layout(tree):
    """Each leaf's sharding (what a sum of trees of this structure is moved to)."""
    return jax.tree.map(lambda x: x.sharding, tree)


def _check_plan(plan, samples) -> None:
    if not isinstance(plan, BatchPlan):
        raise SpecError("plan", type(plan).__name__, "a BatchPlan (plan_batch, "
                        "plan_pipeline_batch)")
    if isinstance(samples, (str, bytes, Mapping)) or not hasattr(samples, "__getitem__") \
            or not hasattr(samples, "__len__") or not len(samples):
        raise SpecError("samples", type(samples).__name__, "a non-empty list of samples "
                        "(token arrays, or mappings of tokens and images)")


def pass_plan(outer: Plan, pipe: PipelineCost, bucket: int, micro_batches: int,
              pipeline: int = 0) -> Plan:
    """The plan a pass of ``micro_batches`` micro-batches of ``bucket`` rows
    (``pipe.rows(bucket)`` each) runs under on ``outer``'s pipeline ``pipeline``: its
    stages, layers,
    devices and remat; each stage's data ways split a micro-batch's rows, or, with
    fewer rows than ways, each row over ``ways / rows`` of them as a context axis (the
    ring). Stages that shard their state over their ways (an ``fsdp`` axis, as
    ``pipeline_costs`` prices them) keep it sharded over all of them: the rows'
    axis stays ``fsdp`` and, where every stage is such a stage, the state spans the
    context axis too (``Context.shard_state``); a stage of ``data`` ways keeps whole
    weights on each.

    Raises:
      SpecError: rows that a stage's data ways do not divide, or ways that the rows do
        not divide.
    """
    rows = pipe.rows(bucket)
    stages = []
    outer_stages = outer.pipelines[pipeline].stages
    sharded = all(st.axis("fsdp") > 1 for st in outer_stages)
    for j, st in enumerate(outer_stages):
        ways = data_ways(st)
        if (rows >= ways and rows % ways) or (rows < ways and ways % rows):
            raise SpecError(f"outer.pipelines[{pipeline}].stages[{j}]", f"{ways} data ways",
                            f"ways that divide, or are divided by, the {rows} rows of a "
                            f"{bucket}-token micro-batch")
        data, context = min(rows, ways), max(1, ways // rows)
        other = [(a, n) for a, n in st.mesh_shape if a not in ("data", "fsdp", "context")]
        name = "fsdp" if st.axis("fsdp") > 1 else "data"
        shape = ((name, data),) + ((("context", context),) if context > 1 else ()) + \
            tuple(other)
        stages.append(dataclasses.replace(st, mesh_shape=shape, activations=()))
    first = min(rows, data_ways(outer_stages[0]))
    pipeline = Pipeline(tuple(stages), rows * micro_batches, rows // first, micro_batches)
    ring = any(st.axis("context") > 1 for st in stages)
    return dataclasses.replace(outer, global_batch=rows * micro_batches, seq_len=bucket,
                               pipelines=(pipeline,),
                               context=Context(shard_state=sharded and ring),
                               predicted=Predicted())


def run_pipeline_batch_plan(step, args: Sequence, samples: Sequence, plan: BatchPlan,
                            pipes: Sequence[PipelineCost], outer: Plan, *,
                            batch_argnums: int = -1):
    """One training step of ``step`` (a ``hetshard.jit`` step whose loss reads packed
    rows: ``models.losses.packed_text_loss``, or ``packed_mllm_loss`` for multimodal
    samples, the encoder in the first stage or, for pipes priced with a vision stage of
    its own encoding every slot (``pipeline_costs(vision_devices=, encoder_slots=True)``),
    the outer pipeline's first stage on those devices holding the program's encoder
    layers: DistTrain's disaggregated encoder) on ``samples`` (1-D token arrays, or
    mappings ``{"tokens", "images"}`` as ``packed_arrays`` takes them, each row's images
    padded to its bucket's slots) as
    ``plan`` (``hetshard.data.plan_pipeline_batch`` on ``pipes``, one a pipeline of
    ``outer``) composes them on ``outer``'s pipelines (over the step's layers): one
    pass a (pipeline, bucket) (``pass_plan``: its micro-batches' rows, part-empty ones
    padded; a pipeline given no samples runs one empty micro-batch), each pipeline's
    passes walked as one pipeline in the plan's micro-batch order
    (``MicroSteps.run_passes``), the gradients summed over the pipelines and the update
    applied once. ``args``: the step's arguments with any batch at ``batch_argnums``
    (replaced per pass). Returns the step's output.

    Raises:
      SpecError: a plan that does not place every sample exactly once, or whose groups
        are not ``pipes`` and ``outer``'s pipelines one to one; multimodal samples on
        pipelines without an encoder or with a vision stage encoding a compacted batch
        (priced, not run); an outer pipeline whose first stage is not the vision
        stage's devices; stages whose data ways a bucket's rows do not fit.
    """
    pipes = check_groups(pipes, PipelineCost, "pipes", "pipeline_costs")
    _check_plan(plan, samples)
    if not isinstance(outer, Plan):
        raise SpecError("outer", type(outer).__name__, "the hetshard.Plan whose pipelines "
                        "the pipes were priced on")
    placed = sorted(i for gp in plan.groups for st in gp.steps for r in st.rows
                    for i in r.samples)
    if placed != list(range(len(samples))):
        raise SpecError("plan", f"{len(placed)} placed samples",
                        f"every one of the {len(samples)} samples exactly once")
    names = [p.name for p in pipes]
    if [g.group for g in plan.groups] != names or len(outer.pipelines) != len(pipes):
        raise SpecError("plan.groups", [g.group for g in plan.groups],
                        f"one plan a pipeline, {names}, on an outer plan of as many "
                        f"pipelines ({len(outer.pipelines)})")
    multimodal = bool(samples) and isinstance(samples[0], Mapping)
    if multimodal and any(not p.image_tokens or (p.encoder_stage is not None
                                                 and not p.encoder_slots) for p in pipes):
        raise SpecError("samples", "multimodal samples",
                        "text samples, or pipelines priced with the vision encoder in "
                        "their first stage (pipeline_costs(vision=)) or on a vision stage "
                        "of its own encoding every slot (vision_devices=, "
                        "encoder_slots=True; the compacted encoder batch is priced, not "
                        "run)")
    for pi, pipe in enumerate(pipes):
        if pipe.encoder_stage is None:
            continue
        first = outer.pipelines[pi].stages[0]
        if len(outer.pipelines[pi].stages) != len(pipe.stages) or \
                first.devices != pipe.stages[0].devices:
            raise SpecError(f"outer.pipelines[{pi}]",
                            [st.devices for st in outer.pipelines[pi].stages],
                            f"a first stage on the vision stage's devices "
                            f"{list(pipe.stages[0].devices)} holding the program's "
                            f"encoder layers, then the {len(pipe.stages) - 1} language-"
                            f"model stages the pipeline was priced with")
    targets = target_count(samples)
    args = list(args)
    at = batch_argnums % len(args)
    passes, order = [], []
    for pi, (gp, pipe) in enumerate(zip(plan.groups, pipes, strict=True)):
        steps = gp.steps or (MicroStep(pipe.buckets[0], 1, (), 0.0),)
        buckets = list(dict.fromkeys(s.bucket for s in steps))
        rows = {b: [] for b in buckets}
        first = len(passes)
        for s in steps:
            order.append((first + buckets.index(s.bucket),
                          len(rows[s.bucket]) // pipe.rows(s.bucket)))
            rows[s.bucket] += list(s.rows) + [Row(s.bucket, (), ())] * (
                pipe.rows(s.bucket) - len(s.rows))
        for b in buckets:
            extra = dict(images_per_row=pipe.images_of(b),
                         image_tokens=pipe.image_tokens) if multimodal else {}
            batch = {name: jnp.asarray(v) for name, v in packed_arrays(
                samples, rows[b], target_tokens=targets, **extra).items()}
            mine = list(args)
            mine[at] = batch
            passes.append((pass_plan(outer, pipe, b, len(rows[b]) // pipe.rows(b), pi),
                           tuple(mine)))
    return micro_steps(step).run_passes(passes, order)
