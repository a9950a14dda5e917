"""Pallas flash attention (Dao et al. 2022; FlashAttention-2's loop order), forward and
backward, with grouped-query attention, segment ids and block ranges.

Masking works on explicit token positions: query i may see key j when ``kv_pos[j] >= 0``
(padding has position -1), ``q_pos[i] >= kv_pos[j]`` if causal, and their segment ids
match. The public entry point builds positions for the usual layout (ends aligned, as
the reference does); ring attention passes the global positions of its chunks, which
is how zigzag order and uneven per-device chunks get exact masks.

Which blocks a kernel computes is decided before it runs (:func:`block_ranges`): for
each query block, the range of key blocks that may hold a visible key (those whose keys
are all padding, all after every query when causal, or all of other segments than the
query block's are outside it when they lie at its ends), and inside that range the
blocks every key of which every query sees, computed without a mask. The kernels loop
over those ranges (loops with bounds, no branch in the body, so Triton pipelines their
loads, as JAX's own Pallas attention does for its causal bound); the dK/dV kernel loops
over the ranges of query blocks each key block needs. A causal row computes about half
its blocks, a packed row about the sum of its documents' squared lengths, a shorter or
padded chunk its own share; masks cost only on the blocks at a range's edges.

Lowering: interpret mode on CPU; on GPU, Pallas's Triton backend, chosen in
``_lowering`` only (JAX 0.10's default GPU lowering is Mosaic GPU, Hopper-only; Triton
also serves Ampere and Volta). Tile sizes, warps and pipeline stages per pass are a
:class:`FlashTuning`: ``TUNED`` holds those measured best per GPU type
(``experiments/gpu_bench.py --tune``), else JAX's Pallas attention defaults.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from hetshard.errors import SpecError
from hetshard.kernels.reference import MASK_VALUE, check_attention_args

_BIG = 2 ** 30


class FlashTuning(NamedTuple):
    """Tiles and Triton settings of the flash kernels on a GPU: the forward's query and
    key blocks; the backward's (the dQ kernel's own query block and the key blocks it
    loops over; the dK/dV kernel's own key block and the query blocks it loops over);
    warps and software-pipeline stages per pass. Blocks are powers of two."""

    block_q: int = 128
    block_k: int = 128
    warps: int = 8
    stages: int = 2
    block_q_bwd: int = 128
    block_k_bwd: int = 128
    warps_bwd: int = 8
    stages_bwd: int = 2
    # The full blocks run without a mask (a loop of their own); False: one masked loop
    # over each range (interpreted, where masks cost little and each loop body compiles).
    unmasked_full: bool = True

    def describe(self) -> str:
        return (f"fwd {self.block_q}x{self.block_k} w{self.warps} s{self.stages}, "
                f"bwd {self.block_q_bwd}x{self.block_k_bwd} w{self.warps_bwd} "
                f"s{self.stages_bwd}" + ("" if self.unmasked_full else ", masked"))


# Measured best per GPU type (``device_kind`` substring, head dim): filled from
# ``experiments/gpu_bench.py --tune`` runs (experiments/results/flash_tuning.json), with
# the GPU and JAX version they were measured on. None yet: every GPU takes the default.
TUNED: dict[tuple[str, int], FlashTuning] = {}


def default_tuning(head_dim: int) -> FlashTuning:
    """JAX's own Pallas (Triton) attention defaults (jax.experimental.pallas.ops.gpu
    .attention: 128 x 128 tiles, 8 warps above head dim 64 and 4 at or below, 2
    stages), for both passes."""
    warps = 8 if head_dim > 64 else 4
    return FlashTuning(warps=warps, warps_bwd=warps)


def tuning_for(device_kind: str, head_dim: int) -> FlashTuning:
    """The tuning a GPU of ``device_kind`` runs at ``head_dim``: :data:`TUNED`'s entry
    whose name is in the kind, else :func:`default_tuning`."""
    for (name, dim), tuned in TUNED.items():
        if name in device_kind and dim == head_dim:
            return tuned
    return default_tuning(head_dim)


def _lowering(interpret: bool | None, warps: int = 4, stages: int = 2) -> dict:
    """The one place that picks how pallas_call lowers."""
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    if interpret:
        return {"interpret": True}
    from jax.experimental.pallas import triton as pltriton
    return {"compiler_params": pltriton.CompilerParams(num_warps=warps, num_stages=stages)}


def _block_mask(qpos, kpos, qseg, kseg, causal: bool, has_seg: bool,
                keys_first: bool = False):
    """[queries, keys] (``keys_first``: [keys, queries]) bool: which pairs are seen."""
    def per_query(x):  # a query-side vector along the queries' axis
        return x[None, :] if keys_first else x[:, None]

    def per_key(x):
        return x[:, None] if keys_first else x[None, :]
    mask = per_key(kpos) >= 0
    if causal:
        mask = mask & (per_query(qpos) >= per_key(kpos))
    if has_seg:
        mask = mask & (per_query(qseg) == per_key(kseg))
    return mask


def _blocks(x, block: int):
    """[b, n] -> [b, n // block, block]."""
    return x.reshape(x.shape[0], -1, block)


def block_flags(qpos, kpos, qseg, kseg, block_q: int, block_k: int, causal: bool,
                has_seg: bool):
    """``(active, full)``, bool [b, query blocks, key blocks]: whether a key block may
    hold a key a query of the block sees (not when its keys are all padding, all after
    every query if causal, or (segment ids) of segments outside the query block's
    range: packed rows keep a document's tokens together), and whether every query of
    the block sees every key of it (no mask needed). Lengths are multiples of the
    blocks."""
    qp, kp = _blocks(qpos, block_q), _blocks(kpos, block_k)
    qs, ks = _blocks(qseg, block_q), _blocks(kseg, block_k)
    k_valid, q_valid = kp >= 0, qp >= 0
    k_any, k_all = k_valid.any(-1), k_valid.all(-1)
    active = jnp.broadcast_to(k_any[:, None, :], (qp.shape[0], qp.shape[1], kp.shape[1]))
    full = jnp.broadcast_to(k_all[:, None, :], active.shape)
    if causal:
        k_first = jnp.min(jnp.where(k_valid, kp, _BIG), -1)
        active = active & (k_first[:, None, :] <= jnp.max(qp, -1)[:, :, None])
        full = full & (jnp.max(kp, -1)[:, None, :] <= jnp.min(qp, -1)[:, :, None])
    if has_seg:
        q_lo = jnp.min(jnp.where(q_valid, qs, _BIG), -1)[:, :, None]
        q_hi = jnp.max(jnp.where(q_valid, qs, -_BIG), -1)[:, :, None]
        k_lo = jnp.min(jnp.where(k_valid, ks, _BIG), -1)[:, None, :]
        k_hi = jnp.max(jnp.where(k_valid, ks, -_BIG), -1)[:, None, :]
        active = active & (k_lo <= q_hi) & (k_hi >= q_lo)
        q_one = (jnp.min(qs, -1) == jnp.max(qs, -1))[:, :, None]
        k_one = (jnp.min(ks, -1) == jnp.max(ks, -1))[:, None, :]
        full = full & q_one & k_one & (qs[:, :, :1] == jnp.swapaxes(ks[:, :, :1], 1, 2))
    return active, full


def block_ranges(active, full):
    """int32 [b, rows, 4] from flags [b, rows, cols]: per row block ``(lo, full_lo,
    full_hi, hi)``. Its kernel computes the column blocks ``lo <= j < hi`` (every active
    one, and any inactive one between them, whose mask leaves the sums unchanged), those
    in ``[full_lo, full_hi)`` without a mask; that middle range is the full blocks when
    they are one run, else empty."""
    cols = active.shape[-1]

    def ends(flags):
        first = jnp.argmax(flags, -1)
        return first, cols - jnp.argmax(flags[..., ::-1], -1)

    lo, hi = ends(active)
    some = active.any(-1)
    lo, hi = jnp.where(some, lo, 0), jnp.where(some, hi, 0)
    flo, fhi = ends(full)
    one_run = full.any(-1) & (full.sum(-1) == fhi - flo)
    flo, fhi = jnp.where(one_run, flo, lo), jnp.where(one_run, fhi, lo)
    return jnp.stack([lo, flo, fhi, hi], -1).astype(jnp.int32)


def _over_ranges(ranges_ref, body, carry, unmasked_full: bool):
    """``body(j, carry, masked)`` over the row block's column blocks: masked, unmasked
    (the full run), masked; or (not ``unmasked_full``) all masked. Loops with bounds: no
    branch in a loop body."""
    lo, flo, fhi, hi = ranges_ref[0], ranges_ref[1], ranges_ref[2], ranges_ref[3]
    if not unmasked_full:
        return jax.lax.fori_loop(lo, hi, functools.partial(body, masked=True), carry)
    carry = jax.lax.fori_loop(lo, flo, functools.partial(body, masked=True), carry)
    carry = jax.lax.fori_loop(flo, fhi, functools.partial(body, masked=False), carry)
    return jax.lax.fori_loop(fhi, hi, functools.partial(body, masked=True), carry)


def _dot(a, b):
    """``a @ b`` in the operands' dtype, accumulated in float32: 16-bit operands run on
    the tensor cores (FlashAttention-2 multiplies its probabilities and score gradients
    in the inputs' dtype too); float32 operands are float32 products."""
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


# The kernels exponentiate in base 2 (e^x = 2^(x log2 e)): the logit scale carries log2 e,
# so a score costs one multiply-add before the exponent (FlashAttention-2's kernels and
# JAX's own Pallas attention do the same). Log-sum-exps leave the kernels in base e.
_LOG2E = math.log2(math.e)


def _fwd_kernel(q_ref, k_ref, v_ref, qpos_ref, kpos_ref, qseg_ref, kseg_ref, ranges_ref,
                o_ref, lse_ref, *, scale, causal, has_seg, block_k, unmasked_full):
    q = q_ref[...]
    qpos, qseg = qpos_ref[...], qseg_ref[...]
    bq, d = q.shape
    scale2 = scale * _LOG2E

    def body(j, carry, masked):
        m, denom, acc = carry  # (m in base 2)
        ks = pl.ds(j * block_k, block_k)
        k, v = k_ref[ks, :], v_ref[ks, :]
        s = _dot(q, k.T) * scale2
        if masked:
            mask = _block_mask(qpos, kpos_ref[ks], qseg, kseg_ref[ks], causal, has_seg)
            s = jnp.where(mask, s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=1))
        p = jnp.exp2(s - m_new[:, None])
        if masked:
            p = jnp.where(mask, p, 0.0)
        alpha = jnp.exp2(m - m_new)
        return (m_new, alpha * denom + p.sum(axis=1),
                alpha[:, None] * acc + _dot(p.astype(v.dtype), v))

    init = (jnp.full((bq,), MASK_VALUE, jnp.float32), jnp.zeros((bq,), jnp.float32),
            jnp.zeros((bq, d), jnp.float32))
    m, denom, acc = _over_ranges(ranges_ref, body, init, unmasked_full)
    safe = jnp.where(denom > 0, denom, 1.0)
    o_ref[...] = jnp.where(denom[:, None] > 0, acc / safe[:, None], 0.0).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(denom > 0, (m + jnp.log2(safe)) / _LOG2E, MASK_VALUE)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qpos_ref, kpos_ref, qseg_ref,
               kseg_ref, ranges_ref, dq_ref, *, scale, causal, has_seg, block_k,
               unmasked_full):
    q, do = q_ref[...], do_ref[...]
    lse2, delta = lse_ref[...], delta_ref[...]  # (the log-sum-exp in base 2)
    qpos, qseg = qpos_ref[...], qseg_ref[...]
    scale2 = scale * _LOG2E

    def body(j, dq, masked):
        ks = pl.ds(j * block_k, block_k)
        k, v = k_ref[ks, :], v_ref[ks, :]
        p = jnp.exp2(_dot(q, k.T) * scale2 - lse2[:, None])
        if masked:
            p = jnp.where(_block_mask(qpos, kpos_ref[ks], qseg, kseg_ref[ks], causal,
                                      has_seg), p, 0.0)
        ds = p * (_dot(do, v.T) - delta[:, None])
        return dq + _dot(ds.astype(k.dtype), k) * scale

    dq = _over_ranges(ranges_ref, body, jnp.zeros(q.shape, jnp.float32), unmasked_full)
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qpos_ref, kpos_ref, qseg_ref,
                kseg_ref, ranges_ref, dk_ref, dv_ref, *, scale, causal, has_seg, block_q,
                unmasked_full):
    k, v = k_ref[...], v_ref[...]
    kpos, kseg = kpos_ref[...], kseg_ref[...]
    scale2 = scale * _LOG2E

    def body(i, carry, masked):
        # In [keys, queries] (the probabilities' transpose, as FlashAttention-2's
        # Triton kernel computes them): no transpose of a computed tile.
        dk, dv = carry
        qs = pl.ds(i * block_q, block_q)
        q, do = q_ref[qs, :], do_ref[qs, :]
        lse2, delta = lse_ref[qs], delta_ref[qs]
        p_t = jnp.exp2(_dot(k, q.T) * scale2 - lse2[None, :])
        if masked:
            p_t = jnp.where(_block_mask(qpos_ref[qs], kpos, qseg_ref[qs], kseg, causal,
                                        has_seg, keys_first=True), p_t, 0.0)
        ds_t = p_t * (_dot(v, do.T) - delta[None, :])
        return (dk + _dot(ds_t.astype(q.dtype), q) * scale,
                dv + _dot(p_t.astype(do.dtype), do))

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = _over_ranges(ranges_ref, body, (zeros, zeros), unmasked_full)
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _pallas(kernel, *, grid, in_specs, out_specs, out_shape, name, lowering, poison, args):
    """``pl.pallas_call`` of ``kernel``; with ``poison`` every output starts as a NaN buffer
    aliased to it, so an element the kernel does not write stays NaN (tests use this)."""
    multi = isinstance(out_shape, (list, tuple))
    shapes = list(out_shape) if multi else [out_shape]
    specs = list(out_specs) if multi else [out_specs]
    if poison:
        n_in = len(args)
        inner = kernel

        def kernel(*refs):  # drop the aliased poison inputs; outputs follow them
            return inner(*refs[:n_in], *refs[n_in + len(shapes):])

        args = (*args, *[jnp.full(x.shape, jnp.nan, x.dtype) for x in shapes])
        in_specs = [*in_specs, *specs]
        lowering = {**lowering,
                    "input_output_aliases": {n_in + i: i for i in range(len(shapes))}}
    return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs,
                          out_shape=out_shape, name=name, **lowering)(*args)


def _row_specs(block: int, other: int, d: int, group: int, rows_are_q: bool,
               n_rows: int):
    """BlockSpecs over grid (b, h, row block): the row side's block, the other side's
    whole sequence, per-row-block vectors and positions, the row block's ranges. Query
    rows go last block first: a causal row's last query blocks have the most key blocks,
    and blocks launched first finish before the short ones fill in behind them (longest
    first; key rows are already in that order)."""
    def head(h):  # a q head's kv head when the spec's side is kv
        return h // group

    def row(i):
        return n_rows - 1 - i if rows_are_q else i
    if rows_are_q:
        rows = pl.BlockSpec((None, None, block, d), lambda b, h, i: (b, h, row(i), 0))
        whole = pl.BlockSpec((None, None, other, d), lambda b, h, i: (b, head(h), 0, 0))
    else:
        rows = pl.BlockSpec((None, None, block, d), lambda b, h, i: (b, head(h), i, 0))
        whole = pl.BlockSpec((None, None, other, d), lambda b, h, i: (b, h, 0, 0))
    return dict(
        rows=rows, whole=whole,
        row_vec=pl.BlockSpec((None, None, block), lambda b, h, i: (b, h, row(i))),
        whole_vec=pl.BlockSpec((None, None, other), lambda b, h, i: (b, h, 0)),
        row_pos=pl.BlockSpec((None, block), lambda b, h, i: (b, row(i))),
        whole_pos=pl.BlockSpec((None, other), lambda b, h, i: (b, 0)),
        ranges=pl.BlockSpec((None, None, 4), lambda b, h, i: (b, row(i), 0)))


class _Config(NamedTuple):
    """The static settings of one flash call (hashable: ``custom_vjp``'s
    non-differentiated argument)."""

    scale: float
    causal: bool
    has_seg: bool  # segment ids given (packed rows)
    tuning: FlashTuning
    interpret: bool
    poison: bool


@functools.partial(jax.jit, static_argnums=(4, 5, 6, 7))  # (one program when eager)
def _ranges(qpos, kpos, qseg, kseg, block_q: int, block_k: int, causal: bool,
            has_seg: bool):
    """(per query block over key blocks, per key block over query blocks)."""
    active, full = block_flags(qpos, kpos, qseg, kseg, block_q, block_k, causal, has_seg)
    return (block_ranges(active, full),
            block_ranges(jnp.swapaxes(active, 1, 2), jnp.swapaxes(full, 1, 2)))


def _forward(q, k, v, qpos, kpos, qseg, kseg, cfg: _Config):
    t = cfg.tuning
    bq, bk = t.block_q, t.block_k
    b, h, sq, d = q.shape
    skv, group = k.shape[2], h // k.shape[1]
    sp = _row_specs(bq, skv, d, group, rows_are_q=True, n_rows=sq // bq)
    ranges, _ = _ranges(qpos, kpos, qseg, kseg, bq, bk, cfg.causal, cfg.has_seg)
    kernel = functools.partial(_fwd_kernel, scale=cfg.scale, causal=cfg.causal,
                               has_seg=cfg.has_seg, block_k=bk,
                               unmasked_full=t.unmasked_full)
    return _pallas(kernel, grid=(b, h, sq // bq),
                   in_specs=[sp["rows"], sp["whole"], sp["whole"], sp["row_pos"],
                             sp["whole_pos"], sp["row_pos"], sp["whole_pos"], sp["ranges"]],
                   out_specs=[sp["rows"], sp["row_vec"]],
                   out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                              jax.ShapeDtypeStruct((b, h, sq), jnp.float32)],
                   name="hetshard_flash_fwd",
                   lowering=_lowering(cfg.interpret, t.warps, t.stages), poison=cfg.poison,
                   args=(q, k, v, qpos, kpos, qseg, kseg, ranges))


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _flash(q, k, v, qpos, kpos, qseg, kseg, cfg):
    return _forward(q, k, v, qpos, kpos, qseg, kseg, cfg)


def _flash_fwd(q, k, v, qpos, kpos, qseg, kseg, cfg):
    o, lse = _forward(q, k, v, qpos, kpos, qseg, kseg, cfg)
    return (o, lse), (q, k, v, qpos, kpos, qseg, kseg, o, lse)


def _flash_bwd(cfg: _Config, res, cts):
    t = cfg.tuning
    bq, bk = t.block_q_bwd, t.block_k_bwd
    q, k, v, qpos, kpos, qseg, kseg, o, lse = res
    do, dlse = cts
    b, h, sq, d = q.shape
    kvh, skv = k.shape[1], k.shape[2]
    group = h // kvh
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)
    if dlse is not None:  # d(lse)/d(s) = p: folds into delta with the opposite sign
        delta = delta - dlse
    q_ranges, k_ranges = _ranges(qpos, kpos, qseg, kseg, bq, bk, cfg.causal,
                                 cfg.has_seg)
    lse2 = lse * _LOG2E  # (the kernels' base)
    lw = _lowering(cfg.interpret, t.warps_bwd, t.stages_bwd)
    static = dict(scale=cfg.scale, causal=cfg.causal, has_seg=cfg.has_seg,
                  unmasked_full=t.unmasked_full)
    sp = _row_specs(bq, skv, d, group, rows_are_q=True, n_rows=sq // bq)
    dq = _pallas(
        functools.partial(_dq_kernel, block_k=bk, **static),
        grid=(b, h, sq // bq),
        in_specs=[sp["rows"], sp["whole"], sp["whole"], sp["rows"], sp["row_vec"],
                  sp["row_vec"], sp["row_pos"], sp["whole_pos"], sp["row_pos"],
                  sp["whole_pos"], sp["ranges"]],
        out_specs=sp["rows"], out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        name="hetshard_flash_dq", lowering=lw, poison=cfg.poison,
        args=(q, k, v, do, lse2, delta, qpos, kpos, qseg, kseg, q_ranges))
    sp = _row_specs(bk, sq, d, group, rows_are_q=False, n_rows=skv // bk)
    # Per query head; with grouped queries the heads of a group add up below (in
    # float32), without groups each head's dK/dV is written in the inputs' dtype.
    kv_dtype = jnp.float32 if group > 1 else k.dtype
    kb_out = pl.BlockSpec((None, None, bk, d), lambda b_, h_, j: (b_, h_, j, 0))
    dk_h, dv_h = _pallas(
        functools.partial(_dkv_kernel, block_q=bq, **static),
        grid=(b, h, skv // bk),
        in_specs=[sp["whole"], sp["rows"], sp["rows"], sp["whole"], sp["whole_vec"],
                  sp["whole_vec"], sp["whole_pos"], sp["row_pos"], sp["whole_pos"],
                  sp["row_pos"], sp["ranges"]],
        out_specs=[kb_out, kb_out],
        out_shape=[jax.ShapeDtypeStruct((b, h, skv, d), kv_dtype)] * 2,
        name="hetshard_flash_dkv", lowering=lw, poison=cfg.poison,
        args=(q, k, v, do, lse2, delta, qpos, kpos, qseg, kseg, k_ranges))
    if group > 1:  # query heads of one group share a kv head: their contributions add
        dk_h = dk_h.reshape(b, kvh, group, skv, d).sum(axis=2)
        dv_h = dv_h.reshape(b, kvh, group, skv, d).sum(axis=2)
    return dq, dk_h.astype(k.dtype), dv_h.astype(v.dtype), None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _pad(x, axis, to, value=0):
    n = x.shape[axis]
    if n == to:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, to - n)
    return jnp.pad(x, widths, constant_values=value)


def _interpret_block(n: int) -> int:
    return max(16, min(64, 1 << max(0, math.ceil(math.log2(max(n, 1))))))


def _tuning(sq, skv, d, block_q, block_k, interpret, tuning) -> FlashTuning:
    """The call's tiles: ``tuning`` if given, else (interpreted) 64 at most, shrunk to
    short sequences, one masked loop a range, else the GPU's (:func:`tuning_for`);
    ``block_q`` / ``block_k`` override both passes' blocks."""
    if tuning is not None:
        check_tuning(tuning)
    else:
        if interpret:
            bq, bk = _interpret_block(sq), _interpret_block(skv)
            tuning = FlashTuning(bq, bk, 4, 2, bq, bk, 4, 2, unmasked_full=False)
        else:
            tuning = tuning_for(jax.devices()[0].device_kind, d)
    if block_q:
        tuning = tuning._replace(block_q=int(block_q), block_q_bwd=int(block_q))
    if block_k:
        tuning = tuning._replace(block_k=int(block_k), block_k_bwd=int(block_k))
    return tuning


def _head_dim(d: int, interpret: bool) -> int:
    """The head dim the kernels run at: Triton's tiles are powers of two, at least 16
    wide for a product, so a head dim of 80 or 96 runs at 128 and one of 8 at 16 (zero
    columns: the scores are the same, the output's extra columns zero and cut off);
    interpreted, only a head dim that is no power of two is padded (so the path is
    tested on CPU)."""
    up = 1 << max(0, math.ceil(math.log2(max(d, 1))))
    return up if interpret else max(16, up)


def check_tuning(tuning) -> None:
    """A :class:`FlashTuning` Triton can lower, else a SpecError naming the field."""
    if not isinstance(tuning, FlashTuning):
        raise SpecError("tuning", tuning, "a hetshard.kernels.FlashTuning")
    for name in ("block_q", "block_k", "block_q_bwd", "block_k_bwd"):
        x = getattr(tuning, name)
        if not isinstance(x, int) or x < 16 or x & (x - 1):
            raise SpecError(f"tuning.{name}", x, "a power of two from 16")
    for name in ("warps", "warps_bwd"):
        x = getattr(tuning, name)
        if x not in (1, 2, 4, 8, 16):
            raise SpecError(f"tuning.{name}", x, "1, 2, 4, 8 or 16")
    for name in ("stages", "stages_bwd"):
        x = getattr(tuning, name)
        if not isinstance(x, int) or x < 1:
            raise SpecError(f"tuning.{name}", x, "an integer from 1")


def _kernel_inputs(q, k, v, q_positions, kv_positions, segment_ids, kv_segment_ids,
                   causal, sm_scale, block_q, block_k, interpret, poison, tuning=None):
    """(cfg, padded [b, h, s, d] q, k, v, positions and segment ids, padded lengths)."""
    b, sq, h, d = q.shape
    skv = k.shape[1]
    use_interpret = jax.default_backend() == "cpu" if interpret is None else interpret
    t = _tuning(sq, skv, d, block_q, block_k, use_interpret, tuning)
    q_mult, k_mult = math.lcm(t.block_q, t.block_q_bwd), math.lcm(t.block_k, t.block_k_bwd)
    sq_p, skv_p = -(-sq // q_mult) * q_mult, -(-skv // k_mult) * k_mult
    has_seg = segment_ids is not None
    qseg = segment_ids if has_seg else jnp.zeros((b, sq), jnp.int32)
    kseg = (kv_segment_ids if kv_segment_ids is not None else segment_ids) if has_seg \
        else jnp.zeros((b, skv), jnp.int32)
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    cfg = _Config(scale=scale, causal=bool(causal), has_seg=has_seg, tuning=t,
                  interpret=use_interpret, poison=bool(poison))
    d_p = _head_dim(d, use_interpret)
    arrays = (_pad(_pad(jnp.swapaxes(q, 1, 2), 2, sq_p), 3, d_p),
              _pad(_pad(jnp.swapaxes(k, 1, 2), 2, skv_p), 3, d_p),
              _pad(_pad(jnp.swapaxes(v, 1, 2), 2, skv_p), 3, d_p),
              _pad(q_positions.astype(jnp.int32), 1, sq_p, -1),
              _pad(kv_positions.astype(jnp.int32), 1, skv_p, -1),
              _pad(qseg.astype(jnp.int32), 1, sq_p, -1),
              _pad(kseg.astype(jnp.int32), 1, skv_p, -2))
    return cfg, arrays, sq_p


def flash_attention_positions(q, k, v, q_positions, kv_positions, *, causal=False,
                              segment_ids=None, kv_segment_ids=None, sm_scale=None,
                              block_q=None, block_k=None, interpret=None,
                              poison_outputs: bool = False,
                              tuning: FlashTuning | None = None):
    """Flash attention with explicit token positions ([b, s] int32, -1 = padding key).

    Returns ``(out [b, sq, h, d], lse [b, h, sq] float32)``. ``segment_ids`` belong to the
    queries and ``kv_segment_ids`` (default: the same) to the keys. ``poison_outputs``
    (a testing aid) starts every kernel output as NaN, forward and backward, so an
    element a kernel fails to write shows up.
    """
    sq = q.shape[1]
    cfg, arrays, _ = _kernel_inputs(q, k, v, q_positions, kv_positions, segment_ids,
                                    kv_segment_ids, causal, sm_scale, block_q, block_k,
                                    interpret, poison_outputs, tuning)
    o, lse = _flash(*arrays, cfg)
    return jnp.swapaxes(o[:, :, :sq, :q.shape[3]], 1, 2), lse[:, :, :sq]


def flash_attention_backward_positions(q, k, v, q_positions, kv_positions, out, lse, dout,
                                       *, causal=False, segment_ids=None,
                                       kv_segment_ids=None, sm_scale=None, block_q=None,
                                       block_k=None, interpret=None,
                                       tuning: FlashTuning | None = None):
    """The flash kernel's backward for queries ``q`` against one key/value chunk, given
    the softmax statistics of the *whole* attention: ``out`` [b, sq, h, d] and ``lse``
    [b, h, sq] of the queries over every key (not only this chunk's). Returns ``(dq, dk,
    dv)``: this chunk's share of dq, and dk, dv of the chunk. A ring's backward sums the
    dq over its chunks (Liu et al. 2023). Arguments as :func:`flash_attention_positions`.
    """
    sq, skv, d = q.shape[1], k.shape[1], q.shape[3]
    cfg, arrays, sq_p = _kernel_inputs(q, k, v, q_positions, kv_positions, segment_ids,
                                       kv_segment_ids, causal, sm_scale, block_q, block_k,
                                       interpret, False, tuning)
    d_p = arrays[0].shape[3]
    ot = _pad(_pad(jnp.swapaxes(out, 1, 2), 2, sq_p), 3, d_p)
    dot = _pad(_pad(jnp.swapaxes(dout, 1, 2), 2, sq_p), 3, d_p)  # padded: no cotangent
    lse_p = _pad(lse.astype(jnp.float32), 2, sq_p)
    dq, dk, dv, *_ = _flash_bwd(cfg, (*arrays, ot, lse_p), (dot, None))
    return (jnp.swapaxes(dq[:, :, :sq, :d], 1, 2), jnp.swapaxes(dk[:, :, :skv, :d], 1, 2),
            jnp.swapaxes(dv[:, :, :skv, :d], 1, 2))


def flash_attention(q, k, v, *, causal: bool = False, segment_ids=None, sm_scale=None,
                    block_q: int | None = None, block_k: int | None = None,
                    interpret: bool | None = None, return_lse: bool = False,
                    poison_outputs: bool = False, tuning: FlashTuning | None = None):
    """Multi-head / grouped-query attention with the Pallas flash kernel.

    Args:
      q: [batch, seq_q, heads, head_dim]; k, v: [batch, seq_kv, kv_heads, head_dim],
        kv_heads dividing heads.
      causal: mask keys after each query (ends of q and kv aligned, as the reference).
      segment_ids: int32 [batch, seq] shared by q and kv (needs seq_q == seq_kv).
      sm_scale: logit scale (default 1/sqrt(head_dim)).
      block_q, block_k: tile sizes of both passes (default: at most 64 interpreted, the
        GPU's :func:`tuning_for` on GPU); any sequence length works: the kernel pads
        internally.
      tuning: a :class:`FlashTuning` (tiles, warps and stages per pass) instead of the
        GPU's; ``block_q`` / ``block_k`` still override its blocks.
      interpret: None means True on CPU and False on GPU.
      return_lse: also return the log-sum-exp [batch, heads, seq_q] (float32).
      poison_outputs: testing aid: kernel outputs start as NaN (forward and backward) so
        any element a kernel does not write is caught.

    Raises:
      SpecError: shapes, dtypes or segment ids that do not fit together, or a tuning
        whose blocks are not powers of two from 16, warps not 1-16 a power of two, or
        stages below 1.
    """
    check_attention_args(q, k, v, segment_ids, where="flash_attention")
    b, sq, _, _ = q.shape
    skv = k.shape[1]
    qpos = jnp.broadcast_to(jnp.arange(sq, dtype=jnp.int32) + (skv - sq), (b, sq))
    kpos = jnp.broadcast_to(jnp.arange(skv, dtype=jnp.int32), (b, skv))
    out, lse = flash_attention_positions(q, k, v, qpos, kpos, causal=causal,
                                         segment_ids=segment_ids, sm_scale=sm_scale,
                                         block_q=block_q, block_k=block_k,
                                         interpret=interpret, poison_outputs=poison_outputs,
                                         tuning=tuning)
    return (out, lse) if return_lse else out
