import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import hetshard
import hetshard_models as models
from hetshard.kernels.reference import attention_reference
from hetshard_models import data
from hetshard_models.mllm import IMAGE_TOKEN, pack

TINY_LM = ["gpt-tiny", "llama-tiny", "moe-tiny"]


def lm_loss(model, batch):
    logits = model(batch["tokens"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def mllm_loss(model, batch):
    logits = model(batch["tokens"], batch["images"], batch["image_index"],
                   positions_bs=batch["positions"], segment_ids_bs=batch["segment_ids"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return (ce * batch["loss_mask"]).sum() / batch["loss_mask"].sum()


def vit_loss(model, batch):
    logits = model(batch["images"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


def train(model, loss_fn, batch, steps=10, lr=1e-2):
    opt = nnx.Optimizer(model, optax.adam(lr), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        opt.update(model, grads)
        return loss, grads

    losses = []
    for _ in range(steps):
        loss, grads = step(model, opt, batch)
        losses.append(float(loss))
        for g in jax.tree.leaves(grads):
            assert bool(jnp.all(jnp.isfinite(g)))
    return losses


@pytest.mark.parametrize("name", TINY_LM)
def test_lm_forward_shapes_and_training(name, rng):
    model = models.build(name, rngs=0)
    c = model.config
    batch = data.text_batch(rng, 4, 32, c.vocab)
    logits = model(batch["tokens"])
    assert logits.shape == (4, 32, c.vocab) and logits.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(logits)))
    losses = train(model, lm_loss, batch)
    assert losses[-1] < 0.7 * losses[0], losses


def test_vit_classifier_trains(rng):
    cfg = dataclasses.replace(models.resolve("vit-tiny"), num_classes=3)
    model = models.build(cfg)
    labels = rng.integers(0, 3, 8)
    images = rng.normal(size=(8, 16, 16, 3)).astype(np.float32) + labels[:, None, None, None]
    batch = {"images": images, "labels": labels.astype(np.int32)}
    assert model(images).shape == (8, 3)
    feats = models.build("vit-tiny")(images)
    assert feats.shape == (8, 17, 32)
    losses = train(model, vit_loss, batch)
    assert losses[-1] < 0.7 * losses[0], losses


def test_mllm_trains(rng):
    model = models.build("llava-tiny")
    batch = data.mllm_batch(rng, 4, model.config, seq_len=64)
    assert (batch["image_index"] >= 0).any() and (batch["segment_ids"].max(axis=1) >= 2).any()
    losses = train(model, mllm_loss, batch)
    assert losses[-1] < 0.7 * losses[0], losses


def _sample(rng, config, n_images, n_text):
    toks = rng.integers(1, config.text.vocab, n_text)
    slots = [IMAGE_TOKEN] * (config.image_tokens * n_images)
    return {"tokens": np.concatenate([toks[:2], slots, toks[2:]]),
            "images": rng.normal(size=(n_images, 16, 16, 3)).astype(np.float32)}


def test_mllm_packing_keeps_samples_independent(rng):
    model = models.build("llava-tiny")
    c = model.config
    a, b = _sample(rng, c, 1, 9), _sample(rng, c, 1, 7)
    b2 = _sample(rng, c, 1, 7)  # same length, different tokens and image
    kw = dict(config=c, seq_len=64, images_per_row=2)
    packed, packed2, alone = pack([a, b], **kw), pack([a, b2], **kw), pack([a], **kw)
    assert packed["tokens"].shape[0] == 1  # both samples share one row

    def run(p):
        return np.asarray(model(p["tokens"], p["images"], p["image_index"],
                                positions_bs=p["positions"], segment_ids_bs=p["segment_ids"]))

    out, out2, out_alone = run(packed), run(packed2), run(alone)
    n_a = len(a["tokens"])
    # Sample a's logits do not depend on its neighbour, and equal a's logits alone.
    np.testing.assert_allclose(out[0, :n_a], out2[0, :n_a], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out[0, :n_a], out_alone[0, :n_a], rtol=1e-5, atol=1e-5)
    # ... while the neighbour's own logits did change (the test can fail).
    n_b = len(b["tokens"])
    assert np.abs(out[0, n_a:n_a + n_b] - out2[0, n_a:n_a + n_b]).max() > 1e-3


def test_pack_rejects_bad_samples(rng):
    c = models.resolve("llava-tiny")
    s = _sample(rng, c, 1, 5)
    with pytest.raises(hetshard.SpecError, match="image slots"):
        pack([{"tokens": s["tokens"][:-20], "images": s["images"]}], config=c, seq_len=64,
             images_per_row=2)
    with pytest.raises(hetshard.SpecError, match="seq_len"):
        pack([s], config=c, seq_len=8, images_per_row=2)
    with pytest.raises(hetshard.SpecError, match="images_per_row"):
        pack([_sample(rng, c, 2, 4)], config=c, seq_len=64, images_per_row=1)


@pytest.mark.parametrize("name", sorted(models.PUBLISHED_PARAMS))
def test_preset_parameter_counts_match_published(name):
    config = models.PRESETS[name]
    published, _source = models.PUBLISHED_PARAMS[name]
    counted = models.param_count(models.abstract(config))
    assert counted == config.num_params()
    assert abs(counted / published - 1) <= 0.02, (counted, published)


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny", "vit-tiny", "llava-tiny",
                                  "moe-tiny"])
def test_abstract_model_matches_real_model(name):
    shapes = lambda m: jax.tree.map(lambda x: (x.shape, x.dtype), nnx.state(m, nnx.Param))
    real, abst = shapes(models.build(name)), shapes(models.abstract(name))
    assert jax.tree.structure(real) == jax.tree.structure(abst)
    assert jax.tree.leaves(real) == jax.tree.leaves(abst)
    assert models.param_count(models.build(name)) == models.PRESETS[name].num_params()


def _name_stacks(jaxpr) -> set[str]:
    out = set()
    for eqn in jaxpr.eqns:
        out.add(str(eqn.source_info.name_stack))
        for p in eqn.params.values():
            for sub in (p if isinstance(p, (list, tuple)) else [p]):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    out |= _name_stacks(inner)
    return out


def test_layer_scopes_visible_in_train_step_jaxpr(rng):
    model = models.build("llava-tiny")
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    batch = data.mllm_batch(rng, 2, model.config, seq_len=64)
    graphdef, state = nnx.split((model, opt))

    def step(state, batch):
        m, o = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(mllm_loss)(m, batch)
        o.update(m, grads)
        return loss, nnx.state((m, o))

    stacks = _name_stacks(jax.make_jaxpr(step)(state, batch).jaxpr)
    for scope in ["decoder/layer_0", "decoder/layer_1", "vision/layer_0", "vision/layer_1"]:
        assert any(s.startswith(f"jvp({scope}") for s in stacks), (scope, stacks)
        assert any(s.startswith(f"transpose(jvp({scope}") for s in stacks), (scope, stacks)
    assert not any("layer_2" in s for s in stacks)


def test_attention_goes_through_one_named_function(rng):
    model = models.build("gpt-tiny")
    jaxpr = jax.make_jaxpr(lambda t: model(t))(jnp.zeros((2, 8), jnp.int32))
    names = [e.params.get("name") for e in jaxpr.jaxpr.eqns]
    assert names.count(hetshard.nn.CAUSAL_ATTENTION_NAME) == model.config.layers


def test_gqa_equals_mha_with_repeated_kv(rng):
    q = jnp.asarray(rng.normal(size=(2, 8, 4, 16)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(2, 8, 2, 16)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(2, 8, 2, 16)), jnp.float32)
    seg = jnp.asarray([[1, 1, 1, 2, 2, 2, 2, 0]] * 2, jnp.int32)
    got = hetshard.nn.attention(q, k, v, causal=True, segment_ids=seg)
    want = attention_reference(q, jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2),
                               causal=True, segment_ids=seg)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # Direct softmax formula for one (batch, head, query) entry.
    b, h, i = 1, 3, 5
    logits = (k[b, :, h // 2] @ q[b, i, h]) / 4.0
    visible = (jnp.arange(8) <= i) & (seg[b] == seg[b, i])
    p = jnp.where(visible, jnp.exp(logits - logits[visible].max()), 0.0)
    np.testing.assert_allclose(got[b, i, h], (p / p.sum()) @ v[b, :, h // 2], rtol=1e-5)


@pytest.mark.parametrize("shape_k,seg,match", [
    ((2, 8, 3, 16), None, "kv heads dividing"),
    ((2, 8, 2, 8), None, "head_dim"),
    ((2, 8, 2, 16), np.zeros((2, 7), np.int32), "segment_ids.shape"),
    ((2, 8, 2, 16), np.zeros((2, 8), np.float32), "segment_ids.dtype"),
])
def test_attention_rejects_bad_arguments(shape_k, seg, match):
    q = jnp.zeros((2, 8, 4, 16))
    k = jnp.zeros(shape_k)
    with pytest.raises(hetshard.SpecError, match=match):
        hetshard.nn.attention(q, k, k, causal=False, segment_ids=seg)


def test_model_spec_parsing():
    c = models.resolve("gpt:layers=24,hidden=2304,heads=24,vocab=51200,seq=2048")
    assert (c.layers, c.hidden, c.heads, c.vocab, c.seq, c.ffn_dim) == (24, 2304, 24, 51200,
                                                                        2048, 9216)
    c = models.resolve("gpt:layers=2,hidden=64,heads=4,vocab=100,seq=16,ffn=96,kv_heads=2,"
                       "pos=rope,norm=rmsnorm,mlp=swiglu,tied=false")
    assert (c.ffn_dim, c.num_kv_heads, c.pos, c.norm, c.mlp, c.tied) == (
        96, 2, "rope", "rmsnorm", "swiglu", False)
    assert models.param_count(models.build(c)) == c.num_params()
    m = models.resolve("mllm:vision=vit-tiny,text=llama-tiny,projector=linear")
    assert m.vision.name == "vit-tiny" and m.projector == "linear"
    assert models.resolve("vit:layers=1,hidden=8,heads=2,ffn=16,patch=2,image=4").seq == 5


@pytest.mark.parametrize("spec,match", [
    ("gpt:layers=2,hidden=64,heads=4,vocab=100", "seq"),
    ("gpt:layers=2,hidden=64,heads=4,vocab=100,seq=8,depth=3", "depth"),
    ("gpt:layers=two,hidden=64,heads=4,vocab=100,seq=8", "layers"),
    ("gpt:layers=2,hidden=64,heads=5,vocab=100,seq=8", "hidden"),
    ("gpt:layers=2,hidden=64,heads=4,vocab=100,seq=8,kv_heads=3", "kv_heads"),
    ("gpt:layers=2,hidden=64,heads=4,vocab=100,seq=8,pos=alibi", "pos"),
    ("gpt:layers=0,hidden=64,heads=4,vocab=100,seq=8", "layers"),
    ("gpt:layers=2,hidden=64,heads=4,vocab=100,seq=8,tied=maybe", "tied"),
    ("gpt:layers=2,hidden=64,heads=4,vocab=100,seq=8,experts=1", "experts"),
    ("gpt:layers=2,hidden=64,heads=4,vocab=100,seq=8,experts=4,top_k=5", "top_k"),
    ("gpt:layers=2,hidden=64,heads=4,vocab=100,seq=8,experts=4,dense_layers=2",
     "dense_layers"),
    ("gpt:layers=2,hidden=64,heads=4,vocab=100,seq=8,experts=4,expert_ffn=0",
     "expert_ffn"),
    ("bert:layers=2", "bert"),
    ("gpt-7b", "gpt-6.7b"),
])
def test_model_spec_errors(spec, match):
    with pytest.raises(hetshard.HetshardError, match=match):
        models.resolve(spec)


def test_the_zoos_mixture_of_experts_is_found_and_cuts_by_token():
    """moe-tiny (a dense first block, then a dropless MoE with a shared expert): hetshard
    finds its one MoE layer in the trace, stacked experts and all, and its loss treats
    the samples one by one."""
    from hetshard_models.steps import program
    prog = program("moe-tiny", seq_len=16)
    (layer,) = prog.moe_layers
    assert (layer.experts, layer.k, layer.dispatch) == (4, 2, "dropless")
    assert sorted(prog.param_path(i).rsplit("/", 1)[-1] for i in layer.expert_weights) == \
        ["down", "gate", "up"]
    assert prog.samples.coupling is None and prog.samples.gap is None
