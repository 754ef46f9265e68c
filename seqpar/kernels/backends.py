"""Which CUDA kernel computes one attention block: chosen the way torch's own SDPA chooses.

seqpar calls torch's fused attention ops directly (it needs their log-sum-exp), so it cannot rely on
``F.scaled_dot_product_attention`` to pick a kernel and must make the same choice itself. The rules
below mirror ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`` (pytorch/pytorch, read for this
module): ``select_sdp_backend`` walks ``priority_order`` and returns the first backend whose
``can_use_*`` checks pass.

- **Flags.** ``torch.backends.cuda.enable_{flash,mem_efficient,cudnn,math}_sdp`` and the
  ``torch.nn.attention.sdpa_kernel`` context (which sets those same global flags, and with
  ``set_priority=True`` the priority order) are read at every call (:meth:`SdpFlags.current`).
- **Priority.** ``torch._C._get_sdp_priority_order()``; by default flash, memory-efficient, math,
  cuDNN. torch moves cuDNN first on the first CUDA SDPA call when ``check_prefer_cudnn_attention``
  holds (sm90/sm10x and cuDNN newer than 9.15.0, unless ``TORCH_CUDNN_SDPA_DEPRIORITIZED=1``); seqpar
  applies the same rule while the order is still torch's untouched default.
- **Flash** (``can_use_flash_attention``): sm80-sm121, fp16/bf16, head_dim <= 256 (SDPA pads it to a
  multiple of 8, and so does seqpar), no training with 192 < head_dim <= 224 on sm86-sm89 and
  sm120-sm121 (``check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120``; seqpar always
  needs the backward), causal only with len_q == len_k, no empty sequence. GQA/MQA native.
- **Memory-efficient** (``can_use_mem_efficient_attention``): sm50-sm121; fp16/fp32, plus bf16 on
  sm80+; head_dim a multiple of ``minimum_gemm_alignment`` (8 for half types on sm70+, 4 for fp32 on
  sm80+, else 1) for q/k and for V: refused otherwise, as torch does (seqpar zero-padded them up to
  2026-11-26; on an H200 that gave NaN or wrong dQ in bf16/fp16, see ``_efficient_rejection``). The op itself needs equal
  head counts: its shape function (``torch/_meta_registrations.py``,
  ``meta__scaled_dot_product_efficient_backward``) returns dK/dV at the *query* head count, so K/V
  are not handed to it at another head count: seqpar folds the query group into the query length on
  blocks without a causal mask and expands K/V only on causal ones (:mod:`seqpar.kernels.local`).
- **cuDNN** (``can_use_cudnn_attention``): sm80-sm121, fp16/bf16, cuDNN >= 9.0, not under
  ``torch.use_deterministic_algorithms(True)``, head_dim a multiple of 8 and <= 128 (torch allows 256
  on sm90/sm10x only with a cuDNN frontend version Python cannot see, so seqpar stays at 128),
  len_k != 1, batch and heads <= 65535. seqpar also keeps causal blocks square there. GQA native
  (K/V and dK/dV at kv_heads, its shape function's contract); torch 2.11 picks cuDNN for GQA shapes too
  (gpu-check's choice stage on an H200).
- **ROCm** (``torch.version.hip`` set; the device still says ``cuda``): the fused kernels' log-sum-exp
  layouts differ (CK flash returns it as (B, S, H): pytorch/pytorch#171568; the efficient kernel
  does not pad it to 32 rows: #146848) and no session has checked them, so seqpar refuses the fused
  kernels there and uses the exact math kernel, with a warning.
- **Math**: always available as the last resort (an exact fp32/fp64 computation), also when torch's
  own math backend is disabled and nothing else qualifies.

The capability is injectable: every function takes a :class:`DeviceCaps`, which tests build by hand
(and :func:`device_caps` reads from the device otherwise).
"""

from __future__ import annotations

import enum
import functools
import os
from dataclasses import dataclass

import torch

__all__ = [
    "Backend",
    "BlockSpec",
    "DeviceCaps",
    "SdpFlags",
    "choose_backend",
    "device_caps",
    "efficient_alignment",
    "rejection",
]


class Backend(str, enum.Enum):
    """A CUDA attention kernel (values as printed in benchmark reports)."""

    FLASH = "flash"
    EFFICIENT = "efficient"
    CUDNN = "cudnn"
    MATH = "math"


# torch's SDPBackend integers, as returned by torch._C._get_sdp_priority_order()
_TORCH_IDS = {0: Backend.MATH, 1: Backend.FLASH, 2: Backend.EFFICIENT, 3: Backend.CUDNN}
_TORCH_DEFAULT_ORDER = (Backend.FLASH, Backend.EFFICIENT, Backend.MATH, Backend.CUDNN)
_CUDNN_FIRST_ORDER = (Backend.CUDNN, Backend.FLASH, Backend.EFFICIENT, Backend.MATH)


@dataclass(frozen=True)
class DeviceCaps:
    """What the device and the torch build can run."""

    capability: tuple[int, int]
    """Compute capability (major, minor), e.g. (9, 0) for an H100."""
    rocm: bool = False
    """``torch.version.hip`` is set: an AMD GPU that reports ``device.type == "cuda"``."""
    cudnn_version: int | None = None
    """``torch.backends.cudnn.version()``, e.g. 91002 for 9.10.2; None without cuDNN."""
    cuda_major: int | None = None
    """Major version of the CUDA toolkit torch was built with (``torch.version.cuda``)."""
    cudnn_deprioritized: bool = False
    """``TORCH_CUDNN_SDPA_DEPRIORITIZED=1``: torch then never moves cuDNN first by itself."""
    total_memory: int | None = None
    """Bytes of device memory (``get_device_properties().total_memory``): fixed for a GPU model, so
    every rank of a job on one model reads the same (free memory would not be); None where unknown."""
    sm_count: int | None = None
    """Streaming multiprocessors (``multi_processor_count``); None where unknown."""


@dataclass(frozen=True)
class SdpFlags:
    """torch's global SDPA switches (what ``sdpa_kernel`` toggles) and priority order."""

    flash: bool = True
    efficient: bool = True
    cudnn: bool = True
    math: bool = True
    order: tuple[Backend, ...] = _TORCH_DEFAULT_ORDER
    deterministic: bool = False
    """``torch.use_deterministic_algorithms(True)`` without ``warn_only``: cuDNN SDPA is not deterministic."""

    @classmethod
    def current(cls) -> SdpFlags:
        """The flags as torch holds them now (inside an ``sdpa_kernel`` context: the context's)."""
        cuda = torch.backends.cuda
        get_order = getattr(torch._C, "_get_sdp_priority_order", None)  # torch >= 2.6
        order = _TORCH_DEFAULT_ORDER
        if get_order is not None:
            order = tuple(_TORCH_IDS[i] for i in get_order() if i in _TORCH_IDS)
        return cls(
            flash=cuda.flash_sdp_enabled(),
            efficient=cuda.mem_efficient_sdp_enabled(),
            cudnn=cuda.cudnn_sdp_enabled(),
            math=cuda.math_sdp_enabled(),
            order=order,
            deterministic=torch.are_deterministic_algorithms_enabled()
            and not torch.is_deterministic_algorithms_warn_only_enabled(),
        )


@dataclass(frozen=True)
class BlockSpec:
    """The shape facts of one block call that the kernel rules look at."""

    dtype: torch.dtype
    qk_head_dim: int
    v_head_dim: int
    """V's own head dim (MLA: narrower than q/k's); the memory-efficient kernel takes each as is."""
    q_heads: int
    kv_heads: int
    len_q: int
    len_k: int
    causal: bool
    batch: int = 1

    @property
    def head_dim(self) -> int:
        """The head dim the equal-dims kernels (flash, cuDNN) see: the wider of q/k's and v's (the
        narrower side is zero-padded to it, see :mod:`seqpar.kernels.local`)."""
        return max(self.qk_head_dim, self.v_head_dim)

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, causal: bool, *, v_head_dim: int | None = None) -> BlockSpec:
        """From q ``(batch, q_heads, len_q, head_dim)``, k ``(batch, kv_heads, len_k, head_dim)`` and
        V's head dim (default: ``head_dim``)."""
        b, hq, lq, d = q.shape
        return cls(q.dtype, d, d if v_head_dim is None else v_head_dim, hq, k.shape[1], lq, k.shape[2], causal, b)


@functools.cache
def _cuda_caps(index: int) -> tuple[tuple[int, int], int | None, int | None, int | None]:
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    try:
        props = torch.cuda.get_device_properties(index)
        total_memory, sm_count = int(props.total_memory), int(props.multi_processor_count)
    except (RuntimeError, AssertionError, AttributeError):  # no such device (a simulated one): unknown
        total_memory = sm_count = None
    return tuple(torch.cuda.get_device_capability(index)), cudnn, total_memory, sm_count


def device_caps(device: torch.device) -> DeviceCaps:
    """Read :class:`DeviceCaps` of a CUDA ``device`` (cached per device; no host sync)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    capability, cudnn, total_memory, sm_count = _cuda_caps(index)
    cuda = torch.version.cuda
    return DeviceCaps(
        capability=capability,
        rocm=bool(torch.version.hip),
        cudnn_version=cudnn,
        cuda_major=int(cuda.split(".")[0]) if cuda else None,
        # mirrors torch's own reading of this variable in check_prefer_cudnn_attention()
        cudnn_deprioritized=os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED", "").upper() in ("1", "ON", "YES", "TRUE", "Y"),
        total_memory=total_memory,
        sm_count=sm_count,
    )


def _sm_between(cap: tuple[int, int], low: tuple[int, int], high: tuple[int, int]) -> bool:
    return low <= cap <= high


def _sm_rejection(cap: tuple[int, int], low: tuple[int, int], high: tuple[int, int]) -> str | None:
    """Why a kernel built for compute capabilities ``low`` .. ``high`` (``(major, minor)``, inclusive) cannot
    run on ``cap`` (None: it can); the range in the message is the one checked."""
    if _sm_between(cap, low, high):
        return None
    return f"needs sm{low[0]}{low[1]}-sm{high[0]}{high[1]}, the device is sm{cap[0]}{cap[1]}"


def efficient_alignment(caps: DeviceCaps, dtype: torch.dtype) -> int:
    """Head-dim multiple the memory-efficient kernel needs (sdp_utils ``minimum_gemm_alignment``)."""
    half = dtype in (torch.float16, torch.bfloat16)
    major = caps.capability[0]
    tensor_cores = major >= 8 or (major >= 7 and half)
    align = 4 if major >= 8 else 1
    if tensor_cores:
        align = max(align, 128 // (16 if half else 32))
    return align


def _prefers_cudnn(caps: DeviceCaps) -> bool:
    # sdp_utils check_prefer_cudnn_attention(): cuDNN > 9.15.0 on sm90 / sm10x (CUDA < 13: minor 0 or 3)
    if caps.cudnn_deprioritized or caps.cudnn_version is None or caps.cudnn_version <= 91500:
        return False
    major, minor = caps.capability
    if major not in (9, 10):
        return False
    return caps.cuda_major is None or caps.cuda_major >= 13 or minor in (0, 3)


def _order(caps: DeviceCaps, flags: SdpFlags) -> tuple[Backend, ...]:
    if flags.order == _TORCH_DEFAULT_ORDER and _prefers_cudnn(caps):
        return _CUDNN_FIRST_ORDER
    return flags.order


def _flash_rejection(spec: BlockSpec, caps: DeviceCaps, flags: SdpFlags) -> str | None:
    if not flags.flash:
        return "disabled (torch.backends.cuda.enable_flash_sdp(False) or an sdpa_kernel context)"
    cap = caps.capability
    if (why := _sm_rejection(cap, (8, 0), (12, 1))) is not None:
        return why
    if spec.dtype not in (torch.float16, torch.bfloat16):
        return f"needs fp16/bf16, got {spec.dtype}"
    if spec.head_dim > 256:
        return f"needs head_dim <= 256, got {spec.head_dim}"
    sm86_89 = _sm_between(cap, (8, 6), (8, 9)) or _sm_between(cap, (12, 0), (12, 1))
    if sm86_89 and 192 < spec.head_dim <= 224:
        return f"no backward for 192 < head_dim <= 224 on sm{cap[0]}{cap[1]}"
    if spec.causal and spec.len_q != spec.len_k:
        return "causal needs len_q == len_k (flash aligns the mask bottom-right)"
    return None


def _efficient_rejection(spec: BlockSpec, caps: DeviceCaps, flags: SdpFlags) -> str | None:
    if not flags.efficient:
        return "disabled (torch.backends.cuda.enable_mem_efficient_sdp(False) or an sdpa_kernel context)"
    cap = caps.capability
    if (why := _sm_rejection(cap, (5, 0), (12, 1))) is not None:
        return why
    dtypes = (torch.float16, torch.float32) + ((torch.bfloat16,) if cap[0] >= 8 else ())
    if spec.dtype not in dtypes:
        return f"takes {', '.join(str(d) for d in dtypes)} on sm{cap[0]}{cap[1]}, got {spec.dtype}"
    align = efficient_alignment(caps, spec.dtype)
    dims = (spec.qk_head_dim, spec.v_head_dim)
    if any(d % align for d in dims):
        # torch refuses these too (check_head_dim_size_mem_efficient). Zero-padding them instead is
        # exact in theory but was not on a GPU: on an H200 (torch 2.11+cu130) bf16/fp16 head dim 100
        # padded to 104 or 128 gave NaN or wrong dQ, while the kernel was exact at every multiple of 8
        # from 64 to 136 unpadded (gpu-check, 2026-11-26; BENCHMARKS.md, "First GPU run")
        return f"needs head dims that are multiples of {align} for {spec.dtype} on sm{cap[0]}{cap[1]}, got {dims}"
    return None


def _cudnn_rejection(spec: BlockSpec, caps: DeviceCaps, flags: SdpFlags) -> str | None:
    if not flags.cudnn:
        return "disabled (torch.backends.cuda.enable_cudnn_sdp(False) or an sdpa_kernel context)"
    if caps.cudnn_version is None or caps.cudnn_version < 90000:
        return f"needs cuDNN >= 9.0, found {caps.cudnn_version}"
    if flags.deterministic:
        return "not deterministic (torch.use_deterministic_algorithms(True))"
    cap = caps.capability
    if (why := _sm_rejection(cap, (8, 0), (12, 1))) is not None:
        return why
    if spec.dtype not in (torch.float16, torch.bfloat16):
        return f"needs fp16/bf16, got {spec.dtype}"
    if spec.head_dim % 8 or spec.head_dim > 128:
        return f"needs head_dim a multiple of 8 and <= 128, got {spec.head_dim}"
    if spec.len_k == 1:
        return "needs len_k != 1"
    if spec.batch > 65535 or spec.q_heads > 65535:
        return "needs batch and heads <= 65535"
    if spec.causal and spec.len_q != spec.len_k:
        return "causal blocks must be square"
    return None


_RULES = {Backend.FLASH: _flash_rejection, Backend.EFFICIENT: _efficient_rejection, Backend.CUDNN: _cudnn_rejection}


def rejection(backend: Backend, spec: BlockSpec, caps: DeviceCaps, flags: SdpFlags) -> str | None:
    """Why ``backend`` cannot run ``spec`` (None: it can). Math can always run."""
    if backend is Backend.MATH:
        return None
    if caps.rocm:
        return "ROCm: the fused kernels' log-sum-exp layout is not verified (see seqpar.kernels.backends)"
    if spec.len_q == 0 or spec.len_k == 0:
        return "empty sequence"
    return _RULES[backend](spec, caps, flags)


def choose_backend(spec: BlockSpec, caps: DeviceCaps, flags: SdpFlags | None = None) -> Backend:
    """The kernel SDPA would pick for ``spec`` on ``caps`` under ``flags`` (default: torch's current).

    Walks the priority order like ``select_sdp_backend``: the first fused backend whose checks pass,
    or math when it is reached and enabled. Where torch would give up (every backend disabled or
    refused), seqpar still computes the block exactly with its math kernel.
    """
    flags = SdpFlags.current() if flags is None else flags
    for backend in _order(caps, flags):
        if backend is Backend.MATH:
            if flags.math:
                return Backend.MATH
        elif rejection(backend, spec, caps, flags) is None:
            return backend
    return Backend.MATH
