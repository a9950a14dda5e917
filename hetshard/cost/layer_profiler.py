"""``hetshard profile --model``: time a program's own layers on the local backend and
write them as a measured profile (``docs/profile-format.md``).

The program's loss is split where the planner cuts it (``hetshard.rewrite.pipeline``):
the layers before the first repeated block (``embedding``), one block (``block``) and
the layers after the last one (``head``); each part's forward and forward + backward
are jitted and timed on one device with random weights at each micro-batch size, the
backward being their difference. The profile records the block's forward flops at the
program's sequence length, which is how the cost model recognises the block it applies
to (``hetshard.cost.measured``). One device: tensor degree 1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hetshard.cluster.catalog import device_type_for_kind
from hetshard.cost.measured import MeasuredProfile, Timing
from hetshard.cost.profile import profile_program
from hetshard.cost.profiler import _best_time
from hetshard.errors import SpecError
from hetshard.rewrite.pipeline import split_stages


def _values(avals, key):
    """Random floats (scale 0.02) and zero integers of ``avals``' shapes."""
    out = []
    for i, a in enumerate(avals):
        if jnp.issubdtype(a.dtype, jnp.inexact):
            out.append((jax.random.normal(jax.random.fold_in(key, i), a.shape, jnp.float32)
                        * 0.02).astype(a.dtype))
        else:
            out.append(jnp.zeros(a.shape, a.dtype))
    return out


def _parts(layering) -> list[tuple[str | None, tuple[int, int]]]:
    """(role or None, layer range) covering the layers: embedding, one block, the other
    blocks (not timed), head."""
    blocks = [k for k, s in enumerate(layering.stacks) if s >= 0]
    if not blocks:
        raise SpecError("model", "no repeated block",
                        "a program whose layers repeat a block (the profile times one)",
                        where="hetshard profile")
    first = blocks[0]
    last = max(k for k in blocks if layering.stacks[k] == layering.stacks[first])
    n = layering.num_layers
    parts: list[tuple[str | None, tuple[int, int]]] = []
    if first > 0:
        parts.append(("embedding", (0, first)))
    parts.append(("block", (first, first + 1)))
    if last > first:
        parts.append((None, (first + 1, last + 1)))
    if last + 1 < n:
        parts.append(("head", (last + 1, n)))
    return parts


def profile_layers(program, micro_batches=(1, 2), *, reps: int = 5,
                   attention: str = "reference", name: str = "") -> MeasuredProfile:
    """The measured profile of ``program``'s layers on this backend (see the module
    docstring), on the local device type's catalog name.

    Raises:
      SpecError: a program without a ``hetshard.value_and_grad`` loss or without a
        repeated block; micro-batch sizes that are not positive.
    """
    if program.call is None:
        raise SpecError("model", program.name, "a step that calls hetshard.value_and_grad "
                        "(its loss is what is cut into layers)", where="hetshard profile")
    sizes = sorted(set(micro_batches))
    if not sizes or any(not isinstance(b, int) or b < 1 for b in sizes):
        raise SpecError("--micro-batches", micro_batches, "positive integers",
                        where="hetshard profile")
    layering = program.layering(2)
    parts = _parts(layering)
    cost = profile_program(program)
    first = next(r for role, r in parts if role == "block")[0]
    block_flops = cost.layers[first].fwd_total_flops(1)
    dev = jax.devices()[0]
    gpu = device_type_for_kind(dev.device_kind).name
    seq = program.seq_len
    key = jax.random.key(0)
    state = _values(program.state_avals, key)
    roles: dict[str, dict] = {}
    for mbs in sizes:
        batch = _values(program.trees.batch_at(mbs), jax.random.fold_in(key, 10_000 + mbs))
        split = split_stages(program.loss_flat, state, batch, [r for _, r in parts],
                             program.diff, attention=attention)
        env: dict = {}
        for (role, _), stage in zip(parts, split.stages, strict=True):
            params = [state[i] for i in stage.params]
            frozen = [state[i] for i in stage.frozen]
            mb = [batch[i] for i in stage.batch]
            recvs = [env[v] for v in stage.recvs]
            fwd = jax.jit(lambda p, fr, b, r, s=stage: s.evaluate(p, fr, b, r))

            def both(p, fr, b, r, s=stage):
                outs, _, vjp = s.forward(p, fr, b, r)
                return vjp([jnp.ones_like(x) for x in outs])
            sends = fwd(params, frozen, mb, recvs)
            for v, val in zip(stage.sends, sends, strict=True):
                env[v] = val
            if role is None:
                continue
            t_f = _best_time(fwd, params, frozen, mb, recvs, reps=reps)
            t_fb = _best_time(jax.jit(both), params, frozen, mb, recvs, reps=reps)
            roles.setdefault(role, {})[(1, mbs, seq)] = Timing(t_f, max(t_fb - t_f, 0.0))
    model = {"seq": seq, "block_forward_flops": block_flops, "layers": layering.num_layers,
             "dtype": program.dtype, "program": program.name}
    return MeasuredProfile(f"hetshard profile --model on {dev.device_kind} "
                           f"({dev.platform})", model, {gpu: roles}, name or program.name)
