import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hetshard.collectives.matmul import allgather_matmul, matmul_reducescatter

DN = (((2,), (0,)), ((), ()))


def _dot(a, b):
    return jax.lax.dot_general(a, b, DN)


def _collectives(hlo: str) -> dict:
    return {op: len(re.findall(" " + op + r"(-start)?\(", hlo))
            for op in ("all-gather", "all-reduce", "reduce-scatter", "collective-permute")}


@pytest.mark.parametrize("data,tp", [(2, 4), (1, 8), (4, 2)])
def test_collective_matmuls_equal_the_plain_mlp_with_gradients(data, tp, rng):
    # An MLP block as tensor-parallel stages run it with tp_overlap: a sequence-split
    # input, two column-parallel weights sharing one all-gather ring (up and gate), a
    # row-parallel weight whose partial sums reduce-scatter back along the sequence.
    mesh = Mesh(np.array(jax.devices()[:data * tp]).reshape(data, tp), ("data", "tensor"))
    # Weights at the usual 1/sqrt(fan_in) scale: activations and gradients of order one,
    # so the tolerances below bound the ring's error, not float32's on values of 1e5.
    x = jnp.asarray(rng.standard_normal((4, 16, 32)), jnp.float32)
    up, gate = (jnp.asarray(rng.standard_normal((32, 24)) / np.sqrt(32), jnp.float32)
                for _ in range(2))
    down = jnp.asarray(rng.standard_normal((24, 32)) / np.sqrt(24), jnp.float32)
    seq = P("data", "tensor")

    def ring(x, up, gate, down):
        u, g = allgather_matmul(x, [up, gate], [_dot, _dot], mesh, seq,
                                [P(None, "tensor")] * 2, [P("data", None, "tensor")] * 2)
        h = jax.nn.silu(g) * u
        y = matmul_reducescatter(h, down, _dot, mesh, P("data", None, "tensor"),
                                 P("tensor", None), seq)
        return (y ** 2).sum()

    def plain(x, up, gate, down):
        return (((jax.nn.silu(x @ gate) * (x @ up)) @ down) ** 2).sum()
    args = jax.device_put((x, up, gate, down), tuple(
        NamedSharding(mesh, s) for s in (seq, P(None, "tensor"), P(None, "tensor"),
                                          P("tensor", None))))
    f = jax.jit(jax.value_and_grad(ring, argnums=(0, 1, 2, 3)))
    got, want = f(*args), jax.value_and_grad(plain, argnums=(0, 1, 2, 3))(x, up, gate, down)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for a, b in zip(got[1], want[1], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-3)
    # The sequence travels the ring by collective-permutes, never all-gathered; the only
    # all-reduce is the weights' gradient over the data axis.
    hlo = f.lower(*args).compile().as_text()
    ops = _collectives(hlo)
    assert ops["collective-permute"] > 0 and ops["all-gather"] == 0
    if data == 1:  # no array to reduce: an all-reduce left has one device per group
        reduces = [line for line in hlo.splitlines()
                   if re.search(r" all-reduce\(", line) and "f32[] all-reduce" not in line]
        assert all(re.search(r"replica_groups=\{\{\d+\},", line) for line in reduces)
    # The gathered blocks are not kept for the backward: it passes them again (no matmul
    # of the forward is recomputed: 3 weights x tp blocks forward, twice that backward).
    jaxpr = str(jax.make_jaxpr(jax.grad(ring, argnums=(0, 1, 2, 3)))(*args))
    assert jaxpr.count("dot_general") == 3 * tp * 3


def test_collective_matmul_backward_splits_into_input_and_weight_rings(rng):
    # Under ZB-H1 a stage's backward runs as B (what the previous stage waits for) and W
    # (the weights' gradients, deferred): a column group's input-cotangent ring and its
    # weights' ring are separate shard_maps, so W takes its weight-gradient matmuls; a
    # row-parallel matmul's one ring (both gradients) runs in B.
    from hetshard.rewrite import backward
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "tensor"))
    x = jnp.asarray(rng.standard_normal((4, 16, 32)), jnp.float32)
    up = jnp.asarray(rng.standard_normal((32, 24)), jnp.float32)
    down = jnp.asarray(rng.standard_normal((24, 32)), jnp.float32)
    seq = P("data", "tensor")

    def block(params, x):
        up, down = params
        (h,) = allgather_matmul(x, [up], [_dot], mesh, seq, [P(None, "tensor")],
                                [P("data", None, "tensor")])
        return [matmul_reducescatter(jnp.tanh(h), down, _dot, mesh,
                                     P("data", None, "tensor"), P("tensor", None), seq)]
    (out,), vjp = jax.vjp(block, (up, down), x)
    closed, _, n_param = backward._traced(vjp, [jnp.ones_like(out)])
    b_eqns, w_eqns, _ = backward._split(closed.jaxpr, n_param)

    def rings(eqns):
        return sum(e.primitive.name == "shard_map" for e in eqns)
    assert n_param == 2 and rings(b_eqns) == 2 and rings(w_eqns) == 1
    matmuls = [sum(str(e).count("dot_general") for e in eqns) for eqns in (b_eqns, w_eqns)]
    assert matmuls[0] > 0 and matmuls[1] > 0
    # Together: the gradients of the plain block.
    want = jax.vjp(lambda p, x: jnp.tanh(x @ p[0]) @ p[1], (up, down), x)[1](
        jnp.ones_like(out))
    got = vjp([jnp.ones_like(out)])
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-3)
