"""The planner's options, its errors and how it shares its time limit among phases."""

from __future__ import annotations

import dataclasses
import math

from hetshard.cluster.catalog import GPU_DTYPE_POLICIES, gpu_dtypes
from hetshard.cluster.spec import Cluster
from hetshard.cost.profile import ModelProfile
from hetshard.errors import (  # noqa: F401 (re-exported)
    HetshardError,
    NoFeasiblePlanError,
    PlannerMemoryWarning,
    PlannerTimeLimitWarning,
    SpecError,
)
from hetshard.offload import ACTIVATION_REMATS, option_key, parse_option
from hetshard.remat import REMATS, check_remat

# How a family of several GPU types orders its stages (``_orders``).
STAGE_ORDERS = ("fastest-first", "fastest-last", "memory-first")


@dataclasses.dataclass(frozen=True)
class SearchEffort:
    """How hard the planner's search works: how many candidates each phase keeps and
    how many simulations a local search may run. None of these changes which plans are
    allowed, only how many are tried; the defaults are the measured trade-off of
    docs/planner.md. ``PlannerOptions.search`` holds one; ``hetshard.jit`` and
    ``hetshard.plan`` take ``search=SearchEffort(...)`` (or a mapping of its fields)."""

    simulate_top: int = 24  # best candidates by the layer tables that are simulated
    # best simulated candidates improved by local search (fewer lost good starts once
    # collective matmuls made tensor-parallel starts rank higher: docs/planner.md)
    refine_top: int = 4
    variant_top: int = 12  # best simulated candidates tried interleaved and re-warmed
    refine_evals: int = 300  # simulations per local search (deterministic effort)
    layout_top: int = 12  # best simulated plans given a layout per GPU type
    partial_top: int = 3  # of those, the ones whose descent goes on with partial remat
    layout_evals: int = 200  # simulations per layout descent (a layout per GPU type)
    exact_combos: int = 512  # exact micro-batch counts for every combination up to this
    include_uniform: bool = True  # the uniform (Megatron-like) plans among the starts
    # ``PlannerOptions.split_blocks=None`` refines in block halves up to this many GPUs
    split_blocks_max_devices: int = 256
    # Stage orders tried for every family of several GPU types (``STAGE_ORDERS``).
    stage_orders: tuple[str, ...] = STAGE_ORDERS
    exhaustive_splits: int = 2000  # enumerate every layer split when there are at most this many
    exhaustive_combos: int = 4096  # no pruning of family candidates below this many combinations
    # Where the plan is refined in block halves, it starts from the search's plan and
    # also from the best priced candidate of this many stage orders (the GPU types'
    # sequence per pipeline), as priced before the whole-block refinement: a descent at
    # half-block grain from there can end ahead of the refined whole-block plan.
    halves_starts: int = 3

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "include_uniform":
                if not isinstance(v, bool):
                    raise SpecError(f.name, v, "True or False", where="SearchEffort")
            elif f.name == "stage_orders":
                if (not isinstance(v, tuple) or not v or any(o not in STAGE_ORDERS
                                                             for o in v)):
                    raise SpecError("stage_orders", v,
                                    f"a non-empty tuple of {STAGE_ORDERS}",
                                    where="SearchEffort")
            elif isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SpecError(f.name, v, "a positive integer", where="SearchEffort")


@dataclasses.dataclass(frozen=True)
class PlannerOptions:
    """What the planner may choose, and how long it may take.

    The fields below constrain the plan: the micro-batch sizes, remats, offloads,
    parallel degrees, schedules and sharding a plan may use, and facts about the model
    the program does not show (its router's skew). ``time_limit_s`` bounds the search's
    wall time; the search's own effort is deterministic, set by ``search`` (a
    :class:`SearchEffort`: how many candidates each phase keeps, how many simulations a
    local search runs), so the same inputs give the same plan on any machine and the
    limit only cuts a search that would overrun it (the plan then says so).
    """

    time_limit_s: float = 60.0
    mbs_options: tuple[int, ...] = (1, 2, 4, 8)
    # Any of ``hetshard.remat.REMATS``, each stage choosing its own. "selective" and the
    # named policies (``save_qkv`` ...) on request: searched with the others, selective's
    # candidates crowd out the starts whose descents end fastest (docs/planner.md has the
    # measurements).
    remat_options: tuple[str, ...] = ("none", "full")
    # What a stage may keep in host memory (``hetshard.offload``), each stage choosing:
    # "none", "optimizer", "activations" (with a remat that keeps values by name) or
    # "optimizer+activations". Priced on each GPU's host link and each node's host
    # memory (``cluster.spec.Group``); a stage that fits without is planned without.
    offload_options: tuple[str, ...] = ("none", "optimizer", "activations",
                                        "optimizer+activations")
    tp_options: tuple[int, ...] = (1, 2, 4, 8)
    cp_options: tuple[int, ...] = (1, 2, 4, 8)  # context parallelism, for long sequences
    context_min_seq: int = 8192  # cp > 1 is considered from this sequence length on
    memory_margin: float = 0.05  # fraction of each GPU's memory kept free
    # The attention implementation plans use (``hetshard.kernel_choice``): "auto" prices
    # and runs, per GPU type, the fastest kernel that computes the program's attention.
    attention: str = "auto"
    # Tensor-parallel stages as collective matmuls (``Plan.tp_overlap``; the runtime's
    # ``hetshard.collectives.matmul``), priced with their collectives overlapped (never
    # slower than without: what cannot hide is paid as the plain collective would be).
    tp_overlap: bool = True
    schedule: str = "1f1b"
    # With schedule "1f1b": the best plans also tried under ZB-H1 (backward split into B
    # and W passes, W filling the bubbles), and kept where faster within memory.
    zero_bubble: bool = True
    virtual_options: tuple[int, ...] = (1, 2, 3, 4)  # stages per submesh (interleaving)
    # ZeRO-1 (Megatron-LM's distributed optimizer): optimizer state sharded over each
    # stage's data ways, for the same traffic as the gradient all-reduce it replaces, but
    # the parameter all-gather waits for the update. None: chosen per plan (families are
    # sized with it; the best plans are also simulated without); True/False: always/never
    distributed_optimizer: bool | None = None
    # Each stage's state sharded over its data ways (stages without tensor parallelism):
    # "node" FSDP inside each node's share of them and data parallelism across nodes
    # (hybrid sharding), "all" FSDP over all of them, "none" never; "auto" searches
    # without, prices the best plans "node" and "all" too (kept where faster), and where
    # no plan fits searches again "node", then "all".
    state_sharding: str = "auto"
    max_stages: int | None = None  # per pipeline (None: no limit)
    min_stages: int = 1  # per pipeline: a pipeline asked for (min = max: an exact count)
    max_pipelines: int | None = None
    # Stage boundaries inside blocks (attention | MLP halves as layers): True searches
    # halves from the start, False never splits, None refines the best whole-block plan
    # in halves (``refine_halves``) on clusters of at most
    # ``SearchEffort.split_blocks_max_devices`` GPUs and keeps it when faster.
    split_blocks: bool | None = None
    # Compute dtype per GPU type (``Plan.gpu_dtypes``, ``catalog.gpu_dtypes``): "program"
    # (every GPU in the program's dtype) or "fastest" (float16 with loss scaling on GPU
    # types without bfloat16 tensor cores, V100 and T4, under a bfloat16 program).
    gpu_dtypes: str = "program"
    # For sequences of at least ``context_min_seq`` on clusters of several GPU types,
    # also plans whose context groups span the types, each device attending a chunk
    # sized to its speed (``hetshard.solver.context``).
    mixed_context: bool = True
    # Mixture-of-experts models: expert-parallel degrees the best plans are also priced
    # with (each stage holding an MoE layer turns that many of its data ways into an
    # ``expert`` axis, where they divide its data ways and the experts), and the
    # exchange's capacity factors (``Plan.capacity_factor``; None: dropless, exact). A
    # factor drops routed tokens past it, so the default offers dropless alone.
    ep_options: tuple[int, ...] = (1, 2, 4, 8)
    capacity_factors: tuple[float | None, ...] = (None,)
    # The router's skew (``ModelProfile.router_skew``: busiest expert over the mean, 1
    # balanced; ``hetshard.cost.profile.routing_skew`` of a measured histogram)
    router_skew: float = 1.0
    # A measured routing histogram: tokens routed to each expert (summed over layers and
    # steps; ``hetshard.cost.profile.routing_skew`` reads its skew). Given, each expert
    # rank is priced by the tokens its experts take; the search prices expert-parallel
    # stages with their experts placed unevenly to balance them
    # (``cost.stage.planned_placement``), and the best plans both so and evenly.
    routing_histogram: tuple[float, ...] | None = None
    # How hard the search works (not what it may choose).
    search: SearchEffort = dataclasses.field(default_factory=SearchEffort)

    @classmethod
    def from_fields(cls, given: dict, where: str) -> PlannerOptions:
        """Options from keyword fields (``hetshard.jit(..., tp_options=(1, 2))``):
        PlannerOptions' fields, ``search`` as a :class:`SearchEffort` or a mapping of
        its fields, and ``options``, a whole PlannerOptions the other keywords then
        change. An unknown name is a SpecError listing the fields."""
        given = dict(given)
        base = given.pop("options", None)
        if base is not None and not isinstance(base, cls):
            raise SpecError("options", base, "a PlannerOptions", where=where)
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(given) - fields)
        if unknown:
            effort = {f.name for f in dataclasses.fields(SearchEffort)}
            hint = (f" (a search-effort field: pass search={{{unknown[0]!r}: ...}} or "
                    "search=SearchEffort(...))" if unknown[0] in effort else "")
            raise SpecError(unknown[0], given[unknown[0]],
                            f"a PlannerOptions field among {sorted(fields)}{hint}",
                            where=where)
        search = given.get("search")
        if isinstance(search, dict):
            bad = sorted(set(search) - {f.name for f in dataclasses.fields(SearchEffort)})
            if bad:
                raise SpecError(f"search.{bad[0]}", search[bad[0]], "a SearchEffort field "
                                f"among {[f.name for f in dataclasses.fields(SearchEffort)]}",
                                where=where)
            given["search"] = SearchEffort(**search)
        return dataclasses.replace(base, **given) if base is not None else cls(**given)

    def searching(self, **effort) -> PlannerOptions:
        """These options with ``search``'s fields ``effort`` changed."""
        return dataclasses.replace(self, search=dataclasses.replace(self.search, **effort))

    def __post_init__(self):
        for name in ("min_stages", "max_stages", "max_pipelines"):
            v = getattr(self, name)
            if (v is not None or name == "min_stages") and (
                    isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise SpecError(name, v, "a positive number of stages" if "stages" in name
                                else "a positive number of pipelines", where="PlannerOptions")
        if self.max_stages is not None and self.min_stages > self.max_stages:
            raise SpecError("min_stages", self.min_stages,
                            f"at most max_stages={self.max_stages}", where="PlannerOptions")
        if not isinstance(self.remat_options, tuple) or not self.remat_options:
            raise SpecError("remat_options", self.remat_options,
                            f"a non-empty tuple of {REMATS}", where="PlannerOptions")
        for r in self.remat_options:
            check_remat(r, "remat_options", where="PlannerOptions")
        if not isinstance(self.offload_options, tuple) or not self.offload_options:
            raise SpecError("offload_options", self.offload_options,
                            "a non-empty tuple of 'none', 'optimizer', 'activations', "
                            "'optimizer+activations'", where="PlannerOptions")
        for o in self.offload_options:
            parse_option(o, "offload_options", where="PlannerOptions")
        if self.state_sharding not in STATE_SHARDINGS:
            raise SpecError("state_sharding", self.state_sharding, f"one of {STATE_SHARDINGS}")
        if self.gpu_dtypes not in GPU_DTYPE_POLICIES:
            raise SpecError("gpu_dtypes", self.gpu_dtypes, f"one of {GPU_DTYPE_POLICIES}")
        if (not isinstance(self.ep_options, tuple) or not self.ep_options or any(
                isinstance(e, bool) or not isinstance(e, int) or e < 1
                for e in self.ep_options)):
            raise SpecError("ep_options", self.ep_options,
                            "a non-empty tuple of positive integers (expert-parallel "
                            "degrees)", where="PlannerOptions")
        if (not isinstance(self.capacity_factors, tuple) or not self.capacity_factors or any(
                c is not None and (isinstance(c, bool) or not isinstance(c, (int, float))
                                   or not math.isfinite(c) or c <= 0)
                for c in self.capacity_factors)):
            raise SpecError("capacity_factors", self.capacity_factors,
                            "a non-empty tuple of None (dropless) and numbers > 0",
                            where="PlannerOptions")
        if isinstance(self.router_skew, bool) or not isinstance(
                self.router_skew, (int, float)) or not math.isfinite(self.router_skew) or \
                self.router_skew < 1:
            raise SpecError("router_skew", self.router_skew,
                            "a number >= 1 (the busiest expert's tokens over the mean)",
                            where="PlannerOptions")
        h = self.routing_histogram
        if h is not None and (not isinstance(h, tuple) or len(h) < 2 or any(
                isinstance(x, bool) or not isinstance(x, (int, float)) or
                not math.isfinite(x) or x < 0 for x in h) or not sum(h)):
            raise SpecError("routing_histogram", h,
                            "None or a tuple of token counts >= 0, one per expert (2 or "
                            "more), not all zero", where="PlannerOptions")
        if not isinstance(self.search, SearchEffort):
            raise SpecError("search", self.search, "a SearchEffort (or, as a hetshard.jit "
                            "or hetshard.plan keyword, a mapping of its fields)",
                            where="PlannerOptions")


    @property
    def memory_options(self) -> tuple[str, ...]:
        """Every (remat, offload) a stage may take, as the search's keys
        (``hetshard.offload.option_key``), per remat in ``offload_options``' order (the
        splits take the first of equally fast options: without offload, by default);
        "activations" only with the remats that keep values by name."""
        out = []
        for remat in self.remat_options:
            for text in self.offload_options:
                off = parse_option(text)
                key = option_key(remat, off)
                if ("activations" not in off or remat in ACTIVATION_REMATS) and \
                        key not in out:
                    out.append(key)
        return tuple(out)


STATE_SHARDINGS = ("auto", "none", "node", "all")


def fsdp_ways(sharding: str, r: int, tp: int, cp: int, per_node: int) -> int:
    """How many of a stage's ``r`` data ways shard its state under ``sharding``
    (``PlannerOptions.state_sharding``) on nodes of ``per_node`` GPUs: 1 (none) for
    "none"/"auto" and for tensor-parallel stages (their parameters keep their per-tensor
    layouts), ``r`` for "all", the data ways inside one node for "node" (a divisor of
    ``r``)."""
    if sharding in ("none", "auto") or tp > 1 or r < 2:
        return 1
    if sharding == "all":
        return r
    return math.gcd(r, max(per_node // (tp * cp), 1))


def ep_ways(profile: ModelProfile, ep_options: tuple[int, ...], r: int, tp: int, cp: int,
            per_node: int, fsdp: int = 1) -> int:
    """The expert-parallel degree the search gives a stage of ``r`` data ways holding a
    mixture-of-experts layer: the largest of ``ep_options`` that divides ``r`` and every
    layer's expert count with its expert groups (``ep x cp x tp`` adjacent devices)
    inside a node, where the state is not FSDP-sharded (``fsdp`` ways); 1 (none) for a
    dense model. The best plans are also priced with the other degrees
    (``Evaluator.experts``)."""
    counts = {layer.experts for layer in profile.layers if layer.experts}
    if not counts or fsdp > 1:
        return 1
    fits = [e for e in ep_options if e >= 1 and r % e == 0 and
            all(n % e == 0 for n in counts) and e * tp * cp <= max(per_node, 1)]
    return max(fits, default=1)


def data_axes(r: int, fsdp: int, ep: int) -> tuple[tuple[str, int], ...]:
    """A stage's batch axes for ``r`` data ways of which ``fsdp`` shard the state (FSDP)
    or ``ep`` hold different experts (one or the other)."""
    if fsdp > 1:
        return (("data", r // fsdp),) * (r > fsdp) + (("fsdp", fsdp),)
    if ep > 1:
        return (("data", r // ep),) * (r > ep) + (("expert", ep),)
    return (("data", r),)


@dataclasses.dataclass(frozen=True)
class Budget:
    """How the search shares ``PlannerOptions.time_limit_s``: the end of each phase, as a
    fraction of the limit from the search's start. The effort is set by the options; a
    phase past its end stops and the plan says so (status "time_limit", a warning). A
    phase cut early does not make the later phases late: each has its own end."""

    seeds: float = 0.25  # heuristic starting points (AMP-, Metis-like)
    families: float = 0.6  # family configurations, group assignments, candidate plans
    refine: float = 0.85  # pricing, layouts per GPU type, variants, local search
    halves_layouts: float = 0.5  # refine_halves: its layout descents
    # make_plan: the inter-op search's share of the whole limit (tracing included) when
    # intra-op shardings follow, and of that share the whole-block search's when it is
    # then refined in block halves
    inter_op: float = 0.85
    whole_blocks: float = 0.75


BUDGET = Budget()


def planned_gpu_dtypes(profile: ModelProfile, cluster: Cluster,
                       opts: PlannerOptions) -> tuple[tuple[str, str], ...]:
    """``Plan.gpu_dtypes`` of the options' policy for the program and cluster."""
    return gpu_dtypes(cluster, profile.dtype, opts.gpu_dtypes)
