"""Expert parallelism's token exchange: a dropless mixture-of-experts region run with its
experts split over a mesh's ``expert`` axis (``hetshard.rewrite.experts`` finds the
regions and calls :func:`expert_parallel`).

Inside ``jax.shard_map`` each device holds its own tokens (split over the stage's batch
axes, ``data``, ``fsdp`` and ``expert``, and over ``tensor`` and ``context`` where they
divide them: those ranks hold the same experts whole) and the experts of its rank of the ``expert``
axis (a contiguous run of the stacked expert axis; ``counts[j]`` on rank ``j``, uneven
where the plan says so):

1. its routed rows (``k`` per token) are sorted by expert, so each rank's rows are one
   run;
2. an all-to-all over ``expert`` hands each rank the rows of its experts from every rank
   of its group, with each row's local expert;
3. the received rows are sorted by local expert and the user's expert equations run on
   them (``hetshard.ir.samples``' row-wise chain: grouped matmuls with the local group
   sizes and the local expert weights);
4. a second all-to-all returns each row's result to the device it came from, where it is
   put back in token order.

Dropless (``capacity_factor`` None), the exchanges are ``jax.lax.ragged_all_to_all``:
each rank is sent only the rows routed to its experts, into a receive buffer that holds
the worst case (every device's ``T * k`` rows: ``ranks`` times the routed rows). Exact.
XLA:CPU has no ragged all-to-all ("UNIMPLEMENTED"), so on CPU devices a padded
``all_to_all`` of one block per rank stands in for it (``_emulated_ragged``: the same
result, with every block as long as the device's rows). With a capacity factor ``c``
the exchange is padded: a block holds ``ceil(c * T * k / ranks)`` rows; rows past it are
dropped (their output is zero, as a capacity-based layer drops a token), as MaxText's and
GShard's capacity factor do.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as ext
from jax.sharding import PartitionSpec as P

from hetshard.errors import PlanNotExecutableError
from hetshard.ir.attention_patterns import inner_jaxpr
from hetshard.layout import batch_axes
from hetshard.meshes import laid_out


def slots(counts: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, int]:
    """(rank of each expert, its slot on that rank, slots per rank) for a placement of
    ``counts[j]`` experts on rank ``j`` (contiguous runs, in rank order)."""
    owner = np.repeat(np.arange(len(counts)), counts).astype(np.int32)
    start = np.concatenate([[0], np.cumsum(counts)[:-1]])
    slot = (np.arange(sum(counts)) - start[owner]).astype(np.int32)
    return owner, slot, max(counts)


def padded_weights(w, counts: tuple[int, ...]):
    """The stacked expert weight ``w`` ([E, ...]) laid out as ``ranks * max(counts)``
    slots: rank ``j``'s experts first in its block, empty slots repeating expert 0 (no
    row reaches them, so they add nothing to the result or the gradient)."""
    m = max(counts)
    if len(set(counts)) == 1:
        return w
    idx = np.zeros(len(counts) * m, np.int32)
    start = 0
    for j, c in enumerate(counts):
        idx[j * m:j * m + c] = np.arange(start, start + c)
        start += c
    return jnp.take(w, jnp.asarray(idx), axis=0)


@dataclasses.dataclass(frozen=True)
class Relayout:
    """How an uneven placement's ranks get their experts from the even storage (rank
    ``q`` storing experts ``[q * s, (q + 1) * s)``, ``s = E / ranks``): per rank shift
    ``d`` (``shifts``), ``send[q]``, the local indices rank ``q`` sends to rank ``q - d``
    (``k`` per rank, padded by repeating index 0); and ``take[r, slot]``, where each of
    rank ``r``'s ``max(counts)`` slots comes from in the concatenation of its own shard
    and what each shift brought, in order."""

    shifts: tuple[tuple[int, np.ndarray], ...]
    take: np.ndarray

    @property
    def moved(self) -> int:
        """Experts a rank receives at the most (the shifts' widths summed)."""
        return sum(send.shape[1] for _, send in self.shifts)


def relayout(counts: tuple[int, ...]) -> Relayout:
    """The :class:`Relayout` of placement ``counts`` (contiguous runs, in rank order;
    their sum a multiple of the ranks)."""
    ranks, s = len(counts), sum(counts) // len(counts)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int)
    need: dict[int, list[list[int]]] = {}  # shift -> per receiving rank, global ids
    take = np.zeros((ranks, max(counts)), np.int32)
    for r in range(ranks):
        for g in range(first[r], first[r] + counts[r]):
            if g // s == r:
                take[r, g - first[r]] = g % s
            else:
                need.setdefault(g // s - r, [[] for _ in range(ranks)])[r].append(g)
    shifts, base = [], s  # (own shard first in the concatenation)
    for d in sorted(need):
        send = np.zeros((ranks, max(len(x) for x in need[d])), np.int32)
        for r, wanted in enumerate(need[d]):
            for j, g in enumerate(wanted):
                send[r + d, j] = g % s
                take[r, g - first[r]] = base + j
        shifts.append((d, send))
        base += send.shape[1]
    return Relayout(tuple(shifts), take)


def _brought(w, counts: tuple[int, ...], rank):
    """Inside the shard_map: the experts this rank lacks, from its neighbours' even
    shards (one ``ppermute`` per shift of :func:`relayout`, carrying only what the
    receiving rank needs), concatenated in shift order."""
    plan, ranks = relayout(counts), len(counts)
    parts = []
    for d, send in plan.shifts:
        out = jnp.take(w, jnp.asarray(send)[rank], axis=0)
        perm = [(q, q - d) for q in range(ranks) if 0 <= q - d < ranks]
        parts.append(jax.lax.ppermute(out, "expert", perm))
    return jnp.concatenate(parts, axis=0) if parts else w[:0]


def _placed(w, brought, counts: tuple[int, ...], rank):
    """This rank's ``max(counts)`` expert slots from its even shard ``w`` and what
    :func:`_brought` brought it (empty slots repeat a stored expert: no row reaches
    them)."""
    take = jnp.asarray(relayout(counts).take)[rank]
    return jnp.take(jnp.concatenate([w, brought], axis=0), take, axis=0)


def brought_experts(counts: tuple[int, ...], mesh):
    """``(bring, give_back)``, jitted, for an uneven placement ``counts`` whose ranks
    divide the experts: ``bring`` takes a stacked expert weight as the state stores it
    ([E, ...] split evenly over ``expert``) to what each rank lacks of its experts
    ([ranks * moved, ...] split over ``expert``: :func:`_brought`); ``give_back`` takes
    gradients of those back to the stored experts (``bring``'s transpose: the
    ``ppermute`` calls reversed). A pipeline stage brings them once per step and gives
    their summed gradients back after its last micro-batch, so the micro-batches'
    exchanges only copy them into place (``expert_parallel``'s ``prelaid``)."""
    spec = P("expert")

    def bring(w):
        return jax.shard_map(
            lambda x: _brought(x, counts, jax.lax.axis_index("expert")), mesh=mesh,
            in_specs=spec, out_specs=spec, check_vma=False)(laid_out(w, mesh, spec))

    def give_back(g):
        stored = jax.ShapeDtypeStruct((sum(counts),) + g.shape[1:], g.dtype)
        (w,) = jax.linear_transpose(bring, stored)(g)
        return w

    return jax.jit(bring), jax.jit(give_back)


def moved_experts(counts: tuple[int, ...]) -> int:
    """Experts a rank receives a step, at the most, to lay an uneven placement out from
    the even storage (``relayout``)."""
    return relayout(counts).moved


def expert_parallel(jaxpr, region, mesh, counts: tuple[int, ...], capacity_factor=None,
                    prelaid: frozenset = frozenset()):
    """``run(tokens, ids, *weights, *others)``: the region's output (every routed row's
    expert result, in token order, [T * k, d_out]) computed expert-parallel on ``mesh``
    (see the module docstring). ``prelaid``: positions in ``weights`` whose experts
    from other ranks come ready, as one more argument each (after ``others``, in
    position order: :func:`brought_experts`' ``bring``), so the exchange only copies
    them into place."""
    # Every device its own tokens: the batch axes, and the tensor and context ranks too
    # (they hold the same expert weights, whole): each computes its share of the routed
    # rows, not all of them again.
    axes = batch_axes(mesh) + tuple(a for a in ("tensor", "context")
                                    if mesh.shape.get(a, 1) > 1)
    ranks = mesh.shape["expert"]
    owner, slot, per_rank = slots(counts)
    k = region.k
    n_w, chain = len(region.weights), region.chain

    # Uneven placements: from the even storage, each rank's experts brought over by
    # ppermute inside the map (only those it needs); where the ranks do not divide the
    # experts, from the whole weights (``padded_weights``).
    relay = len(set(counts)) > 1 and sum(counts) % ranks == 0

    laid = sorted(prelaid)
    # Dropless: the ragged all-to-all, which sends each rank only the rows it gets (on
    # XLA:CPU, which lacks it, its emulation by the padded one); with a capacity: the
    # padded blocks that cap each rank's rows.
    ragged = capacity_factor is None
    emulated = mesh.devices.flat[0].platform == "cpu"

    def body(tokens, ids, *rest):
        weights, others = list(rest[:n_w]), rest[n_w:len(rest) - len(laid)]
        if relay:
            rank = jax.lax.axis_index("expert")
            brought = dict(zip(laid, rest[len(rest) - len(laid):], strict=True))
            weights = [_placed(w, brought[j] if j in brought else _brought(w, counts, rank),
                               counts, rank) for j, w in enumerate(weights)]
        rows_n = ids.shape[0]
        order = jnp.argsort(ids, stable=True)
        sorted_ids = ids[order]
        rows = tokens[order // k]
        row_slot = jnp.asarray(slot)[sorted_ids]
        dest = jnp.asarray(owner)[sorted_ids]
        per_dest = jax.ops.segment_sum(jnp.ones_like(dest), dest, ranks)
        first = jnp.cumsum(per_dest) - per_dest

        def compute(got, got_slot):  # the received rows' results, in received order
            by_slot = jnp.argsort(got_slot, stable=True)  # empty slots (per_rank) last
            sizes = jnp.bincount(got_slot, length=per_rank + 1)[:per_rank].astype(jnp.int32)
            y = _run_chain(jaxpr, region, chain, got[by_slot], sizes, weights, others)
            return jnp.zeros_like(y).at[by_slot].set(y)

        if ragged:
            done = _ragged_exchange(rows, row_slot, per_dest, first, per_rank, compute,
                                    emulated)
        else:
            block = rows_n if capacity_factor is None else \
                max(1, math.ceil(capacity_factor * rows_n / ranks))
            done = _padded_exchange(rows, row_slot, dest, first, ranks, block, per_rank,
                                    compute)
        return jnp.zeros_like(done).at[order].set(done)

    weight_spec = P("expert")

    def run(tokens, ids, *rest):
        weights = list(rest[:n_w]) if relay else [padded_weights(w, counts)
                                                   for w in rest[:n_w]]
        others, brought = list(rest[n_w:len(rest) - len(laid)]), rest[len(rest) - len(laid):]
        split = axes
        while split and tokens.shape[0] % int(np.prod([mesh.shape[a] for a in split])):
            split = split[:-1]  # (tensor and context ranks share tokens they cannot split)
        if split[:len(batch_axes(mesh))] != batch_axes(mesh):
            ways = int(np.prod([mesh.shape[a] for a in batch_axes(mesh)]))
            raise PlanNotExecutableError(
                f"expert parallelism splits the {tokens.shape[0]} tokens of a "
                f"mixture-of-experts layer over the stage's batch axes "
                f"{batch_axes(mesh)} ({ways} ways), which must divide them; use a "
                f"micro-batch whose tokens they divide")
        spec = P(split or None)
        specs = (spec, spec) + (weight_spec,) * n_w + (P(),) * len(others) + \
            (weight_spec,) * len(brought)
        args = [tokens, ids, *weights, *others, *brought]
        args = [laid_out(a, mesh, s) for a, s in zip(args, specs, strict=True)]
        return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=spec,
                             check_vma=False)(*args)

    return run


def _padded_exchange(rows, row_slot, dest, first, ranks: int, block: int, per_rank: int,
                     compute):
    """The exchange with one block of ``block`` rows per rank each way (rows past a
    block dropped: their result zero): ``rows`` (sorted by ``dest``, rank ``j``'s run
    starting at ``first[j]``) sent, ``compute`` run on what arrived, the results back in
    ``rows``' order."""
    pos = jnp.arange(rows.shape[0], dtype=jnp.int32) - first[dest]
    where = jnp.where(pos < block, dest * block + pos, ranks * block)
    send = jnp.zeros((ranks * block,) + rows.shape[1:], rows.dtype) \
        .at[where].set(rows, mode="drop")
    send_slot = jnp.full((ranks * block,), per_rank, jnp.int32) \
        .at[where].set(row_slot, mode="drop")
    got = jax.lax.all_to_all(send, "expert", 0, 0, tiled=True)
    got_slot = jax.lax.all_to_all(send_slot, "expert", 0, 0, tiled=True)
    mine = jax.lax.all_to_all(compute(got, got_slot), "expert", 0, 0, tiled=True)
    return jnp.take(mine, where, axis=0, mode="fill", fill_value=0)


def _ragged_exchange(rows, row_slot, per_dest, first, per_rank: int, compute,
                     emulated: bool):
    """The dropless exchange by ``jax.lax.ragged_all_to_all``: each rank is sent only
    the rows routed to it (rank ``j``'s run of ``rows``: ``first[j]``, ``per_dest[j]``
    rows), written after those of the ranks before the sender; ``compute`` runs on what
    arrived and the results go back the same way, into ``rows``' order. The receive
    buffer holds the worst case (every rank's rows to one rank). ``emulated``: the
    padded all-to-all stands in for the ragged one (XLA:CPU has none)."""
    exchange = _emulated_ragged if emulated else jax.lax.ragged_all_to_all
    ranks, rows_n = per_dest.shape[0], rows.shape[0]
    cap = ranks * rows_n
    recv = jax.lax.all_to_all(per_dest, "expert", 0, 0, tiled=True)  # from each rank
    recv_first = jnp.cumsum(recv) - recv
    # where this rank's run lands on each receiver, and where each receiver's results
    # land back here
    there = jax.lax.all_to_all(recv_first, "expert", 0, 0, tiled=True)
    back_at = jax.lax.all_to_all(first, "expert", 0, 0, tiled=True)
    got = exchange(rows, jnp.zeros((cap,) + rows.shape[1:], rows.dtype), first, per_dest,
                   there, recv, axis_name="expert")
    got_slot = exchange(row_slot, jnp.full((cap,), per_rank, jnp.int32), first, per_dest,
                        there, recv, axis_name="expert")
    y = compute(got, got_slot)
    return exchange(y, jnp.zeros((rows_n,) + y.shape[1:], y.dtype), recv_first, recv,
                    back_at, per_dest, axis_name="expert")


def _emulated_ragged(operand, output, input_offsets, send_sizes, output_offsets,
                     recv_sizes, *, axis_name):
    """``jax.lax.ragged_all_to_all``'s result (one slice per rank of ``axis_name``) by a
    padded ``all_to_all``: every slice sent in a block as long as ``operand``."""
    n = operand.shape[0]
    idx = jnp.arange(n, dtype=jnp.int32)
    take = jnp.clip(input_offsets[:, None] + idx[None, :], 0, n - 1)
    blocks = jnp.take(operand, take.reshape(-1), axis=0)
    got = jax.lax.all_to_all(blocks, axis_name, 0, 0, tiled=True)  # [ranks * n, ...]
    at = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    # (rows of a block past its slice are never written: recv_sizes are the send_sizes)
    keep = (idx[None, :] < recv_sizes[:, None]).reshape(-1)
    pos = jnp.where(keep, (at[:, None] + idx[None, :]).reshape(-1), output.shape[0])
    return output.at[pos].set(got, mode="drop")


def _run_chain(jaxpr, region, chain, rows, sizes, weights, others):
    """The region's expert equations evaluated on this device's received ``rows`` with
    the local group ``sizes`` and expert ``weights``: what the scatter would put back."""
    env = {region.rows: rows}
    env.update({s: sizes for s in region.sizes})
    env.update(zip(region.weights, weights, strict=True))
    env.update(zip(region.others, others, strict=True))
    _eval_rows(jaxpr, env, chain)
    return env[region.result]


def _eval_rows(jaxpr, env: dict, indices) -> None:
    """``jaxpr``'s equations ``indices`` evaluated on values whose leading (row) axis may
    differ from the traced one: calls are evaluated through their bodies, broadcasts keep
    the operand's row count."""
    def read(v):
        return v.val if isinstance(v, ext.Literal) else env[v]

    for i in indices:
        e = jaxpr.eqns[i]
        ins = [read(v) for v in e.invars]
        inner = inner_jaxpr(e)
        if inner is not None:
            body, consts = inner[0], inner[1] if len(inner) > 1 else ()
            sub = dict(zip(body.constvars, consts, strict=False))
            sub.update(zip(body.invars, ins, strict=True))
            _eval_rows(body, sub, range(len(body.eqns)))
            outs = [v.val if isinstance(v, ext.Literal) else sub[v] for v in body.outvars]
        else:
            params = dict(e.primitive.get_bind_params(e.params))
            if e.primitive.name == "broadcast_in_dim" and np.ndim(ins[0]) and \
                    tuple(params["broadcast_dimensions"])[:1] == (0,):
                params["shape"] = (np.shape(ins[0])[0],) + tuple(params["shape"][1:])
            with e.ctx.manager:
                outs = e.primitive.bind(*ins, **params)
            if not e.primitive.multiple_results:
                outs = [outs]
        for v, x in zip(e.outvars, outs, strict=True):
            if not isinstance(v, ext.Literal):
                env[v] = x
