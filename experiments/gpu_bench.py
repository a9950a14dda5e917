"""One GPU, one script (issue 48): is ``@hetshard.jit`` as fast as the best hand-written step,
is its attention at the state of the art, and does the simulator price what runs?

1. **Train step.** A LLaMA-style model written here with Flax NNX (``--layers`` blocks of
   width ``--hidden``, 128-wide heads, SwiGLU, RMSNorm, rotary positions; bfloat16 compute,
   float32 parameters; AdamW), about 1.1B parameters by default (fills an 80 GB GPU at
   ``--batch`` 4 x 4096 tokens), runs three ways on the same initial weights:

   * ``handwritten``: ``jax.jit`` of a functional step (``nnx.split`` once,
     ``jax.value_and_grad``, ``optax`` update, donated state), attention by
     ``jax.nn.dot_product_attention(implementation="cudnn")``, as MaxText writes it;
   * ``nnx_jit``: ``nnx.jit`` of the usual NNX step (``nnx.Optimizer``), same attention;
   * ``hetshard``: ``@hetshard.jit`` of that NNX step on a cluster of this one GPU, the
     model's attention written as ``hetshard.nn.attention`` (the rewrite pass runs what
     ``auto`` chooses for the GPU: cuDNN on Ampere and later).

   ``--steps`` steps are dispatched back to back after two warm-up steps; step time is
   their wall time over ``--steps``. Tokens/s, and MFU against the catalog's dense
   bfloat16 peak for the GPU type, counting 6 x (parameters outside the input
   embedding) per token plus causal attention, 6 x batch x seq^2 x hidden per layer
   (half the pairs: forward 2, backward 4 products), MaxText's convention.

2. **Attention alone**, forward + backward, bfloat16, 16 heads of 128, at 4K, 16K and 32K
   tokens a row (batch 32K tokens / seq), causal, and packed rows of Wikipedia documents
   (``experiments/data/lengths``) at 16K: cuDNN (``hetshard.kernels.dot_product_attention``),
   hetshard's Pallas kernel, XLA's reference (where its O(S^2) scores fit). TFLOP/s
   count the products a causal kernel computes (7 products of 2 S^2 D flops, halved;
   packed rows: over the documents' own squares).

3. **Price against time.** ``hetshard profile``'s calibration of this GPU
   (``hetshard.cost.profiler.profile_backend``), then the simulator's step time for the
   plan ``hetshard.jit`` ran, on the step's own profile, against the measured step.

Top-level JSON keys: ``gpu``, ``jax``, ``hetshard_vs_handwritten`` (hand-written step time
over hetshard's), ``mfu`` (hetshard's), ``own_kernel_vs_cudnn`` (the lower of 4K and 16K,
flash over cuDNN TFLOP/s), ``predicted_vs_measured`` (after profiling), and the detail.
Targets: hetshard_vs_handwritten >= 0.97, mfu >= 0.45 on H100/H200, own_kernel_vs_cudnn
>= 0.7, predicted_vs_measured within 10%.

``--tune`` runs instead a sweep of the flash kernels' tiles, warps and pipeline stages
(``hetshard.kernels.FlashTuning``) on this GPU: first the forward's settings (forward
alone), then the backward's with the best forward (forward + backward), causal bf16, 16
heads of 128, at 4K and 16K tokens a row; each setting's TFLOP/s at both lengths, the
best by their geometric mean against the default's and cuDNN's, and the line to put in
``hetshard.kernels.flash_attention.TUNED`` (``experiments/results/flash_tuning.json``).
A setting Triton cannot compile on this GPU is recorded with its error.

Without a GPU it writes that nothing was measured; ``--tiny`` runs a 2-layer model and
short rows on CPU (jax.nn's XLA path standing in for cuDNN) to check the script: its
numbers mean nothing.

Usage: python experiments/gpu_bench.py [--tiny] [--steps 10] [--budget-s 420] [--out PATH]
                                      [--tuning flash_tuning.json]
       python experiments/gpu_bench.py --tune [--tiny] [--budget-s 300]
Writes experiments/results/gpu_bench.json (a --tiny run: gpu_bench_tiny.json), with
--tune flash_tuning.json (flash_tuning_tiny.json).
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
LENGTHS = os.path.join(HERE, "data", "lengths", "wikipedia-flexsp.txt.gz")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="check the script on CPU")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="skip the sections not yet started after this many seconds")
    ap.add_argument("--out", default=None)
    ap.add_argument("--tune", action="store_true",
                    help="sweep the flash kernels' settings on this GPU instead")
    ap.add_argument("--tuning", default=None,
                    help="a --tune run's JSON: its best settings run the flash kernel "
                         "here (when measured on this GPU type)")
    args = ap.parse_args()
    if args.tiny:
        args.layers, args.hidden, args.batch, args.seq, args.steps = 2, 128, 2, 128, 3
    name = "flash_tuning" if args.tune else "gpu_bench"
    out = args.out or os.path.join(HERE, "results",
                                   f"{name}_tiny.json" if args.tiny else f"{name}.json")

    import jax
    backend = jax.default_backend()
    if backend != "gpu" and not args.tiny:
        _write(out, {"measured": False, "backend": backend, "jax": jax.__version__,
                     "note": "no GPU on this machine: run on one (or --tiny to check the "
                             "script on CPU)"})
        print("no GPU: nothing measured")
        return 0
    if args.tune:
        result = tune_flash(args, backend)
        _write(out, result)
        print(json.dumps({k: result.get(k) for k in ("gpu", "jax", "best", "best_gain",
                                                     "tuned_line")}, indent=1))
        return 0
    t0 = time.perf_counter()
    device = jax.devices()[0]
    tuned = _use_tuning(args.tuning, device.device_kind) if args.tuning else None
    result = {"measured": backend == "gpu", "backend": backend, "jax": jax.__version__,
              "gpu": device.device_kind, "tiny": args.tiny, "flash_tuning": tuned,
              "model": {"layers": args.layers, "hidden": args.hidden, "heads":
                        args.hidden // 128 if not args.tiny else 4, "batch": args.batch,
                        "seq": args.seq}}
    steps = train_steps(args, backend)
    result["train_step"] = steps["table"]
    result["hetshard_vs_handwritten"] = steps["table"]["handwritten"]["step_s"] / \
        steps["table"]["hetshard"]["step_s"]
    result["mfu"] = steps["table"]["hetshard"]["mfu"]
    _write(out, result)
    if time.perf_counter() - t0 < args.budget_s:
        result["attention"] = attention_table(args, backend)
        both = [r for r in result["attention"] if r["pattern"] == "causal" and
                r["seq"] in ((4096, 16384) if not args.tiny else (128, 256))]
        ratios = [r["tflops"]["flash"] / r["tflops"]["cudnn"] for r in both
                  if r["tflops"].get("flash") and r["tflops"].get("cudnn")]
        result["own_kernel_vs_cudnn"] = min(ratios) if ratios else None
        _write(out, result)
    if time.perf_counter() - t0 < args.budget_s:
        result["prediction"] = predicted(steps, args)
        result["predicted_vs_measured"] = result["prediction"]["predicted_over_measured"]
    result["wall_s"] = time.perf_counter() - t0
    _write(out, result)
    print(json.dumps({k: result.get(k) for k in ("gpu", "jax", "hetshard_vs_handwritten",
                                                 "mfu", "own_kernel_vs_cudnn",
                                                 "predicted_vs_measured")}, indent=1))
    return 0


# ---- the model ---------------------------------------------------------------------------

def _model_classes():
    import jax
    import jax.numpy as jnp
    from flax import nnx

    def rope(x, theta=10000.0):
        s, d = x.shape[1], x.shape[-1]
        freq = 1.0 / theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
        ang = jnp.arange(s, dtype=jnp.float32)[:, None] * freq[None, :]
        cos, sin = jnp.cos(ang)[None, :, None, :], jnp.sin(ang)[None, :, None, :]
        x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)

    class Block(nnx.Module):
        def __init__(self, hidden, heads, ffn, attend, rngs):
            kw = dict(use_bias=False, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=rngs)
            self.heads, self.attend = heads, attend
            self.norm1 = nnx.RMSNorm(hidden, dtype=jnp.bfloat16, rngs=rngs)
            self.qkv = nnx.Linear(hidden, 3 * hidden, **kw)
            self.o = nnx.Linear(hidden, hidden, **kw)
            self.norm2 = nnx.RMSNorm(hidden, dtype=jnp.bfloat16, rngs=rngs)
            self.gate_up = nnx.Linear(hidden, 2 * ffn, **kw)
            self.down = nnx.Linear(ffn, hidden, **kw)

        def __call__(self, x):
            b, s, h = x.shape
            q, k, v = jnp.split(self.qkv(self.norm1(x)), 3, axis=-1)
            q, k, v = (t.reshape(b, s, self.heads, h // self.heads) for t in (q, k, v))
            a = self.attend(rope(q), rope(k), v).reshape(b, s, h)
            x = x + self.o(a)
            g, u = jnp.split(self.gate_up(self.norm2(x)), 2, axis=-1)
            return x + self.down(jax.nn.silu(g) * u)

    class LM(nnx.Module):
        def __init__(self, layers, hidden, heads, ffn, vocab, attend, rngs):
            self.embed = nnx.Embed(vocab, hidden, dtype=jnp.bfloat16, param_dtype=jnp.float32,
                                   rngs=rngs)
            self.blocks = nnx.List([Block(hidden, heads, ffn, attend, rngs)
                                    for _ in range(layers)])
            self.norm = nnx.RMSNorm(hidden, dtype=jnp.bfloat16, rngs=rngs)
            self.head = nnx.Linear(hidden, vocab, use_bias=False, dtype=jnp.bfloat16,
                                   param_dtype=jnp.float32, rngs=rngs)

        def __call__(self, tokens):
            x = self.embed(tokens)
            for i, block in enumerate(self.blocks):
                with jax.named_scope(f"layer_{i}"):
                    x = block(x)
            return self.head(self.norm(x)).astype(jnp.float32)
    return LM


def _loss(model, batch):
    import optax
    logits = model(batch["tokens"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def _shape(args):
    heads = 4 if args.tiny else args.hidden // 128
    ffn = 256 if args.tiny else int(8 * args.hidden / 3 / 256 + 0.999) * 256
    vocab = 512 if args.tiny else 32000
    return heads, ffn, vocab


def train_steps(args, backend: str) -> dict:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import hetshard
    from hetshard.cluster import Cluster
    from hetshard.cluster.catalog import device_type_for_kind

    LM = _model_classes()
    heads, ffn, vocab = _shape(args)
    impl = "cudnn" if backend == "gpu" else "xla"
    fused = functools.partial(jax.nn.dot_product_attention, is_causal=True,
                              implementation=impl)
    marked = functools.partial(hetshard.nn.attention, causal=True)

    def build(attend):
        return LM(args.layers, args.hidden, heads, ffn, vocab, attend, nnx.Rngs(0))

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, (args.batch, args.seq + 1)).astype(np.int32)
    batch = {"tokens": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:])}
    adamw = optax.adamw(3e-4, weight_decay=0.1)

    def nnx_step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(_loss)(model, batch)
        optimizer.update(model, grads)
        return loss

    table = {}
    # hand-written: functional state, donated
    model = build(fused)
    graphdef, params = nnx.split(model, nnx.Param)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    embed = args.hidden * vocab
    del model
    opt_state = adamw.init(params)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def hand(params, opt_state, batch):
        loss, grads = jax.value_and_grad(lambda p: _loss(nnx.merge(graphdef, p), batch))(params)
        updates, opt_state = adamw.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    state = [params, opt_state]

    def run_hand():
        state[0], state[1], loss = hand(state[0], state[1], batch)
        return loss
    table["handwritten"] = _time_steps(run_hand, args.steps)
    del state[:], params, opt_state
    # nnx.jit

    def under_nnx_jit():  # its model and optimizer freed on return
        model = build(fused)
        optimizer = nnx.Optimizer(model, adamw, wrt=nnx.Param)
        jitted = nnx.jit(nnx_step)
        return _time_steps(lambda: jitted(model, optimizer, batch), args.steps)
    table["nnx_jit"] = under_nnx_jit()
    # hetshard.jit
    device_kind = jax.devices()[0].device_kind
    gpu = device_type_for_kind(device_kind).name if backend == "gpu" else "H100-80GB"
    cluster = Cluster.from_dict({"name": f"one-{gpu}", "groups": [
        {"name": "g", "gpu": gpu, "nodes": 1, "gpus_per_node": 1}]})
    model = build(marked)
    optimizer = nnx.Optimizer(model, adamw, wrt=nnx.Param)
    step = hetshard.jit(nnx_step, cluster=cluster, quiet=True)
    table["hetshard"] = _time_steps(lambda: step(model, optimizer, batch), args.steps)
    table["hetshard"]["plan"] = step.plan.summary()
    # throughput and MFU
    tokens_per_step = args.batch * args.seq
    flops = 6 * (n_params - embed) * tokens_per_step + \
        6 * args.batch * args.seq ** 2 * args.hidden * args.layers
    peak = Cluster.load(cluster).groups[0].gpu.peak_flops("bfloat16")
    for row in table.values():
        row["tokens_per_s"] = tokens_per_step / row["step_s"]
        row["mfu"] = flops / row["step_s"] / peak
    for name, row in table.items():
        print(f"{name:>12}: {row['step_s'] * 1e3:8.2f} ms/step, "
              f"{row['tokens_per_s']:10.0f} tokens/s, MFU {row['mfu']:.3f}", flush=True)
    table["params"] = int(n_params)
    table["model_flops_per_step"] = float(flops)
    table["peak_flops"] = float(peak)
    return {"table": table, "step": step, "args": (model, optimizer, batch),
            "cluster": cluster, "device_kind": device_kind}


def _time_steps(run, steps: int) -> dict:
    import jax
    t = time.perf_counter()
    jax.block_until_ready(run())  # compile
    first = time.perf_counter() - t
    jax.block_until_ready(run())
    t = time.perf_counter()
    out = None
    for _ in range(steps):
        out = run()
    dispatched = time.perf_counter() - t
    jax.block_until_ready(out)
    total = time.perf_counter() - t
    return {"step_s": total / steps, "dispatch_over_finish": dispatched / total,
            "first_call_s": first, "loss": float(out)}


# ---- attention alone -----------------------------------------------------------------------

def attention_table(args, backend: str) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from hetshard.kernels import attention_reference, dot_product_attention, flash_attention

    heads, dim = (4, 32) if args.tiny else (16, 128)
    dtype = jnp.bfloat16
    lengths = (128, 256, 512) if args.tiny else (4096, 16384, 32768)
    tokens = 1024 if args.tiny else 32768
    impl = "cudnn" if backend == "gpu" else "xla"
    fns = {"cudnn": functools.partial(dot_product_attention, implementation=impl),
           "flash": flash_attention, "reference": attention_reference}
    rows = []
    wiki = _wikipedia(args.tiny)
    for pattern in ("causal", "packed"):
        for s in lengths:
            if pattern == "packed" and s != lengths[1]:
                continue
            b = max(1, tokens // s)
            key = jax.random.split(jax.random.key(s), 3)
            q, k, v = (jax.random.normal(kk, (b, s, heads, dim), dtype) for kk in key)
            seg, pairs = None, b * s * s / 2
            if pattern == "packed":
                seg, squares = _packed_segments(b, s, wiki)
                pairs = squares / 2
            row = {"pattern": pattern, "seq": s, "batch": b, "heads": heads, "head_dim": dim,
                   "seconds": {}, "tflops": {}, "errors": {}}
            for name, fn in fns.items():
                if name == "cudnn" and seg is not None:
                    continue  # no segment ids through jax.nn (auto runs flash there)
                if name == "reference" and b * heads * s * s * 4 * 3 > 40e9:
                    continue  # O(S^2) scores do not fit
                try:
                    t = _attention_time(functools.partial(fn, causal=True, segment_ids=seg),
                                        (q, k, v), backward=True)
                except Exception as e:  # noqa: BLE001 - what this GPU cannot run, recorded
                    row["errors"][name] = f"{type(e).__name__}: {e}"[:300]
                    continue
                row["seconds"][name] = t
                row["tflops"][name] = _tflops(pairs, heads, dim, t, backward=True)
            rows.append(row)
            print(f"attention {pattern} S={s} B={b}: " + ", ".join(
                f"{n} {v:.1f}" for n, v in row["tflops"].items()) + " TFLOP/s", flush=True)
    return rows


def _use_tuning(path: str, device_kind: str) -> dict:
    """Puts a ``--tune`` run's best settings into ``flash_attention.TUNED`` for this run,
    when that run measured this GPU type; says what it did."""
    import importlib

    from hetshard.kernels import FlashTuning
    fa = importlib.import_module("hetshard.kernels.flash_attention")  # (the module)
    with open(path) as f:
        got = json.load(f)
    if got.get("gpu") != device_kind or not got.get("best"):
        return {"from": path, "used": False,
                "why": f"measured on {got.get('gpu')!r}, best {bool(got.get('best'))}"}
    tuning = FlashTuning(**got["best"]["tuning"])
    fa.TUNED[(device_kind, int(got["head_dim"]))] = tuning
    return {"from": path, "used": True, "tuning": tuning._asdict()}


def _tuning_grid(tiny: bool):
    """(forward settings, backward settings): FlashTuning keyword sets. Forward: tiles
    of 64 and 128, 4 or 8 warps, 2 or 3 stages (12); backward: tiles of 32-128, 4 or 8
    warps, 1 or 2 stages (20). Triton's fused-attention tutorial and FlashAttention-2's
    Triton kernel use settings in these ranges on Ampere and Hopper."""
    if tiny:
        return ([dict(block_q=16, block_k=16), dict(block_q=32, block_k=16)],
                [dict(block_q_bwd=16, block_k_bwd=16), dict(block_q_bwd=16, block_k_bwd=32)])
    fwd = [dict(block_q=bq, block_k=bk, warps=w, stages=st)
           for bq, bk in ((128, 128), (128, 64), (64, 64)) for w in (4, 8) for st in (2, 3)]
    bwd = [dict(block_q_bwd=bq, block_k_bwd=bk, warps_bwd=w, stages_bwd=st)
           for bq, bk in ((128, 128), (128, 64), (64, 128), (64, 64), (32, 64))
           for w in (4, 8) for st in (1, 2)]
    return fwd, bwd


def tune_flash(args, backend: str) -> dict:
    """The ``--tune`` sweep (see the module docstring)."""
    import jax
    import jax.numpy as jnp

    from hetshard.kernels import FlashTuning, dot_product_attention, flash_attention
    from hetshard.kernels.flash_attention import default_tuning

    t0 = time.perf_counter()
    heads, dim = (4, 32) if args.tiny else (16, 128)
    lengths = (128, 256) if args.tiny else (4096, 16384)
    tokens = 1024 if args.tiny else 32768
    dtype = jnp.bfloat16
    inputs = {}
    for s in lengths:
        b = max(1, tokens // s)
        key = jax.random.split(jax.random.key(s), 3)
        inputs[s] = tuple(jax.random.normal(kk, (b, s, heads, dim), dtype) for kk in key)

    def rate(fn, s, backward: bool):
        q = inputs[s][0]
        return _tflops(q.shape[0] * s * s / 2, heads, dim,
                       _attention_time(fn, inputs[s], backward), backward)

    def measure(tuning: FlashTuning, backward: bool) -> dict:
        row = {"tuning": tuning._asdict(), "tflops": {}}
        for s in lengths:
            try:
                row["tflops"][str(s)] = rate(functools.partial(
                    flash_attention, causal=True, tuning=tuning), s, backward)
            except Exception as e:  # noqa: BLE001 - a setting this GPU cannot compile
                row["error"] = f"{type(e).__name__}: {e}"[:300]
                return row
        row["geomean"] = float(np.exp(np.mean(np.log(list(row["tflops"].values())))))
        print(f"{'fwd+bwd' if backward else 'fwd'} {tuning.describe()}: " + ", ".join(
            f"{s} {v:.1f}" for s, v in row["tflops"].items()) + " TFLOP/s", flush=True)
        return row

    def best(rows):
        ok = [r for r in rows if "geomean" in r]
        return max(ok, key=lambda r: r["geomean"]) if ok else None

    base = default_tuning(dim)
    if args.tiny:
        base = base._replace(block_q=16, block_k=16, block_q_bwd=16, block_k_bwd=16)
    fwd_grid, bwd_grid = _tuning_grid(args.tiny)
    result = {"measured": backend == "gpu", "backend": backend, "jax": jax.__version__,
              "gpu": jax.devices()[0].device_kind, "tiny": args.tiny, "head_dim": dim,
              "heads": heads, "lengths": list(lengths), "tokens_per_length": tokens,
              "default": {"tuning": base._asdict(),
                          "fwd": measure(base, False), "fwd_bwd": measure(base, True)}}
    ref = "cudnn" if backend == "gpu" else "xla"
    result["cudnn"] = {str(s): {
        "fwd": rate(functools.partial(dot_product_attention, implementation=ref,
                                      causal=True), s, False),
        "fwd_bwd": rate(functools.partial(dot_product_attention, implementation=ref,
                                          causal=True), s, True)} for s in lengths}
    rows = []
    for kw in fwd_grid:
        if time.perf_counter() - t0 > args.budget_s / 2:
            result["fwd_cut"] = f"budget: {len(rows)} of {len(fwd_grid)} settings"
            break
        rows.append(measure(base._replace(**kw), False))
    result["fwd"] = rows
    top = best(rows) or result["default"]["fwd"]
    chosen = base._replace(**{k: v for k, v in top["tuning"].items()
                              if k in ("block_q", "block_k", "warps", "stages")})
    rows = []
    for kw in bwd_grid:
        if time.perf_counter() - t0 > args.budget_s:
            result["bwd_cut"] = f"budget: {len(rows)} of {len(bwd_grid)} settings"
            break
        rows.append(measure(chosen._replace(**kw), True))
    result["fwd_bwd"] = rows
    top = best(rows)
    if top is not None:
        tuned = FlashTuning(**top["tuning"])
        result["best"] = top
        default = result["default"]["fwd_bwd"].get("geomean")
        result["best_gain"] = top["geomean"] / default if default else None
        result["best_vs_cudnn"] = {s: top["tflops"][s] / result["cudnn"][s]["fwd_bwd"]
                                   for s in top["tflops"]}
        kind = result["gpu"].replace("NVIDIA ", "").split()[0]
        result["tuned_line"] = f"({kind!r}, {dim}): FlashTuning{tuple(tuned)!r},"
    result["wall_s"] = time.perf_counter() - t0
    return result


def _attention_time(fn, qkv, backward: bool) -> float:
    """Best time of ``fn(q, k, v)`` jitted: forward, or (``backward``) the gradient of its
    sum with respect to q, k and v."""
    import jax
    import jax.numpy as jnp

    from hetshard.cost.profiler import _best_time
    g = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32)),
                         argnums=(0, 1, 2))) if backward else jax.jit(fn)
    return _best_time(g, *qkv)


def _tflops(pairs: float, heads: int, dim: int, seconds: float, backward: bool) -> float:
    """TFLOP/s of attention over ``pairs`` (query, key) pairs computed (a causal row's:
    half its S^2): forward 2 products of 2 D flops a pair, forward + backward 7 (the
    backward recomputes the scores)."""
    return (7 if backward else 2) * 2 * pairs * heads * dim / seconds / 1e12


def _packed_segments(b, s, wiki):
    import jax.numpy as jnp
    rng = np.random.default_rng(1)
    seg = np.zeros((b, s), np.int32)
    squares = 0.0
    for r in range(b):
        pos, i = 0, 0
        while pos < s:
            n = int(min(wiki[rng.integers(wiki.size)], s - pos))
            seg[r, pos:pos + n] = i
            squares += n * n
            pos, i = pos + n, i + 1
    return jnp.asarray(seg), squares


def _wikipedia(tiny: bool) -> np.ndarray:
    if os.path.exists(LENGTHS):
        with gzip.open(LENGTHS, "rt") as f:
            got = np.array([int(x) for x in f.read().split()], np.int64)
        got = got[got > 0]
        return np.maximum(1, got // 64) if tiny else got
    return np.array([16, 40, 90] if tiny else [300, 700, 1500], np.int64)


# ---- the price against the time --------------------------------------------------------------

def predicted(steps: dict, args) -> dict:
    from hetshard.cluster import Cluster
    from hetshard.cost.calibration import DEFAULT
    from hetshard.cost.profiler import profile_backend
    from hetshard.sim.simulator import simulate

    step = steps["step"]
    model, optimizer, batch = steps["args"]
    profile = step.profile(model, optimizer, batch)
    cluster = Cluster.load(steps["cluster"])
    t = time.perf_counter()
    cal = profile_backend(quick=args.tiny)
    profiled_s = time.perf_counter() - t
    measured = steps["table"]["hetshard"]["step_s"]
    before = simulate(step.plan, profile, cluster, DEFAULT, trace=False).step_time_s
    after = simulate(step.plan, profile, cluster, cal, trace=False).step_time_s
    eff = dict(cal.per_type)
    return {"measured_s": measured, "predicted_s": after, "predicted_default_s": before,
            "predicted_over_measured": after / measured,
            "default_over_measured": before / measured, "profile_s": profiled_s,
            "calibration": {k: float(v) for k, v in vars(next(iter(eff.values()))).items()
                            if isinstance(v, float)} if eff else {}}


def _write(path: str, obj) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, default=str)


if __name__ == "__main__":
    sys.exit(main())
