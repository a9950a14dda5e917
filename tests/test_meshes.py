"""Meshes as JAX 0.10 makes them: ``jax.make_mesh`` gives Explicit axes, and
``jax.set_mesh`` puts a mesh in context. Every hetshard entry point that takes a mesh,
and the runtime under a caller's ambient mesh, work with them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import user_models
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import hetshard
from hetshard._plan import Pipeline, Plan, Stage
from hetshard.cluster import Cluster
from hetshard.collectives.matmul import allgather_matmul, matmul_reducescatter
from hetshard.kernels import context_parallel_attention
from hetshard.kernels.reference import attention_reference
from hetshard.meshes import is_explicit
from hetshard.nn import attention
from hetshard.rewrite import swap_attention

DN = (((2,), (0,)), ((), ()))


def _dot(a, b):
    return jax.lax.dot_general(a, b, DN)


def test_make_mesh_is_explicit_here():
    # What the fixes below are for: JAX 0.10's default.
    assert is_explicit(jax.make_mesh((8,), ("data",)))


@pytest.mark.parametrize("kind", ["spmd", "pipeline"])
def test_jit_runs_under_a_callers_explicit_mesh(kind):
    step, args, batches = user_models.make_transformer()
    program = hetshard.Program(step, args)
    n = program.layering(2).num_layers
    cluster = Cluster.load("h100-a100-v100-x8")
    if kind == "spmd":
        pipe = Pipeline((Stage(0, n, tuple(range(8)), "A100-80GB+H100-80GB+V100-32GB",
                               (("data", 8),)),), 8, 1, 1)
    else:
        pipe = Pipeline((Stage(0, n // 2, (0, 1), "H100-80GB", (("data", 2),)),
                         Stage(n // 2, n, (4, 5, 6, 7), "V100-32GB", (("data", 4),))), 8, 2, 2)
    plan = Plan(program.name, cluster.to_dict(), 8, 16, (pipe,), attention="reference")
    want = float(nnx.jit(step)(*user_models.make_transformer()[1]))
    mesh = jax.make_mesh((8,), ("data",))
    with jax.set_mesh(mesh):
        # The caller's batch, explicitly sharded over its own mesh.
        batch = jax.device_put(args[2], NamedSharding(mesh, P("data")))
        got = float(hetshard.jit(step, cluster=cluster, plan=plan)(args[0], args[1], batch))
    assert got == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("shape", [(2, 4), (1, 8)])
def test_collective_matmuls_take_explicit_meshes(shape, rng):
    mesh = jax.make_mesh(shape, ("data", "tensor"))
    x = jnp.asarray(rng.standard_normal((4, 16, 32)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((32, 24)) / np.sqrt(32), jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((24, 32)) / np.sqrt(24), jnp.float32)
    seq = P("data", "tensor")

    def ring(x, w, w2):
        (h,) = allgather_matmul(x, [w], [_dot], mesh, seq, [P(None, "tensor")],
                                [P("data", None, "tensor")])
        y = matmul_reducescatter(jnp.tanh(h), w2, _dot, mesh, P("data", None, "tensor"),
                                 P("tensor", None), seq)
        return (y ** 2).sum()

    def plain(x, w, w2):
        return ((jnp.tanh(x @ w) @ w2) ** 2).sum()
    got = jax.jit(jax.value_and_grad(ring, argnums=(0, 1, 2)))(x, w, w2)
    want = jax.value_and_grad(plain, argnums=(0, 1, 2))(x, w, w2)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for a, b in zip(got[1], want[1], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_flash_on_an_explicit_stage_mesh(rng):
    mesh = jax.make_mesh((2, 4), ("data", "tensor"))
    q, k, v = (jnp.asarray(rng.standard_normal((4, 16, 4, 8)), jnp.float32)
               for _ in range(3))
    f = swap_attention(lambda q, k, v: attention(q, k, v, causal=True), "flash", mesh=mesh,
                       interpret=True)
    np.testing.assert_allclose(jax.jit(f)(q, k, v),
                               attention_reference(q, k, v, causal=True), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("chunks,zigzag", [(None, True), ([40, 32, 32, 24], True),
                                           ([40, 32, 32, 24], False)])
def test_context_parallel_attention_on_make_mesh(chunks, zigzag, rng):
    mesh = jax.make_mesh((4,), ("context",))
    q, k, v = (jnp.asarray(rng.standard_normal((2, 128, 4, 8)), jnp.float32)
               for _ in range(3))
    k, v = k[:, :, :2], v[:, :, :2]  # grouped-query attention
    seg = jnp.asarray(np.repeat(np.arange(4), 32)[None].repeat(2, 0), jnp.int32)
    got = context_parallel_attention(q, k, v, mesh, causal=True, chunk_lengths=chunks,
                                     zigzag=zigzag, segment_ids=seg, interpret=True)
    want = attention_reference(q, k, v, causal=True, segment_ids=seg)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
