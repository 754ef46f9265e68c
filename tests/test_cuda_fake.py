"""Every CUDA branch of the local kernels, on a CPU-only machine (runs in CI).

Under ``FakeTensorMode`` a CPU build of torch creates fake CUDA tensors and runs the CUDA attention
ops' shape functions, so each branch of ``block_forward`` / ``block_backward`` (flash, efficient,
cuDNN, math) is executed with the real op schemas. Fake ops accept inputs the real kernels refuse, so
they cannot judge *which* kernel may run: ``test_backend_choice`` checks that against a table of
torch's own SDPA rules (pytorch/pytorch ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``),
with the device capability injected. Numerics on a real GPU: tests/test_cuda.py (``gpu-check``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

import seqpar.kernels.local as local
import seqpar.kernels.merge as merge_mod
from seqpar.kernels import add_sink, block_backward, block_forward, merge_into
from seqpar.kernels.backends import (
    Backend,
    DeviceCaps,
    SdpFlags,
    efficient_alignment,
)
from seqpar.kernels.local import cuda_backend
from seqpar.testing.syncs import cuda_build

H100 = DeviceCaps((9, 0), cudnn_version=91002, cuda_major=13)  # cuDNN 9.10: torch keeps flash first
H100_NEW_CUDNN = DeviceCaps((9, 0), cudnn_version=91600, cuda_major=13)  # > 9.15.0: torch puts cuDNN first
A100 = DeviceCaps((8, 0), cudnn_version=91002, cuda_major=12)
RTX4090 = DeviceCaps((8, 9), cudnn_version=91600, cuda_major=12)
V100 = DeviceCaps((7, 0), cudnn_version=91002, cuda_major=12)
T4 = DeviceCaps((7, 5), cudnn_version=91002, cuda_major=12)
P100 = DeviceCaps((6, 0), cudnn_version=None, cuda_major=12)
K80 = DeviceCaps((3, 7), cudnn_version=None, cuda_major=11)
MI300 = DeviceCaps((9, 4), rocm=True)

_SDP = {Backend.FLASH: SDPBackend.FLASH_ATTENTION, Backend.EFFICIENT: SDPBackend.EFFICIENT_ATTENTION,
        Backend.CUDNN: SDPBackend.CUDNN_ATTENTION, Backend.MATH: SDPBackend.MATH}
_FWD_OP = {Backend.FLASH: "_scaled_dot_product_flash_attention",
           Backend.EFFICIENT: "_scaled_dot_product_efficient_attention",
           Backend.CUDNN: "_scaled_dot_product_cudnn_attention"}


class _RecordingAten:
    """Stands in for ``torch.ops.aten`` in seqpar.kernels.local: records (op name, key shape)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[int, ...]]] = []

    def __getattr__(self, name: str):  # noqa: ANN204
        op = getattr(torch.ops.aten, name)

        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            key = kwargs["key"] if "key" in kwargs else args[2 if name.endswith("_backward") else 1]
            self.calls.append((name, tuple(key.shape)))
            return op(*args, **kwargs)

        return call


@contextlib.contextmanager
def _only(backend: Backend) -> Iterator[None]:
    """torch's own switch: only ``backend`` enabled (math off unless asked for)."""
    with sdpa_kernel([_SDP[backend]]):
        yield


# ---------------------------------------------------------------------------------- every branch
HEADS = [(4, 4), (4, 2), (4, 1)]  # MHA, GQA, MQA
HEAD_DIMS = [40, 64, 100, 128, 256]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("backend", list(Backend), ids=lambda b: b.value)
def test_every_cuda_branch_shapes(backend: Backend, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Forward + backward on fake CUDA tensors: out/lse/dq/dk/dv shapes and dtypes, and the op that ran.

    Non-causal blocks are rectangular (len_k != len_q, len_q not a multiple of 32: the efficient
    kernel's padded lse must be cut back), causal ones square, as the planners hand them in.
    """
    rec = _RecordingAten()
    monkeypatch.setattr(local, "_aten", rec)
    ran = set()
    with FakeTensorMode(), _only(backend):
        for (hq, hkv), d, causal in ((h, d, c) for h in HEADS for d in HEAD_DIMS for c in (False, True)):
            lq, lk = (24, 24) if causal else (24, 40)
            q = torch.empty(2, hq, lq, d, device="cuda", dtype=dtype)
            k = torch.empty(2, hkv, lk, d, device="cuda", dtype=dtype)
            v = torch.empty(2, hkv, lk, d, device="cuda", dtype=dtype)
            dout = torch.empty(2, hq, lq, d, device="cuda", dtype=dtype)
            case = f"{backend.value} {dtype} heads={hq}/{hkv} d={d} causal={causal}"
            chosen = cuda_backend(q, k, causal, H100)
            assert chosen in (backend, Backend.MATH), case  # forced, or refused -> exact math
            if backend is Backend.EFFICIENT:  # refused exactly where torch refuses it: head dim % alignment
                assert (chosen is Backend.MATH) == bool(d % efficient_alignment(H100, dtype)), case
            if chosen is not backend:
                continue  # the math branch is run by the MATH parametrization
            rec.calls.clear()
            out, lse = block_forward(q, k, v, scale=d**-0.5, causal=causal, caps=H100)
            dq, dk, dv = block_backward(dout, q, k, v, out, lse, scale=d**-0.5, causal=causal, caps=H100)
            assert (out.shape, out.dtype, out.device.type) == (q.shape, dtype, "cuda"), case
            assert (lse.shape, lse.dtype) == ((2, hq, lq), torch.float32), case
            assert (dq.shape, dq.dtype) == (q.shape, dtype), case
            assert (dk.shape, dk.dtype) == (k.shape, dtype), case
            assert (dv.shape, dv.dtype) == (v.shape, dtype), case
            names = [name for name, _ in rec.calls]
            if chosen is Backend.MATH:
                assert names == [], case
                continue
            ran.add(chosen)
            assert names == [_FWD_OP[chosen], _FWD_OP[chosen] + "_backward"], case
            kv_heads_seen = {shape[1] for _, shape in rec.calls}
            # flash and cuDNN take GQA K/V as they are; so does the efficient kernel on a block without a
            # causal mask (q folded into the query length); on a causal one K/V are expanded to q's heads
            expanded = chosen is Backend.EFFICIENT and causal
            assert kv_heads_seen == {hq if expanded else hkv}, case
            padded = {shape[-1] for _, shape in rec.calls}
            # flash and cuDNN see the head dim padded to 8; the efficient kernel takes it as is
            assert padded == {d if chosen is Backend.EFFICIENT else d + (-d) % 8}, case
    expected = {Backend.FLASH: dtype != torch.float32, Backend.CUDNN: dtype != torch.float32,
                Backend.EFFICIENT: True, Backend.MATH: False}[backend]
    assert (backend in ran) == expected, f"{backend} ran: {ran}"


def test_math_fallback_on_fp64_and_rocm() -> None:
    """fp64 (no fused kernel takes it) and ROCm (refused, with a warning) run the exact math kernel."""
    with FakeTensorMode():
        q = torch.empty(1, 4, 8, 64, device="cuda", dtype=torch.float64)
        k = torch.empty(1, 2, 8, 64, device="cuda", dtype=torch.float64)
        assert cuda_backend(q, k, True, H100) is Backend.MATH
        out, lse = block_forward(q, k, k, scale=0.125, causal=True, caps=H100)
        assert (out.dtype, lse.dtype) == (torch.float64, torch.float64)
        qb, kb = q.to(torch.bfloat16), k.to(torch.bfloat16)
        with pytest.warns(RuntimeWarning, match="ROCm"):
            assert cuda_backend(qb, kb, True, MI300) is Backend.MATH
        with pytest.warns(RuntimeWarning, match="ROCm"):
            out, lse = block_forward(qb, kb, kb, scale=0.125, causal=True, caps=MI300)
            dq, dk, dv = block_backward(qb, qb, kb, kb, out, lse, scale=0.125, causal=True, caps=MI300)
        assert (lse.shape, dk.shape) == ((1, 4, 8), kb.shape)


def test_rocm_detected_from_torch_version(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.version.hip`` set (a ROCm build) is what marks the device as ROCm."""
    import seqpar.kernels.backends as backends

    monkeypatch.setattr(backends, "_cuda_caps", lambda index: ((9, 4), None, None, None))
    monkeypatch.setattr(torch.version, "hip", "6.2.41133")
    assert backends.device_caps(torch.device("cuda", 0)).rocm
    monkeypatch.setattr(torch.version, "hip", None)
    assert not backends.device_caps(torch.device("cuda", 0)).rocm


# ------------------------------------------------------------------------------- backend choice
# torch's rules (sdp_utils.cpp), one row each:
#   (caps, dtype, head_dim, (q_heads, kv_heads), (len_q, len_k), causal, enabled, priority, expected)
# enabled None = torch's defaults (all on); priority None = torch's default order
# (flash, efficient, math, cudnn), else set with sdpa_kernel(..., set_priority=True).
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
ALL = None
FL, EF, CU, MA = Backend.FLASH, Backend.EFFICIENT, Backend.CUDNN, Backend.MATH
CHOICE_TABLE = [
    # flash first wherever it qualifies: sm80-sm121, fp16/bf16, head_dim <= 256 (SDPA pads to 8)
    ("A100 bf16", A100, BF16, 128, (8, 8), (64, 64), True, ALL, None, FL),
    ("A100 fp16 GQA", A100, F16, 64, (8, 2), (64, 96), False, ALL, None, FL),
    ("H100 bf16 d=100 (padded)", H100, BF16, 100, (8, 8), (64, 64), True, ALL, None, FL),
    ("H100 bf16 d=256", H100, BF16, 256, (8, 1), (64, 64), False, ALL, None, FL),
    # fp32: flash never; the efficient kernel on sm50+
    ("A100 fp32", A100, F32, 64, (8, 8), (64, 64), True, ALL, None, EF),
    # the efficient kernel takes head dims that are multiples of its alignment only (4 for fp32 on sm80),
    # as torch's check_head_dim_size_mem_efficient: d=42 goes to math, as in torch
    ("A100 fp32 d=42 (not a multiple of 4)", A100, F32, 42, (8, 8), (64, 64), False, ALL, None, MA),
    ("A100 fp32 d=44", A100, F32, 44, (8, 8), (64, 64), False, ALL, None, EF),
    ("A100 fp16 flash disabled, d=100 (not a multiple of 8)", A100, F16, 100, (8, 8), (64, 64), True,
     [EF, CU, MA], None, MA),
    ("V100 fp32", V100, F32, 64, (8, 8), (64, 64), True, ALL, None, EF),
    # pre-Ampere: flash refused (sm80+), fp16 falls back to efficient instead of raising; bf16 needs sm80
    ("V100 fp16", V100, F16, 64, (8, 8), (64, 64), True, ALL, None, EF),
    ("T4 fp16 GQA", T4, F16, 128, (8, 2), (64, 64), True, ALL, None, EF),
    ("T4 bf16", T4, BF16, 64, (8, 8), (64, 64), True, ALL, None, MA),
    ("P100 fp16", P100, F16, 64, (8, 8), (64, 64), False, ALL, None, EF),
    ("K80 (sm37) fp16", K80, F16, 64, (8, 8), (64, 64), False, ALL, None, MA),
    # flash head-dim limits: > 256 never; (192, 224] has no backward on sm86-sm89 / sm120-sm121
    ("H100 bf16 d=320", H100, BF16, 320, (8, 8), (64, 64), False, ALL, None, EF),
    ("RTX4090 bf16 d=200", RTX4090, BF16, 200, (8, 8), (64, 64), True, ALL, None, EF),
    ("RTX4090 bf16 d=256", RTX4090, BF16, 256, (8, 8), (64, 64), True, ALL, None, FL),
    ("H100 bf16 d=200", H100, BF16, 200, (8, 8), (64, 64), True, ALL, None, FL),
    # causal with len_q != len_k: flash aligns bottom-right, so SDPA refuses it there
    ("H100 bf16 causal 32x64", H100, BF16, 64, (8, 8), (32, 64), True, ALL, None, EF),
    # cuDNN: first on sm90/sm10x with cuDNN > 9.15.0 (check_prefer_cudnn_attention), else after math
    ("H100 new cuDNN bf16", H100_NEW_CUDNN, BF16, 128, (8, 8), (64, 64), True, ALL, None, CU),
    ("H100 new cuDNN bf16 GQA", H100_NEW_CUDNN, BF16, 64, (8, 2), (64, 64), False, ALL, None, CU),
    ("B200 new cuDNN bf16", DeviceCaps((10, 0), cudnn_version=91600, cuda_major=13), BF16, 128, (8, 8),
     (64, 64), True, ALL, None, CU),
    ("RTX4090 new cuDNN (not preferred on sm89)", RTX4090, BF16, 128, (8, 8), (64, 64), True, ALL, None, FL),
    ("H100 cuDNN 9.15.0 (not newer)", DeviceCaps((9, 0), cudnn_version=91500, cuda_major=13), BF16, 128,
     (8, 8), (64, 64), True, ALL, None, FL),
    ("H100 new cuDNN, deprioritized by env", DeviceCaps((9, 0), cudnn_version=91600, cuda_major=13,
     cudnn_deprioritized=True), BF16, 128, (8, 8), (64, 64), True, ALL, None, FL),
    ("sm90a-like minor 2, CUDA 12", DeviceCaps((9, 2), cudnn_version=91600, cuda_major=12), BF16, 128,
     (8, 8), (64, 64), True, ALL, None, FL),
    ("H100 new cuDNN fp32", H100_NEW_CUDNN, F32, 128, (8, 8), (64, 64), True, ALL, None, EF),
    ("H100 new cuDNN d=100 (not a multiple of 8)", H100_NEW_CUDNN, BF16, 100, (8, 8), (64, 64), True, ALL,
     None, FL),
    ("H100 new cuDNN d=256 (seqpar keeps cuDNN <= 128)", H100_NEW_CUDNN, BF16, 256, (8, 8), (64, 64), True,
     ALL, None, FL),
    ("H100 new cuDNN len_k == 1", H100_NEW_CUDNN, BF16, 64, (8, 8), (8, 1), False, ALL, None, FL),
    # the flags sdpa_kernel sets, and its priority order
    ("H100 flash disabled", H100, BF16, 128, (8, 8), (64, 64), True, [EF, CU, MA], None, EF),
    ("H100 only math", H100, BF16, 128, (8, 8), (64, 64), True, [MA], None, MA),
    ("H100 only cuDNN", H100, BF16, 128, (8, 8), (64, 64), True, [CU], None, CU),
    ("H100 only cuDNN, fp32 -> exact math", H100, F32, 128, (8, 8), (64, 64), True, [CU], None, MA),
    ("A100 cuDNN first by priority", A100, BF16, 64, (8, 8), (64, 64), True, ALL, [CU, FL, EF, MA], CU),
    ("A100 efficient first by priority", A100, BF16, 64, (8, 8), (64, 64), True, ALL, [EF, FL, MA, CU], EF),
    ("H100 new cuDNN, user order wins", H100_NEW_CUDNN, BF16, 64, (8, 8), (64, 64), True, ALL,
     [FL, EF, CU, MA], FL),
    ("nothing enabled -> exact math", H100, BF16, 64, (8, 8), (64, 64), True, [], None, MA),
    # beyond torch's table of architectures (sm121): nothing fused
    ("future sm130", DeviceCaps((13, 0), cudnn_version=91600, cuda_major=13), BF16, 64, (8, 8), (64, 64),
     True, ALL, None, MA),
    # ROCm: refused clearly (warning), exact math
    ("MI300 (ROCm)", MI300, BF16, 128, (8, 8), (64, 64), True, ALL, None, MA),
]


@contextlib.contextmanager
def _flags(enabled: list[Backend] | None, priority: list[Backend] | None) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        if enabled is not None:
            stack.enter_context(sdpa_kernel([_SDP[b] for b in enabled]))
        if priority is not None:
            stack.enter_context(sdpa_kernel([_SDP[b] for b in priority], set_priority=True))
        yield


@pytest.mark.filterwarnings("ignore:seqpar on ROCm")
def test_backend_choice() -> None:
    """Which kernel runs for each (capability, dtype, head_dim, heads, lengths, causal, flags)."""
    wrong = []
    with FakeTensorMode():
        for name, caps, dtype, d, (hq, hkv), (lq, lk), causal, enabled, priority, want in CHOICE_TABLE:
            q = torch.empty(1, hq, lq, d, device="cuda", dtype=dtype)
            k = torch.empty(1, hkv, lk, d, device="cuda", dtype=dtype)
            with _flags(enabled, priority):
                got = cuda_backend(q, k, causal, caps)
            if got is not want:
                wrong.append(f"{name}: chose {got.value}, torch's rules say {want.value}")
    assert not wrong, "\n".join(wrong)


def test_flags_follow_torch_switches() -> None:
    """``sdpa_kernel`` and the global switches are observable the way seqpar reads them."""
    default = SdpFlags.current()
    assert default.flash and default.efficient and default.cudnn and default.math
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        inside = SdpFlags.current()
        assert (inside.flash, inside.efficient, inside.cudnn, inside.math) == (False, True, False, True)
    torch.backends.cuda.enable_flash_sdp(False)
    try:
        assert not SdpFlags.current().flash
    finally:
        torch.backends.cuda.enable_flash_sdp(True)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION], set_priority=True):
        assert SdpFlags.current().order[:2] == (Backend.CUDNN, Backend.FLASH)
    assert SdpFlags.current() == default
    torch.use_deterministic_algorithms(True)
    try:
        assert SdpFlags.current().deterministic
        with FakeTensorMode():
            q = torch.empty(1, 8, 64, 64, device="cuda", dtype=torch.bfloat16)
            assert cuda_backend(q, q, True, H100_NEW_CUDNN) is Backend.FLASH  # cuDNN is not deterministic
    finally:
        torch.use_deterministic_algorithms(False)


# ------------------------------------------------------- the CUDA glue with real numbers, on CPU
class _CudaContractsOnCpu:
    """``torch.ops.aten`` stand-in: each CUDA op's contract (what it accepts, the layouts it returns)
    checked, and its numbers computed by the CPU flash kernel, so the glue around the CUDA calls
    (padding, slicing, lse layouts, GQA expansion and folding, keyword binding) runs on real data."""

    cpu_fwd = staticmethod(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu)
    cpu_bwd = staticmethod(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward)

    def __init__(self, align: int) -> None:
        self.align = align

    @staticmethod
    def _lse(lse: torch.Tensor) -> torch.Tensor:
        assert lse.dtype == torch.float32, "the CUDA kernels take lse in fp32"
        return lse.double()  # what the CPU kernel takes for float64 data

    @staticmethod
    def _dense_last(*xs: torch.Tensor) -> None:
        assert all(x.stride(-1) == 1 for x in xs), "fused kernels need a unit stride on the head dim"

    def _scaled_dot_product_flash_attention(self, *, query, key, value, dropout_p, is_causal,  # noqa: ANN001, ANN202
                                            return_debug_mask, scale):
        q, k, v = query, key, value
        assert q.shape[-1] % 8 == 0 and dropout_p == 0.0 and q.shape[1] % k.shape[1] == 0
        self._dense_last(q, k, v)
        out, lse = self.cpu_fwd(q, k, v, 0.0, is_causal, scale=scale)
        return out, lse.float(), None, None, q.shape[2], k.shape[2], None, None, None

    def _scaled_dot_product_flash_attention_backward(self, *, grad_out, query, key, value, out, logsumexp,  # noqa: ANN001, ANN202
                                                     cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                                                     philox_seed, philox_offset, scale):
        dout, q, k, v, lse, cq, ck = grad_out, query, key, value, logsumexp, cum_seq_q, cum_seq_k
        mq, mk, p, causal = max_q, max_k, dropout_p, is_causal
        assert dout.shape[-1] % 8 == 0 and lse.shape == q.shape[:3] and lse.is_contiguous()
        assert cq is None and ck is None and (mq, mk) == (q.shape[2], k.shape[2]) and p == 0.0
        self._dense_last(dout, q, k, v, out)
        return self.cpu_bwd(dout, q, k, v, out, self._lse(lse), 0.0, causal, scale=scale)

    def _scaled_dot_product_efficient_attention(self, *, query, key, value, attn_bias, compute_log_sumexp,  # noqa: ANN001, ANN202
                                                dropout_p, is_causal, scale):
        q, k, v, bias, lse_wanted, p, causal = query, key, value, attn_bias, compute_log_sumexp, dropout_p, is_causal
        assert q.shape[1] == k.shape[1], "the efficient kernel needs equal head counts"
        assert q.shape[-1] % self.align == 0 and bias is None and lse_wanted and p == 0.0
        self._dense_last(q, k, v)
        out, lse = self.cpu_fwd(q, k, v, 0.0, causal, scale=scale)
        lse = lse.float()
        rows = q.shape[2] + (-q.shape[2]) % 32  # padded with garbage, as the kernel leaves it
        lse = torch.cat([lse, torch.full((*lse.shape[:2], rows - q.shape[2]), float("nan"), dtype=lse.dtype)], -1)
        return out, lse, torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)

    def _scaled_dot_product_efficient_attention_backward(self, *, grad_out_, query, key, value, attn_bias, out,  # noqa: ANN001, ANN202
                                                         logsumexp, philox_seed, philox_offset, dropout_p,
                                                         grad_input_mask, is_causal, scale):
        dout, q, k, v, bias, lse = grad_out_, query, key, value, attn_bias, logsumexp
        mask, causal = grad_input_mask, is_causal
        assert dropout_p == 0.0
        # the cutlass kernel reads out with row stride heads * v_head_dim in (B, L, H, D) order (in half
        # precision it computes rowsum(dout * out) itself from out's pointer and batch/head strides only)
        h, dv = out.shape[1], out.shape[-1]
        assert (h == 1 or out.stride(1) == dv) and out.stride(2) == h * dv, f"out not row-dense: {out.stride()}"
        assert q.shape[1] == k.shape[1] and q.shape[-1] % self.align == 0 and bias is None
        assert lse.shape[-1] % 32 == 0 and lse.shape[-1] >= q.shape[2] and list(mask) == [True, True, True, False]
        self._dense_last(dout, q, k, v, out)
        lse = self._lse(lse.narrow(-1, 0, q.shape[2]))
        return (*self.cpu_bwd(dout, q, k, v, out, lse, 0.0, causal, scale=scale), None)

    def _scaled_dot_product_cudnn_attention(self, *, query, key, value, attn_bias, compute_log_sumexp,  # noqa: ANN001, ANN202
                                            dropout_p, is_causal, return_debug_mask, scale):
        assert query.shape[1] % key.shape[1] == 0 and query.shape[-1] % 8 == 0 and attn_bias is None
        self._dense_last(query, key, value)
        out, lse = self.cpu_fwd(query, key, value, 0.0, is_causal, scale=scale)
        return out, lse.float().unsqueeze(-1), None, None, query.shape[2], key.shape[2], None, None, None

    def _scaled_dot_product_cudnn_attention_backward(self, *, grad_out, query, key, value, out, logsumexp,  # noqa: ANN001, ANN202
                                                     philox_seed, philox_offset, attn_bias, cum_seq_q, cum_seq_k,
                                                     max_q, max_k, dropout_p, is_causal, scale):
        assert logsumexp.shape == (*query.shape[:3], 1) and query.shape[1] % key.shape[1] == 0
        self._dense_last(query, key, value)
        assert grad_out.stride() == out.stride(), "cuDNN wants dout in out's layout"
        lse = self._lse(logsumexp.squeeze(-1))
        return self.cpu_bwd(grad_out, query, key, value, out, lse, 0.0, is_causal, scale=scale)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", [Backend.FLASH, Backend.EFFICIENT, Backend.CUDNN], ids=lambda b: b.value)
def test_cuda_glue_is_exact(backend: Backend, causal: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """float64 (fp32 lse) through each fused path's glue equals float64 SDPA: head dims padded (42, 100) or not,
    MHA/GQA/MQA, rectangular blocks off the 32-row grid, a non-contiguous dout."""
    align = efficient_alignment(A100, torch.float32)
    monkeypatch.setattr(local, "_aten", _CudaContractsOnCpu(align))
    # flash pads 42 and 100 to 8; the efficient kernel takes aligned dims only (4 for fp32 on sm80)
    dims = {Backend.CUDNN: [40, 64], Backend.FLASH: [42, 100, 64], Backend.EFFICIENT: [44, 100, 64]}[backend]
    g = torch.Generator().manual_seed(7)
    for (hq, hkv), d in ((h, d) for h in HEADS for d in dims):
        lq, lk = (20, 20) if causal else (20, 37)
        q = torch.randn(2, hq, lq, d, generator=g, dtype=torch.float64)
        k, v = (torch.randn(2, hkv, lk, d, generator=g, dtype=torch.float64) for _ in range(2))
        dout = torch.randn(2, lq, hq, d, generator=g, dtype=torch.float64).transpose(1, 2)  # HF-style view
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=True)
        want = [ref, *torch.autograd.grad(ref, leaves, dout)]
        out, lse = local._cuda_forward(q, k, v, d**-0.5, causal, backend, align)
        got = [out, *local._cuda_backward(dout, q, k, v, out, lse, d**-0.5, causal, backend, align)]
        case = f"{backend.value} heads={hq}/{hkv} d={d} causal={causal}"
        assert lse.shape == (2, hq, lq), case
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            assert a.shape == b.shape, f"{case} {name}"
            # float64 data, lse in fp32 as the CUDA kernels keep it: ~1e-7 relative
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m, n=name, c=case: f"{c} {n}: {m}")


# -------------------------------------------------------------------- math fallback, real numbers
@pytest.mark.parametrize("causal", [False, True])
def test_math_kernel_matches_reference(causal: bool) -> None:
    """The math fallback (fp64 and ROCm on a GPU) is exact: float64 against autograd SDPA, GQA, d=40."""
    g = torch.Generator().manual_seed(3)
    q, dout = (torch.randn(2, 6, 12, 40, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, 2, 12, 40, generator=g, dtype=torch.float64) for _ in range(2))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=True)
    want = [ref, *torch.autograd.grad(ref, leaves, dout)]
    out, lse = local._math_forward(q, k, v, 40**-0.5, causal)
    got = [out, *local._math_backward(dout, q, k, v, out, lse, 40**-0.5, causal)]
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(3, 1)) / math.sqrt(40)
    if causal:
        scores = scores.masked_fill(~torch.ones(12, 12, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), rtol=1e-12, atol=1e-12)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")


# --------------------------------------------------------------------------------- gpu-check on CPU
def test_gpu_check_without_cuda_says_so(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``python -m seqpar.bench gpu-check`` on a machine without CUDA exits 2 with a clear message."""
    from seqpar.bench.__main__ import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["gpu-check"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device" in err and "gpu-check" in err


def test_gpu_check_records_each_stage_and_goes_on(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # noqa: ANN001
    """A stage that fails, hangs, skips or runs no test is recorded as such (the runner never raises)."""
    import sys

    import seqpar.bench.gpu_check as gc

    def script(body: str) -> list[str]:
        return [sys.executable, "-c", body]

    bodies = {
        "fails": "import sys; print('boom'); sys.exit(3)",
        "hangs": "import time; time.sleep(30)",
        "skips": "import json, sys; json.dump({'passed': None, 'skipped': 'no fairscale'}, open(sys.argv[1], 'w'))",
        "passes": "import json, sys; json.dump({'passed': True}, open(sys.argv[1], 'w'))",
        "cuda-tests": "print('26 skipped in 1.0s')",  # pytest exits 0 when every test skips
    }
    monkeypatch.setattr(gc, "_command", lambda stage, out, res: [*script(bodies[stage.name]), res])
    rows = {name: gc.run_stage(gc.Stage(name, 1 if name == "hangs" else 120, name), str(tmp_path)) for name in bodies}
    status = {name: row["status"] for name, row in rows.items()}
    assert status == {"fails": "fail", "hangs": "timeout", "skips": "skipped", "passes": "pass", "cuda-tests": "fail"}
    assert "boom" in rows["fails"]["output_tail"] and rows["fails"]["returncode"] == 3
    summary = {"command": "gpu-check", "date": "today", "stages": list(rows.values()), "environment": {
        "device": "X", "capability": [9, 0], "memory_gib": 80, "gpus": 1, "torch": "2.11", "cuda": "13.0",
        "cudnn": 91002, "python": "3.12", "transformers": "5.17", "fairscale": None, "deepspeed": None}}
    md = gc.render_markdown(summary)
    assert "| hangs | timeout |" in md and "no fairscale" in md and "sm90" in md


def test_gpu_check_sync_sites_name_the_calling_frames(monkeypatch: pytest.MonkeyPatch) -> None:
    """host-sync's check on CPU, torch's debug mode stubbed: every synchronising warning in the warned
    steps is counted at its site with the Python frames that led to it (a C++ warning names only the
    innermost frame), other warnings are not, and the verdict fails on any."""
    import warnings

    import seqpar.bench.gpu_check as gc

    modes: list = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    def syncing_layer() -> None:
        if modes and modes[-1] == "warn":
            warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
        # torch's one-time notice on the first switch to "warn" (an H200 run counted it as a sync)
        warnings.warn("Synchronization debug mode is a prototype feature and does not yet detect all "
                      "synchronizing operations", UserWarning, stacklevel=1)

    def step() -> None:
        syncing_layer()

    r = gc._sync_check(step, warmup=1, steps=3)
    (site,) = r["sync_sites"]
    assert r["sync_sites"][site] == 3 and "test_cuda_fake.py" in site and not r["passed"], r
    assert "in syncing_layer" in r["stacks"][site] and "in step" in r["stacks"][site], r["stacks"]
    assert gc._sync_check(lambda: None, warmup=1, steps=3)["passed"]


def test_softcap_refused_on_fused_cuda_paths_and_math_in_fp64() -> None:
    """Soft-capping needs the scores: on CUDA the fused kernels have none, so seqpar.attention refuses
    it (every half/fp32 dtype) with the fix; fp64 blocks run the math kernel, soft-capped, forward and back."""
    import seqpar

    with FakeTensorMode():
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            q = torch.empty(1, 4, 8, 64, device="cuda", dtype=dtype)
            with pytest.raises(ValueError, match=r"softcap=50.0 on CUDA.*no logit soft-capping.*attn_logit_softcapping=None"):
                seqpar.attention(q, q, q, causal=True, softcap=50.0)
        q = torch.empty(1, 4, 8, 64, device="cuda", dtype=torch.float64)
        out, lse = block_forward(q, q, q, scale=0.125, causal=True, caps=H100, softcap=50.0)
        dq, dk, dv = block_backward(q, q, q, q, out, lse, scale=0.125, causal=True, caps=H100, softcap=50.0)
        assert lse.dtype == torch.float64 and dq.shape == dk.shape == q.shape


def test_private_ops_called_by_keyword_with_this_torchs_names() -> None:
    """Every private aten op seqpar.kernels.local calls takes keywords only (the stand-in above has
    keyword-only parameters, so a positional call fails test_cuda_glue_is_exact), and those keywords
    are exactly the argument names of the installed torch's schema (2.11 on the GPU machines and the
    fake-CUDA CI stage, 2.13 in the main suite): a renamed argument fails here, not on a GPU."""
    import inspect

    checked = 0
    for name, fn in vars(_CudaContractsOnCpu).items():
        if not name.startswith("_scaled_dot_product"):
            continue
        params = list(inspect.signature(fn).parameters.values())[1:]
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params), name
        schema = getattr(torch.ops.aten, name).default._schema
        assert [p.name for p in params] == [a.name for a in schema.arguments], (name, str(schema))
        checked += 1
    assert checked == 6
    source = inspect.getsource(local)
    for name in ("_scaled_dot_product_flash_attention_for_cpu(", "_scaled_dot_product_flash_attention_for_cpu_backward("):
        call = source[source.index(name):].split(")", 1)[0]
        schema = getattr(torch.ops.aten, name[:-1]).default._schema
        used = [part.split("=")[0].strip() for part in call[len(name):].split(",") if "=" in part]
        assert used == [a.name for a in schema.arguments if a.name in used] and len(used) >= 6, (name, used)


# --------------------------------------------------------------------------------- the fused merge
class _OpNames(TorchDispatchMode):
    """Records the name of every op dispatched below it (here: onto fake tensors)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def test_merge_on_cuda_is_one_fused_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """On fake CUDA tensors (Triton taken as present), merge_into and add_sink each dispatch the one
    opaque fused op and nothing else, for contiguous and strided fp32 accumulators and bf16/fp16/fp32
    blocks; what the kernel does not take goes to the torch path (fp64 accumulators, a strided head
    dim, a block shaped unlike the accumulator), and everything does where Triton is absent (those
    under torch's CUDA build only: the fake-CUDA stage)."""
    monkeypatch.setattr(merge_mod, "_triton_available", lambda: True)
    with FakeTensorMode():
        acc = torch.empty(2, 8, 3, 64, device="cuda").transpose(1, 2)  # (b, h, n, d) of a bshd buffer
        lse = torch.empty(2, 3, 8, device="cuda")
        rows = (acc, lse), (acc.narrow(2, 2, 5), lse.narrow(2, 2, 5))  # and a row range of them
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            blk = torch.empty(2, 3, 8, 64, device="cuda", dtype=dtype)
            for out_acc, lse_acc in rows:
                n = out_acc.shape[2]
                blk_n, blk_lse = blk.narrow(2, 0, n), lse.narrow(2, 0, n)
                with _OpNames() as ops:
                    merge_into(out_acc, lse_acc, blk_n, blk_lse)
                assert ops.names == ["seqpar.lse_merge_"], (dtype, n, ops.names)
        sink = torch.empty(3, device="cuda", dtype=torch.bfloat16)
        with _OpNames() as ops:
            add_sink(acc, lse, sink)
        kernels = [n for n in ops.names if n not in ("aten.view", "aten.expand") and not n.startswith("prim.")]
        assert kernels == ["seqpar.lse_merge_"], ops.names  # views of the sink, then the one op
        if not cuda_build():  # the torch path's ops on fake CUDA tensors need torch's CUDA build
            return
        blk = torch.empty(2, 3, 8, 64, device="cuda", dtype=torch.bfloat16)
        refused = {
            "fp64 accumulators": (acc.double(), lse.double(), blk, lse),
            "strided head dim": (acc, lse, torch.empty(2, 3, 64, 8, device="cuda").transpose(-1, -2), lse),
            "broadcast block": (acc, lse, blk.narrow(0, 0, 1), lse),
        }
        for case, args in refused.items():
            with _OpNames() as ops:
                merge_into(*args)
            assert "seqpar.lse_merge_" not in ops.names and "aten.sigmoid" in ops.names, (case, ops.names)
        monkeypatch.setattr(merge_mod, "_triton_available", lambda: False)
        blk = torch.empty(2, 3, 8, 64, device="cuda", dtype=torch.bfloat16)
        with _OpNames() as ops:
            merge_into(acc, lse, blk, lse)
        assert "seqpar.lse_merge_" not in ops.names and "aten.sigmoid" in ops.names, ops.names
