"""Attention implementations per GPU type and pattern (issue 48): which one runs, that
each computes what the reference does, and that a request a type cannot run is refused
before tracing."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from hetshard._plan import Pipeline, Plan, Stage
from hetshard.cluster import Cluster
from hetshard.cluster.catalog import CATALOG, device_type_from_dict
from hetshard.cost.calibration import DEFAULT
from hetshard.cost.stage import attention_rate, priced_attention, stage_cost
from hetshard.errors import SpecError
from hetshard.kernel_choice import Hardware, Pattern, choose, refusal, resolve
from hetshard.kernels import attention_reference, dot_product_attention
from hetshard.rewrite.attention import _flash_on_mesh, swap_attention


def _hw(name):
    return Hardware.of_type(CATALOG[name])


CAUSAL = Pattern(causal=True)


@pytest.mark.parametrize("gpu,pattern,expect", [
    ("H100-80GB", CAUSAL, "cudnn"),
    ("H200", Pattern(causal=False, head_dim=256), "cudnn"),  # Hopper: head dim up to 256
    ("A100-80GB", Pattern(causal=False, head_dim=256), "flash"),  # Ampere: up to 128
    ("A100-80GB", CAUSAL, "cudnn"),
    ("L4", Pattern(dtype="float16"), "cudnn"),
    ("H100-80GB", Pattern(segments=True), "flash"),  # packed rows
    ("H100-80GB", Pattern(dtype="float32"), "flash"),  # cuDNN is 16-bit only
    ("H100-80GB", Pattern(same_length=False), "flash"),  # causal, ends aligned
    ("V100-32GB", CAUSAL, "reference"),  # Triton: no bfloat16 products before 8.0
    ("V100-32GB", Pattern(dtype="float16"), "flash"),
    ("T4", Pattern(dtype="float16", segments=True), "flash"),
    ("P100-16GB", Pattern(dtype="float16"), "reference"),
    ("MI300X", CAUSAL, "reference"),
])
def test_auto_picks_the_fastest_implementation_that_runs_the_pattern(gpu, pattern, expect):
    assert choose(_hw(gpu), pattern) == expect
    assert resolve("auto", _hw(gpu), pattern) == expect


def test_fake_cpu_devices_run_the_flash_kernel_where_cudnn_is_chosen():
    cpu = Hardware.of_device(jax.devices()[0])
    assert cpu.vendor == "cpu"
    assert resolve("auto", cpu, CAUSAL) == "flash"
    assert priced_attention("auto", CATALOG["CPU"], "float32") == "flash"
    with pytest.raises(SpecError, match=r"NVIDIA GPUs only.*") as e:
        resolve("cudnn", cpu, CAUSAL)
    assert "flash, reference" in str(e.value)


def test_an_explicit_request_names_the_type_the_pattern_and_what_runs():
    with pytest.raises(SpecError) as e:
        resolve("cudnn", _hw("H100-80GB"), Pattern(segments=True))
    msg = str(e.value)
    assert "attention='cudnn'" in msg and "H100-80GB" in msg and "packed rows" in msg
    assert "flash, reference" in msg
    assert refusal("cudnn", _hw("V100-32GB")).startswith("cuDNN's fused flash attention "
                                                         "needs compute capability 8.0+")


def _qkv(seed, b=2, s=32, h=4, kvh=2, d=16, dtype=jnp.float32):
    k = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(k[0], (b, s, h, d), dtype),
            jax.random.normal(k[1], (b, s, kvh, d), dtype),
            jax.random.normal(k[2], (b, s, kvh, d), dtype))


@pytest.mark.parametrize("causal", [True, False])
def test_dot_product_attention_equals_the_reference_values_and_gradients(causal):
    """What the wrapper passes jax.nn (scale, causal mask, GQA heads), checked through
    jax.nn's XLA lowering of the same call (cuDNN itself needs a GPU)."""
    q, k, v = _qkv(0)
    w = jax.random.normal(jax.random.key(9), q.shape)
    dpa = functools.partial(dot_product_attention, causal=causal, sm_scale=0.3,
                            implementation="xla")
    ref = functools.partial(attention_reference, causal=causal, sm_scale=0.3)
    np.testing.assert_allclose(dpa(q, k, v), ref(q, k, v), atol=2e-6)
    g1 = jax.grad(lambda *a: jnp.sum(dpa(*a) * w), argnums=(0, 1, 2))(q, k, v)
    g2 = jax.grad(lambda *a: jnp.sum(ref(*a) * w), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g1, g2, strict=True):
        np.testing.assert_allclose(a, b, atol=2e-5)


def test_dot_product_attention_refuses_what_it_cannot_compute_exactly():
    q, k, v = _qkv(1)
    seg = jnp.zeros(q.shape[:2], jnp.int32)
    with pytest.raises(SpecError, match="segment_ids"):
        dot_product_attention(q, k, v, segment_ids=seg, implementation="xla")
    with pytest.raises(SpecError, match="causal"):
        dot_product_attention(q, k[:, :16], v[:, :16], causal=True, implementation="xla")


def test_a_kernel_per_device_on_a_mesh_equals_the_reference():
    """cuDNN's call runs per device of a stage mesh (samples over data, heads over
    tensor) as the flash kernel does; jax.nn's XLA lowering stands in on CPU."""
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "tensor"))
    q, k, v = _qkv(2, b=4)
    attend = functools.partial(dot_product_attention, implementation="xla")
    got = jax.jit(lambda q, k, v: _flash_on_mesh(mesh, q, k, v, None, 0.25, True, {},
                                                 attend=attend))(q, k, v)
    np.testing.assert_allclose(got, attention_reference(q, k, v, causal=True, sm_scale=0.25),
                               atol=2e-6)


def test_auto_swaps_in_the_devices_choice():
    from hetshard import nn
    q, k, v = _qkv(3)

    def f(q, k, v):
        return jnp.sum(nn.attention(q, k, v, causal=True) ** 2)
    got = jax.grad(swap_attention(f, "auto"), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(f, argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, atol=3e-5)
    with pytest.raises(SpecError, match="cudnn.*CPU"):
        jax.grad(swap_attention(f, "cudnn"), argnums=0)(q, k, v)


def test_auto_on_an_ampere_or_later_gpu_routes_each_call_to_its_kernel(monkeypatch):
    """The runtime's routing as on an H100 (its hardware and cuDNN's call stood in for:
    jax.nn's XLA lowering): a causal LM's attention goes to cuDNN's call, packed rows to
    the flash kernel, and both equal the reference, gradients too."""
    from hetshard import nn
    from hetshard.rewrite import attention as rw
    calls = []

    def cudnn(*a, **kw):
        calls.append(kw)
        return dot_product_attention(*a, **{**kw, "implementation": "xla"})
    monkeypatch.setattr(rw, "_hardware", lambda mesh: _hw("H100-80GB"))
    monkeypatch.setattr(rw, "dot_product_attention", cudnn)
    q, k, v = _qkv(4, dtype=jnp.bfloat16)
    seg = jnp.asarray(np.repeat(np.arange(4), 8)[None].repeat(2, 0), jnp.int32)
    for segment_ids, expect in ((None, 1), (seg, 0)):
        calls.clear()

        def f(q, k, v, segment_ids=segment_ids):
            out = nn.attention(q, k, v, causal=True, segment_ids=segment_ids)
            return jnp.sum(out.astype(jnp.float32) ** 2)
        got = jax.grad(swap_attention(f, "auto"), argnums=(0, 1, 2))(q, k, v)
        want = jax.grad(f, argnums=(0, 1, 2))(q, k, v)
        assert len(calls) == expect
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                       atol=0.05, rtol=0.05)


def _plan(attention, gpu="V100-32GB", dtype="bfloat16", gpu_dtypes=()):
    cluster = Cluster.load("h100-a100-v100-x8")
    devices = {"H100-80GB": (0, 1), "V100-32GB": (4, 5)}[gpu]  # 2 H100, 2 A100, 4 V100
    return Plan("gpt", cluster.to_dict(), 8, 64,
                (Pipeline((Stage(0, 4, devices, gpu, (("data", len(devices)),)),), 8, 4, 1),),
                dtype=dtype, attention=attention, gpu_dtypes=gpu_dtypes)


def test_a_plan_asking_for_an_implementation_a_stage_cannot_run_is_refused():
    with pytest.raises(SpecError) as e:
        _plan("cudnn")
    msg = str(e.value)
    assert "attention='cudnn'" in msg and "V100-32GB" in msg and "reference" in msg
    with pytest.raises(SpecError, match=r"V100-32GB in bfloat16: reference"):
        _plan("flash")
    _plan("flash", gpu_dtypes=(("V100-32GB", "float16"),))  # float16 runs there
    _plan("cudnn", gpu="H100-80GB")
    with pytest.raises(SpecError, match="attention='fast'"):
        _plan("fast", gpu="H100-80GB")


def test_the_plan_and_the_selection_name_the_same_implementations():
    from hetshard import kernel_choice as select
    from hetshard._plan import ATTENTION_IMPLEMENTATIONS
    assert select.IMPLEMENTATIONS == ATTENTION_IMPLEMENTATIONS


def test_plans_before_schema_13_read_as_the_flash_kernel_they_ran():
    d = _plan("auto", gpu="H100-80GB").to_dict()
    assert Plan.from_dict(d).attention == "auto"
    old = {k: v for k, v in d.items() if k != "attention"}
    assert Plan.from_dict({**old, "version": 12}).attention == "flash"


def test_compute_capability_is_checked_in_inline_gpus():
    spec = {"name": "X", "bf16_tflops": 100, "memory_gb": 40, "memory_gbs": 1000}
    assert device_type_from_dict({**spec, "compute_capability": "8.6"}).capability == (8, 6)
    # Without one, an inline GPU is taken to run every kernel (its devices decide).
    inline = Hardware.of_type(device_type_from_dict(spec))
    assert choose(inline, CAUSAL) == "cudnn" and refusal("flash", inline) is None
    old = Hardware.of_type(device_type_from_dict({**spec, "compute_capability": "7.0"}))
    assert choose(old, CAUSAL) == "reference"
    with pytest.raises(SpecError, match=r"gpu\.compute_capability.*major\.minor"):
        device_type_from_dict({**spec, "compute_capability": 9})


def test_auto_is_priced_at_the_chosen_kernels_rate():
    h100, v100 = CATALOG["H100-80GB"], CATALOG["V100-32GB"]
    e = DEFAULT.for_type(h100.name)
    assert priced_attention("auto", h100, "bfloat16") == "cudnn"
    assert attention_rate(h100, "bfloat16", e, "cudnn") > 5 * attention_rate(
        h100, "bfloat16", e, "flash")  # measured on an H200: 541 against 76 TFLOP/s
    assert priced_attention("auto", v100, "bfloat16") == "reference"
    assert priced_attention("auto", v100, "float16") == "flash"


def test_a_stage_under_auto_costs_what_its_implementation_costs():
    from hetshard_models import profile as profile_model
    prof = profile_model("gpt:layers=2,hidden=256,heads=2,vocab=128,seq=1024", 1024,
                         "bfloat16")
    for gpu, impl in ((CATALOG["H100-80GB"], "cudnn"), (CATALOG["V100-32GB"], "reference")):
        auto = stage_cost(prof, 0, prof.num_layers, gpu, mbs=2, cal=DEFAULT, attention="auto")
        same = stage_cost(prof, 0, prof.num_layers, gpu, mbs=2, cal=DEFAULT, attention=impl)
        assert (auto.fwd_s, auto.bwd_s, auto.peak_memory(2)) == (same.fwd_s, same.bwd_s,
                                                               same.peak_memory(2))
    h100 = CATALOG["H100-80GB"]
    cudnn, flash = (stage_cost(prof, 0, prof.num_layers, h100, mbs=2, cal=DEFAULT,
                               attention=a) for a in ("cudnn", "flash"))
    assert cudnn.attention_bwd_s < flash.attention_bwd_s
    assert cudnn.peak_memory(2) == flash.peak_memory(2)  # both O(S): no stored scores
