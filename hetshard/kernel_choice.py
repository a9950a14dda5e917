"""Which attention implementation computes a call, per GPU type and attention pattern.

A plan's ``attention`` is one of :data:`IMPLEMENTATIONS`:

* ``cudnn``: cuDNN's fused flash attention through ``jax.nn.dot_product_attention``
  (``hetshard.kernels.dot_product``): NVIDIA compute capability 8.0 or later, 16-bit
  q, k and v, head dim a multiple of 8 up to 128 (256 from Hopper on), no segment ids,
  causal only when q and k have one length. The fastest measured on Hopper
  (``hetshard.cost.stage.ATTENTION_TFLOPS``).
* ``flash``: hetshard's Pallas kernel (``hetshard.kernels.flash_attention``): every
  pattern (segment ids, GQA, uneven lengths, positions for ring attention); on GPUs its
  Triton lowering (compute capability 7.0 or later, bfloat16 from 8.0 on); on CPU
  interpret mode.
* ``reference``: XLA's einsum-softmax-einsum (``attention_reference``): runs everywhere,
  keeps O(S^2) scores; ``auto`` takes it where nothing else runs (a bfloat16 program's
  attention on V100 and T4, AMD GPUs).
* ``auto`` (the planner's default): per call, the first of :data:`PREFERENCE` that
  computes the call's pattern exactly on the device that runs it. Where cuDNN is
  chosen for a GPU type but the devices are not CUDA GPUs (tests on fake CPU devices),
  the flash kernel computes the call: the same math with the same O(S) memory.

Ring attention (a ``context`` axis) runs the flash kernel inside the ring: it needs a
kernel that takes explicit token positions and returns the log-sum-exp.
"""

from __future__ import annotations

import dataclasses

from hetshard.errors import SpecError

# A plan's ``attention`` values (``hetshard._plan.ATTENTION_IMPLEMENTATIONS`` holds the same;
# this module imports no JAX and not the plan: the plan's checks import it).
IMPLEMENTATIONS = ("auto", "cudnn", "flash", "reference")

PREFERENCE = ("cudnn", "flash", "reference")
_SIXTEEN_BIT = ("bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class Pattern:
    """What an attention call computes: what decides which implementation can run it."""

    causal: bool = True
    segments: bool = False  # packed rows: a segment-id mask
    dtype: str = "bfloat16"  # q, k and v's dtype
    head_dim: int = 128
    same_length: bool = True  # q and k have one sequence length

    @classmethod
    def of(cls, q, k, segment_ids, causal: bool) -> Pattern:
        return cls(causal=bool(causal), segments=segment_ids is not None,
                   dtype=getattr(q.dtype, "name", str(q.dtype)), head_dim=int(q.shape[-1]),
                   same_length=q.shape[1] == k.shape[1])

    def describe(self) -> str:
        parts = ["causal" if self.causal else "full",
                 "packed rows (segment ids)" if self.segments else "one sequence a row",
                 self.dtype, f"head dim {self.head_dim}"]
        if not self.same_length:
            parts.append("q and k of different lengths")
        return ", ".join(parts)


@dataclasses.dataclass(frozen=True)
class Hardware:
    """What runs a call: ``vendor`` ("nvidia", "amd", "cpu", ...), the CUDA compute
    capability where NVIDIA, and a name for messages."""

    vendor: str
    capability: tuple[int, int] | None
    name: str

    @classmethod
    def of_type(cls, gpu) -> Hardware:
        """A catalog ``DeviceType`` (what the planner prices)."""
        return cls(gpu.vendor, gpu.capability, gpu.name)

    @classmethod
    def of_device(cls, device) -> Hardware:
        """A JAX device (what the runtime runs on)."""
        if device.platform == "cpu":
            return cls("cpu", None, "CPU")
        kind = getattr(device, "device_kind", device.platform)
        version = str(getattr(getattr(device, "client", None), "platform_version", ""))
        if device.platform == "rocm" or "rocm" in version.lower():
            return cls("amd", None, kind)
        cc = getattr(device, "compute_capability", None)
        if device.platform in ("gpu", "cuda") and cc:
            major, minor = str(cc).split(".")[:2]
            return cls("nvidia", (int(major), int(minor)), kind)
        # a platform hetshard knows no kernel for (TPU, ...): XLA's attention
        return cls(device.platform, None, kind)


def refusal(impl: str, hw: Hardware, pattern: Pattern | None = None) -> str | None:
    """Why ``impl`` cannot compute ``pattern`` on ``hw`` exactly; None when it can
    (``pattern`` None: only what the hardware decides). An inline GPU of a cluster spec
    (vendor "custom") that gives no compute capability is taken to run every
    implementation: the devices that run it decide at run time."""
    if impl not in IMPLEMENTATIONS:
        raise SpecError("attention", impl, f"one of {IMPLEMENTATIONS}")
    if impl in ("reference", "auto"):
        return None
    cap = hw.capability
    nvidia = hw.vendor == "nvidia" and cap is not None
    unknown = hw.vendor == "custom" and cap is None  # an inline GPU without one
    if impl == "cudnn":
        if not (nvidia or unknown):
            return f"cuDNN runs on NVIDIA GPUs only ({hw.name} is {hw.vendor})"
        if nvidia and cap < (8, 0):
            return (f"cuDNN's fused flash attention needs compute capability 8.0+ "
                    f"({hw.name} has {cap[0]}.{cap[1]})")
        if pattern is None:
            return None
        if pattern.dtype not in _SIXTEEN_BIT:
            return f"cuDNN's fused attention takes bfloat16 or float16, not {pattern.dtype}"
        most = 256 if (cap or (9, 0)) >= (9, 0) else 128
        if pattern.head_dim % 8 or pattern.head_dim > most:
            return (f"cuDNN's fused attention needs a head dim that is a multiple of 8 up "
                    f"to {most} on {hw.name}, not {pattern.head_dim}")
        if pattern.segments:
            return "cuDNN's fused attention takes no segment ids through jax.nn"
        if pattern.causal and not pattern.same_length:
            return "jax.nn's causal mask aligns starts, not ends, when q and k differ in length"
        return None
    # flash
    if hw.vendor == "cpu" or unknown:
        return None  # interpret mode; an unknown GPU: decided on its devices
    if not nvidia:
        return (f"the Pallas kernel lowers through Triton for NVIDIA GPUs ({hw.name} is "
                f"{hw.vendor})")
    if cap < (7, 0):
        return (f"the Pallas kernel's Triton lowering needs compute capability 7.0+ "
                f"({hw.name} has {cap[0]}.{cap[1]})")
    if pattern is not None and pattern.dtype == "bfloat16" and cap < (8, 0):
        return (f"Triton has no bfloat16 tensor-core products before compute capability "
                f"8.0 ({hw.name} has {cap[0]}.{cap[1]})")
    return None


def runs_on(hw: Hardware, pattern: Pattern | None = None) -> list[str]:
    """The implementations that compute ``pattern`` on ``hw``, fastest first."""
    return [i for i in PREFERENCE if refusal(i, hw, pattern) is None]


def choose(hw: Hardware, pattern: Pattern | None = None) -> str:
    """``auto``'s choice: the first of :data:`PREFERENCE` that runs ``pattern`` on ``hw``."""
    return runs_on(hw, pattern)[0]


def resolve(impl: str, hw: Hardware, pattern: Pattern, *, where: str = "attention") -> str:
    """The implementation that computes a call: ``impl``, or ``auto``'s choice, with
    cuDNN's place taken by the flash kernel on devices that are not CUDA GPUs (fake CPU
    devices standing in for a GPU type). An explicit ``impl`` that cannot run the call
    is a :class:`SpecError` naming the hardware, the pattern and what runs there."""
    if impl == "auto":
        return choose(hw, pattern)
    why = refusal(impl, hw, pattern)
    if why is not None:
        raise SpecError("attention", impl,
                        f"an implementation that runs {pattern.describe()} on {hw.name}: "
                        f"{', '.join(runs_on(hw, pattern))} ({why})", where=where)
    return impl


def check_types(impl: str, gpus, dtypes: dict | None = None, *,
                where: str = "plan.attention") -> None:
    """Refuses, before tracing, an explicit ``impl`` that cannot run on some GPU type
    of ``gpus`` (catalog ``DeviceType``s) in the dtype it computes in there
    (``dtypes``: type name -> dtype; absent types are not checked for dtype)."""
    if impl not in IMPLEMENTATIONS:
        raise SpecError("attention", impl, f"one of {IMPLEMENTATIONS}", where=where)
    if impl == "auto":
        return
    for gpu in gpus:
        if gpu.vendor == "cpu":
            continue  # fake devices: checked on the devices that run it
        hw = Hardware.of_type(gpu)
        dtype = (dtypes or {}).get(gpu.name)
        pattern = None if dtype is None else Pattern(dtype=dtype)
        why = refusal(impl, hw, pattern)
        if why is not None:
            what = f" in {dtype}" if dtype else ""
            raise SpecError("attention", impl,
                            f"an implementation that runs on {gpu.name}{what}: "
                            f"{', '.join(runs_on(hw, pattern))} ({why})", where=where)
