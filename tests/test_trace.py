import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hetshard_models as models
from hetshard.ir.program import traced_graph
from hetshard.ir.trace import layer_of, phase_of, trace
from hetshard_models import profile as profile_model


def trace_train_step(config, *, micro_batch, seq_len, dtype):
    """The zoo step's loss differentiated whole (every layer traced)."""
    return traced_graph(models.program(config, seq_len=seq_len, dtype=dtype), micro_batch)

SMALL_GPT = "gpt:layers=2,hidden=256,heads=4,vocab=512,seq=128"


def test_dense_layer_flops_match_closed_form():
    m, k, n = 8, 32, 16
    g = trace(lambda w, x: jnp.tanh(x @ w), jax.ShapeDtypeStruct((k, n), jnp.float32),
              jax.ShapeDtypeStruct((m, k), jnp.float32))
    dots = [op for op in g.ops if op.primitive == "dot_general"]
    assert len(dots) == 1 and dots[0].flops == 2 * m * k * n
    assert g.param_layers == [""] and g.param_bytes == [k * n * 4]


def test_scan_body_counted_length_times():
    def f(w, x):
        def body(c, _):
            return c @ w, None
        return jax.lax.scan(body, x, None, length=5)[0]
    g = trace(f, jax.ShapeDtypeStruct((16, 16), jnp.float32),
              jax.ShapeDtypeStruct((4, 16), jnp.float32))
    assert sum(op.flops for op in g.ops if op.primitive == "dot_general") == 5 * 2 * 4 * 16 * 16


def test_name_stack_parsing():
    assert layer_of("jvp(encoder)/block") == "block"
    assert layer_of("transpose(jvp(tower))") == "tower" and layer_of("transpose(jvp())") == ""
    assert phase_of("transpose(jvp(decoder/layer_0))") == "bwd"
    assert phase_of("jvp(decoder/head)") == "fwd" and phase_of("") == "opt"


def test_train_step_flops_close_to_6NT_plus_attention():
    c = models.resolve(SMALL_GPT)
    b, s = 2, 128
    g = trace_train_step(c, micro_batch=b, seq_len=s, dtype="float32")
    n_blocks = c.num_params() - c.vocab * c.hidden - c.seq * c.hidden  # no lookup tables
    matmul_params = n_blocks + c.vocab * c.hidden  # the tied head is a matmul
    tokens = b * s
    expected = 6 * matmul_params * tokens + 12 * c.layers * b * s * s * c.hidden
    got = g.total_flops("fwd") + g.total_flops("bwd")
    assert abs(got / expected - 1) < 0.05, (got, expected)
    assert g.layers == ["decoder/embed", "decoder/layer_0", "decoder/layer_1", "decoder/head"]
    assert [len(x) for x in g.identical_layers()] == [1, 2, 1]
    # Every parameter is attributed to the layer that reads it first.
    totals = g.layer_totals()
    assert sum(t.get("params", 0) for t in totals.values()) == c.num_params() * 4


def test_profile_is_exactly_linear_in_micro_batch():
    full = models.resolve("gpt:layers=4,hidden=64,heads=4,vocab=128,seq=32")
    prof = profile_model(full, 32, "float32")  # traced with 2 blocks, replicated to 4
    g3 = trace_train_step(full, micro_batch=3, seq_len=32, dtype="float32")
    assert prof.num_layers == 6 and prof.param_count == full.num_params()
    want = g3.total_flops("fwd") + g3.total_flops("bwd")
    got = sum(layer.flops(3) for layer in prof.layers)
    assert got == pytest.approx(want, rel=1e-9)
    totals = g3.layer_totals()
    for layer in prof.layers:
        assert layer.residual_bytes_per_sample * 3 + layer.weight_copy_bytes == pytest.approx(
            totals[layer.name].get("residual_bytes", 0.0))
    block = prof.layers[1]
    assert block.boundary_bytes_per_sample == 32 * 64 * 4  # [seq, hidden] float32
    assert block.attention_residual_bytes_per_sample > 0


def test_mllm_profile_has_both_stacks():
    prof = profile_model("llava-tiny", 64, "float32")
    names = prof.layer_names()
    assert names[:2] == ["vision/embed", "vision/layer_0"] and names[-1] == "decoder/head"
    assert "projector" in names and prof.param_count == models.resolve("llava-tiny").num_params()


@pytest.mark.slow
def test_gpt_175b_plans_from_its_traced_program():
    # Shape-only: the model, its optimizer and batch are ShapeDtypeStructs.
    program = models.program("gpt-175b", seq_len=2048, dtype="bfloat16")
    lay = program.layering(2)
    assert lay.num_layers == 98 and lay.source == "scopes" and len(set(lay.kinds)) == 3
    prof = profile_model("gpt-175b", 2048, "bfloat16")
    assert prof.param_bytes == models.resolve("gpt-175b").num_params() * 4
    assert prof.opt_bytes_per_param_byte == 2.0  # AdamW's two float32 moments
    assert np.isfinite([layer.flops(1) for layer in prof.layers]).all()
