"""Time and memory of one pipeline stage: a layer range on a (tp x cp) submesh of one
GPU type, replicated ``dp`` ways, running micro-batches of ``mbs`` samples.

Compute: per kernel, ``max(flops / rate, bytes / (hbm * memory_eff))`` plus
``kernel_launch_s``. The kernels are XLA's (``OpGraph.kernels``): each matmul, and each
fused chain of the other equations, which reads its inputs and writes its outputs once
(times ``fusion``, 1 by default). A matmul's rate is ``matmul_eff`` of the peak times its
shape's tile and wave quantization on the device's SMs (``matmul_shape_eff``, on the
per-device shape after tensor and context splits); attention's equations run at
``attention_rate`` (a measured ``attention_eff``, else the catalog's FlashAttention-2 rate
for the GPU type, else 0.8 of the matmul rate). Under the flash kernel, attention's
equations move no HBM bytes (the scores stay on chip), are one kernel forward and two
backward, and a causal kernel computes half of the traced products (Dao 2023). The
batch-independent elementwise bytes (weight and gradient casts) count once per step
with the optimizer update, not per micro-batch.
Where the calibration holds a measured profile of the program's layers
(``hetshard.cost.measured``: per GPU type, role and tensor degree), a layer's forward,
backward and optimizer update are the measured times instead.
Tensor parallelism divides flops by ``tp``, and bytes but those of a weight matmul's
operand without the split dimension (a column-parallel matmul reads its whole input, a
row-parallel one writes its whole partial sum: ``_tp_columns``), and adds Megatron's
four activation all-reduces per block (two forward, two backward; a block half has one
each way; Shoeybi et al. 2019, with sequence parallelism as reduce-scatter + all-gather
of the same volume, Korthikanti et al. 2022, whose backward also gathers the
column-parallel inputs
again: half an all-reduce more per collective, on blocks whose sequence the tensor
degree divides, as the runtime runs them). With ``tp_overlap`` (the runtime's collective
matmuls, ``hetshard.collectives.matmul``; Wang et al. ASPLOS'23) each block's
reduce-scatters and all-gathers are hidden behind the matmuls next to them
(``LayerProfile.tp_groups``) as far as ``(tp - 1) / tp`` of those matmuls' time allows,
the hidden part still costing ``tp_overlap_interference`` of itself; in the backward a
column group runs two rings (the input's cotangent, then the weights': ZB-H1's W pass),
a row-parallel matmul one for both its gradients (its weight gradient then runs in B).
Not measured on a GPU.
Context parallelism divides activations by ``cp`` and adds the K/V ring exchange, hidden
behind compute where it is shorter (Liu et al. 2023).
Expert parallelism (``ep`` ranks of an ``expert`` axis, themselves data ways: ``mbs`` is
already per device) divides a mixture-of-experts layer's expert weights, their gradients
and optimizer state by ``ep`` where it divides the experts (stored evenly; an uneven
``expert_counts`` placement moves to each rank the experts it lacks once a step, by
``ppermute``, and their summed gradients back after the last micro-batch; the laid-out
copy and its gradient are held for the step),
multiplies its grouped matmuls by the busiest rank's load over the mean (its share of
the experts' tokens: from a measured routing histogram, ``ModelProfile.expert_loads``,
else its share of the experts times ``router_skew``) and adds the runtime's four all-to-
alls a step (dispatch and combine, forward and backward; six under full remat):
dropless, ragged ones carrying the routed rows (the busiest rank receiving its load's
share), into receive buffers of the worst case (``ep`` times the local routed rows); with
a capacity, padded blocks of ``capacity_factor`` times the routed rows
(``hetshard.collectives.experts``). The received rows (that buffer) are what the expert
equations' backward keeps in place of the local rows, and the exchange's buffers are
live during the layer.
FSDP (ZeRO-3) adds a per-layer all-gather of parameters in
forward and backward, overlapped with the layer's compute (slowed by
``overlap_interference`` of the hidden part), and turns the gradient all-reduce into a
reduce-scatter. The distributed optimizer (ZeRO-1, ``shard_optimizer``) divides the
optimizer state and the update's work by ``dp`` (the gradient all-reduce becomes a
reduce-scatter before the update and a parameter all-gather after it: the simulator
prices both).

Memory per device (Korthikanti et al. 2022, §4): parameters, gradients and
optimizer state (divided by tp, by dp under FSDP, the optimizer state alone by dp under
ZeRO-1), the compute-dtype weight
copies autodiff keeps, and activations: the traced residuals per sample times the
micro-batch size times the micro-batches in flight (1F1B: p - stage; GPipe: all),
reduced by remat: ``selective`` keeps the weight projections' outputs and recomputes
the rest, the named policies (``hetshard.remat.POLICIES``) keep only the projections
they name (each layer's ``RematSave``: bytes kept, equations recomputed), ``full``
keeps only each layer's input (the layer before's output) plus one layer's working
set. A remat applies to the stage's first ``remat_layers`` layers (all by default;
Megatron-LM's ``--recompute-num-layers`` with the block method), the others keep
everything: the finer trade between recomputation and memory. With the flash
attention kernel (``attention="flash"``, the default: hetshard's runtime swaps it
in), attention keeps only O(S) state and its backward recomputes the scores, so
attention's residuals are never stored whatever the remat.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from hetshard._plan import named_spec, spec_axes
from hetshard.cluster.catalog import DeviceType
from hetshard.cost.calibration import Calibration
from hetshard.cost.comm import Topology, buckets, collective_time
from hetshard.cost.profile import LayerProfile, ModelProfile
from hetshard.errors import SpecError
from hetshard.kernel_choice import IMPLEMENTATIONS, Hardware, Pattern, choose
from hetshard.offload import check_offload
from hetshard.remat import check_remat

ATTENTIONS = IMPLEMENTATIONS  # auto, cudnn, flash, reference


@dataclasses.dataclass(frozen=True)
class StageCost:
    fwd_s: float  # one micro-batch forward, communication included
    bwd_s: float  # one micro-batch backward, recomputation included
    grad_sync_bytes: float  # gradient bytes per device to synchronise across replicas
    optimizer_s: float
    model_flops: float  # one micro-batch, whole stage (all tp*cp devices), no recompute
    hardware_flops: float  # with recompute
    memory_static_bytes: float  # per device: params, grads, optimizer state, weight copies
    memory_per_microbatch_bytes: float  # per device, per micro-batch in flight
    memory_working_bytes: float  # per device, transient (recompute working set)
    # of bwd_s, the weight-gradient part a zero-bubble schedule runs as its own W pass
    bwd_weight_s: float = 0.0
    # per device, per micro-batch between its B and W passes (zero-bubble schedules):
    # what W reads from B's results, and the cotangent the next stage sent back
    memory_carry_bytes: float = 0.0
    memory_cotangent_bytes: float = 0.0
    # Parameters read here that another stage owns (a tied embedding read by the head):
    # (owner layer, bytes per device). Their gradient goes to the owner every step, and
    # the updated copy comes back.
    read_copies: tuple[tuple[str, float], ...] = ()
    # Per step, outside the micro-batches (priced with the update): the weights' and
    # their gradients' dtype casts, and unevenly placed experts laid out and their
    # gradients taken back (``collectives.experts.placed_weights``)
    cast_s: float = 0.0
    # of cast_s, the experts brought and their gradients given back
    brought_s: float = 0.0
    # Of fwd_s and bwd_s, attention's (its kernels, the flash backward's recompute of the
    # scores, the context ring's exposed transfers), and the flash kernel's inputs and
    # outputs kept per micro-batch: what uneven context chunks redistribute
    attention_fwd_s: float = 0.0
    attention_bwd_s: float = 0.0
    attention_memory_bytes: float = 0.0
    # Host memory per device (``offload``): the optimizer state kept there between
    # steps, and the activations offloaded per micro-batch in flight
    host_static_bytes: float = 0.0
    host_per_microbatch_bytes: float = 0.0
    # Of optimizer_s, what streaming the state through the host link adds beyond the
    # update's own time (the first layer's wait left out): per layer, it adds up
    host_stream_s: float = 0.0
    # Per device: the state the update writes anew (parameters, read copies and the
    # optimizer state kept on the GPU). An update not written over the old state holds
    # both at once (``hetshard.sim.simulator.worker_memory``).
    memory_state_bytes: float = 0.0

    def peak_memory(self, inflight: int) -> float:
        return (self.memory_static_bytes + inflight * self.memory_per_microbatch_bytes +
                self.memory_working_bytes)


# Output tiles of tensor-core GEMM kernels (cuBLAS's and Triton's usual shapes on Ampere
# and Hopper); XLA autotunes each GEMM among its kernels, so a GEMM runs the tile that
# quantizes least. A dimension under a tile takes the next power of two (the libraries
# pick smaller tiles there). A split-K slice keeps at least SPLIT_K_MIN of K.
GEMM_TILES = ((128, 128), (128, 256), (256, 128), (64, 128), (128, 64))
SPLIT_K_MIN = 256


def matmul_shape_eff(dims: np.ndarray, sms: int | None) -> np.ndarray:
    """Fraction of a GPU's large-GEMM rate a matmul of ``dims`` = [..., (batch, M, N, K)]
    reaches, best over ``GEMM_TILES``: tile quantization (a partial output tile costs a
    whole one) times wave quantization (tiles run ``sms`` at a time, so a last partial
    wave idles SMs; a GEMM of fewer tiles than SMs is split along K where K allows, as
    cuBLAS's split-K and stream-K kernels do). NVIDIA's "Matrix Multiplication
    Background" guide describes both; the large-GEMM rate itself is ``matmul_eff`` of the
    peak. Rows of zeros (no matmul) give 1."""
    b, m, n, k = (np.maximum(dims[..., i], 1.0) for i in range(4))

    def tile(d, size):
        t = np.minimum(size, 2.0 ** np.ceil(np.log2(d)))
        return t, np.ceil(d / t)
    best = np.zeros(np.shape(m))
    for size_m, size_n in GEMM_TILES:
        tm, cm = tile(m, size_m)
        tn, cn = tile(n, size_n)
        eff = (m / (cm * tm)) * (n / (cn * tn))
        if sms:
            tiles = b * cm * cn
            split = np.where(tiles < sms, np.clip(np.minimum(np.floor(sms / tiles),
                                                             np.floor(k / SPLIT_K_MIN)),
                                                  1, None), 1.0)
            work = tiles * split
            eff = eff * work / (np.ceil(work / sms) * sms)
        best = np.maximum(best, eff)
    return np.where(dims[..., 1] > 0, best, 1.0)


def gemm_rate(gpu, m: int, n: int, k: int, dtype: str = "bfloat16") -> float:
    """FLOP/s of one ``m x k @ k x n`` matmul run alone on ``gpu`` (a ``DeviceType``): its
    measured large-GEMM ceiling (``gemm_tflops``; where not measured, the training share
    ``matmul_eff`` of the peak, else MATMUL_EFF) times :func:`matmul_shape_eff`. A
    training step prices its matmuls at ``matmul_eff`` of the peak instead (the clocks
    and mix of a whole step, fitted per architecture: ``hetshard.cluster.catalog``)."""
    from hetshard.cost.calibration import MATMUL_EFF
    peak = gpu.peak_flops(dtype)
    if gpu.gemm_tflops is not None and dtype in ("bfloat16", "bf16", "float16", "fp16"):
        ceiling = min(gpu.gemm_tflops * 1e12, peak)
    else:
        ceiling = peak * (gpu.matmul_eff if gpu.matmul_eff is not None else MATMUL_EFF)
    shape = matmul_shape_eff(np.array([[1.0, m, n, k]]), gpu.sms)[0]
    return float(ceiling * shape)


class _Held(NamedTuple):
    """A cache entry keyed by ``id(owner)``: the owner is held so that the id is not
    reused while the entry lives, and checked on a hit."""

    owner: object
    value: object


_PER_DIMS: dict[tuple, _Held] = {}


def _per_dims(fn, dims: tuple[np.ndarray, np.ndarray], *args) -> np.ndarray:
    """``fn(dims, *args)``, cached: a model's identical blocks share their arrays, and the
    planner prices the same shapes many times."""
    key = (fn, id(dims[0]), *args)
    hit = _PER_DIMS.get(key)
    if hit is None or hit.owner is not dims[0]:
        if len(_PER_DIMS) > 100_000:
            _PER_DIMS.clear()
        hit = _PER_DIMS[key] = _Held(dims[0], fn(dims, *args))
    return hit.value


def _shape_eff(dims: tuple[np.ndarray, np.ndarray], mbs: int, tp: int, cp: int,
               sms: int | None) -> np.ndarray:
    """``matmul_shape_eff`` of a layer's matmuls on one device of a (tp x cp) shard at
    ``mbs`` samples: tensor parallelism splits each matmul's dimension ``_tp_columns``
    names, context parallelism its largest that grows with the batch (the tokens)."""
    return _per_dims(_shape_eff_of, dims, mbs, tp, cp, sms)


def _tp_columns(dims, mbs: int) -> np.ndarray:
    """Per equation of a layer, the column of its (batch, M, N, K) that tensor
    parallelism splits (-1 where it is not a matmul). A matmul batched over the samples
    (attention's) splits its batch (the heads). A weight's matmul splits the weight's
    dimension that is not the residual stream's width (the layer's most frequent weight
    dimension): the output of a column-parallel one (q, k, v, up, gate: their input stays
    whole), the input of a row-parallel one (the attention output, the down projection:
    their output is a partial sum, whole). Where the width is not known (one weight, or
    a tie) or both dimensions are it, the larger one."""
    q0, q1 = dims
    d = q0 + q1 * mbs
    grows = q1 > 0
    fixed = np.where(grows[:, 1:], -1.0, d[:, 1:])
    weights = fixed[(fixed.max(axis=1) > 0) & (q0[:, 1] + q1[:, 1] > 0) & ~grows[:, 0]]
    values, counts = np.unique(weights[weights > 0], return_counts=True)
    width = values[counts.argmax()] if len(counts) and (counts == counts.max()).sum() == 1 \
        else None
    other = np.where(fixed == width, 0.0, fixed) if width is not None else fixed
    other = np.where(other.max(axis=1, keepdims=True) > 0, other, fixed)
    col = np.where(fixed.max(axis=1) > 0, other.argmax(axis=1) + 1, d.argmax(axis=1))
    col = np.where(grows[:, 0], 0, col)
    return np.where(d[:, 1] > 0, col, -1)


def _shape_eff_of(dims, mbs, tp, cp, sms) -> np.ndarray:
    q0, q1 = dims
    if not len(q0):
        return np.ones(0)
    d = q0 + q1 * mbs
    grows = q1 > 0
    rows = np.arange(len(d))
    if tp > 1:
        col = np.maximum(_tp_columns(dims, mbs), 0)
        d[rows, col] = d[rows, col] / tp
    if cp > 1:
        growing = np.where(grows, d, -1.0)
        col = np.where(growing.max(axis=1) > 0, growing.argmax(axis=1), d.argmax(axis=1))
        d[rows, col] = d[rows, col] / cp
    return matmul_shape_eff(d, sms)


_OPERANDS = np.array([[1, 1, 0, 1], [1, 0, 1, 1], [1, 1, 1, 0]], bool)  # A, B, C: b M N K


def _tp_batch_bytes(dims, mbs: int, tp: int) -> np.ndarray:
    """Per equation, the share of its batch-dependent bytes one of ``tp`` devices moves:
    ``1 / tp`` but for weight matmuls, whose operands without the split dimension
    (``_tp_columns``) stay whole: a column-parallel matmul reads its whole input, a
    row-parallel one writes its whole (partial-sum) output."""
    q0, q1 = dims
    share = np.full(len(q0), 1.0 / tp)
    if tp == 1 or not len(q0):
        return share
    d = np.maximum(q0 + q1 * mbs, 1.0)
    col = _tp_columns(dims, mbs)
    grows = q1 > 0
    for row in np.flatnonzero(col > 0):
        sizes = [float(np.prod(d[row][op])) for op in _OPERANDS]
        batch = [bool((grows[row] & op).any()) for op in _OPERANDS]
        split = [bool(op[col[row]]) for op in _OPERANDS]
        kept = [(n, s) for n, b, s in zip(sizes, batch, split, strict=True) if b]
        whole = sum(n for n, _ in kept)
        if whole > 0:
            share[row] = sum(n / (tp if s else 1.0) for n, s in kept) / whole
    return share


def _tp_share(dims, nbytes, mbs: int, tp: int):
    """``_tp_batch_bytes`` where the layer has its matmuls' shapes, else ``1 / tp``."""
    if tp > 1 and len(dims[0]) == len(nbytes[1]):
        return _per_dims(_tp_batch_bytes, dims, mbs, tp)
    return 1.0 / tp


def _kernels(starts: np.ndarray, in_attention: np.ndarray, attention: str,
             flash_kernels: int) -> int:
    """Kernels a layer's phase launches: one per matmul and fused chain; the flash kernel
    replaces attention's equations by ``flash_kernels`` launches (its backward: dq, dkv)."""
    if attention == "reference" or not in_attention.any():
        return int(starts.sum())
    return int(starts[~in_attention].sum()) + flash_kernels


def _op_times(flops: np.ndarray, nbytes: np.ndarray, matmul: np.ndarray,
              peak: float | np.ndarray, bw: float, fusion: float) -> np.ndarray:
    eff_bytes = np.where(matmul, nbytes, nbytes * fusion)
    return np.maximum(flops / peak, eff_bytes / bw)


def _ops_time(flops: np.ndarray, nbytes: np.ndarray, matmul: np.ndarray,
              peak: float | np.ndarray, bw: float, fusion: float) -> float:
    return float(_op_times(flops, nbytes, matmul, peak, bw, fusion).sum())


_MEASURED: dict[tuple[int, int], _Held] = {}


def _measured(profile: ModelProfile, cal: Calibration):
    """The calibration's measured profile of this program's blocks, as a per-layer lookup
    (``_MeasuredLayers``), or None."""
    if not cal.measured:
        return None
    key = (id(profile), id(cal))
    hit = _MEASURED.get(key)
    if hit is None or hit.owner[0] is not profile or hit.owner[1] is not cal:
        hit = _MEASURED[key] = _Held((profile, cal), _MeasuredLayers.of(profile, cal))
    return hit.value


class _MeasuredLayers:
    """Measured times for a program's layers: its blocks (halves split by their share of
    the block's flops), the layers before them (the embedding) and after them (the head,
    the loss) as the profile's roles; a layer between two stacks keeps the roofline."""

    def __init__(self, profile: ModelProfile, measured, roles):
        self.profile, self.measured, self.roles = profile, measured, roles

    @classmethod
    def of(cls, profile: ModelProfile, cal: Calibration):
        names = profile.layer_names()
        if profile.split_blocks:
            block = [n.endswith(("/half_0", "/half_1")) for n in names]
        else:
            block = [layer.block for layer in profile.layers]
        if not any(block):
            return None
        first = block.index(True)
        last = len(block) - 1 - block[::-1].index(True)
        flops = profile.layers[first].fwd_total_flops(1)
        if profile.split_blocks:
            flops += profile.layers[first + 1].fwd_total_flops(1)
        measured = cal.measured_for(flops, profile.seq_len)
        if measured is None:
            return None
        roles = []
        for i, is_block in enumerate(block):
            if is_block:
                half = (0 if names[i].endswith("/half_0") else 1) if profile.split_blocks \
                    else None
                roles.append(("block", half))
            elif i < first:
                roles.append(("embedding", None))
            elif i > last:
                roles.append(("head", None))
            else:
                roles.append((None, None))
        return cls(profile, measured, roles)

    def layer(self, index: int, gpu: str, tp: int, mbs: int):
        """(forward s, backward s, update s or None) of layer ``index`` on ``gpu`` at tensor
        degree ``tp`` and ``mbs`` samples, or None where nothing was measured at that
        degree."""
        role, half = self.roles[index]
        if role is None:
            return None
        got = self.measured.timing(gpu, role, tp, mbs)
        if got is None or got[1] != tp:
            return None
        t, _, seq = got
        layer = self.profile.layers[index]
        ours = self.profile.seq_len
        scale = (self.measured.block_flops(ours) / self.measured.block_flops(seq)
                 if role == "block" else ours / seq)
        fwd = t.forward_s * scale
        f1, b1 = layer.fwd_total_flops(mbs), layer.flops(mbs) - layer.fwd_total_flops(mbs)
        bwd = t.backward_s * scale if t.backward_s is not None else fwd * b1 / max(f1, 1.0)
        update = t.update_s
        if half is not None:
            # A half of the measured block: its share of the block's flops and parameters.
            sib = self.profile.layers[index + 1 if half == 0 else index - 1]
            f2 = sib.fwd_total_flops(mbs)
            b2 = sib.flops(mbs) - f2
            if t.backward_s is None:
                bwd = t.forward_s * scale * (b1 + b2) / max(f1 + f2, 1.0)
            fwd *= f1 / max(f1 + f2, 1.0)
            bwd *= b1 / max(b1 + b2, 1.0)
            if update is not None:
                update *= layer.param_bytes / max(layer.param_bytes + sib.param_bytes, 1)
        return fwd, bwd, update


# Where neither a calibration nor the catalog gives a GPU's attention rate, a flash
# kernel runs at this fraction of the GPU's matmul rate: FlashAttention-2 on the A100 (the
# catalog's ~190 TFLOP/s against 0.75 of 312 for its GEMMs).
ATTENTION_GEMM_RATIO = 0.8


# Measured attention rates, TFLOP/s forward + backward (bfloat16, causal, 16 heads of 128,
# counted on the products a causal kernel computes), by implementation and CUDA major
# version: this project's H200 run (experiments/packed_step_gpu.py, JAX 0.11.2,
# experiments/results/packed_step_gpu.json "compare.attention"): at S=16384 cuDNN
# (jax.nn.dot_product_attention) 541, hetshard's Pallas kernel (Triton) 76; at S=4096
# 218 and 60 (one sample: launch-bound). The long-sequence rate is the sustained one.
# Types without a measurement take the catalog's FlashAttention-2 rate for both kernels.
# The flash rate is the kernel of 2026-12-04 (every key block visited under a branch,
# masks on every block, 4 warps); the kernel now loops over block ranges, leaves the
# mask off full blocks and takes per-GPU tiles: 76 stands until a GPU measures it.
ATTENTION_TFLOPS = {("cudnn", 9): 541.0, ("flash", 9): 76.0}


def priced_attention(attention: str, gpu: DeviceType, dtype: str,
                     causal: bool = True) -> str:
    """The implementation a stage's attention runs (``auto``: ``hetshard.kernel_choice``'s
    choice for the GPU type and the stage's compute dtype; on CPU stand-ins the flash
    kernel)."""
    if attention != "auto":
        return attention
    if gpu.vendor == "cpu":
        return "flash"
    return choose(Hardware.of_type(gpu), Pattern(causal=causal, dtype=dtype))


def attention_rate(gpu: DeviceType, dtype: str, e, attention: str = "flash") -> float:
    """FLOP/s of attention's products (those the kernel computes) under implementation
    ``attention`` (resolved: ``priced_attention``): a calibration's ``attention_eff`` of
    the peak where measured; for a kernel (flash, cuDNN), the measured
    ``ATTENTION_TFLOPS`` for the GPU's architecture, else the catalog's FlashAttention-2
    rate, else ``ATTENTION_GEMM_RATIO`` of the matmul rate (16-bit rates scaled by the
    dtype's peak); the reference runs XLA's matmuls at ``matmul_eff``."""
    peak = gpu.peak_flops(dtype)
    if e.attention_eff is not None:
        return peak * e.attention_eff
    if attention == "reference":
        return peak * e.matmul(gpu)
    half = gpu.peak_flops("bfloat16" if gpu.bf16_tflops is not None else "float16")
    cap = gpu.capability
    measured = ATTENTION_TFLOPS.get((attention, cap[0])) if cap else None
    if measured is not None:
        return measured * 1e12 * min(1.0, peak / half)
    if gpu.attention_tflops is not None:
        return gpu.attention_tflops * 1e12 * min(1.0, peak / half)
    return peak * e.matmul(gpu) * ATTENTION_GEMM_RATIO


def _exposed(transfer: float, matmuls: float, tp: int, e) -> float:
    """Time a collective matmul adds to its matmuls: of ``tp`` steps, ``tp - 1`` transfer
    a block while another block is multiplied, so ``(tp - 1) / tp`` of the matmul time
    can hide the transfer; what is hidden still slows the matmuls by
    ``tp_overlap_interference`` of its time (the transfer's kernels take SMs and memory
    bandwidth from them, the matmul runs as ``tp`` smaller ones)."""
    hide = matmuls * (tp - 1) / tp
    return max(0.0, transfer - hide) + e.tp_overlap_interference * min(transfer, hide)


class _ExpertShare:
    """What expert parallelism changes in one layer's price (the module docstring)."""

    def __init__(self, layer: LayerProfile, ep: int, mbs: float, capacity_factor,
                 counts: tuple[int, ...], skew: float, ranks=None, loads=()):
        self.layer, self.ep = layer, ep
        self.active = bool(layer.experts) and ep > 1
        if not self.active:
            self.load, self.buffer_bytes, self.extra_residual_bytes = 1.0, 0.0, 0.0
            self.even, self.send_rows, self.divides, self.gathers = True, 0.0, True, False
            self.sent_rows = 0.0
            return
        self.even = not counts or len(set(counts)) == 1
        self.counts = tuple(counts)
        # stored evenly where the ranks divide the experts; an uneven placement then
        # moves each rank the experts it lacks from that storage once a step
        self.divides = layer.experts % ep == 0
        self.gathers = not self.even and self.divides
        self.moved = 0
        if self.gathers and sum(counts) == layer.experts:
            from hetshard.collectives.experts import moved_experts
            self.moved = moved_experts(tuple(counts))
        self.load = rank_load(layer.experts, ep, counts, loads, ranks)
        if len(loads) != layer.experts:  # (a measured histogram is its own skew)
            self.load *= max(1.0, float(skew))
        rows = layer.routed_rows_per_sample * mbs  # this device's routed rows
        factor = ep if capacity_factor is None else float(capacity_factor)
        self.send_rows = factor * rows  # the buffers' rows
        # the rows the busiest rank receives: dropless, the ragged all-to-all sends only
        # the routed rows (that rank taking its load's share); with a capacity, the
        # padded blocks
        self.sent_rows = rows * self.load if capacity_factor is None else self.send_rows
        width = layer.routed_row_bytes + layer.routed_out_bytes
        # send and receive buffers of both directions, live during the layer
        self.buffer_bytes = 2 * self.send_rows * width
        self.extra_residual_bytes = max(0.0, self.send_rows - rows) * (
            layer.routed_chain_bytes + layer.routed_row_bytes)

    def saved_param_bytes(self, own: float) -> float:
        """Of the layer's ``own`` bytes on a device, the expert weights other ranks
        store (all but a rank's ``1/ep``, where the ranks divide the experts)."""
        if not self.active or not self.divides or not self.layer.param_bytes:
            return 0.0
        share = own / self.layer.param_bytes  # (the tensor split, as ``own`` has it)
        return self.layer.expert_param_bytes * share * (1 - 1 / self.ep)

    def loaded(self, flops: np.ndarray, expert: np.ndarray) -> np.ndarray:
        if not self.active or self.load == 1.0 or len(expert) != len(flops):
            return flops
        return np.where(expert, flops * self.load, flops)

    def gather_s(self, topo: Topology, cal: Calibration, gpu: str) -> float:
        """An uneven placement's move of each rank's experts from their even storage
        (``collectives.experts.relayout``: a ``ppermute`` per shift carrying the experts a
        rank lacks, ``moved`` at the most), priced as an all-to-all that brings each
        rank those bytes: 0 otherwise. Once per step each way: the experts out, their
        summed gradients back."""
        if not self.active or not self.gathers or not self.moved:
            return 0.0
        layer = self.layer
        moved = self.moved * layer.expert_param_bytes / layer.experts
        return collective_time("all_to_all", moved * self.ep / (self.ep - 1), topo, cal, gpu)

    def _expert_copy_bytes(self) -> float:
        """One expert's weights in the compute dtype (the layer's weight copies' share
        where it casts them, else as stored)."""
        layer = self.layer
        copy = layer.weight_copy_bytes / layer.param_bytes \
            if layer.weight_copy_bytes and layer.param_bytes else 1.0
        return layer.expert_param_bytes / layer.experts * copy

    def brought_bytes(self) -> float:
        """Per device, held for the step by an uneven placement stored evenly: the
        experts brought from other ranks and their gradients, accumulated beside them
        (``collectives.experts.brought_experts``; 0 otherwise)."""
        if not self.active or not self.gathers or not self.moved:
            return 0.0
        return 2 * self.moved * self._expert_copy_bytes()

    def placed_working_bytes(self) -> float:
        """Per device, while the layer's exchange runs under an uneven placement: its
        rank's experts copied into place (``max(counts)`` of them; 0 for an even
        placement, which reads the stored ones)."""
        if not self.active or self.even:
            return 0.0
        return max(self.counts) * self._expert_copy_bytes()

    def exchange_s(self, topo: Topology, cal: Calibration, gpu: str) -> float:
        """Dispatch and combine: two all-to-alls of the rows sent (each row's expert
        slot, an int32, rides with the dispatch)."""
        layer = self.layer
        go = self.sent_rows * (layer.routed_row_bytes + 4)
        back = self.sent_rows * layer.routed_out_bytes
        return collective_time("all_to_all", go, topo, cal, gpu) + \
            collective_time("all_to_all", back, topo, cal, gpu)


def rank_load(experts: int, ep: int, counts: tuple[int, ...] = (), loads=(),
              ranks=None) -> float:
    """The busiest of ``ranks`` (all by default) of ``ep`` expert ranks over the mean:
    each holding ``counts[r]`` experts, a contiguous run (even by default), each expert
    routed ``loads[e]`` of the tokens (a measured histogram, normalised; uniform when
    ``loads`` does not cover the ``experts``)."""
    counts = tuple(counts) or (experts // ep,) * ep
    share = [float(x) for x in loads] if len(loads) == experts else [1.0] * experts
    held, start = [], 0
    for c in counts:
        held.append(sum(share[start:start + c]))
        start += c
    mean = sum(held) / len(held)
    picked = [held[r] for r in (range(len(held)) if ranks is None else ranks)]
    return max(picked) / mean if picked and mean > 0 else 1.0


def balanced_placement(loads, ep: int) -> tuple[int, ...]:
    """Experts per rank (contiguous runs, each rank at least one) minimising the busiest
    rank's routed tokens, for per-expert ``loads`` (a measured histogram): the linear
    partition problem, solved exactly by dynamic programming."""
    loads = [float(x) for x in loads]
    n = len(loads)
    if not 1 <= ep <= n:
        raise SpecError("ep", ep, f"1 to the {n} experts")
    prefix = np.concatenate([[0.0], np.cumsum(loads)])
    best = np.full((ep + 1, n + 1), np.inf)
    cut = np.zeros((ep + 1, n + 1), int)
    best[0, 0] = 0.0
    for k in range(1, ep + 1):
        for j in range(k, n - (ep - k) + 1):
            for i in range(k - 1, j):
                v = max(best[k - 1, i], prefix[j] - prefix[i])
                if v < best[k, j] - 1e-12:
                    best[k, j], cut[k, j] = v, i
    counts, j = [], n
    for k in range(ep, 0, -1):
        i = cut[k, j]
        counts.append(int(j - i))
        j = int(i)
    return tuple(counts[::-1])


def planned_placement(profile: ModelProfile, ep: int) -> tuple[int, ...]:
    """Experts per rank the planner gives an ``ep``-rank expert axis over ``profile``'s
    mixture-of-experts layers: :func:`balanced_placement` under a measured routing
    histogram (``ModelProfile.expert_loads``) where it evens the ranks out more than the
    even split does, else the even split (``()``). Whether bringing the experts a rank
    lacks pays is for the price to say (the evaluator tries both)."""
    sizes = {layer.experts for layer in profile.layers if layer.experts}
    loads = profile.expert_loads
    if ep <= 1 or len(sizes) != 1 or len(loads) != next(iter(sizes)) or \
            ep > len(loads) or len(loads) % ep:
        return ()
    counts = balanced_placement(loads, ep)
    if rank_load(len(loads), ep, counts, loads) >= rank_load(len(loads), ep, (), loads) - 1e-9:
        return ()
    return counts


def tensor_rank_bytes(layer: LayerProfile, tp: int,
                      shardings: tuple[tuple[str, tuple], ...] | None) -> float:
    """``layer``'s parameter bytes on one of ``tp`` tensor ranks: given the stage's
    per-parameter layouts, split only where its layout names the ``tensor`` axis
    (``hetshard.layout`` keeps the others whole on every rank: norms, biases, a weight
    the intra-op solver left replicated, embeddings and heads); without them (layouts not
    solved yet), every weight split but what no layout splits (``tp_whole_bytes``, and
    the stacked expert weights of a mixture-of-experts layer)."""
    if tp == 1:
        return float(layer.param_bytes)
    if shardings is None or not layer.param_shares:
        # (the intra-op solver has no rule splitting grouped matmuls' stacked expert
        # weights over ``tensor``: they stay whole, split by expert parallelism instead)
        whole = min(layer.param_bytes, layer.tp_whole_bytes + layer.expert_param_bytes)
        return (layer.param_bytes - whole) / tp + whole
    return float(sum(nbytes / tp if "tensor" in spec_axes(named_spec(shardings, path))
                     else nbytes for path, nbytes in layer.param_shares))


@dataclasses.dataclass(frozen=True)
class StageShape:
    """How a stage runs its layers: the typed form of :func:`stage_cost`'s keywords.

    ``tp``, ``cp``, ``dp``: tensor, context and data ways; ``fsdp``: the state sharded
    over the ``dp`` ways (gathered per layer); ``shard_optimizer``: ZeRO-1 over
    ``dp x cp``; ``mbs``: samples a micro-batch per data way; ``remat`` on the first
    ``remat_layers`` (None: all); ``attention``: the implementation asked for;
    ``tp_overlap``: tensor collectives as collective matmuls; ``dtype``: the compute
    dtype (None: the program's); ``shard_context``: the state sharded over the context
    ranks too; ``optimizer_ways``: the optimizer state's ways where not what the others
    say (hybrid sharding); ``offload``, ``host_link_gbs``: what lives in host memory and
    over what link; ``shardings``: solved per-parameter layouts (None: unsolved);
    ``ep``, ``capacity_factor``, ``expert_counts``, ``router_skew``, ``expert_ranks``:
    expert parallelism; ``*_topo``: where each axis's collectives run (None: priced
    free)."""

    tp: int = 1
    cp: int = 1
    dp: int = 1
    fsdp: bool = False
    shard_optimizer: bool = False
    mbs: int = 1
    remat: str = "none"
    remat_layers: int | None = None
    attention: str = "flash"
    tp_topo: Topology | None = None
    cp_topo: Topology | None = None
    dp_topo: Topology | None = None
    tp_overlap: bool = False
    dtype: str | None = None
    shard_context: bool = False
    optimizer_ways: int | None = None
    offload: tuple[str, ...] = ()
    host_link_gbs: float | None = None
    shardings: tuple[tuple[str, tuple], ...] | None = None
    ep: int = 1
    ep_topo: Topology | None = None
    capacity_factor: float | None = None
    expert_counts: tuple[int, ...] = ()
    router_skew: float | None = None
    expert_ranks: tuple[int, ...] | None = None

    @property
    def shard(self) -> int:
        """Ways a micro-batch's activations are split: tensor x context."""
        return self.tp * self.cp

    @property
    def gathered(self) -> int:
        """The ways FSDP splits the state over (gathered for each layer's use)."""
        return (self.dp if self.fsdp else 1) * (self.cp if self.shard_context else 1)


def stage_cost(profile: ModelProfile, start: int, end: int, gpu: DeviceType, *,
               cal: Calibration, **shape) -> StageCost:
    """Prices layers ``[start, end)`` of ``profile`` on ``gpu`` (see the module
    docstring) for the :class:`StageShape` the keywords ``shape`` give.

    The price is a sum over the stage's layers of named terms (:class:`_LayerPrice`):
    the roofline compute, the tensor collectives, the context ring, the expert
    exchange, a measured layer's times, the FSDP gathers and the recompute, and each
    layer's memory; then the stage's optimizer state and update."""
    return _StagePricer(profile, start, end, gpu, StageShape(**shape), cal).price()


@dataclasses.dataclass
class _LayerTimes:
    """One layer's times for one micro-batch: forward, backward (without recompute),
    the backward's weight-gradient share (ZB-H1's W), attention's shares, and the
    recompute its remat adds."""

    f: float
    b: float
    weight: float
    att_f: float
    att_b: float
    recompute: float = 0.0


@dataclasses.dataclass
class _Roofline:
    """A layer's per-equation flops, bytes and rates after the stage's splits (what the
    named terms re-price parts of)."""

    ff: np.ndarray
    fb: np.ndarray
    pf: np.ndarray
    f_ops: np.ndarray


@dataclasses.dataclass
class _LayerMemory:
    """One layer's memory terms per device (``_StagePricer.memory``): kept per
    micro-batch in flight, its working set, the flash kernel's share of what is kept,
    offloaded activations on the host and the transfer time they expose each way, the
    one-program fusion's saving and what it applies to, what W carries, and the
    compute-dtype weight copy."""

    kept: float = 0.0
    working: float = 0.0
    attention: float = 0.0
    host: float = 0.0
    host_fwd_s: float = 0.0
    host_bwd_s: float = 0.0
    fused_saving: float = 0.0
    fusable: float = 0.0
    carry: float = 0.0
    weight_copy: float = 0.0


class _StagePricer:
    """The named terms of one stage's price (``stage_cost``)."""

    def __init__(self, profile: ModelProfile, start: int, end: int, gpu: DeviceType,
                 shape: StageShape, cal: Calibration):
        check_remat(shape.remat)
        offload = check_offload(shape.offload, shape.remat)
        if shape.remat_layers is not None and not 0 <= shape.remat_layers <= end - start:
            raise SpecError("remat_layers", shape.remat_layers,
                            f"None or a count of the stage's layers, 0 to {end - start}")
        if shape.attention not in ATTENTIONS:
            raise SpecError("attention", shape.attention, f"one of {ATTENTIONS}")
        if not 0 <= start < end <= profile.num_layers:
            raise SpecError("layers", (start, end),
                            f"a range within [0, {profile.num_layers})")
        self.profile, self.start, self.end, self.gpu, self.cal = profile, start, end, gpu, cal
        self.s = shape
        self.offload = offload
        self.e = e = cal.for_type(gpu.name)
        dtype = shape.dtype or profile.dtype
        # A context axis runs the ring, whose inner kernel is the flash kernel.
        self.attention = "flash" if shape.cp > 1 and shape.attention in ("auto", "cudnn") \
            else priced_attention(shape.attention, gpu, dtype,
                                  any(layer.attention_causal for layer in profile.layers))
        self.fused = self.attention != "reference"  # a kernel: scores on chip, O(S) residuals
        self.peak = gpu.peak_flops(dtype) * e.matmul(gpu)
        self.peak_attn = attention_rate(gpu, dtype, e, self.attention)
        self.bw = gpu.memory_gbs * 1e9 * e.memory_eff
        self.host_bw = (shape.host_link_gbs or gpu.host_link_gbs) * 1e9 * e.host_link_eff
        self.measured = _measured(profile, cal)
        self.last_remat = end if shape.remat_layers is None else start + shape.remat_layers

    # ---- time terms, per layer ------------------------------------------------------
    def compute(self, layer: LayerProfile, moe: _ExpertShare) -> tuple[_LayerTimes, _Roofline,
                                                                         float]:
        """The layer's roofline forward and backward: per kernel, flops at the matmul,
        attention or shape-quantised rate against bytes at HBM bandwidth, plus kernel
        launches; the flash kernel's attention on chip (half the products causal); the
        busiest expert rank's load. Also the bytes moved once a step (casts: seconds,
        returned third)."""
        e, bw, mbs, tp, cp, shard = self.e, self.bw, self.s.mbs, self.s.tp, self.s.cp, \
            self.s.shard
        ff = layer.fwd_flops[0] / tp + layer.fwd_flops[1] * mbs / shard
        # Batch-independent elementwise bytes (the weights' casts to the compute dtype
        # forward, their gradients' back to the parameters' dtype backward) are moved
        # once per step, not per micro-batch: mixed-precision runtimes keep the cast
        # weights across micro-batches and accumulate gradients in the GEMMs' output
        # type (Megatron-LM's fused accumulation). ``cast_s``, run with the update.
        step_bytes = float(np.where(layer.fwd_matmul, 0.0, layer.fwd_bytes[0]).sum() +
                           np.where(layer.bwd_matmul, 0.0, layer.bwd_bytes[0]).sum()) / tp
        cast_s = step_bytes * e.fusion / bw
        fb = np.where(layer.fwd_matmul, layer.fwd_bytes[0] / tp, 0.0) + \
            layer.fwd_bytes[1] * mbs / cp * _tp_share(layer.fwd_dims, layer.fwd_bytes, mbs, tp)
        bf = layer.bwd_flops[0] / tp + layer.bwd_flops[1] * mbs / shard
        bb = np.where(layer.bwd_matmul, layer.bwd_bytes[0] / tp, 0.0) + \
            layer.bwd_bytes[1] * mbs / cp * _tp_share(layer.bwd_dims, layer.bwd_bytes, mbs, tp)
        # the busiest expert rank's grouped matmuls: its rows and its experts' weights
        ff, bf = moe.loaded(ff, layer.fwd_expert), moe.loaded(bf, layer.bwd_expert)
        fb, bb = moe.loaded(fb, layer.fwd_expert), moe.loaded(bb, layer.bwd_expert)
        pf = np.where(layer.fwd_attention, self.peak_attn,
                      self.peak * _shape_eff(layer.fwd_dims, mbs, tp, cp, self.gpu.sms))
        pb = np.where(layer.bwd_attention, self.peak_attn,
                      self.peak * _shape_eff(layer.bwd_dims, mbs, tp, cp, self.gpu.sms))
        if self.fused:
            # The flash kernel keeps the scores on chip (no HBM traffic for the traced
            # reference's [seq, seq] tensors) and, causal, computes only the unmasked
            # half of the products the reference traces.
            half = 0.5 if layer.attention_causal else 1.0
            ff = np.where(layer.fwd_attention, ff * half, ff)
            fb = np.where(layer.fwd_attention, 0.0, fb)
            bf = np.where(layer.bwd_attention, bf * half, bf)
            bb = np.where(layer.bwd_attention, 0.0, bb)
        f_ops = _op_times(ff, fb, layer.fwd_matmul, pf, bw, e.fusion)
        t_f = float(f_ops.sum()) + e.kernel_launch_s * _kernels(
            layer.fwd_kernels, layer.fwd_attention, self.attention, 1)
        per_op = _op_times(bf, bb, layer.bwd_matmul, pb, bw, e.fusion)
        att_f = float(f_ops[layer.fwd_attention].sum()) if layer.fwd_attention.any() else 0.0
        att_b = float(per_op[layer.bwd_attention].sum()) \
            if len(layer.bwd_attention) == len(per_op) and layer.bwd_attention.any() else 0.0
        t_b = float(per_op.sum()) + e.kernel_launch_s * _kernels(
            layer.bwd_kernels, layer.bwd_attention, self.attention, 2)
        weight = float(per_op[layer.bwd_weight].sum()) \
            if len(layer.bwd_weight) == len(per_op) else 0.0
        return _LayerTimes(t_f, t_b, weight, att_f, att_b), _Roofline(ff, fb, pf, f_ops), \
            cast_s

    def tensor_collectives(self, layer: LayerProfile, t: _LayerTimes, r: _Roofline,
                           mode: str) -> None:
        """Megatron's activation all-reduces (sequence parallel: reduce-scatter and
        all-gather, the backward regathering the column inputs unless full remat just
        did), or as collective matmuls each hidden behind its matmul group."""
        s, e = self.s, self.e
        if s.tp <= 1 or s.tp_topo is None:
            return
        act_bytes = layer.boundary_bytes_per_sample * s.mbs / s.cp  # on the tp group
        ar = collective_time("all_reduce", act_bytes, s.tp_topo, self.cal, self.gpu.name)
        sequence = bool(layer.tp_groups) and layer.tp_sequence % s.tp == 0
        if s.tp_overlap and sequence:
            # Collective matmuls: a reduce-scatter or all-gather (half the ring of an
            # all-reduce) per matmul group, each hidden behind its group's matmuls.
            half = ar / 2
            for col, row in layer.tp_groups:
                mc, mr = float(r.f_ops[list(col)].sum()), float(r.f_ops[list(row)].sum())
                t.f += _exposed(half, mc, s.tp, e) + _exposed(half, mr, s.tp, e)
                # Backward. Column group: two rings, the input's cotangent
                # reduce-scattered behind its input-gradient matmuls, then the input
                # passed around again behind the weight-gradient ones (ZB-H1's W).
                # Row: one ring gathering the output's cotangent behind both of its
                # gradient matmuls, so its weight gradient runs in B (about its
                # forward matmul's time, taken from the W share).
                w_ring = _exposed(half, mc, s.tp, e)
                t.b += 2 * w_ring + _exposed(half, 2 * mr, s.tp, e)
                t.weight += w_ring - mr
        else:
            t.f += layer.tp_collectives * ar
            regather = sequence and mode != "full"
            t.b += layer.tp_collectives * ar * (1.5 if regather else 1.0)

    def context_ring(self, layer: LayerProfile, t: _LayerTimes, r: _Roofline) -> None:
        """K and V chunks around the context ring (cp - 1 steps: an all-gather of the
        sequence's K and V), hidden behind attention where it is shorter."""
        s = self.s
        if s.cp <= 1 or s.cp_topo is None or not layer.fwd_attention.any():
            return
        act_bytes = layer.boundary_bytes_per_sample * s.mbs / s.cp
        ring = collective_time("all_gather", 2 * act_bytes * s.cp / s.tp, s.cp_topo,
                               self.cal, self.gpu.name)
        m = layer.fwd_attention
        t_attn = _ops_time(r.ff[m], r.fb[m], layer.fwd_matmul[m], self.peak_attn, self.bw,
                           self.e.fusion)
        exposed = max(0.0, ring - t_attn)
        t.f += exposed
        t.b += 2 * exposed
        t.att_f += exposed
        t.att_b += 2 * exposed

    def expert_exchange(self, t: _LayerTimes, moe: _ExpertShare) -> float:
        """The dispatch and combine all-to-alls, each way; returns what an uneven
        placement's experts cost once a step (brought, their gradients given back: the
        pipeline runtime's ``brought_experts``; a single-stage step's one program does
        the same)."""
        s = self.s
        if not moe.active or s.ep_topo is None:
            return 0.0
        a2a = moe.exchange_s(s.ep_topo, self.cal, self.gpu.name)
        t.f += a2a
        t.b += a2a
        return 2 * moe.gather_s(s.ep_topo, self.cal, self.gpu.name)

    def fsdp_gather(self, own: float, t: _LayerTimes) -> None:
        """Each layer's parameters gathered behind the layer before's compute, what is
        hidden still slowing it (the transfer's kernels take SMs and bandwidth); one ring
        per tensor rank (and context rank where the state is not split over them), all at
        once, sharing each node's network card."""
        s, e = self.s, self.e
        if s.gathered <= 1 or s.dp_topo is None:
            return
        ag = collective_time("all_gather", own, s.dp_topo, self.cal, self.gpu.name,
                             s.tp if s.shard_context else s.tp * s.cp)
        t.f = max(t.f, ag) + e.overlap_interference * min(t.f, ag)
        t.b = max(t.b, ag) + e.overlap_interference * min(t.b, ag)

    def recompute(self, layer: LayerProfile, t: _LayerTimes, r: _Roofline, mode: str,
                  save, timed: bool) -> None:
        """What the layer's remat recomputes in its backward: the whole forward (full),
        all but the saved values (a policy; a measured layer re-runs the roofline's
        share of its measured forward), and the flash kernel's scores."""
        e, bw = self.e, self.bw
        if mode == "full":
            t.recompute += t.f
            t.att_b += t.att_f
            return
        if timed:
            # The framework measured recomputes what it recomputes: nothing else added.
            if save is not None:
                m = save.recomputed
                share = _ops_time(r.ff[m], r.fb[m], layer.fwd_matmul[m], r.pf[m], bw,
                                  e.fusion) / max(_ops_time(r.ff, r.fb, layer.fwd_matmul,
                                                            r.pf, bw, e.fusion), 1e-30)
                t.recompute += share * t.f
            return
        if save is not None:
            # Everything but the saved values, attention included where the policy does
            # not keep its output (the flash kernel's forward is re-run for its residuals).
            m = save.recomputed
            t.recompute += _ops_time(r.ff[m], r.fb[m], layer.fwd_matmul[m], r.pf[m], bw,
                                     e.fusion)
        if self.fused:
            # The flash kernel's backward recomputes the attention scores from q, k and v
            # (Dao 2023).
            m = layer.fwd_attention
            again = _ops_time(r.ff[m], r.fb[m], layer.fwd_matmul[m], self.peak_attn, bw,
                              e.fusion)
            t.recompute += again
            t.att_b += again

    # ---- memory terms, per layer ----------------------------------------------------
    def memory(self, index: int, layer: LayerProfile, t: _LayerTimes, mode: str, save,
               own: float, moe: _ExpertShare) -> _LayerMemory:
        """What the layer keeps per micro-batch in flight under its remat, its working
        set, the host copies of offloaded activations (and the time they expose), what
        W carries and the compute-dtype copy of its weights."""
        s, profile, attention, fused = self.s, self.profile, self.attention, self.fused
        mbs, shard = s.mbs, s.shard
        m = _LayerMemory()
        res = layer.residual_bytes_per_sample * mbs / shard
        attn = layer.attention_residual_bytes_per_sample * mbs / shard
        # What the layer's backward reads without remat. The flash kernel never
        # materialises attention's scores: it keeps its inputs, output and log-sum-exp
        # instead of the reference's residuals (and of q, k, v in the reference's copies).
        whole = res if attention == "reference" else (
            res - attn + (layer.flash_residual_bytes_per_sample
                          - layer.attention_input_residual_bytes_per_sample) * mbs / shard)
        if fused and mode != "full":
            m.attention = layer.flash_residual_bytes_per_sample * mbs / shard
        checkpoint = (profile.layers[index - 1].boundary_bytes_per_sample * mbs / shard
                      if index else 0.0)  # a layer's input: the layer before's output
        if mode == "none":
            m.kept = whole
            if layer.fused_residual_bytes_per_sample > 0:  # (0: a profile without it)
                # Attention's own residuals are the kernel's under flash: only the rest is
                # fused. (Summed over the stage: a value one program keeps for a
                # recomputed one may be a layer before's.)
                one = layer.fused_residual_bytes_per_sample * mbs / shard
                if attention != "reference":
                    one -= layer.fused_attention_residual_bytes_per_sample * mbs / shard
                m.fused_saving = (res if attention == "reference" else res - attn) - one
                m.fusable = m.kept
            m.kept += moe.extra_residual_bytes
        elif save is not None and "activations" in self.offload:
            # The kept values go to the host in the forward and come back for the
            # backward, each copy behind the layer's own compute (``hetshard.offload``);
            # the GPU keeps the layer's input, as under full remat.
            m.host = save.kept_bytes_per_sample * mbs / shard
            m.host_fwd_s = max(0.0, m.host / self.host_bw - t.f)
            m.host_bwd_s = max(0.0, m.host / self.host_bw - t.b)
            m.kept, m.working = checkpoint, whole
        elif save is not None:
            m.kept = save.kept_bytes_per_sample * mbs / shard
            m.working = whole  # one layer's recomputed values live during its backward
        else:
            m.kept, m.working = checkpoint, whole  # a checkpointed layer keeps its input
        if mode != "none":
            # A W pass reads the weight matmuls' inputs, which B recomputed: kept until W.
            m.carry = (layer.weight_input_bytes_per_sample if save is None else
                       save.weight_input_bytes_per_sample) * mbs / shard
        m.carry += layer.weight_carry_bytes_per_sample * mbs / shard
        # (the compute-dtype copies of the weights split as the weights are)
        m.weight_copy = layer.weight_copy_bytes * (own / layer.param_bytes
                                                   if layer.param_bytes else 1.0 / s.tp)
        return m

    # ---- the stage ------------------------------------------------------------------
    def price(self) -> StageCost:
        s, profile, start, end = self.s, self.profile, self.start, self.end
        mbs, tp, cp, fused = s.mbs, s.tp, s.cp, self.fused
        fwd = bwd = recompute = weight = carry = cast_s = brought_s = 0.0
        att_f = att_b = att_mem = 0.0
        model_flops = hw_flops = 0.0
        act = static_copy = param_bytes = host_act = largest_param = fused_saving = 0.0
        fusable = 0.0  # the activations of the layers without remat
        layer_params: list[float] = []  # per layer, parameter bytes per device
        working = 0.0
        inside = {layer.name for layer in profile.layers[start:end]}
        updates: list[float | None] = []
        read_copies: dict[int, tuple[str, float]] = {}  # foreign parameters: copy, gradient
        for index, layer in enumerate(profile.layers[start:end], start):
            for key, owner, nbytes in layer.foreign_params:
                if owner not in inside:
                    read_copies[key] = (owner, nbytes / tp)
            own = tensor_rank_bytes(layer, tp, s.shardings)  # on one tensor rank
            moe = _ExpertShare(layer, s.ep, mbs, s.capacity_factor, s.expert_counts,
                               profile.router_skew if s.router_skew is None else s.router_skew,
                               s.expert_ranks, profile.expert_loads)
            own -= moe.saved_param_bytes(own)
            mode = s.remat if index < self.last_remat else "none"
            save = layer.saves.get(mode)  # a remat keeping some values: what it keeps
            # time: the named terms
            t, roof, layer_cast_s = self.compute(layer, moe)
            self.tensor_collectives(layer, t, roof, mode)
            self.context_ring(layer, t, roof)
            if moe.active and s.ep_topo is not None:
                brought_s += self.expert_exchange(t, moe)
                working = max(working, moe.buffer_bytes + moe.placed_working_bytes())
                static_copy += moe.brought_bytes()
            timed = self.measured.layer(index, self.gpu.name, tp, mbs) \
                if self.measured and cp == 1 else None
            if timed is None:
                cast_s += layer_cast_s
                updates.append(None)
            else:
                # The layer as measured on this GPU and tensor degree (its tensor
                # collectives included); ZB-H1's W keeps the roofline's share.
                roof_b = t.b
                t.f, t.b, update = timed
                t.weight = t.weight * t.b / max(roof_b, 1e-30)
                updates.append(update)
            self.fsdp_gather(own, t)
            self.recompute(layer, t, roof, mode, save, timed is not None)
            fwd += t.f
            bwd += t.b
            recompute += t.recompute
            weight += t.weight
            if timed is None:  # (a measured layer keeps its attention share unknown)
                att_f += t.att_f
                att_b += t.att_b
            f_model = layer.flops(mbs)
            model_flops += f_model
            hw_flops += f_model + (layer.fwd_total_flops(mbs) if mode == "full" else 0.0)
            m = self.memory(index, layer, t, mode, save, own, moe)
            act += m.kept
            working = max(working, m.working)
            att_mem += m.attention
            host_act += m.host
            fwd += m.host_fwd_s
            bwd += m.host_bwd_s
            fused_saving += m.fused_saving
            fusable += m.fusable
            carry += m.carry
            static_copy += m.weight_copy
            param_bytes += own
            largest_param = max(largest_param, own)
            layer_params.append(own)
            if save is not None:
                hw_flops += float(layer.fwd_flops[1][save.recomputed].sum()) * mbs
            if mode != "full" and fused:
                hw_flops += float(layer.fwd_flops[1][layer.fwd_attention].sum()) * mbs
        # W also reads the cotangent the next stage sent back (a full activation per tp
        # rank; the last layer's is the loss's seed).
        cotangent = (profile.layers[end - 1].boundary_bytes_per_sample * mbs / cp
                     if end < profile.num_layers else 0.0)
        state = self.state(param_bytes, read_copies, layer_params, largest_param, updates)
        static = state.static + static_copy / s.gathered
        working = max(working + state.fsdp_working, state.offload_working)
        # Without remat a layer keeps what XLA writes when the forward and backward are
        # one program (a single-stage step), the elementwise values between recomputed by
        # the backward's kernels (``OpGraph.residuals(fused=True)``); a pipeline stage's
        # forward checkpoints each such layer to keep the same
        # (``hetshard.rewrite.pipeline.Remat``).
        act -= min(max(fused_saving, 0.0), fusable)
        return StageCost(fwd_s=fwd, bwd_s=bwd + recompute, grad_sync_bytes=param_bytes,
                         optimizer_s=state.optimizer_s, model_flops=model_flops,
                         hardware_flops=hw_flops, memory_static_bytes=static,
                         memory_per_microbatch_bytes=act, memory_working_bytes=working,
                         bwd_weight_s=weight, memory_carry_bytes=carry,
                         memory_cotangent_bytes=cotangent,
                         read_copies=tuple(sorted(read_copies.values())),
                         cast_s=cast_s + brought_s, brought_s=brought_s,
                         attention_fwd_s=att_f, attention_bwd_s=att_b,
                         attention_memory_bytes=att_mem,
                         host_static_bytes=state.host_static,
                         host_per_microbatch_bytes=host_act,
                         host_stream_s=state.host_stream_s,
                         memory_state_bytes=state.held + state.opt_state - state.host_static)

    def state(self, param_bytes: float, read_copies: dict, layer_params: list[float],
              largest_param: float, updates: list) -> _StageState:
        """The stage's parameters, gradients and optimizer state per device, the
        update's time, and what FSDP's gathers and a host-kept optimizer state hold
        while they run."""
        s, profile, bw, host_bw = self.s, self.profile, self.bw, self.host_bw
        gathered = s.gathered
        # The distributed optimizer shards the optimizer state over data x context (the
        # context ranks hold the same parameters: Megatron-LM's distributed optimizer
        # does the same; ``hetshard.layout.leaf_spec``).
        opt_dp = s.optimizer_ways or max(gathered, s.dp * s.cp if s.shard_optimizer else 1)
        opt_state = param_bytes * profile.opt_bytes_per_param_byte / opt_dp
        held = (param_bytes + sum(b for _, b in read_copies.values())) / gathered
        fsdp_working = 0.0
        if gathered > 1:
            # FSDP: a layer's gathered weights are read again by its backward, which
            # gathers them again (every layer is checkpointed, remat none's included:
            # ``hetshard.rewrite.spmd``, ``rewrite.pipeline.Remat``), one layer at a time
            # behind the next (two at once). Its gradients are whole until their
            # reduce-scatter, which runs in XLA's combined buckets
            # (``hetshard.cost.comm.buckets``): the largest bucket whole.
            kept = 2 * max(layer_params, default=0.0)
            bucket = max((b for _, b in buckets(layer_params[::-1])), default=0.0)
            fsdp_working = (kept + bucket) * (1 - 1 / gathered)
        static = held * 2.0 + opt_state  # (the gradients: held)
        optimizer_s = param_bytes / opt_dp * profile.opt_update_bytes_per_param_byte / bw
        if updates and all(u is not None for u in updates):
            optimizer_s = sum(updates) / opt_dp  # measured per layer (its tensor degree)
        host_static = host_stream_s = offload_working = 0.0
        if "optimizer" in self.offload:
            # The state lives on the host; the update streams it in and back out, both
            # ways at once, the GPU holding two layers' worth (one arriving, one leaving)
            # while it runs. The update waits for the first layer's copy, then runs at
            # the pace of the slower of its compute and the link.
            host_static = opt_state
            static -= opt_state
            layer_state = largest_param * profile.opt_bytes_per_param_byte / opt_dp
            offload_working = 2 * layer_state
            host_stream_s = max(0.0, opt_state / host_bw - optimizer_s)
            optimizer_s = max(optimizer_s, opt_state / host_bw) + layer_state / host_bw
        return _StageState(held, opt_state, static, optimizer_s, fsdp_working,
                           offload_working, host_static, host_stream_s)


class _StageState(NamedTuple):
    """A stage's state per device (``_StagePricer.state``): parameters and read copies
    (``held``), the optimizer state, the static bytes they make (gradients included,
    weight copies not), the update's time, the working bytes of FSDP's gathers and of a
    host-kept optimizer state's stream, the host-kept state and its stream's extra
    time."""

    held: float
    opt_state: float
    static: float
    optimizer_s: float
    fsdp_working: float
    offload_working: float
    host_static: float
    host_stream_s: float
