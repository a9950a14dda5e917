"""``hetshard profile``: measure this backend and write a calibration.

Times jitted matmuls of several shapes, causal attention (forward and backward:
the Pallas flash kernel the runtime swaps in on a GPU, XLA's reference on other
backends, where the kernel would only run interpreted), an elementwise op
streaming a large buffer, and (when there are several local devices) an
all-reduce over them; the achieved rates divided by the catalog's peaks for the
local device type become that type's ``matmul_eff``, ``attention_eff``,
``memory_eff`` and ``comm_eff``. On CPU this
calibrates the ``CPU`` type (whose catalog peaks are nominal), on a GPU its type.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from hetshard.cluster.catalog import device_type_for_kind
from hetshard.cost.calibration import DEFAULT, Calibration, Efficiency
from hetshard.kernels import attention_reference, flash_attention


def _best_time(fn, *args, reps: int = 5) -> float:
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t)
    return best


def attention_rate(dtype, quick: bool = False, platform: str | None = None) -> float:
    """Flop/s of causal attention forward + backward, counting the products the kernel
    computes, as the cost model does: the reference's 4*B*H*S*S*D forward and twice that
    backward; the flash kernel (on a GPU) skips the masked half of them."""
    platform = platform or jax.devices()[0].platform
    b, s, h, d = (1, 256, 2, 64) if quick else ((4, 2048, 16, 128) if platform == "gpu"
                                                else (2, 1024, 8, 64))
    attend = flash_attention if platform == "gpu" else attention_reference
    q = jnp.ones((b, s, h, d), dtype) * 0.01

    def loss(q, k, v):
        return attend(q, k, v, causal=True).astype(jnp.float32).sum()
    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    t = _best_time(step, q, q, q)
    computed = 0.5 if platform == "gpu" else 1.0  # causal blocks the flash kernel skips
    return 12 * b * h * s * s * d * computed / t


def profile_backend(quick: bool = False, base: Calibration = DEFAULT) -> Calibration:
    dev = jax.devices()[0]
    gpu = device_type_for_kind(dev.device_kind)
    dtype = jnp.bfloat16 if dev.platform == "gpu" else jnp.float32
    sizes = [256, 512] if quick else [1024, 2048, 4096]
    rates = []
    for n in sizes:
        a = jnp.ones((n, n), dtype)
        t = _best_time(jax.jit(lambda x: x @ x), a)
        rates.append(2 * n ** 3 / t)
    peak = gpu.peak_flops("bfloat16" if dtype == jnp.bfloat16 else "float32")
    matmul_eff = max(rates) / peak
    attention_eff = attention_rate(dtype, quick, dev.platform) / peak
    n = 1 << (20 if quick else 26)
    x = jnp.ones((n,), jnp.float32)
    t = _best_time(jax.jit(lambda v: v * 2.0 + 1.0), x)
    memory_eff = (2 * n * 4 / t) / (gpu.memory_gbs * 1e9)
    comm_eff = base.default.comm_eff
    devs = jax.local_devices()
    if len(devs) > 1:
        m = 1 << (16 if quick else 22)
        mesh = jax.sharding.Mesh(np.array(devs), ("i",))
        spec = jax.sharding.PartitionSpec("i")
        arr = jax.device_put(jnp.ones((len(devs) * m,), jnp.float32),
                             jax.sharding.NamedSharding(mesh, spec))
        f = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "i"), mesh=mesh, in_specs=spec,
                                  out_specs=spec))
        t = _best_time(f, arr)
        bus = 2 * (len(devs) - 1) / len(devs) * m * 4 / t
        comm_eff = bus / (gpu.intra_node_gbs * 1e9)
    eff = Efficiency(matmul_eff=float(matmul_eff), attention_eff=float(attention_eff),
                     memory_eff=float(memory_eff),
                     fusion=base.default.fusion, comm_eff=float(np.clip(comm_eff, 1e-6, 10)))
    return Calibration(default=base.default, per_type=((gpu.name, eff),),
                       source=f"hetshard profile on {dev.device_kind} ({dev.platform})")
