"""Pallas flash attention (Dao et al. 2022; FlashAttention-2's loop order), forward and
backward, with grouped-query attention, segment ids and causal block skipping.

Masking works on explicit token positions: query i may see key j when ``kv_pos[j] >= 0``
(padding has position -1), ``q_pos[i] >= kv_pos[j]`` if causal, and their segment ids
match. The public entry point builds positions for the usual layout (ends aligned, as
the reference does); ring attention passes the global positions of its chunks, which
is how zigzag order and uneven per-device chunks get exact masks. A key block whose
keys are all padding, (causal) all after every query of the query block, or (segment
ids) all of segments outside the query block's range, is skipped, so padded or shorter
chunks and packed rows really cost less.

Lowering: interpret mode on CPU; on GPU, Pallas's Triton backend, chosen in
``_lowering`` only (JAX 0.10's default GPU lowering is Mosaic GPU, Hopper-only; Triton
also serves Ampere and Volta, and JAX deprecates that path from 0.11).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from hetshard.kernels.reference import MASK_VALUE, check_attention_args

_BIG = 2 ** 30


def _lowering(interpret: bool | None) -> dict:
    """The one place that picks how pallas_call lowers."""
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    if interpret:
        return {"interpret": True}
    from jax.experimental.pallas import triton as pltriton
    return {"compiler_params": pltriton.CompilerParams(num_warps=4, num_stages=2)}


def _block_mask(qpos, kpos, qseg, kseg, causal: bool, has_seg: bool):
    mask = kpos[None, :] >= 0
    if causal:
        mask = mask & (qpos[:, None] >= kpos[None, :])
    if has_seg:
        mask = mask & (qseg[:, None] == kseg[None, :])
    return mask


def _block_active(qpos, kpos, qseg, kseg, causal: bool, has_seg: bool):
    """False when the key block can be skipped for this query block: its keys are all
    padding, (causal) all after every query, or (segment ids) their segments' range
    misses the queries' (packed rows keep each segment's tokens together, so a key
    block of other documents is skipped and a row costs about the sum of its
    documents' squared lengths, not its own)."""
    valid = kpos >= 0
    active = jnp.max(kpos) >= 0
    if causal:
        active = active & (jnp.min(jnp.where(valid, kpos, _BIG)) <= jnp.max(qpos))
    if has_seg:
        q_valid = qpos >= 0
        active = active & (jnp.min(jnp.where(valid, kseg, _BIG))
                           <= jnp.max(jnp.where(q_valid, qseg, -_BIG)))
        active = active & (jnp.max(jnp.where(valid, kseg, -_BIG))
                           >= jnp.min(jnp.where(q_valid, qseg, _BIG)))
    return active


def _dot(a, b):
    """``a @ b`` in the operands' dtype, accumulated in float32: 16-bit operands run on
    the tensor cores (FlashAttention-2 multiplies its probabilities and score gradients
    in the inputs' dtype too); float32 operands are float32 products."""
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


def _fwd_kernel(q_ref, k_ref, v_ref, qpos_ref, kpos_ref, qseg_ref, kseg_ref, o_ref, lse_ref,
                *, scale, causal, has_seg, block_k, num_k_blocks):
    q = q_ref[...]
    qpos, qseg = qpos_ref[...], qseg_ref[...]
    bq, d = q.shape

    def body(j, carry):
        ks = pl.ds(j * block_k, block_k)
        kpos, kseg = kpos_ref[ks], kseg_ref[ks]

        def compute(carry):
            m, denom, acc = carry
            k, v = k_ref[ks, :], v_ref[ks, :]
            s = _dot(q, k.T) * scale
            mask = _block_mask(qpos, kpos, qseg, kseg, causal, has_seg)
            s = jnp.where(mask, s, MASK_VALUE)
            m_new = jnp.maximum(m, s.max(axis=1))
            p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
            alpha = jnp.exp(m - m_new)
            return (m_new, alpha * denom + p.sum(axis=1),
                    alpha[:, None] * acc + _dot(p.astype(v.dtype), v))

        return jax.lax.cond(_block_active(qpos, kpos, qseg, kseg, causal, has_seg),
                            compute, lambda c: c, carry)

    init = (jnp.full((bq,), MASK_VALUE, jnp.float32), jnp.zeros((bq,), jnp.float32),
            jnp.zeros((bq, d), jnp.float32))
    m, denom, acc = jax.lax.fori_loop(0, num_k_blocks, body, init)
    safe = jnp.where(denom > 0, denom, 1.0)
    o_ref[...] = jnp.where(denom[:, None] > 0, acc / safe[:, None], 0.0).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(denom > 0, m + jnp.log(safe), MASK_VALUE)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qpos_ref, kpos_ref, qseg_ref,
               kseg_ref, dq_ref, *, scale, causal, has_seg, block_k, num_k_blocks):
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    qpos, qseg = qpos_ref[...], qseg_ref[...]

    def body(j, dq):
        ks = pl.ds(j * block_k, block_k)
        kpos, kseg = kpos_ref[ks], kseg_ref[ks]

        def compute(dq):
            k, v = k_ref[ks, :], v_ref[ks, :]
            mask = _block_mask(qpos, kpos, qseg, kseg, causal, has_seg)
            p = jnp.where(mask, jnp.exp(_dot(q, k.T) * scale - lse[:, None]), 0.0)
            ds = p * (_dot(do, v.T) - delta[:, None])
            return dq + _dot(ds.astype(k.dtype), k) * scale

        return jax.lax.cond(_block_active(qpos, kpos, qseg, kseg, causal, has_seg),
                            compute, lambda x: x, dq)

    dq = jax.lax.fori_loop(0, num_k_blocks, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qpos_ref, kpos_ref, qseg_ref,
                kseg_ref, dk_ref, dv_ref, *, scale, causal, has_seg, block_q, num_q_blocks):
    k, v = k_ref[...], v_ref[...]
    kpos, kseg = kpos_ref[...], kseg_ref[...]

    def body(i, carry):
        qs = pl.ds(i * block_q, block_q)
        qpos, qseg = qpos_ref[qs], qseg_ref[qs]

        def compute(carry):
            dk, dv = carry
            q, do = q_ref[qs, :], do_ref[qs, :]
            lse, delta = lse_ref[qs], delta_ref[qs]
            mask = _block_mask(qpos, kpos, qseg, kseg, causal, has_seg)
            p = jnp.where(mask, jnp.exp(_dot(q, k.T) * scale - lse[:, None]), 0.0)
            ds = p * (_dot(do, v.T) - delta[:, None])
            return (dk + _dot(ds.T.astype(q.dtype), q) * scale,
                    dv + _dot(p.T.astype(do.dtype), do))

        return jax.lax.cond(_block_active(qpos, kpos, qseg, kseg, causal, has_seg),
                            compute, lambda c: c, carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = jax.lax.fori_loop(0, num_q_blocks, body, (zeros, zeros))
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


def _specs(bq, bk, sq, skv, d, group):
    qb = pl.BlockSpec((None, None, bq, d), lambda b, h, i: (b, h, i, 0))
    kv_full = pl.BlockSpec((None, None, skv, d), lambda b, h, i: (b, h // group, 0, 0))
    qvec = pl.BlockSpec((None, None, bq), lambda b, h, i: (b, h, i))
    posq = pl.BlockSpec((None, bq), lambda b, h, i: (b, i))
    posk = pl.BlockSpec((None, skv), lambda b, h, i: (b, 0))
    return qb, kv_full, qvec, posq, posk


class _Config(NamedTuple):
    """The static settings of one flash call (hashable: ``custom_vjp``'s
    non-differentiated argument)."""

    scale: float
    causal: bool
    has_seg: bool  # segment ids given (packed rows)
    block_q: int
    block_k: int
    interpret: bool
    poison: bool


def _forward(q, k, v, qpos, kpos, qseg, kseg, cfg: _Config):
    scale, causal, has_seg = cfg.scale, cfg.causal, cfg.has_seg
    bq, bk, interpret, poison = cfg.block_q, cfg.block_k, cfg.interpret, cfg.poison
    b, h, sq, d = q.shape
    skv, group = k.shape[2], h // k.shape[1]
    qb, kv_full, qvec, posq, posk = _specs(bq, bk, sq, skv, d, group)
    kernel = functools.partial(_fwd_kernel, scale=scale, causal=causal, has_seg=has_seg,
                               block_k=bk, num_k_blocks=skv // bk)
    return _pallas(kernel, grid=(b, h, sq // bq),
                   in_specs=[qb, kv_full, kv_full, posq, posk, posq, posk],
                   out_specs=[qb, qvec],
                   out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                              jax.ShapeDtypeStruct((b, h, sq), jnp.float32)],
                   name="hetshard_flash_fwd", lowering=_lowering(interpret), poison=poison,
                   args=(q, k, v, qpos, kpos, qseg, kseg))


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _flash(q, k, v, qpos, kpos, qseg, kseg, cfg):
    return _forward(q, k, v, qpos, kpos, qseg, kseg, cfg)


def _flash_fwd(q, k, v, qpos, kpos, qseg, kseg, cfg):
    o, lse = _forward(q, k, v, qpos, kpos, qseg, kseg, cfg)
    return (o, lse), (q, k, v, qpos, kpos, qseg, kseg, o, lse)


def _flash_bwd(cfg: _Config, res, cts):
    scale, causal, has_seg = cfg.scale, cfg.causal, cfg.has_seg
    bq, bk, interpret, poison = cfg.block_q, cfg.block_k, cfg.interpret, cfg.poison
    q, k, v, qpos, kpos, qseg, kseg, o, lse = res
    do, dlse = cts
    b, h, sq, d = q.shape
    kvh, skv = k.shape[1], k.shape[2]
    group = h // kvh
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)
    if dlse is not None:  # d(lse)/d(s) = p: folds into delta with the opposite sign
        delta = delta - dlse
    qb, kv_full, qvec, posq, posk = _specs(bq, bk, sq, skv, d, group)
    lw = _lowering(interpret)
    dq = _pallas(
        functools.partial(_dq_kernel, scale=scale, causal=causal, has_seg=has_seg,
                          block_k=bk, num_k_blocks=skv // bk),
        grid=(b, h, sq // bq),
        in_specs=[qb, kv_full, kv_full, qb, qvec, qvec, posq, posk, posq, posk],
        out_specs=qb, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        name="hetshard_flash_dq", lowering=lw, poison=poison,
        args=(q, k, v, do, lse, delta, qpos, kpos, qseg, kseg))
    kb = pl.BlockSpec((None, None, bk, d), lambda b_, h_, j: (b_, h_ // group, j, 0))
    kb_out = pl.BlockSpec((None, None, bk, d), lambda b_, h_, j: (b_, h_, j, 0))
    q_full = pl.BlockSpec((None, None, sq, d), lambda b_, h_, j: (b_, h_, 0, 0))
    qvec_full = pl.BlockSpec((None, None, sq), lambda b_, h_, j: (b_, h_, 0))
    posq_full = pl.BlockSpec((None, sq), lambda b_, h_, j: (b_, 0))
    posk_b = pl.BlockSpec((None, bk), lambda b_, h_, j: (b_, j))
    dk_h, dv_h = _pallas(
        functools.partial(_dkv_kernel, scale=scale, causal=causal, has_seg=has_seg,
                          block_q=bq, num_q_blocks=sq // bq),
        grid=(b, h, skv // bk),
        in_specs=[q_full, kb, kb, q_full, qvec_full, qvec_full, posq_full, posk_b,
                  posq_full, posk_b],
        out_specs=[kb_out, kb_out],
        out_shape=[jax.ShapeDtypeStruct((b, h, skv, d), jnp.float32)] * 2,
        name="hetshard_flash_dkv", lowering=lw, poison=poison,
        args=(q, k, v, do, lse, delta, qpos, kpos, qseg, kseg))
    # Query heads of one group share a kv head: their contributions add up.
    dk = dk_h.reshape(b, kvh, group, skv, d).sum(axis=2).astype(k.dtype)
    dv = dv_h.reshape(b, kvh, group, skv, d).sum(axis=2).astype(v.dtype)
    return dq, dk, dv, None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _pad(x, axis, to, value=0):
    n = x.shape[axis]
    if n == to:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, to - n)
    return jnp.pad(x, widths, constant_values=value)


def _default_block(n: int, interpret: bool) -> int:
    cap = 64 if interpret else 128
    return max(16, min(cap, 1 << max(0, math.ceil(math.log2(max(n, 1))))))


def _kernel_inputs(q, k, v, q_positions, kv_positions, segment_ids, kv_segment_ids,
                   causal, sm_scale, block_q, block_k, interpret, poison):
    """(cfg, padded [b, h, s, d] q, k, v, positions and segment ids, padded lengths)."""
    b, sq, h, d = q.shape
    skv = k.shape[1]
    use_interpret = jax.default_backend() == "cpu" if interpret is None else interpret
    bq = block_q or _default_block(sq, use_interpret)
    bk = block_k or _default_block(skv, use_interpret)
    sq_p, skv_p = -(-sq // bq) * bq, -(-skv // bk) * bk
    has_seg = segment_ids is not None
    qseg = segment_ids if has_seg else jnp.zeros((b, sq), jnp.int32)
    kseg = (kv_segment_ids if kv_segment_ids is not None else segment_ids) if has_seg \
        else jnp.zeros((b, skv), jnp.int32)
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    cfg = _Config(scale=scale, causal=bool(causal), has_seg=has_seg, block_q=bq,
                  block_k=bk, interpret=use_interpret, poison=bool(poison))
    arrays = (_pad(jnp.swapaxes(q, 1, 2), 2, sq_p), _pad(jnp.swapaxes(k, 1, 2), 2, skv_p),
              _pad(jnp.swapaxes(v, 1, 2), 2, skv_p),
              _pad(q_positions.astype(jnp.int32), 1, sq_p, -1),
              _pad(kv_positions.astype(jnp.int32), 1, skv_p, -1),
              _pad(qseg.astype(jnp.int32), 1, sq_p, -1),
              _pad(kseg.astype(jnp.int32), 1, skv_p, -2))
    return cfg, arrays, sq_p


def flash_attention_positions(q, k, v, q_positions, kv_positions, *, causal=False,
                              segment_ids=None, kv_segment_ids=None, sm_scale=None,
                              block_q=None, block_k=None, interpret=None,
                              poison_outputs: bool = False):
    """Flash attention with explicit token positions ([b, s] int32, -1 = padding key).

    Returns ``(out [b, sq, h, d], lse [b, h, sq] float32)``. ``segment_ids`` belong to the
    queries and ``kv_segment_ids`` (default: the same) to the keys. ``poison_outputs``
    (a testing aid) starts every kernel output as NaN, forward and backward, so an
    element a kernel fails to write shows up.
    """
    sq = q.shape[1]
    cfg, arrays, _ = _kernel_inputs(q, k, v, q_positions, kv_positions, segment_ids,
                                    kv_segment_ids, causal, sm_scale, block_q, block_k,
                                    interpret, poison_outputs)
    o, lse = _flash(*arrays, cfg)
    return jnp.swapaxes(o[:, :, :sq], 1, 2), lse[:, :, :sq]


def flash_attention_backward_positions(q, k, v, q_positions, kv_positions, out, lse, dout,
                                       *, causal=False, segment_ids=None,
                                       kv_segment_ids=None, sm_scale=None, block_q=None,
                                       block_k=None, interpret=None):
    """The flash kernel's backward for queries ``q`` against one key/value chunk, given
    the softmax statistics of the *whole* attention: ``out`` [b, sq, h, d] and ``lse``
    [b, h, sq] of the queries over every key (not only this chunk's). Returns ``(dq, dk,
    dv)``: this chunk's share of dq, and dk, dv of the chunk. A ring's backward sums the
    dq over its chunks (Liu et al. 2023). Arguments as :func:`flash_attention_positions`.
    """
    sq, skv = q.shape[1], k.shape[1]
    cfg, arrays, sq_p = _kernel_inputs(q, k, v, q_positions, kv_positions, segment_ids,
                                       kv_segment_ids, causal, sm_scale, block_q, block_k,
                                       interpret, False)
    ot = _pad(jnp.swapaxes(out, 1, 2), 2, sq_p)
    dot = _pad(jnp.swapaxes(dout, 1, 2), 2, sq_p)  # padded queries: no cotangent
    lse_p = _pad(lse.astype(jnp.float32), 2, sq_p)
    dq, dk, dv, *_ = _flash_bwd(cfg, (*arrays, ot, lse_p), (dot, None))
    return (jnp.swapaxes(dq[:, :, :sq], 1, 2), jnp.swapaxes(dk[:, :, :skv], 1, 2),
            jnp.swapaxes(dv[:, :, :skv], 1, 2))


def flash_attention(q, k, v, *, causal: bool = False, segment_ids=None, sm_scale=None,
                    block_q: int | None = None, block_k: int | None = None,
                    interpret: bool | None = None, return_lse: bool = False,
                    poison_outputs: bool = False):
    """Multi-head / grouped-query attention with the Pallas flash kernel.

    Args:
      q: [batch, seq_q, heads, head_dim]; k, v: [batch, seq_kv, kv_heads, head_dim],
        kv_heads dividing heads.
      causal: mask keys after each query (ends of q and kv aligned, as the reference).
      segment_ids: int32 [batch, seq] shared by q and kv (needs seq_q == seq_kv).
      sm_scale: logit scale (default 1/sqrt(head_dim)).
      block_q, block_k: tile sizes (default 64 interpreted, 128 on GPU); any sequence
        length works: the kernel pads internally.
      interpret: None means True on CPU and False on GPU.
      return_lse: also return the log-sum-exp [batch, heads, seq_q] (float32).
      poison_outputs: testing aid: kernel outputs start as NaN (forward and backward) so
        any element a kernel does not write is caught.

    Raises:
      SpecError: shapes, dtypes or segment ids that do not fit together.
    """
    check_attention_args(q, k, v, segment_ids, where="flash_attention")
    b, sq, _, _ = q.shape
    skv = k.shape[1]
    qpos = jnp.broadcast_to(jnp.arange(sq, dtype=jnp.int32) + (skv - sq), (b, sq))
    kpos = jnp.broadcast_to(jnp.arange(skv, dtype=jnp.int32), (b, skv))
    out, lse = flash_attention_positions(q, k, v, qpos, kpos, causal=causal,
                                         segment_ids=segment_ids, sm_scale=sm_scale,
                                         block_q=block_q, block_k=block_k,
                                         interpret=interpret, poison_outputs=poison_outputs)
    return (out, lse) if return_lse else out
