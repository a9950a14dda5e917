"""Context parallelism: ring attention over a mesh axis, with zigzag order and uneven
chunks (Liu et al. 2023, "Ring Attention"; zigzag/dual-chunk load balancing as in
Megatron-LM's context parallelism; uneven per-device chunks as in HexiSeq).

Each device holds a chunk of the sequence. For ``n`` steps it attends its queries to
the key/value chunk it currently holds (the flash kernel, masked by the tokens' global
positions), merges the partial result with the log-sum-exp, and passes the key/value
chunk to the next device with ``lax.ppermute``. The backward pass is the transpose of
that ring: JAX differentiates ``ppermute`` into the reverse ring and the kernel's own
backward computes dQ/dK/dV per step. Chunks shorter than the longest are padded with
position -1, which the kernel skips block by block, so a device given less of the
sequence does less work.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from hetshard.errors import SpecError
from hetshard.kernels.flash_attention import flash_attention_positions
from hetshard.kernels.reference import MASK_VALUE, check_attention_args
from hetshard.meshes import gathered, is_explicit, laid_out


def ring_attention(q, k, v, *, axis_name: str, axis_size: int, causal: bool,
                   q_positions, kv_positions, segment_ids=None, kv_segment_ids=None,
                   sm_scale=None, block_q=None, block_k=None, interpret=None):
    """Per-device body, inside ``jax.shard_map`` over ``axis_name`` (of ``axis_size``).

    q, k, v: this device's chunks [batch, chunk, heads | kv_heads, head_dim];
    q_positions, kv_positions: global token positions of the chunk ([batch, chunk] int32,
    -1 for padding); segment ids likewise. Returns this device's output chunk.
    """
    perm = [(i, (i + 1) % axis_size) for i in range(axis_size)]
    kv_seg = kv_segment_ids if kv_segment_ids is not None else segment_ids
    b, c, h, d = q.shape
    out = jnp.zeros((b, c, h, d), jnp.float32)
    lse = jnp.full((b, h, c), MASK_VALUE, jnp.float32)
    carry = (k, v, kv_positions, kv_seg)
    for step in range(axis_size):
        k_s, v_s, kpos_s, kseg_s = carry
        o_s, lse_s = flash_attention_positions(
            q, k_s, v_s, q_positions, kpos_s, causal=causal, segment_ids=segment_ids,
            kv_segment_ids=kseg_s, sm_scale=sm_scale, block_q=block_q, block_k=block_k,
            interpret=interpret)
        new = jnp.logaddexp(lse, lse_s)
        w_old = jnp.swapaxes(jnp.exp(lse - new), 1, 2)[..., None]
        w_new = jnp.swapaxes(jnp.exp(lse_s - new), 1, 2)[..., None]
        out = out * w_old + o_s.astype(jnp.float32) * w_new
        lse = new
        if step < axis_size - 1:
            carry = jax.tree.map(lambda x: jax.lax.ppermute(x, axis_name, perm), carry)
    return out.astype(q.dtype)


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
