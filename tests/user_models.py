"""Models written the way users write them: nothing from ``models/`` or ``hetshard.nn``.

Each ``make_*`` returns ``(step, args, batches)``: a train step, the arguments of its
first call (the batch last) and a few batches to train on. Every loss is a mean over
samples of per-sample values, so micro-batches and batch shares weighted by their sizes
give the global loss exactly. The steps differentiate as users write them: Flax's
tutorial step (``nnx.value_and_grad`` with aux and a metrics object), ``nnx.grad`` of a
closure over the batch, ``jax.value_and_grad`` of a pytree, and
``hetshard.value_and_grad``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.nnx import value_and_grad as imported_value_and_grad

import hetshard

VOCAB, SEQ, DIM, HEADS = 64, 16, 32, 4


def _text_batches(rng, n=2, batch=8, seq=SEQ, vocab=VOCAB):
    out = []
    for _ in range(n):
        start = rng.integers(0, vocab, (batch, 1))
        rows = (start * 5 + 3 * np.arange(seq + 1)) % vocab
        out.append({"tokens": jnp.asarray(rows[:, :-1], jnp.int32),
                    "targets": jnp.asarray(rows[:, 1:], jnp.int32)})
    return out


def lm_loss(model, batch):
    logits = model(batch["tokens"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def nnx_step(loss):
    def step(model, optimizer, batch):
        value, grads = hetshard.value_and_grad(loss)(model, batch)
        optimizer.update(model, grads)
        return value
    return step


def flax_step(loss):
    """The step as Flax users write it: ``nnx.value_and_grad`` of ``loss(model, batch)``
    called in the step (hetshard answers the plain transform), the update, the loss."""
    def step(model, optimizer, batch):
        value, grads = nnx.value_and_grad(loss)(model, batch)
        optimizer.update(model, grads)
        return value
    return step


def by_name_step(model, optimizer, batch):
    """A step calling Flax's transform by a name imported from it (``from flax.nnx
    import value_and_grad``), not as ``nnx.value_and_grad``."""
    value, grads = imported_value_and_grad(lm_loss)(model, batch)
    optimizer.update(model, grads)
    return value


def tutorial_step(loss, per_sample_aux=False):
    """Flax's own tutorial step: ``nnx.value_and_grad`` with aux and a metrics object
    updated from it (hetshard answers the plain transform). The aux is the batch's
    accuracy, or (``per_sample_aux``, as the tutorial writes it) the logits themselves,
    which keep the batch whole."""
    def with_aux(model, batch):
        logits = model(batch[_INPUT[loss]])
        labels = batch[_LABEL[loss]]
        value = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        if per_sample_aux:
            return value, logits
        return value, (logits.argmax(-1) == labels).mean()

    def step(model, optimizer, metrics, batch):
        grad_fn = nnx.value_and_grad(with_aux, has_aux=True)
        (value, aux), grads = grad_fn(model, batch)
        if per_sample_aux:
            metrics.update(loss=value, logits=aux, labels=batch[_LABEL[loss]])
        else:
            metrics.update(loss=value, accuracy=aux)
        optimizer.update(model, grads)
        return value
    return step


def closure_step(loss):
    """``nnx.grad`` of a loss that closes over the batch, returning it as its aux."""
    def step(model, optimizer, batch):
        def of_model(m):
            value = loss(m, batch)
            return value, value
        grads, value = nnx.grad(of_model, has_aux=True)(model)
        optimizer.update(model, grads)
        return value
    return step


# ---- (a) a pre-norm transformer, einsum attention, no named scopes ---------------------

class Block(nnx.Module):
    def __init__(self, d, heads, rngs):
        self.heads = heads
        self.ln1, self.ln2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
        self.wq = nnx.Linear(d, d, rngs=rngs)
        self.wk = nnx.Linear(d, d, rngs=rngs)
        self.wv = nnx.Linear(d, d, rngs=rngs)
        self.wo = nnx.Linear(d, d, rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x):
        b, s, d = x.shape
        h = self.ln1(x)
        q, k, v = (w(h).reshape(b, s, self.heads, d // self.heads)
                   for w in (self.wq, self.wk, self.wv))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // self.heads)
        scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -1e9)
        y = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        x = x + self.wo(y.reshape(b, s, d))
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class TinyLM(nnx.Module):
    def __init__(self, rngs, layers=4, d=DIM, heads=HEADS):
        self.embed = nnx.Embed(VOCAB, d, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (SEQ, d)))
        self.blocks = nnx.List([Block(d, heads, rngs) for _ in range(layers)])
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.head = nnx.Linear(d, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens) + self.pos[None, :tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def make_transformer(seed=0):
    model = TinyLM(nnx.Rngs(seed))
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    batches = _text_batches(np.random.default_rng(seed))
    return nnx_step(lm_loss), (model, opt, batches[0]), batches


def make_tutorial(seed=0):
    """The transformer under Flax's tutorial step, its aux the batch's accuracy."""
    model = TinyLM(nnx.Rngs(seed))
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"),
                              accuracy=nnx.metrics.Average("accuracy"))
    batches = _text_batches(np.random.default_rng(seed))
    return tutorial_step(lm_loss), (model, opt, metrics, batches[0]), batches


def make_logits_aux(seed=0):
    """The transformer under Flax's tutorial step as written there: the logits as aux."""
    model = TinyLM(nnx.Rngs(seed))
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"),
                              accuracy=nnx.metrics.Accuracy())
    batches = _text_batches(np.random.default_rng(seed))
    return (tutorial_step(lm_loss, per_sample_aux=True), (model, opt, metrics, batches[0]),
            batches)


# ---- (b) the same blocks stacked and run by nnx.scan -----------------------------------

class ScanLM(nnx.Module):
    def __init__(self, rngs, layers=4, d=DIM, heads=HEADS):
        self.embed = nnx.Embed(VOCAB, d, rngs=rngs)

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs):
            return Block(d, heads, rngs)
        self.blocks = create(rngs)
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.head = nnx.Linear(d, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(x, block):
            return block(x)
        return self.head(self.norm(run(self.embed(tokens), self.blocks)))


def make_scanned(seed=0):
    model = ScanLM(nnx.Rngs(seed))
    opt = nnx.Optimizer(model, optax.sgd(0.05, momentum=0.9), wrt=nnx.Param)
    batches = _text_batches(np.random.default_rng(seed))
    return nnx_step(lm_loss), (model, opt, batches[0]), batches


# ---- (c) an MLP-Mixer: no attention ------------------------------------------------------

class MixerBlock(nnx.Module):
    def __init__(self, tokens, d, rngs):
        self.ln1, self.ln2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
        self.tok1, self.tok2 = nnx.Linear(tokens, 2 * tokens, rngs=rngs), nnx.Linear(
            2 * tokens, tokens, rngs=rngs)
        self.ch1, self.ch2 = nnx.Linear(d, 2 * d, rngs=rngs), nnx.Linear(2 * d, d, rngs=rngs)

    def __call__(self, x):  # [batch, tokens, channels]
        y = jnp.swapaxes(self.ln1(x), 1, 2)
        x = x + jnp.swapaxes(self.tok2(jax.nn.gelu(self.tok1(y))), 1, 2)
        return x + self.ch2(jax.nn.gelu(self.ch1(self.ln2(x))))


class Mixer(nnx.Module):
    def __init__(self, rngs, layers=4, patch=4, image=16, d=DIM, classes=10):
        self.patch = patch
        tokens = (image // patch) ** 2
        self.stem = nnx.Linear(patch * patch * 3, d, rngs=rngs)
        self.blocks = nnx.List([MixerBlock(tokens, d, rngs) for _ in range(layers)])
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.head = nnx.Linear(d, classes, rngs=rngs)

    def __call__(self, images):
        b, h, w, c = images.shape
        p = self.patch
        x = images.reshape(b, h // p, p, w // p, p, c).transpose(0, 1, 3, 2, 4, 5)
        x = self.stem(x.reshape(b, (h // p) * (w // p), p * p * c))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(axis=1))


def image_loss(model, batch):
    logits = model(batch["images"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


def _image_batches(rng, n=2, batch=8, image=16, classes=10):
    out = []
    for _ in range(n):
        labels = rng.integers(0, classes, batch)
        images = rng.standard_normal((batch, image, image, 3)) + labels[:, None, None, None]
        out.append({"images": jnp.asarray(images, jnp.float32),
                    "labels": jnp.asarray(labels, jnp.int32)})
    return out


def make_mixer(seed=0):
    model = Mixer(nnx.Rngs(seed))
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    batches = _image_batches(np.random.default_rng(seed))
    return closure_step(image_loss), (model, opt, batches[0]), batches


# ---- (d) a pure-pytree functional step: a params dict and optax.lion --------------------

def init_params(key, layers=4, d=DIM, ffn=2 * DIM):
    keys = jax.random.split(key, 2 * layers + 2)
    normal = lambda k, shape: 0.05 * jax.random.normal(k, shape)  # noqa: E731
    return {
        "embed": normal(keys[0], (VOCAB, d)),
        "blocks": [{"w_in": normal(keys[1 + 2 * i], (d, ffn)), "b_in": jnp.zeros(ffn),
                    "w_out": normal(keys[2 + 2 * i], (ffn, d)), "scale": jnp.ones(d)}
                   for i in range(layers)],
        "head": normal(keys[-1], (d, VOCAB)),
    }


def functional_loss(params, batch):
    x = params["embed"][batch["tokens"]]
    for blk in params["blocks"]:
        h = x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * blk["scale"]
        x = x + jnp.tanh(h @ blk["w_in"] + blk["b_in"]) @ blk["w_out"]
    logits = x @ params["head"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def make_functional(seed=0):
    params = init_params(jax.random.key(seed))
    tx = optax.lion(1e-3)

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(functional_loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates), opt_state

    batches = _text_batches(np.random.default_rng(seed))
    return step, (params, tx.init(params), batches[0]), batches


# ---- (e) two towers: a vision encoder and a text encoder, a joint classifier ------------

class Tower(nnx.Module):
    def __init__(self, d, heads, layers, rngs):
        self.blocks = nnx.List([Block(d, heads, rngs) for _ in range(layers)])

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class TwoTower(nnx.Module):
    def __init__(self, rngs, layers=2, d=DIM, heads=HEADS, classes=10):
        self.patches = nnx.Linear(4 * 4 * 3, d, rngs=rngs)
        self.vision = Tower(d, heads, layers, rngs)
        self.words = nnx.Embed(VOCAB, 2 * d, rngs=rngs)
        self.text = Tower(2 * d, heads, layers, rngs)
        self.classify = nnx.Linear(3 * d, classes, rngs=rngs)

    def __call__(self, images, tokens):
        b = images.shape[0]
        x = images.reshape(b, 4, 4, 4, 4, 3).transpose(0, 1, 3, 2, 4, 5).reshape(b, 16, 48)
        v = self.vision(self.patches(x)).mean(axis=1)
        t = self.text(self.words(tokens)).mean(axis=1)
        return self.classify(jnp.concatenate([v, t], axis=-1))


def two_tower_loss(model, batch):
    logits = model(batch["images"], batch["tokens"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


def make_two_tower(seed=0):
    model = TwoTower(nnx.Rngs(seed))
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    rng = np.random.default_rng(seed)
    batches = [dict(img, tokens=txt["tokens"]) for img, txt in
               zip(_image_batches(rng), _text_batches(rng), strict=True)]
    return nnx_step(two_tower_loss), (model, opt, batches[0]), batches


# ---- (f) flax's own attention and norms, the embedding tied to the output ---------------

class FlaxBlock(nnx.Module):
    def __init__(self, d, heads, rngs):
        self.n1, self.n2 = nnx.RMSNorm(d, rngs=rngs), nnx.RMSNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(heads, d, decode=False, rngs=rngs)
        self.mlp = nnx.Sequential(nnx.Linear(d, 4 * d, rngs=rngs), nnx.gelu,
                                  nnx.Linear(4 * d, d, rngs=rngs))

    def __call__(self, x, mask):
        x = x + self.attn(self.n1(x), mask=mask)
        return x + self.mlp(self.n2(x))


class TiedLM(nnx.Module):
    def __init__(self, rngs, layers=4, d=DIM, heads=HEADS):
        self.embed = nnx.Embed(VOCAB, d, rngs=rngs)
        self.blocks = nnx.List([FlaxBlock(d, heads, rngs) for _ in range(layers)])
        self.norm = nnx.RMSNorm(d, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        mask = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.embed.attend(self.norm(x))


def make_flax_attention(seed=0):
    model = TiedLM(nnx.Rngs(seed))
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    batches = _text_batches(np.random.default_rng(seed))
    return nnx_step(lm_loss), (model, opt, batches[0]), batches


# ---- (g) LoRA fine-tuning: only the adapters differentiated and updated -----------------

class LoRABlock(Block):
    def __init__(self, d, heads, rngs, rank=4):
        super().__init__(d, heads, rngs)
        self.wq = nnx.LoRALinear(d, d, lora_rank=rank, rngs=rngs)
        self.wv = nnx.LoRALinear(d, d, lora_rank=rank, rngs=rngs)


class LoRALM(TinyLM):
    def __init__(self, rngs, layers=4, d=DIM, heads=HEADS):
        super().__init__(rngs, layers, d, heads)
        self.blocks = nnx.List([LoRABlock(d, heads, rngs) for _ in range(layers)])


def make_lora(seed=0):
    model = LoRALM(nnx.Rngs(seed))
    # flax initialises lora_b to zeros: give the adapters a start that moves the loss
    adapters = [x for _, x in nnx.iter_graph(model) if isinstance(x, nnx.LoRA)]
    for k, x in enumerate(adapters):
        x.lora_b[...] = 0.05 * jax.random.normal(jax.random.key(k), x.lora_b.shape)
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.LoRAParam)

    def step(model, optimizer, batch):
        value, grads = hetshard.value_and_grad(
            lm_loss, argnums=nnx.DiffState(0, nnx.LoRAParam))(model, batch)
        optimizer.update(model, grads)
        return value
    batches = _text_batches(np.random.default_rng(seed))
    return step, (model, opt, batches[0]), batches


_INPUT = {lm_loss: "tokens", image_loss: "images"}
_LABEL = {lm_loss: "targets", image_loss: "labels"}

MODELS = {"transformer": make_transformer, "tutorial": make_tutorial,
          "scanned": make_scanned, "mixer": make_mixer, "functional": make_functional,
          "two_tower": make_two_tower, "flax_attention": make_flax_attention,
          "lora": make_lora}


# ---- a packed LM: samples share rows, attention kept within each ------------------------
# Not in MODELS (its batch is packed rows: hetshard.data.packed_arrays).

class PackedLM(nnx.Module):
    """A causal LM over packed rows as a user writes one with Flax's own pieces:
    ``nnx.MultiHeadAttention`` under ``nnx.make_causal_mask`` combined with a segment
    mask from ``nnx.make_attention_mask``, learned positions that restart per sample.
    Called on tokens alone it is one sample a row."""

    def __init__(self, rngs, layers=2, d=DIM, heads=HEADS, max_len=64):
        self.embed = nnx.Embed(VOCAB, d, rngs=rngs)
        self.pos = nnx.Embed(max_len, d, rngs=rngs)
        self.blocks = nnx.List([FlaxBlock(d, heads, rngs) for _ in range(layers)])
        self.norm = nnx.RMSNorm(d, rngs=rngs)
        self.head = nnx.Linear(d, VOCAB, rngs=rngs)

    def __call__(self, tokens, positions=None, segment_ids=None):
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        if segment_ids is None:
            segment_ids = jnp.ones_like(tokens)
        mask = nnx.combine_masks(nnx.make_causal_mask(tokens),
                                 nnx.make_attention_mask(segment_ids, segment_ids, jnp.equal))
        x = self.embed(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


def packed_loss(model, batch):
    """Each row's weighted next-token cross-entropy, averaged over rows."""
    logits = model(batch["tokens"], batch["positions"], batch["segment_ids"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return (ce * batch["loss_weight"]).sum(-1).mean()


# ---- a model with dropout: an RNG stream in the model state ----------------------------
# Not in MODELS: a dropout mask is drawn in the batch's shape from the model's RNG
# stream, so each micro-batch of a cut batch would draw the same mask again (not its
# rows of the whole batch's): hetshard keeps such a step to the whole batch, where it
# matches nnx.jit exactly.

class DropoutMLP(nnx.Module):
    def __init__(self, rngs, layers=3, d=DIM):
        self.embed = nnx.Embed(VOCAB, d, rngs=rngs)
        self.hidden = nnx.List([nnx.Linear(d, d, rngs=rngs) for _ in range(layers)])
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.head = nnx.Linear(d, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for lin in self.hidden:
            x = x + self.drop(jax.nn.gelu(lin(x)))
        return self.head(x)


def make_dropout(seed=0):
    model = DropoutMLP(nnx.Rngs(seed, dropout=seed + 1))
    opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    return nnx_step(lm_loss), [model, opt, None], _text_batches(np.random.default_rng(seed))


# ---- a CNN with batch statistics: its loss mixes the batch's samples -------------------
# Not in MODELS: nnx.BatchNorm normalises over the batch, so a plan that cuts the batch
# computes other statistics than one device (hetshard keeps it to the whole batch).

class BatchNormCNN(nnx.Module):
    def __init__(self, rngs, width=8, classes=10):
        self.convs = nnx.List([nnx.Conv(c, width, (3, 3), rngs=rngs) for c in (3, width, width)])
        self.norms = nnx.List([nnx.BatchNorm(width, rngs=rngs) for _ in range(3)])
        self.head = nnx.Linear(width, classes, rngs=rngs)

    def __call__(self, x):
        for conv, norm in zip(self.convs, self.norms, strict=True):
            x = nnx.relu(norm(conv(x)))
        return self.head(x.mean(axis=(1, 2)))


def make_batchnorm(seed=0):
    model = BatchNormCNN(nnx.Rngs(seed))
    opt = nnx.Optimizer(model, optax.sgd(1e-2, momentum=0.9), wrt=nnx.Param)
    batches = _image_batches(np.random.default_rng(seed))
    return nnx_step(image_loss), (model, opt, batches[0]), batches


def _by_name_grads(model, batch):  # a helper of the step's module, by the same name
    return imported_value_and_grad(lm_loss)(model, batch)


def by_name_helper_step(model, optimizer, batch):
    """``by_name_step`` with the transform called in a helper of its module."""
    value, grads = _by_name_grads(model, batch)
    optimizer.update(model, grads)
    return value


# ---- Flax's MNIST tutorial: a pooling CNN, the logits as aux, train and eval steps -----

class PoolingCNN(nnx.Module):
    """The tutorial's CNN (convolutions, average pooling, two dense layers), smaller."""

    def __init__(self, rngs, classes=10):
        self.conv1 = nnx.Conv(3, 8, kernel_size=(3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(8, 8, kernel_size=(3, 3), rngs=rngs)
        self.linear1 = nnx.Linear(8 * 4 * 4, 32, rngs=rngs)
        self.linear2 = nnx.Linear(32, classes, rngs=rngs)

    def __call__(self, x):
        x = nnx.avg_pool(nnx.relu(self.conv1(x)), window_shape=(2, 2), strides=(2, 2))
        x = nnx.max_pool(nnx.relu(self.conv2(x)), window_shape=(2, 2), strides=(2, 2))
        x = x.reshape(x.shape[0], -1)
        return self.linear2(nnx.relu(self.linear1(x)))


def mnist_loss(model, batch):
    logits = model(batch["image"])
    loss = optax.softmax_cross_entropy_with_integer_labels(
        logits=logits, labels=batch["label"]).mean()
    return loss, logits


def mnist_train_step(model, optimizer, metrics, batch):
    grad_fn = nnx.value_and_grad(mnist_loss, has_aux=True)
    (loss, logits), grads = grad_fn(model, batch)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])
    optimizer.update(model, grads)


def mnist_eval_step(model, metrics, batch):
    loss, logits = mnist_loss(model, batch)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])


def make_mnist(seed=0):
    """(model, optimizer, metrics, batches) as the tutorial builds them."""
    model = PoolingCNN(nnx.Rngs(seed))
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(),
                              loss=nnx.metrics.Average("loss"))
    rng = np.random.default_rng(seed)
    batches = [{"image": b["images"], "label": b["labels"]} for b in _image_batches(rng)]
    return model, opt, metrics, batches


def rolled_gradients(tx):
    """``tx`` after a transform that mixes the gradients of different parameters
    element by element (the flattened gradient rolled by one): an update coupling no
    pipeline stage split can run, as no few scalars carry it."""
    from jax.flatten_util import ravel_pytree

    def update(grads, state, params=None):
        flat, unravel = ravel_pytree(grads)
        return unravel(0.5 * (flat + jnp.roll(flat, 1))), state
    return optax.chain(optax.GradientTransformation(lambda params: optax.EmptyState(),
                                                    update), tx)


class RouterBias(nnx.Variable):
    """The router's load-balancing bias: state the step updates, not a parameter."""


class MoE(nnx.Module):
    """A mixture-of-experts feed-forward layer written from scratch: a router, top-``k``,
    experts stacked on a leading axis, and one of three dispatches: ``"dropless"``
    (tokens sorted by expert, ``jax.lax.ragged_dot``), ``"capacity"`` (one-hot positions
    into per-expert buffers of ``capacity_factor * tokens * k / experts`` rows; a token
    past them is dropped) or ``"dense"`` (every expert on every token, gated after).
    ``shared``: a dense expert every token also goes through. ``balance="sequence"``:
    the call also returns DeepSeek-V3's sequence-level balance loss, one per sample
    (experts x the sum over experts of the fraction of the sequence's routed tokens
    times its mean router probability); ``"batch"``: Switch's, the same over the whole
    batch (one value); ``"bias"``: no loss, DeepSeek-V3's auxiliary-loss-free balancing
    (a router bias for choosing experts, updated each step outside the gradient); else
    None."""

    def __init__(self, d, f, experts, k, dispatch, rngs, shared=False, capacity_factor=2.0,
                 balance=None):
        init = nnx.initializers.lecun_normal()
        self.router = nnx.Linear(d, experts, use_bias=False, rngs=rngs)
        self.w_in = nnx.Param(init(rngs.params(), (experts, d, f)))
        self.w_out = nnx.Param(init(rngs.params(), (experts, f, d)))
        self.k, self.experts, self.dispatch = k, experts, dispatch
        self.capacity_factor, self.balance = capacity_factor, balance
        self.shared = nnx.Linear(d, d, rngs=rngs) if shared else None
        # DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias added to the
        # scores for choosing experts only, nudged each step toward the underloaded
        # experts, outside the gradient (a state variable, not a parameter)
        self.bias = RouterBias(jnp.zeros(experts)) if balance == "bias" else None

    def __call__(self, x):
        b, s, d = x.shape
        t = x.reshape(b * s, d)
        probs = jax.nn.softmax(self.router(t), axis=-1)
        if self.bias is not None:
            _, idx = jax.lax.top_k(probs + self.bias[...], self.k)
            gates = jnp.take_along_axis(probs, idx, axis=-1)
            load = jnp.bincount(idx.reshape(-1), length=self.experts).astype(jnp.float32)
            self.bias[...] = self.bias[...] + 1e-2 * jnp.sign(load.mean() - load)
        else:
            gates, idx = jax.lax.top_k(probs, self.k)
        aux = None
        if self.balance == "sequence":
            routed = jax.nn.one_hot(idx, self.experts).sum(1).reshape(b, s, self.experts)
            share = routed.mean(1) / self.k
            aux = self.experts * (share * probs.reshape(b, s, self.experts).mean(1)).sum(-1)
        elif self.balance == "batch":  # Switch's: the whole batch's share and probability
            share = jax.nn.one_hot(idx, self.experts).sum(1).mean(0) / self.k
            aux = self.experts * (share * probs.mean(0)).sum()
        gates = gates / gates.sum(-1, keepdims=True)
        if self.dispatch == "dropless":
            flat = idx.reshape(-1)
            order = jnp.argsort(flat)
            sizes = jnp.bincount(flat, length=self.experts).astype(jnp.int32)
            h = jax.nn.gelu(jax.lax.ragged_dot(t[order // self.k], self.w_in[...], sizes))
            y = jax.lax.ragged_dot(h, self.w_out[...], sizes)
            out = jnp.zeros((b * s * self.k, d), y.dtype).at[order].set(y)
            out = (out.reshape(b * s, self.k, d) * gates[..., None]).sum(1)
        elif self.dispatch == "capacity":
            cap = int(self.capacity_factor * b * s * self.k / self.experts)
            mask = jax.nn.one_hot(idx, self.experts)  # [tokens, k, experts]
            pos = (jnp.cumsum(mask.reshape(-1, self.experts), 0).reshape(mask.shape)
                   - 1).astype(jnp.int32)
            kept = (pos < cap) & (mask > 0)
            slots = jax.nn.one_hot(jnp.where(kept, pos, -1), cap) * kept[..., None]
            h = jax.nn.gelu(jnp.einsum("ecd,edf->ecf",
                                       jnp.einsum("tkec,td->ecd", slots, t), self.w_in[...]))
            y = jnp.einsum("ecf,efd->ecd", h, self.w_out[...])
            out = jnp.einsum("tkec,tk,ecd->td", slots, gates, y)
        else:
            weights = jnp.zeros((b * s, self.experts), gates.dtype).at[
                jnp.arange(b * s)[:, None], idx].set(gates)
            h = jax.nn.gelu(jnp.einsum("td,edf->tef", t, self.w_in[...]))
            out = jnp.einsum("tef,efd,te->td", h, self.w_out[...], weights)
        if self.shared is not None:
            out = out + self.shared(t)
        return out.reshape(b, s, d), aux


class MoEBlock(nnx.Module):
    def __init__(self, d, rngs, **moe):
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.moe = MoE(d, 2 * d, rngs=rngs, **moe)

    def __call__(self, x):
        out, aux = self.moe(self.norm(x))
        return x + out, aux


class MoELM(nnx.Module):
    """Embedding, ``layers`` MoE blocks, head: the MoE tests' model. Returns the logits,
    and with a balance loss also its mean over the blocks, per sample."""

    def __init__(self, rngs, layers=2, d=16, **moe):
        self.embed = nnx.Embed(VOCAB, d, rngs=rngs)
        self.blocks = nnx.List([MoEBlock(d, rngs, **moe) for _ in range(layers)])
        self.head = nnx.Linear(d, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        x, balance = self.embed(tokens), []
        for block in self.blocks:
            x, aux = block(x)
            if aux is not None:
                balance.append(aux)
        logits = self.head(x)
        return (logits, sum(balance) / len(balance)) if balance else logits


def moe_balanced_loss(model, batch):
    logits, balance = model(batch["tokens"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
    return ce + 0.01 * balance.mean()


def make_moe(seed=0, experts=4, k=2, dispatch="dropless", shared=False, layers=2,
             balance=None):
    model = MoELM(nnx.Rngs(seed), layers=layers, experts=experts, k=k, dispatch=dispatch,
                  shared=shared, balance=balance)
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    batches = _text_batches(np.random.default_rng(seed))
    loss = moe_balanced_loss if balance in ("sequence", "batch") else lm_loss
    return nnx_step(loss), (model, opt, batches[0]), batches
