"""The per-batch planner's price of a micro-step against the same micro-step measured on a
GPU.

The data-aware planner (``hetshard.data``) prices a row of ``bucket`` token slots
holding documents of lengths ``l_i`` as ``token_cost * slots + attention_s * sum(l_i^2)``
(``GroupCost``, from the simulator's profile of the step): a row of short documents is
priced far below a row of one long document of the same bucket, because the flash
kernel skips the key blocks of other documents. Every plan it picks, and every
tokens/s figure of ``experiments/data_aware.py``, rests on that. This script checks it.

On one GPU (CUDA), a LLaMA-style model written here with Flax NNX (8 layers, width 2048,
bfloat16 compute, float32 parameters; AdamW) runs under ``hetshard.jit`` on a cluster
of that one GPU (its catalog type from the device's name). ``hetshard.data.group_costs``
prices it from the step's own profile (``HetshardJit.profile``). For each bucket (4K to
32K tokens) and each row kind:

* ``one``: one document filling the row (the most attention a row can have);
* ``halves`` / ``quarters`` / ``eighths``: 2, 4 or 8 equal documents;
* ``wikipedia``: documents drawn from the Wikipedia lengths FlexSP published, packed
  best-fit until the row is full (mostly a few hundred tokens each);
* ``long+wikipedia``: one document of half the bucket, the rest Wikipedia documents;

the micro-step the runtime runs for it (``run_batch_plan``'s ``micro_step_plan`` and
``MicroSteps.grads_under``: the loss's value and gradients, under the remat the group
prices that bucket with) is timed (median of ``--repeats`` after a warm-up) and
compared with the planner's price of that row (``_Pricer.rows``, what the planner
minimises). Reported: each row's predicted and measured seconds and their ratio; per
bucket, the measured and predicted cost of attention (a row's time minus the
``wikipedia`` row's, whose squares are near zero) and of a token slot; the median
error over all rows; and what the planner's decisions depend on, the ratio between
two rows of one bucket (``one`` over ``wikipedia``), measured and predicted.

Without a GPU it records that nothing was measured (``--tiny`` runs a 2-layer model at
buckets of 64 to 256 tokens on CPU, to check the script, and prices it as the same
GPU type would run it: its numbers mean nothing).

Usage: python experiments/packed_step_gpu.py [--repeats 5] [--tiny] [--out PATH]
Writes experiments/results/packed_step_gpu.json.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
LENGTHS = os.path.join(HERE, "data", "lengths", "wikipedia-flexsp.txt.gz")
KINDS = ("one", "halves", "quarters", "eighths", "wikipedia", "long+wikipedia")


def _row_lengths(kind: str, bucket: int, wiki: np.ndarray, rng) -> list[int]:
    """Document lengths of one row of ``bucket`` slots of ``kind`` (module docstring)."""
    parts = {"one": 1, "halves": 2, "quarters": 4, "eighths": 8}
    if kind in parts:
        return [bucket // parts[kind]] * parts[kind]
    out = [bucket // 2] if kind == "long+wikipedia" else []
    room = bucket - sum(out)
    # draw until nothing more fits (best fit: the largest that fits of a few draws)
    misses = 0
    while room > 0 and misses < 50:
        got = int(wiki[rng.integers(wiki.size)])
        got = min(got, bucket // 8)  # Wikipedia documents only, not another long one
        if got <= room:
            out.append(got)
            room -= got
            misses = 0
        else:
            misses += 1
    return out


def _wikipedia(tiny: bool, path: str) -> np.ndarray:
    if not os.path.exists(path):
        raise SystemExit(f"--lengths {path!r}: no such file (the Wikipedia length file, "
                         f"experiments/data/lengths/wikipedia-flexsp.txt.gz)")
    with gzip.open(path, "rt") as f:
        lengths = np.array([int(x) for x in f.read().split()], np.int64)
    lengths = lengths[lengths > 1]
    return np.maximum(2, lengths // 64) if tiny else lengths


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--lengths", default=LENGTHS, help="the Wikipedia length file")
    ap.add_argument("--compare", action="store_true",
                    help="also time the same rows without hetshard (plain jax.jit, the "
                         "model's own XLA attention) and the attention kernels alone")
    ap.add_argument("--attention", default="flash", choices=("flash", "reference"),
                    help="the attention the micro-steps run (reference: XLA's, scores "
                         "materialised)")
    ap.add_argument("--buckets", type=int, nargs="*", help="default 4096 .. 32768")
    ap.add_argument("--compare-only", action="store_true",
                    help="only --compare, added to the results file --out already holds")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="stop starting new buckets after this many seconds")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "packed_step_gpu.json"))
    args = ap.parse_args()

    import jax
    backend = jax.default_backend()
    if backend != "gpu" and not args.tiny:
        _write(args.out, {"measured": False, "backend": backend,
                          "note": "no GPU on this machine: run on one (or --tiny to check "
                                  "the script on CPU)"})
        print("no GPU: nothing measured")
        return 0
    out = 0 if args.compare_only else measure(args, backend)
    if args.compare or args.compare_only:
        compare(args, backend)
    return out


def _model(tiny: bool):
    from hetshard_models.gpt import GPTConfig
    if tiny:
        return GPTConfig(layers=2, hidden=64, heads=4, vocab=256, seq=256, pos="rope",
                         norm="rmsnorm", mlp="swiglu", tied=False, bias=False,
                         name="llama-tiny-packed")
    return GPTConfig(layers=8, hidden=2048, heads=16, ffn=5632, vocab=32000, seq=32768,
                     pos="rope", norm="rmsnorm", mlp="swiglu", tied=False, bias=False,
                     dtype="bfloat16", param_dtype="float32", name="llama-8x2048")


def measure(args, backend: str) -> int:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import hetshard
    import hetshard_models as models
    from hetshard.cluster import Cluster
    from hetshard.cluster.catalog import device_type_for_kind
    from hetshard.cost.calibration import DEFAULT
    from hetshard.data import group_costs, pack, packed_arrays
    from hetshard.data.packing import Packing
    from hetshard.data.planner import _Pricer
    from hetshard.data.runner import micro_step_plan
    from hetshard_models.losses import packed_text_loss
    from hetshard_models.steps import train_step

    device = jax.devices()[0]
    gpu = device_type_for_kind(device.device_kind).name if backend == "gpu" else "H200"
    config = _model(args.tiny)
    buckets = tuple(args.buckets or ((64, 128, 256) if args.tiny else
                                     (4096, 8192, 16384, 32768)))
    chunk = 64 if args.tiny else 4096
    cluster = Cluster.from_dict({"name": f"one-{gpu}", "groups": [
        {"name": "g", "gpu": gpu, "nodes": 1, "gpus_per_node": 1}]})
    model = models.build(config, rngs=0)
    opt = nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)
    step = hetshard.jit(train_step(packed_text_loss), cluster=cluster, quiet=True)

    rng = np.random.default_rng(0)
    wiki = _wikipedia(args.tiny, args.lengths)

    def batch_of(bucket: int, lengths: list[int]):
        samples = [rng.integers(0, config.vocab, n).astype(np.int32) for n in lengths]
        rows = pack(lengths, (bucket,))
        assert len(rows) == 1, (bucket, lengths)
        arrays = packed_arrays(samples, rows, target_tokens=sum(lengths))
        return rows, {k: jnp.asarray(v) for k, v in arrays.items()}

    # the profile at the smallest bucket: the group's chunk (token slots a micro-step)
    _, first = batch_of(chunk, [chunk])
    profile = step.profile(model, opt, first)
    group, = group_costs(profile, cluster, max_context=buckets[-1], buckets=buckets,
                         max_buckets=len(buckets))
    pricer = _Pricer(group, cluster, DEFAULT)
    print(f"{gpu}: {config.name}, chunk {group.chunk}, remat {group.remat} / long "
          f"{group.long_remat or '-'}; token_s {group.token_s:.3e} long {group.long_token_s:.3e}, "
          f"attention_s {group.attention_s:.3e}", flush=True)

    rows_out, started, done = [], time.perf_counter(), []
    for bucket in buckets:
        if time.perf_counter() - started > args.budget_s:
            print(f"budget spent: bucket {bucket} and longer not measured", flush=True)
            break
        done.append(bucket)
        for kind in KINDS:
            lengths = _row_lengths(kind, bucket, wiki, rng)
            rows, batch = batch_of(bucket, lengths)
            predicted = float(pricer.rows(Packing.of(rows))[0])
            plan = micro_step_plan(step, (model, opt, batch), group, bucket, 1,
                                   args.attention)
            measured, fastest, first_s = _timed(step.micro_steps.grads_under, plan, model,
                                                opt, batch, repeats=args.repeats)
            row = {"bucket": bucket, "kind": kind, "documents": len(lengths),
                   "tokens": int(sum(lengths)),
                   "squares": int(sum(n * n for n in lengths)),
                   "remat": group.remat_of(bucket), "predicted_s": predicted,
                   "measured_s": measured, "measured_min_s": fastest,
                   "first_call_s": first_s, "ratio": predicted / measured}
            rows_out.append(row)
            print(f"{bucket:>6} {kind:<15} docs {len(lengths):>3}  predicted "
                  f"{predicted * 1e3:8.2f} ms  measured {measured * 1e3:8.2f} ms  "
                  f"pred/meas {predicted / measured:5.2f}", flush=True)

    per_bucket = []
    for bucket in done:
        mine = {r["kind"]: r for r in rows_out if r["bucket"] == bucket}
        one, wk = mine["one"], mine["wikipedia"]
        d_sq = one["squares"] - wk["squares"]
        per_bucket.append({
            "bucket": bucket,
            "attention_s_per_square_measured": (one["measured_s"] - wk["measured_s"]) / d_sq,
            "attention_s_per_square_predicted": (one["predicted_s"] - wk["predicted_s"]) / d_sq,
            "token_slot_s_measured": wk["measured_s"] / bucket,
            "token_slot_s_predicted": wk["predicted_s"] / bucket,
            "one_over_wikipedia_measured": one["measured_s"] / wk["measured_s"],
            "one_over_wikipedia_predicted": one["predicted_s"] / wk["predicted_s"],
            "attention_share_of_one_measured": 1 - wk["measured_s"] / one["measured_s"]})
    errors = [abs(r["ratio"] - 1) for r in rows_out]
    summary = {"median_abs_error": statistics.median(errors), "max_abs_error": max(errors),
               "median_pred_over_measured": statistics.median(r["ratio"] for r in rows_out)}
    print(json.dumps(summary, indent=2))
    _write(args.out, {
        "measured": True, "backend": backend, "device_kind": device.device_kind,
        "gpu_type": gpu, "jax": jax.__version__, "model": {
            "name": config.name, "layers": config.layers, "hidden": config.hidden,
            "heads": config.heads, "ffn": config.ffn, "vocab": config.vocab,
            "dtype": config.dtype, "param_dtype": config.param_dtype},
        "group": {"chunk": group.chunk, "remat": group.remat, "long_remat": group.long_remat,
                  "long_chunk": group.long_chunk, "token_s": group.token_s,
                  "long_token_s": group.long_token_s, "attention_s": group.attention_s},
        "attention": args.attention, "repeats": args.repeats, "rows": rows_out,
        "per_bucket": per_bucket, "summary": summary})
    return 0


def _timed(fn, *args, repeats: int) -> tuple[float, float, float]:
    """(median, fastest, first call) seconds of ``fn(*args)``: the first call (compiling)
    apart, then ``repeats`` timed calls."""
    import jax
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times), first


def compare(args, backend: str) -> None:
    """Where the time goes: the same rows as one ``jax.jit`` of the loss's value and
    gradients without hetshard (the model's own XLA attention, which materialises the
    scores, so only short buckets), and the attention alone (forward and backward of
    one layer's [1, S, heads, head_dim] bfloat16 causal attention): hetshard's Pallas
    flash kernel, ``jax.nn.dot_product_attention`` (cuDNN on a GPU, XLA elsewhere) and
    the XLA reference. Added to the results file under ``compare``."""
    import functools

    import jax
    import jax.numpy as jnp
    from flax import nnx

    import hetshard_models as models
    from hetshard.data import pack, packed_arrays
    from hetshard.kernels import attention_reference, flash_attention
    from hetshard_models.losses import packed_text_loss

    config = _model(args.tiny)
    model = models.build(config, rngs=0)
    rng = np.random.default_rng(0)
    wiki = _wikipedia(args.tiny, args.lengths)
    grad = nnx.jit(nnx.value_and_grad(packed_text_loss))
    plain = []
    for bucket in ((64, 128) if args.tiny else (4096, 8192)):
        for kind in ("one", "wikipedia"):
            lengths = _row_lengths(kind, bucket, wiki, rng)
            samples = [rng.integers(0, config.vocab, n).astype(np.int32) for n in lengths]
            batch = {k: jnp.asarray(v) for k, v in packed_arrays(
                samples, pack(lengths, (bucket,)), target_tokens=sum(lengths)).items()}
            t = _timed(grad, model, batch, repeats=args.repeats)[0]
            plain.append({"bucket": bucket, "kind": kind, "measured_s": t})
            print(f"plain jax.jit {bucket:>6} {kind:<10} {t * 1e3:8.2f} ms", flush=True)
    del model, grad
    kernels = []
    heads, dim = config.heads, config.hidden // config.heads
    for s in ((128, 256) if args.tiny else (4096, 16384)):
        q = jax.random.normal(jax.random.key(0), (1, s, heads, dim), jnp.bfloat16)
        fns = {"hetshard_flash": functools.partial(flash_attention, causal=True),
               "dot_product_attention": functools.partial(
                   jax.nn.dot_product_attention, is_causal=True,
                   implementation="cudnn" if backend == "gpu" else None),
               "reference": functools.partial(attention_reference, causal=True)}
        row = {"seq": s, "heads": heads, "head_dim": dim}
        for name, fn in fns.items():
            g = jax.jit(jax.grad(lambda q, k, v, fn=fn: jnp.sum(
                fn(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2)))
            try:
                row[f"{name}_s"] = _timed(g, q, q, q, repeats=args.repeats)[0]
            except Exception as e:  # noqa: BLE001 - an implementation this GPU lacks
                row[f"{name}_s"], row[f"{name}_error"] = None, f"{type(e).__name__}: {e}"[:300]
        # flops of causal attention forward + backward (2 + 5 matmuls, half the pairs)
        flops = 7 * 2 * s * s * heads * dim / 2
        row["tflops"] = {k[:-2]: flops / v / 1e12 for k, v in row.items()
                         if k.endswith("_s") and v}
        kernels.append(row)
        print(f"attention S={s}: " + ", ".join(f"{k} {v:.1f} TFLOP/s"
                                              for k, v in row["tflops"].items()), flush=True)
    with open(args.out) as f:
        got = json.load(f)
    got["compare"] = {"plain_jit": plain, "attention": kernels}
    _write(args.out, got)


def _write(path: str, obj) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
