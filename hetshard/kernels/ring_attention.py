"""Context parallelism: ring attention over a mesh axis, with zigzag order and uneven
chunks (Liu et al. 2023, "Ring Attention"; zigzag/dual-chunk load balancing as in
Megatron-LM's context parallelism; uneven per-device chunks as in HexiSeq).

Each device holds a chunk of the sequence. For ``n`` steps it attends its queries to
the key/value chunk it currently holds (the flash kernel, masked by the tokens' global
positions), merges the partial result with the log-sum-exp, and passes the key/value
chunk to the next device with ``lax.ppermute``. The backward (a ``custom_vjp``) runs
the ring again rather than keeping each step's chunk: the key/value chunks travel with
their dK/dV accumulators, and each step is the kernel's backward against the whole
attention's log-sum-exp, so a device holds O(1) chunks in either direction. Chunks
shorter than the longest are padded with position -1, which the kernel skips block by
block, so a device given less of the sequence does less work.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from hetshard.errors import SpecError
from hetshard.kernels.flash_attention import (
    flash_attention_backward_positions,
    flash_attention_positions,
)
from hetshard.kernels.reference import MASK_VALUE, check_attention_args
from hetshard.meshes import gathered, is_explicit, laid_out


def ring_attention(q, k, v, *, axis_name: str, axis_size: int, causal: bool,
                   q_positions, kv_positions, segment_ids=None, kv_segment_ids=None,
                   sm_scale=None, block_q=None, block_k=None, interpret=None):
    """Per-device body, inside ``jax.shard_map`` over ``axis_name`` (of ``axis_size``).

    q, k, v: this device's chunks [batch, chunk, heads | kv_heads, head_dim];
    q_positions, kv_positions: global token positions of the chunk ([batch, chunk] int32,
    -1 for padding); segment ids likewise. Returns this device's output chunk.

    Differentiable with a ring of its own (``_ring_bwd``): the backward keeps no
    per-step key/value chunk; it sends the chunks around the ring again, each with the
    dK/dV accumulated for it so far, so a device holds O(1) chunks whatever the ring's
    length.
    """
    has_seg = segment_ids is not None
    b, c = q.shape[0], q.shape[1]
    qseg = segment_ids if has_seg else jnp.zeros((b, c), jnp.int32)
    kseg = (kv_segment_ids if kv_segment_ids is not None else segment_ids) if has_seg \
        else jnp.zeros((b, k.shape[1]), jnp.int32)
    static = (axis_name, int(axis_size), bool(causal), has_seg, sm_scale, block_q, block_k,
              interpret)
    return _ring(q, k, v, q_positions.astype(jnp.int32), kv_positions.astype(jnp.int32),
                 qseg.astype(jnp.int32), kseg.astype(jnp.int32), static)


def _kernel_args(static, qseg, kseg):
    _, _, causal, has_seg, sm_scale, block_q, block_k, interpret = static
    return dict(causal=causal, segment_ids=qseg if has_seg else None,
                kv_segment_ids=kseg if has_seg else None, sm_scale=sm_scale,
                block_q=block_q, block_k=block_k, interpret=interpret)


def _ring_forward(q, k, v, qpos, kpos, qseg, kseg, static):
    """(output [b, c, h, d] in q's dtype, log-sum-exp [b, h, c] over every key). A
    ``fori_loop``: one step's buffers, whatever the ring's length."""
    axis_name, n = static[0], static[1]
    perm = [(i, (i + 1) % n) for i in range(n)]
    b, c, h, d = q.shape

    def attend(out, lse, k_s, v_s, kpos_s, kseg_s):
        o_s, lse_s = flash_attention_positions(q, k_s, v_s, qpos, kpos_s,
                                               **_kernel_args(static, qseg, kseg_s))
        new = jnp.logaddexp(lse, lse_s)
        w_old = jnp.swapaxes(jnp.exp(lse - new), 1, 2)[..., None]
        w_new = jnp.swapaxes(jnp.exp(lse_s - new), 1, 2)[..., None]
        return out * w_old + o_s.astype(jnp.float32) * w_new, new

    def step(_, carry):
        out, lse, *chunk = carry
        out, lse = attend(out, lse, *chunk)
        return (out, lse, *(jax.lax.ppermute(x, axis_name, perm) for x in chunk))

    out = jnp.zeros((b, c, h, d), jnp.float32)
    lse = jnp.full((b, h, c), MASK_VALUE, jnp.float32)
    out, lse, *chunk = jax.lax.fori_loop(0, n - 1, step, (out, lse, k, v, kpos, kseg))
    out, lse = attend(out, lse, *chunk)
    return out.astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _ring(q, k, v, qpos, kpos, qseg, kseg, static):
    return _ring_forward(q, k, v, qpos, kpos, qseg, kseg, static)[0]


def _ring_fwd(q, k, v, qpos, kpos, qseg, kseg, static):
    out, lse = _ring_forward(q, k, v, qpos, kpos, qseg, kseg, static)
    # Residuals: this device's own chunks and the softmax statistics, nothing per step.
    return out, (q, k, v, qpos, kpos, qseg, kseg, out, lse)


def _ring_bwd(static, res, dout):
    """The ring again: step by step each device computes its queries' gradient against
    the key/value chunk it holds (with the whole attention's statistics) and that
    chunk's dK/dV, added to the accumulators travelling with the chunk; after ``n``
    sends every chunk's gradient is home (the last send carries the gradients only)."""
    axis_name, n = static[0], static[1]
    perm = [(i, (i + 1) % n) for i in range(n)]
    q, k, v, qpos, kpos, qseg, kseg, out, lse = res

    def grads(dq, k_s, v_s, kpos_s, kseg_s, dk_s, dv_s):
        dq_i, dk_i, dv_i = flash_attention_backward_positions(
            q, k_s, v_s, qpos, kpos_s, out, lse, dout, **_kernel_args(static, qseg, kseg_s))
        return (dq + dq_i.astype(jnp.float32), dk_s + dk_i.astype(jnp.float32),
                dv_s + dv_i.astype(jnp.float32))

    def step(_, carry):
        dq, k_s, v_s, kpos_s, kseg_s, dk_s, dv_s = carry
        dq, dk_s, dv_s = grads(dq, k_s, v_s, kpos_s, kseg_s, dk_s, dv_s)
        moved = (jax.lax.ppermute(x, axis_name, perm)
                 for x in (k_s, v_s, kpos_s, kseg_s, dk_s, dv_s))
        return (dq, *moved)

    init = (jnp.zeros(q.shape, jnp.float32), k, v, kpos, kseg,
            jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    dq, k_s, v_s, kpos_s, kseg_s, dk_s, dv_s = jax.lax.fori_loop(0, n - 1, step, init)
    dq, dk_s, dv_s = grads(dq, k_s, v_s, kpos_s, kseg_s, dk_s, dv_s)
    dk, dv = (jax.lax.ppermute(x, axis_name, perm) for x in (dk_s, dv_s))
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
            None, None, None, None)


_ring.defvjp(_ring_fwd, _ring_bwd)


def device_token_ids(seq_len: int, chunk_lengths, zigzag: bool) -> list[np.ndarray]:
    """Global token ids held by each device. Zigzag gives device i the i-th piece from
    the front and the i-th from the back (halves of its share), balancing causal work."""
    n = len(chunk_lengths)
    if not zigzag:
        starts = np.concatenate([[0], np.cumsum(chunk_lengths)[:-1]])
        return [np.arange(s, s + n_i) for s, n_i in zip(starts, chunk_lengths, strict=True)]
    front = [-(-n_i // 2) for n_i in chunk_lengths]
    back = [n_i - f for n_i, f in zip(chunk_lengths, front, strict=True)]
    f_starts = np.concatenate([[0], np.cumsum(front)[:-1]])
    out, pos = [None] * n, sum(front)
    for i in reversed(range(n)):
        out[i] = (pos, back[i])
        pos += back[i]
    return [np.concatenate([np.arange(f_starts[i], f_starts[i] + front[i]),
                            np.arange(out[i][0], out[i][0] + out[i][1])]) for i in range(n)]


def context_parallel_attention(q, k, v, mesh, axis: str = "context", causal: bool = True,
                               segment_ids=None, chunk_lengths=None, zigzag: bool = True,
                               sm_scale=None, block_q=None, block_k=None, interpret=None):
    """Attention of global q, k, v with the sequence split over ``mesh`` axis ``axis``.

    ``chunk_lengths`` (default: equal) gives each device's number of tokens, in mesh
    order, and must sum to the sequence length; faster devices can take more. With
    ``zigzag`` each device's share is half from the front and half from the back of the
    sequence. Equals full attention (tested, gradients too).

    Raises:
      SpecError: bad shapes, an axis the mesh lacks, or chunk lengths that do not match
        the mesh or sum to the sequence.
    """
    check_attention_args(q, k, v, segment_ids, where="context_parallel_attention")
    if axis not in mesh.shape:
        raise SpecError("axis", axis, f"a mesh axis among {tuple(mesh.shape)}",
                        where="context_parallel_attention")
    n = mesh.shape[axis]
    b, s = q.shape[0], q.shape[1]
    if k.shape[1] != s:
        raise SpecError("k.shape[1]", k.shape[1], f"the query length {s} (self-attention)",
                        where="context_parallel_attention")
    if chunk_lengths is None:
        if s % n:
            raise SpecError("chunk_lengths", None, f"explicit lengths: seq {s} does not "
                            f"divide into {n} equal chunks", where="context_parallel_attention")
        chunk_lengths = [s // n] * n
    chunk_lengths = [int(c) for c in chunk_lengths]
    if len(chunk_lengths) != n:
        raise SpecError("chunk_lengths", chunk_lengths, f"{n} lengths (mesh axis {axis!r})",
                        where="context_parallel_attention")
    if sum(chunk_lengths) != s or min(chunk_lengths) < 1:
        raise SpecError("chunk_lengths", chunk_lengths,
                        f"positive lengths summing to the sequence length {s}",
                        where="context_parallel_attention")
    ids = device_token_ids(s, chunk_lengths, zigzag)
    width = max(chunk_lengths)
    gather = np.zeros((n, width), np.int64)
    pos = np.full((n, width), -1, np.int32)
    for i, t in enumerate(ids):
        gather[i, :len(t)] = t
        pos[i, :len(t)] = t
    flat = gather.reshape(-1)
    positions = jnp.broadcast_to(jnp.asarray(pos.reshape(-1)), (b, n * width))
    # On an Explicit mesh the inputs may be split along the sequence: gathered first so
    # that the reorder into device chunks is a plain gather.
    seg = None if segment_ids is None else jnp.take(gathered(segment_ids, mesh), flat, axis=1)
    local = [jnp.take(gathered(x, mesh), flat, axis=1) for x in (q, k, v)]
    spec = PartitionSpec(None, axis)

    def body(q_c, k_c, v_c, pos_c, seg_c):
        return ring_attention(q_c, k_c, v_c, axis_name=axis, axis_size=n, causal=causal,
                              q_positions=pos_c, kv_positions=pos_c,
                              segment_ids=None if segment_ids is None else seg_c,
                              sm_scale=sm_scale, block_q=block_q, block_k=block_k,
                              interpret=interpret)

    seg_arg = seg if seg is not None else jnp.zeros((b, n * width), jnp.int32)
    args = [laid_out(x, mesh, spec) if is_explicit(mesh) else
            jax.device_put(x, NamedSharding(mesh, spec)) for x in (*local, positions, seg_arg)]
    out = jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 5, out_specs=spec,
                        check_vma=False)(*args)
    inverse = np.empty(s, np.int64)
    for i, t in enumerate(ids):
        inverse[t] = i * width + np.arange(len(t))
    return jnp.take(gathered(out, mesh), jnp.asarray(inverse), axis=1)
