"""Catalog of accelerator types with datasheet numbers.

All figures are per JAX device (what ``jax.devices()`` lists): for AMD MI250X
that is one GCD, half of the package. TFLOP/s are dense (no 2:4 sparsity);
tensor-core figures for bf16/fp16 assume fp32 accumulation, as training uses.
``bf16_tflops=None`` means the chip has no bf16 matrix units (V100, T4, P100):
bf16 runs there at ``fp32_tflops``. ``tf32_tflops`` is the dense TF32 tensor rate of
Ampere and later: float32 matmuls run there at it, as JAX's default matmul precision
lets XLA do (None: no TF32 units, float32 at ``fp32_tflops``). ``intra_node_gbs`` is GB/s
per GPU in one direction over the node's GPU interconnect (NVLink/xGMI/PCIe);
``inter_node_gbs`` is the usual per-node network of systems built from it,
GB/s in one direction (all NICs together), used when a spec omits it.
``memory_mib`` is the device memory the driver reports (nvidia-smi's total; rocm-smi's
VRAM total): the datasheet's "40 GB" of an A100 is 40960 MiB = 42.9e9 bytes, a T4's
"16 GB" with ECC on is 15360 MiB = 16.1e9. The planner's memory margin (5% by default)
is taken from it, for the CUDA context, the allocator and fragmentation.
"""

from __future__ import annotations

import dataclasses
import re

from hetshard.errors import (
    PrecisionWarning,
    SpecError,
    UnknownNameError,
    check_positive,
)


def _share(field: str, value, where: str = ""):
    """``value`` if None or a share of the peak in (0, 1]; else a SpecError naming ``field``."""
    if value is not None and (isinstance(value, bool) or
                              not isinstance(value, (int, float)) or not 0 < value <= 1):
        raise SpecError(field, value, "a share of the peak in (0, 1]", where=where)
    return value


def _capability(field: str, value, where: str = ""):
    """``value`` if None or a CUDA compute capability "major.minor"; else a SpecError."""
    if value is not None and not (isinstance(value, str) and
                                  re.fullmatch(r"[1-9][0-9]?\.[0-9]", value)):
        raise SpecError(field, value, 'a CUDA compute capability "major.minor", e.g. "9.0"',
                        where=where)
    return value


def _whole(field: str, value, where: str = ""):
    """``value`` if None or a positive whole number; else a SpecError naming ``field``."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or
                              value < 1):
        raise SpecError(field, value, "a positive whole number", where=where)
    return value


@dataclasses.dataclass(frozen=True)
class DeviceType:
    """One accelerator model. Units: TFLOP/s, GB (1e9 bytes), GB/s (one direction);
    ``memory_mib``: the driver's total in MiB (None: ``memory_gb`` x 1e9 bytes)."""

    name: str
    bf16_tflops: float | None
    fp16_tflops: float
    fp32_tflops: float
    memory_gb: float
    memory_gbs: float
    intra_node_gbs: float
    inter_node_gbs: float
    vendor: str = "nvidia"
    device_kinds: tuple[str, ...] = ()  # jax Device.device_kind strings that mean this type
    source: str = ""
    memory_mib: int | None = None
    tf32_tflops: float | None = None
    # Sustained 16-bit TFLOP/s of a FlashAttention-2-class kernel (forward + backward,
    # causal, head dim 128, long sequences), counted on the products it computes; None:
    # not published (the cost model then takes ATTENTION_GEMM_RATIO of its matmul rate).
    attention_tflops: float | None = None
    # Streaming multiprocessors (AMD: compute units) per device, from the datasheet or
    # architecture whitepaper: how many matmul tiles run at once (the cost model's wave
    # quantization). None: not modelled (every tile count fills the device).
    sms: int | None = None
    # Large GEMMs' sustained share of the 16-bit peak in training (power and clock limits
    # included), fitted per architecture on documented measured runs
    # (experiments/cost_model_accuracy.py); None: the cost model's default 0.75.
    matmul_eff: float | None = None
    # CUDA compute capability ("9.0"), from NVIDIA's CUDA GPUs table; None for other
    # vendors. It says which attention implementations run on the type
    # (``hetshard.kernel_choice``): cuDNN's fused attention needs 8.0 or later, the
    # Pallas kernel's Triton lowering 7.0 (bfloat16 products 8.0).
    compute_capability: str | None = None
    # The measured large-GEMM ceiling, 16-bit TFLOP/s: the best rate of one bf16 matmul
    # alone over a scan of large shapes (Bekman's "maximum achievable matmul FLOPS"),
    # the rate of a GEMM kernel, not of a training step; None: not measured.
    gemm_tflops: float | None = None
    # The link between one GPU and its host's memory, GB/s in one direction as the
    # GPU's share when every GPU of the node streams at once (a PCIe switch shared by
    # two GPUs halves it), and the host memory (GB) a node gives each of its GPUs; the
    # usual server of the type (``_HOST`` says which). What ``offload`` plans move and
    # hold (``hetshard.cost.stage``); a cluster spec can override both per group.
    host_link_gbs: float = 32.0
    host_memory_gb: float = 64.0

    def __post_init__(self):
        where = f"GPU type {self.name!r}"
        for f in ("fp16_tflops", "fp32_tflops", "memory_gb", "memory_gbs", "intra_node_gbs",
                  "inter_node_gbs", "host_link_gbs", "host_memory_gb"):
            check_positive(f, getattr(self, f), where=where)
        if self.bf16_tflops is not None:
            check_positive("bf16_tflops", self.bf16_tflops, where=where)
        if self.memory_mib is not None:
            check_positive("memory_mib", self.memory_mib, where=where)
        if self.tf32_tflops is not None:
            check_positive("tf32_tflops", self.tf32_tflops, where=where)
        if self.attention_tflops is not None:
            check_positive("attention_tflops", self.attention_tflops, where=where)
        if self.gemm_tflops is not None:
            check_positive("gemm_tflops", self.gemm_tflops, where=where)
        _share("matmul_eff", self.matmul_eff, where)
        _whole("sms", self.sms, where)
        if self.compute_capability is not None:
            _capability("compute_capability", self.compute_capability, where)

    @property
    def capability(self) -> tuple[int, int] | None:
        """``compute_capability`` as (major, minor), None when not given."""
        if self.compute_capability is None:
            return None
        major, minor = self.compute_capability.split(".")
        return int(major), int(minor)

    @property
    def memory_bytes(self) -> int:
        """Device memory in bytes: the driver's total where known, else ``memory_gb``."""
        if self.memory_mib is not None:
            return int(self.memory_mib) * 2**20
        return int(self.memory_gb * 1e9)

    def peak_flops(self, dtype: str = "bfloat16") -> float:
        """Peak dense FLOP/s for matmuls in ``dtype`` (``bfloat16``, ``float16``, ``float32``)."""
        if dtype in ("bfloat16", "bf16"):
            tflops = self.bf16_tflops if self.bf16_tflops is not None else self.fp32_tflops
        elif dtype in ("float16", "fp16"):
            tflops = self.fp16_tflops
        elif dtype in ("float32", "fp32"):
            tflops = self.tf32_tflops if self.tf32_tflops is not None else self.fp32_tflops
        else:
            raise SpecError("dtype", dtype, "bfloat16, float16 or float32")
        return tflops * 1e12

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["device_kinds"] = list(self.device_kinds)
        return d


# PCIe one-direction bandwidth per x16 slot: Gen3 ~16 GB/s, Gen4 ~32 GB/s, Gen5 ~64 GB/s
# (PCI-SIG base specifications 3.0/4.0/5.0: 8/16/32 GT/s per lane, x16).
_PCIE3, _PCIE4, _PCIE5 = 16.0, 32.0, 64.0
# DGX A100 / DGX H100: 8x 200 Gb/s HDR InfiniBand = 200 GB/s per node (NVIDIA DGX A100
# datasheet; Narayanan et al. 2021 §5). DGX H100: 8x 400 Gb/s NDR = 400 GB/s.
# DGX-1 (V100): 4x 100 Gb/s EDR = 50 GB/s. Cloud/PCIe boxes: 100 Gb/s = 12.5 GB/s.
# FlashAttention-2's sustained rate, causal, head dim 128, 8k tokens: ~190 TFLOP/s forward +
# backward on A100 80GB (Dao 2023, Fig. 4); ~330 TFLOP/s on H100 SXM5 (Shah et al. 2024,
# FlashAttention-3, Fig. 5: FA2's causal forward at 8k), i.e. ~0.61 and ~0.33 of peak: a
# Hopper runs FA2-class kernels (and the Triton-lowered Pallas kernel) far below its GEMMs.
_FA2_A100, _FA2_HOPPER = 190.0, 330.0
# Measured large-GEMM ceilings, bf16 TFLOP/s (S. Bekman, "Machine Learning Engineering",
# compute/accelerator, "Maximum Achievable Matmul FLOPS comparison table", measured with
# its mamf-finder.py): A100 SXM 267.9 (85.9% of 312, CUDA 12.1), A100 PCIe 256.4, H100 SXM
# 792.1 (80.1% of 989, 700 W, CUDA 12.1), GH200 821.0 (83.0%, CUDA 12.5); the same page
# gives 794.5 for H100/H200 SXM. An 8192^3 bf16 GEMM lands within a few percent of them.
_MAMF = {"A100-SXM": 267.9, "A100-PCIe": 256.4, "H100-SXM": 792.1, "GH200": 821.0}
# Large GEMMs' sustained share of the 16-bit peak in a training step (clocks under a
# training's power draw, the kernels' mix, what the per-op model does not see), fitted
# where documented runs exist (experiments/cost_model_accuracy.py, ``fit_matmul_eff``:
# the mean log error of the fit rows zeroed; every other row of every set held out).
# Ampere: 3 of Megatron-LM's 14 DGX A100 rows (Narayanan et al. 2021: 1.7B, 18.4B,
# 145.6B) give 0.674, i.e. 0.785 of the A100's measured GEMM ceiling. Hopper at 500 W
# (torchtitan's Grand Teton hosts): its 8-GPU FSDP Llama 3.1 8B row gives 0.542 of the
# 912 TFLOP/s priced for that part. A 700 W Hopper without a fitted row of its own (H100
# SXM, H200, GH200) runs its measured ceiling at Ampere's training share: 0.801 x 0.785 =
# 0.629 of peak on an H100 SXM (0.54, the 500 W fit, had priced NeMo/MaxText H100 runs
# 13-29% too slow). Without either a type uses the cost model's 0.75.
_AMPERE_GEMM, _HOPPER_500W_GEMM = 0.674, 0.542
_TRAINING_SHARE = _AMPERE_GEMM / (_MAMF["A100-SXM"] / 312.0)


def _sustained(mamf: float, peak: float) -> float:
    """A type's training share of its peak from its measured GEMM ceiling."""
    return round(mamf / peak * _TRAINING_SHARE, 3)

_TYPES = [
    DeviceType("V100-16GB", None, 125.0, 15.7, 16, 900, 150, 50,
               device_kinds=("Tesla V100-SXM2-16GB", "Tesla V100-PCIE-16GB", "Tesla V100-16GB"),
               source="NVIDIA Tesla V100 datasheet (SXM2): 125 TFLOPS tensor, 15.7 FP32, "
                      "900 GB/s HBM2, NVLink 300 GB/s bidirectional",
               memory_mib=16160, sms=80,
               compute_capability="7.0"),
    DeviceType("V100-32GB", None, 125.0, 15.7, 32, 900, 150, 50,
               device_kinds=("Tesla V100-SXM2-32GB", "Tesla V100-PCIE-32GB",
                             "Tesla V100-32GB", "Tesla V100S-PCIE-32GB"),
               source="NVIDIA Tesla V100 datasheet (SXM2 32GB)",
               memory_mib=32510, sms=80,
               compute_capability="7.0"),
    DeviceType("P100-16GB", None, 21.2, 10.6, 16, 732, 80, 12.5,
               device_kinds=("Tesla P100-SXM2-16GB", "Tesla P100-PCIE-16GB"),
               source="NVIDIA Tesla P100 datasheet (SXM2): 21.2 FP16, 10.6 FP32, 732 GB/s, "
                      "NVLink 160 GB/s bidirectional",
               memory_mib=16280, sms=56,
               compute_capability="6.0"),
    DeviceType("A100-40GB", 312.0, 312.0, 19.5, 40, 1555, 300, 200,
               device_kinds=("NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB"),
               source="NVIDIA A100 datasheet: 312 TFLOPS BF16 dense, 156 TF32 dense, 19.5 "
                      "FP32, 1555 GB/s, NVLink3 600 GB/s bidirectional",
               memory_mib=40960, tf32_tflops=156.0, attention_tflops=_FA2_A100, sms=108,
               matmul_eff=_AMPERE_GEMM, gemm_tflops=_MAMF["A100-SXM"],
               compute_capability="8.0"),
    DeviceType("A100-80GB", 312.0, 312.0, 19.5, 80, 2039, 300, 200,
               device_kinds=("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe"),
               source="NVIDIA A100 datasheet (SXM 80GB): 2039 GB/s HBM2e, 156 TF32 dense",
               memory_mib=81920, tf32_tflops=156.0, attention_tflops=_FA2_A100, sms=108,
               matmul_eff=_AMPERE_GEMM, gemm_tflops=_MAMF["A100-SXM"],
               compute_capability="8.0"),
    DeviceType("H100-80GB", 989.0, 989.0, 67.0, 80, 3350, 450, 400,
               device_kinds=("NVIDIA H100 80GB HBM3", "NVIDIA H100"),
               source="NVIDIA H100 datasheet (SXM5, 700 W): 989 TFLOPS BF16 dense, 494.7 "
                      "TF32 dense, 67 FP32, 3.35 TB/s, NVLink4 900 GB/s bidirectional",
               memory_mib=81559, tf32_tflops=494.7, attention_tflops=_FA2_HOPPER, sms=132,
               matmul_eff=_sustained(_MAMF["H100-SXM"], 989.0), gemm_tflops=_MAMF["H100-SXM"],
               compute_capability="9.0"),
    DeviceType("H100-96GB-500W", 912.0, 912.0, 62.0, 96, 2400, 450, 400,
               source="H100 SXM with 96 GB HBM2e at 2.4 TB/s, capped at 500 W (Meta's Grand "
                      "Teton hosts, torchtitan's published runs): dense BF16 priced at 912, "
                      "between the 700 W SXM's 989 and the NVL's 835 (torchtitan's note), "
                      "FP32 and TF32 scaled alike; 400 Gb/s RDMA per GPU",
               tf32_tflops=456.0, attention_tflops=_FA2_HOPPER * 912 / 989,
               sms=132, matmul_eff=_HOPPER_500W_GEMM, compute_capability="9.0"),
    DeviceType("H100-PCIe", 756.0, 756.0, 51.0, 80, 2000, _PCIE5, 50,
               device_kinds=("NVIDIA H100 PCIe",),
               source="NVIDIA H100 datasheet (PCIe, 350 W): 1513 TFLOPS BF16 with sparsity "
                      "(756 dense), 378 TF32 dense, 51 FP32, 80 GB HBM2e at 2 TB/s, 114 SMs, "
                      "PCIe Gen5 x16 (NVLink bridges pair cards only); 400 Gb/s per node",
               memory_mib=81559, tf32_tflops=378.0, attention_tflops=_FA2_HOPPER * 756 / 989,
               sms=114, compute_capability="9.0"),
    DeviceType("H100-NVL", 835.0, 835.0, 60.0, 94, 3900, _PCIE5, 50,
               device_kinds=("NVIDIA H100 NVL",),
               source="NVIDIA H100 NVL datasheet (400 W): 1671 TFLOPS BF16 with sparsity "
                      "(835 dense), 835 TF32 with sparsity (417.5 dense), 60 FP32, 94 GB "
                      "HBM3 at 3.9 TB/s, 132 SMs, PCIe Gen5 x16 (NVLink bridges pair cards "
                      "only)",
               memory_mib=95830, tf32_tflops=417.5, attention_tflops=_FA2_HOPPER * 835 / 989,
               sms=132, compute_capability="9.0"),
    DeviceType("H200", 989.0, 989.0, 67.0, 141, 4800, 450, 400,
               device_kinds=("NVIDIA H200", "NVIDIA H200 141GB HBM3e"),
               source="NVIDIA H200 datasheet (SXM): 989 TFLOPS BF16 dense, 494.7 TF32 dense, "
                      "141 GB, 4.8 TB/s",
               memory_mib=143771, tf32_tflops=494.7, attention_tflops=_FA2_HOPPER, sms=132,
               matmul_eff=_sustained(_MAMF["H100-SXM"], 989.0), gemm_tflops=_MAMF["H100-SXM"],
               compute_capability="9.0"),
    DeviceType("GH200-96GB", 989.0, 989.0, 67.0, 96, 4000, 450, 100,
               device_kinds=("NVIDIA GH200 96GB HBM3", "NVIDIA GH200"),
               source="NVIDIA GH200 Grace Hopper datasheet: H100 GPU with 96 GB HBM3 at "
                      "4 TB/s, 989 TFLOPS BF16 and 494.7 TF32 dense, NVLink4 900 GB/s "
                      "bidirectional; 4 per node with 4x 200 Gb/s Slingshot (CSCS Alps); "
                      "memory as Sailor's cluster config gives it (102625181696 bytes)",
               memory_mib=97872, tf32_tflops=494.7, attention_tflops=_FA2_HOPPER, sms=132,
               matmul_eff=_sustained(_MAMF["GH200"], 989.0), gemm_tflops=_MAMF["GH200"],
               compute_capability="9.0"),
    DeviceType("B200", 2250.0, 2250.0, 75.0, 180, 7700, 900, 400,
               device_kinds=("NVIDIA B200",),
               source="NVIDIA HGX B200 datasheet: 4.5 PFLOPS FP16/BF16 sparse (2.25 dense), "
                      "2.2 PFLOPS TF32 sparse (1.1 dense), 75 TFLOPS FP32, 180 GB HBM3e at "
                      "7.7 TB/s, NVLink5 1.8 TB/s bidir.",
               memory_mib=183359, tf32_tflops=1100.0, sms=148,
               compute_capability="10.0"),
    DeviceType("L4", 121.0, 121.0, 30.3, 24, 300, _PCIE4, 12.5,
               device_kinds=("NVIDIA L4",),
               source="NVIDIA L4 datasheet: 242 TFLOPS BF16 with sparsity (121 dense), "
                      "120 TF32 with sparsity (60 dense), 30.3 FP32, 24 GB GDDR6 300 GB/s, "
                      "PCIe Gen4 x16",
               memory_mib=23034, tf32_tflops=60.0, sms=58,
               compute_capability="8.9"),
    DeviceType("T4", None, 65.0, 8.1, 16, 320, _PCIE3, 6.25,
               device_kinds=("Tesla T4",),
               source="NVIDIA T4 datasheet: 65 TFLOPS FP16 mixed, 8.1 FP32, 320 GB/s, "
                      "PCIe Gen3 x16; network as AWS g4dn.12xlarge (50 Gb/s)",
               memory_mib=15360, sms=40,
               compute_capability="7.5"),
    DeviceType("A10", 125.0, 125.0, 31.2, 24, 600, _PCIE4, 12.5,
               device_kinds=("NVIDIA A10", "NVIDIA A10G"),
               source="NVIDIA A10 datasheet: 250 BF16 with sparsity (125 dense), 62.5 TF32 "
                      "dense, 31.2 FP32, 600 GB/s, PCIe Gen4",
               memory_mib=23028, tf32_tflops=62.5, sms=72,
               compute_capability="8.6"),
    DeviceType("RTX-3090", 71.0, 71.0, 35.6, 24, 936, _PCIE4, 1.25,
               device_kinds=("NVIDIA GeForce RTX 3090",),
               source="NVIDIA Ampere GA102 whitepaper, Table 9: 71 TFLOPS FP16/BF16 tensor "
                      "with FP32 accumulate (dense), 35.6 TF32 tensor (dense), 35.6 FP32, "
                      "936 GB/s; 10 GbE network",
               memory_mib=24576, tf32_tflops=35.6, sms=82,
               compute_capability="8.6"),
    DeviceType("RTX-3080Ti", 68.2, 68.2, 34.1, 12, 912, _PCIE4, 1.25,
               device_kinds=("NVIDIA GeForce RTX 3080 Ti",),
               source="GA102 whitepaper rates scaled to the 3080 Ti (80 SMs, 1665 MHz boost): "
                      "68.2 TFLOPS tensor FP32-acc, 34.1 TF32 tensor and FP32, 912 GB/s GDDR6X",
               memory_mib=12288, tf32_tflops=34.1, sms=80,
               compute_capability="8.6"),
    DeviceType("RTX-4090", 165.2, 165.2, 82.6, 24, 1008, _PCIE4, 1.25,
               device_kinds=("NVIDIA GeForce RTX 4090",),
               source="NVIDIA Ada AD102 whitepaper, Table 2: 165.2 TFLOPS FP16/BF16 tensor "
                      "with FP32 accumulate (dense), 82.6 TF32 tensor (dense), 82.6 FP32, "
                      "1008 GB/s",
               memory_mib=24564, tf32_tflops=82.6, sms=128,
               compute_capability="8.9"),
    DeviceType("TITAN-RTX", None, 130.5, 16.3, 24, 672, _PCIE3, 1.25,
               device_kinds=("NVIDIA TITAN RTX",),
               source="NVIDIA Turing TU102 whitepaper, Appendix A (Titan RTX): 130.5 TFLOPS "
                      "FP16 tensor with FP32 accumulate (full rate on Titan), 16.3 FP32, "
                      "24 GB GDDR6 at 672 GB/s; no BF16 or TF32 units",
               memory_mib=24576, sms=72,
               compute_capability="7.5"),
    DeviceType("RTX-2080Ti", None, 53.8, 13.4, 11, 616, _PCIE3, 1.25,
               device_kinds=("NVIDIA GeForce RTX 2080 Ti",),
               source="NVIDIA Turing TU102 whitepaper, Table 1 (RTX 2080 Ti, reference "
                      "clocks): 53.8 TFLOPS FP16 tensor with FP32 accumulate, 13.4 FP32, "
                      "11 GB GDDR6 at 616 GB/s",
               memory_mib=11264, sms=68,
               compute_capability="7.5"),
    DeviceType("MI250X", 191.5, 191.5, 47.9, 64, 1638, 100, 100, vendor="amd",
               device_kinds=("AMD Instinct MI250X", "MI250X"),
               source="AMD Instinct MI250X datasheet: 383 TFLOPS BF16, 95.7 FP32 matrix, "
                      "128 GB at 3.2 TB/s per package = 2 GCDs (per-GCD figures here); "
                      "Infinity Fabric 50-100 GB/s per direction between GCDs (Frontier node)",
               memory_mib=65520, sms=110),
    DeviceType("MI300X", 1307.4, 1307.4, 163.4, 192, 5300, 448, 400, vendor="amd",
               device_kinds=("AMD Instinct MI300X", "MI300X"),
               source="AMD Instinct MI300X datasheet: 1307.4 TFLOPS BF16 dense, 653.7 TF32, "
                      "163.4 FP32 matrix, 192 GB at 5.3 TB/s, 896 GB/s aggregate Infinity "
                      "Fabric (bidir.)",
               memory_mib=196288, tf32_tflops=653.7, sms=304),
    # Host CPUs stand in for GPUs in tests; nominal numbers, replaced by `hetshard profile`.
    DeviceType("CPU", None, 0.1, 0.1, 16, 20, 10, 1.25, vendor="cpu", device_kinds=("cpu",),
               source="nominal: one fake XLA CPU device; calibrate with `hetshard profile`"),
]

# Host link (GB/s one direction, per GPU with every GPU of the node streaming) and host
# memory per GPU (GB) of each type's usual server. PCIe x16 per direction: Gen3 ~16, Gen4
# ~32, Gen5 ~64 GB/s (above). DGX-1 (V100, P100): GPUs in pairs behind PCIe Gen3 switches
# (one x16 uplink per pair), 512 GB DDR4 for 8 GPUs (NVIDIA DGX-1 datasheet). DGX A100:
# GPUs in pairs behind PCIe Gen4 switches, 1 TB (40 GB GPUs) or 2 TB (80 GB GPUs) for 8
# (NVIDIA DGX A100 datasheet and user guide). DGX H100 / H200: one PCIe Gen5 x16 per GPU,
# 2 TB for 8 (NVIDIA DGX H100 / H200 datasheets). GH200: NVLink-C2C 900 GB/s
# bidirectional to the Grace CPU's LPDDR5X, 128 GB per module on CSCS Alps (NVIDIA GH200
# datasheet; CSCS Alps documentation). DGX B200: PCIe Gen5, 4 TB for 8 (datasheet).
# PCIe cards (L4, T4, A10, H100 PCIe/NVL, consumer GPUs): the card's own x16 slot, and
# 64 GB of host memory per GPU, an assumption (a 4-GPU workstation or cloud VM with
# 256 GB; AWS g4dn.12xlarge gives 192 GB for 4 T4s); MI250X: 36 GB/s Infinity Fabric per
# GCD to the CPU, 512 GB for 8 GCDs (OLCF Frontier node); MI300X: PCIe Gen5, 2 TB for 8
# (AMD Instinct MI300X platform). Set ``host_link_gbs`` and ``host_memory_gb`` in a
# cluster spec where a machine differs.
_HOST = {
    "V100-16GB": (_PCIE3 / 2, 64.0), "V100-32GB": (_PCIE3 / 2, 64.0),
    "P100-16GB": (_PCIE3 / 2, 64.0),
    "A100-40GB": (_PCIE4 / 2, 128.0), "A100-80GB": (_PCIE4 / 2, 256.0),
    "H100-80GB": (_PCIE5, 256.0), "H100-96GB-500W": (_PCIE5, 256.0),
    "H100-PCIe": (_PCIE5, 64.0), "H100-NVL": (_PCIE5, 64.0), "H200": (_PCIE5, 256.0),
    "GH200-96GB": (450.0, 128.0), "B200": (_PCIE5, 512.0),
    "L4": (_PCIE4, 64.0), "T4": (_PCIE3, 48.0), "A10": (_PCIE4, 64.0),
    "RTX-3090": (_PCIE4, 64.0), "RTX-3080Ti": (_PCIE4, 64.0), "RTX-4090": (_PCIE4, 64.0),
    "TITAN-RTX": (_PCIE3, 64.0), "RTX-2080Ti": (_PCIE3, 64.0),
    "MI250X": (36.0, 64.0), "MI300X": (_PCIE5, 256.0), "CPU": (10.0, 16.0),
}
_TYPES = [dataclasses.replace(t, host_link_gbs=_HOST[t.name][0], host_memory_gb=_HOST[t.name][1])
          for t in _TYPES]
CATALOG: dict[str, DeviceType] = {t.name: t for t in _TYPES}

_INLINE_FIELDS = {"name", "bf16_tflops", "fp16_tflops", "fp32_tflops", "tf32_tflops",
                  "attention_tflops", "memory_gb", "memory_mib", "memory_gbs",
                  "intra_node_gbs", "inter_node_gbs", "vendor", "sms", "matmul_eff",
                  "compute_capability", "gemm_tflops", "host_link_gbs", "host_memory_gb"}


def warn_precision_fallback(cluster, dtype: str, stacklevel: int = 3,
                            gpu_dtypes=()) -> list[str]:
    """Warns (once per call) when ``dtype`` is bfloat16 and some GPU types of ``cluster``
    have no bfloat16 tensor cores (V100, T4) and no other compute dtype in
    ``gpu_dtypes``: there bfloat16 matmuls run at the float32 rate. Returns the names of
    those types."""
    import warnings
    if dtype not in ("bfloat16", "bf16"):
        return []
    other = {g for g, d in gpu_dtypes if d != dtype}
    slow = [t for t in cluster.device_types if t.bf16_tflops is None and t.name not in other]
    if slow:
        rates = ", ".join(f"{t.name} {t.fp32_tflops:g} instead of {t.fp16_tflops:g}"
                          for t in slow)
        warnings.warn(
            f"the {', '.join(t.name for t in slow)} GPUs have no bfloat16 tensor cores: "
            f"bfloat16 "
            f"matmuls fall back to their float32 rate there (TFLOP/s: {rates} in float16); "
            f"let those GPUs compute in float16 with loss scaling (--gpu-dtypes fastest, "
            f"PlannerOptions(gpu_dtypes='fastest')) or train in float16 (--dtype float16, "
            f"or a float16 model) to use them", PrecisionWarning, stacklevel=stacklevel)
    return [t.name for t in slow]


GPU_DTYPE_POLICIES = ("program", "fastest")


def gpu_dtypes(cluster, dtype: str, policy: str = "program") -> tuple[tuple[str, str], ...]:
    """``Plan.gpu_dtypes`` under ``policy``: "program" (every GPU computes in the
    program's ``dtype``) or "fastest" (a bfloat16 program's matmuls run in float16 on the
    GPU types without bfloat16 tensor cores, V100 and T4, where float16 is 4-8x their
    float32 rate; the runtime then scales the loss)."""
    if policy not in GPU_DTYPE_POLICIES:
        raise SpecError("gpu_dtypes", policy, f"one of {GPU_DTYPE_POLICIES}")
    if policy == "program" or dtype not in ("bfloat16", "bf16"):
        return ()
    return tuple((t.name, "float16") for t in cluster.device_types
                 if t.bf16_tflops is None and t.fp16_tflops > t.fp32_tflops)


def device_type(name: str) -> DeviceType:
    """Looks up a catalog entry by name (case-insensitive), suggesting close names."""
    if name in CATALOG:
        return CATALOG[name]
    by_lower = {k.lower(): v for k, v in CATALOG.items()}
    if isinstance(name, str) and name.lower() in by_lower:
        return by_lower[name.lower()]
    raise UnknownNameError("gpu", name, CATALOG)


def device_type_from_dict(d: dict, *, field: str = "gpu") -> DeviceType:
    """An inline GPU type: ``{"name", "bf16_tflops", "memory_gb", "memory_gbs", ...}``.

    ``fp16_tflops`` defaults to ``bf16_tflops``; ``fp32_tflops`` to 1/16 of it
    (the A100/H100 ratio of dense tensor to FP32 is ~16x); links default to PCIe
    Gen4 and a 100 Gb/s NIC, the host to a Gen4 x16 slot and 64 GB per GPU.
    ``memory_mib`` (optional): the driver's memory total, which then sets the capacity
    instead of ``memory_gb``.
    """
    extra = set(d) - _INLINE_FIELDS
    if extra:
        raise SpecError(f"{field}.{sorted(extra)[0]}", d[sorted(extra)[0]],
                        f"only the fields {sorted(_INLINE_FIELDS)}")
    for req in ("name", "bf16_tflops", "memory_gb", "memory_gbs"):
        if req not in d:
            raise SpecError(f"{field}.{req}", None, "a value (required for an inline GPU)")
    if not isinstance(d["name"], str) or not d["name"]:
        raise SpecError(f"{field}.name", d["name"], "a non-empty string")
    for k in ("bf16_tflops", "fp16_tflops", "fp32_tflops", "tf32_tflops", "attention_tflops",
              "gemm_tflops", "memory_gb", "memory_mib", "memory_gbs", "intra_node_gbs",
              "inter_node_gbs", "host_link_gbs", "host_memory_gb"):
        if k in d:
            check_positive(f"{field}.{k}", d[k])
    bf16 = d["bf16_tflops"]
    return DeviceType(
        name=d["name"], bf16_tflops=bf16, fp16_tflops=d.get("fp16_tflops", bf16),
        fp32_tflops=d.get("fp32_tflops", bf16 / 16), memory_gb=d["memory_gb"],
        memory_gbs=d["memory_gbs"], intra_node_gbs=d.get("intra_node_gbs", _PCIE4),
        inter_node_gbs=d.get("inter_node_gbs", 12.5), vendor=d.get("vendor", "custom"),
        source="inline spec", memory_mib=d.get("memory_mib"), tf32_tflops=d.get("tf32_tflops"),
        attention_tflops=d.get("attention_tflops"), sms=_whole(f"{field}.sms", d.get("sms")),
        matmul_eff=_share(f"{field}.matmul_eff", d.get("matmul_eff")),
        gemm_tflops=d.get("gemm_tflops"), host_link_gbs=d.get("host_link_gbs", _PCIE4),
        host_memory_gb=d.get("host_memory_gb", 64.0),
        compute_capability=_capability(f"{field}.compute_capability",
                                       d.get("compute_capability")))


def device_type_for_kind(kind: str) -> DeviceType:
    """Maps a JAX ``Device.device_kind`` string to a catalog entry."""
    for t in _TYPES:
        if kind in t.device_kinds:
            return t
    low = kind.lower()
    for t in _TYPES:  # loose match: "NVIDIA A100-SXM4-80GB" style names we have not listed
        if t.vendor != "cpu" and t.name.split("-")[0].lower() in low and \
                (len(t.name.split("-")) == 1 or t.name.split("-")[1].lower() in low):
            return t
    raise UnknownNameError("device_kind", kind, [k for t in _TYPES for k in t.device_kinds],
                           where="Cluster.from_jax_devices (describe it with an inline gpu "
                                 "object in a cluster spec instead)")
