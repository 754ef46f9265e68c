"""Input checks for the distributed attention calls: clear errors, the same on every rank, never a hang.

Local checks (shapes, dtypes, devices, divisibility) give the same verdict on every rank as long as
every rank passes the same shapes. That is itself checked first, across ranks, by all-gathering a
digest of the integers that describe the call (:mod:`seqpar.comm.agree`): if any rank differs, every
rank raises the same error naming each rank's shapes, instead of some ranks entering a collective the
others never reach. That check costs a device-to-host read, so a swapped model makes it once per
batch for all its layers (:mod:`seqpar.swap.batch`) and its layers skip the per-call check.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import guard_scalar

from seqpar.comm.agree import rows_across_ranks
from seqpar.config import (
    DKV_WIRE_DTYPES,
    DKV_WIRE_HINT,
    DKV_WIRE_NO_EFFECT,
    MODES,
    SHARDINGS,
    foreign_mode_hint,
)
from seqpar.kernels.backends import DeviceCaps

__all__ = [
    "check_options",
    "check_dkv_wire",
    "dkv_wire_digest",
    "check_local",
    "check_causal",
    "check_scale",
    "check_across_ranks",
    "describe_call",
    "resolve_head_chunks",
    "ulysses_share",
    "AUTO_HEAD_CHUNKS",
    "AUTO_MEMORY_FRACTION",
    "FLASH_TILE_ROWS",
    "GpuCall",
    "CompileOnlyRefusal",
    "shown",
]


class CompileOnlyRefusal(ValueError):
    """A call that runs in eager mode but cannot be traced (e.g. ``sharding="balanced"`` with ``cu_seqlens`` as a
    tensor). Raised while dynamo traces, never deferred to the graph (:func:`seqpar.attn.ops.refused_output` defers
    plain ValueError / TypeError only): without ``fullgraph=True`` dynamo then runs the call eagerly, which is exact;
    under ``fullgraph=True`` it is dynamo's ``Unsupported``, this message in its debug context."""



def shown(value: object) -> object:
    """``value`` as a refusal's message shows it: a size, or a shape's sizes, as this call's ints.

    Why: while dynamo traces with symbolic sizes (``dynamic=True``, or a second length), a size or an int argument
    is a SymInt, and dynamo cannot build an f-string of one (``{n!r}``, or a SymInt inside a string built by another
    f-string: "BUILD_STRING type error"; ``tuple(t.shape)``: "Failed to trace builtin operator str"), which lost
    the message under ``fullgraph=True``. ``guard_scalar`` makes it the call's number (a guard: the refused graph
    is specialised to it, which is fine, it only raises). Eager values are returned as they are (``torch.Size``:
    as a tuple)."""
    if isinstance(value, (tuple, list)):  # torch.Size too
        return tuple(shown(v) for v in value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):  # (dynamo's isinstance of a SymInt says int)
        return guard_scalar(value)
    return value


_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
# tag, 3 tensors x (ndim + 4 dims), dtype, device type, causal, mode/sharding, head chunks, scale bits
_BASE_LEN = 1 + 3 * 5 + 6

# "auto" head chunks on the CPU: up to 4 passes. At P = 4 that brings the ring's peak per rank from ~19
# blocks of S/P to ~11 (inputs, output and gradients are 8 of them); more chunks save less and add messages.
AUTO_HEAD_CHUNKS = 4

# "auto" on a GPU: one pass unless the unchunked call's transients (see GpuCall.transient_bytes) exceed
# this share of the device's total memory; the rest is the model's (weights, optimizer state, activations).
AUTO_MEMORY_FRACTION = 0.25
# Query rows per thread block of the flash kernels (FlashAttention-2's forward tile for head dims <= 128,
# as torch builds it): a kernel call has batch * heads * ceil(rows / FLASH_TILE_ROWS) blocks, and one wave
# of the GPU is one such block per SM (at head dim 128 its shared memory leaves room for one per SM).
FLASH_TILE_ROWS = 128


@dataclass(frozen=True)
class GpuCall:
    """One rank's ring / all-gather call on a GPU, as ``head_chunks="auto"`` sees it: shapes every rank
    agrees on (checked across ranks first) and the device's fixed properties, never its free memory, so
    every rank of a job on one GPU model decides the same."""

    caps: DeviceCaps
    """The device (its ``total_memory`` and ``sm_count``)."""
    batch: int
    q_heads: int
    kv_heads: int
    seq_local: int
    """Rows of q on this rank."""
    head_dim: int
    v_head_dim: int
    element_size: int
    """Bytes per element of q/k/v (accumulators: fp32, fp64 for fp64 inputs)."""
    world: int
    """Ranks in the ring / all-gather."""

    @classmethod
    def of(cls, q: Tensor, k: Tensor, v: Tensor, world: int) -> GpuCall | None:
        """From one rank's q ``(batch, q_heads, seq_local, head_dim)``, k and v ``(batch, kv_heads,
        seq_local, *)`` on a CUDA device; None elsewhere (the CPU rule applies)."""
        if q.device.type != "cuda":
            return None
        from seqpar.kernels.backends import device_caps

        b, hq, lq, d = q.shape
        return cls(device_caps(q.device), b, hq, k.shape[1], lq, d, v.shape[-1], q.element_size(), world)

    def transient_bytes(self) -> int:
        """What one unchunked pass holds beside the call's inputs, output and gradients, and what head
        chunks divide: the larger of the ring's and the all-gather's (the mode may not be chosen yet).
        Ring: three K/V blocks (the current one, the next in flight, the one being sent), the fp32 dK/dV
        accumulators travelling and arriving (two blocks of each), the fp32 output and dq accumulators and
        one hop's kernel outputs. All-gather: every rank's K/V and their fp32 dK/dV, and the same
        accumulators. An estimate to compare with a quarter of the device, not a prediction."""
        e, a = self.element_size, max(4, self.element_size)
        rows = self.batch * self.seq_local
        kv = rows * self.kv_heads * (self.head_dim + self.v_head_dim)  # one block of K and V, elements
        q, o = rows * self.q_heads * self.head_dim, rows * self.q_heads * self.v_head_dim
        accumulators = (q + o) * a + (q + o + kv) * e  # fp32 dq and out, and a hop's kernel outputs
        ring = 3 * kv * e + 2 * kv * a
        gathered = self.world * kv * (e + a) if self.world > 1 else 0
        return int(max(ring, gathered) + accumulators)

    def tiles(self, chunks: int) -> int:
        """Thread blocks of one flash kernel call on ``q_heads / chunks`` heads over the smallest query
        block a plan hands a kernel (half the local rows at P > 1: a zigzag half)."""
        rows = self.seq_local // 2 if self.world > 1 else self.seq_local
        return self.batch * (self.q_heads // chunks) * math.ceil(max(rows, 1) / FLASH_TILE_ROWS)


def resolve_head_chunks(head_chunks: int | str, kv_heads: int | None, gpu: GpuCall | None = None, *,
                        share: str = "") -> int:
    """The number of head passes over ``kv_heads`` K/V heads (the call's, or under Ulysses each rank's share of
    them, which ``share`` then names for the error: the caller's tensor has more heads than the message's
    count): ``head_chunks`` itself (validated), or for ``"auto"``:

    - on a GPU (``gpu`` given, its total memory known): 1 while the unchunked call's transients fit in
      :data:`AUTO_MEMORY_FRACTION` of the device's memory, else the fewest passes (a divisor of
      ``kv_heads``) that fit, never so many that a kernel call falls below one wave of the GPU (a flash
      tile per SM, :meth:`GpuCall.tiles`): where both cannot hold, the wave wins;
    - elsewhere: the largest divisor of ``kv_heads`` that is at most :data:`AUTO_HEAD_CHUNKS`.

    ``kv_heads=None`` (an int ``head_chunks`` only): validate the value but not that it divides the heads, which a
    traced multi-rank call leaves to its custom op (:mod:`seqpar.attn.ops`), at the real head count.
    """
    if head_chunks == "auto":
        divisors = [c for c in range(1, kv_heads + 1) if kv_heads % c == 0]
        if gpu is None or gpu.caps.total_memory is None:
            return max(c for c in divisors if c <= AUTO_HEAD_CHUNKS)
        wave = gpu.caps.sm_count or 1
        allowed = [c for c in divisors if c == 1 or gpu.tiles(c) >= wave]
        budget = gpu.caps.total_memory * AUTO_MEMORY_FRACTION
        need = gpu.transient_bytes()
        return next((c for c in allowed if need / c <= budget), allowed[-1])
    if isinstance(head_chunks, bool) or not isinstance(head_chunks, int) or head_chunks < 1:
        raise ValueError(f"head_chunks={shown(head_chunks)!r} is invalid: pass a positive integer or 'auto'")
    if kv_heads is not None and kv_heads % head_chunks:
        divisors = [c for c in range(1, kv_heads + 1) if kv_heads % c == 0]
        raise ValueError(
            f"head_chunks={shown(head_chunks)} does not divide the {shown(kv_heads)} K/V heads{share}: choose one of "
            f"{divisors} or "
            "'auto'"
        )
    return head_chunks


def ulysses_share(u: int, kv_heads: int) -> str:
    """The words :func:`resolve_head_chunks` adds (``share=``) when it checks ``head_chunks`` against each Ulysses
    rank's share of the K/V heads, so that "the 1 K/V heads" does not read as a miscount of the caller's
    ``kv_heads`` (fuzz case 243281122: hybrid u=3, 2 K/V heads, head_chunks=2)."""
    return f" each of the {shown(u)} Ulysses ranks holds (its share of the call's {shown(kv_heads)})"


def dkv_wire_digest(dkv_wire_dtype: object) -> int:
    """``dkv_wire_dtype`` as an int for the cross-rank check (-1: not a valid value): ranks that send
    dK/dV in different dtypes would pair messages of different sizes."""
    return DKV_WIRE_DTYPES.index(dkv_wire_dtype) if dkv_wire_dtype in DKV_WIRE_DTYPES else -1


def check_dkv_wire(dkv_wire_dtype: object, algorithm: str | None = None) -> None:
    """Refuse a ``dkv_wire_dtype`` that is no valid value, or ``"bf16"`` for an ``algorithm`` whose dK/dV
    move no accumulators (``"allgather"``, ``"ulysses"``: an explicit mode; ``"auto"`` applies it only
    where it chose the ring or the hybrid). Raises ValueError naming the option and the fix."""
    if not isinstance(dkv_wire_dtype, str) or dkv_wire_dtype not in DKV_WIRE_DTYPES:
        raise ValueError(f"dkv_wire_dtype={dkv_wire_dtype!r} is invalid: {DKV_WIRE_HINT}")
    if dkv_wire_dtype != "fp32" and algorithm in DKV_WIRE_NO_EFFECT:
        raise ValueError(
            f"dkv_wire_dtype={dkv_wire_dtype!r} with mode={algorithm!r}: this mode moves no dK/dV accumulators "
            "(all-gather reduce-scatters the dK/dV shares, and a bf16 reduce-scatter would sum in bf16; Ulysses "
            "returns finished gradients by all-to-all in the input dtype). Use mode='ring', 'hybrid' or 'auto', "
            "or leave dkv_wire_dtype='fp32'"
        )


def check_options(mode: str, sharding: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is invalid: choose one of {list(MODES)}{foreign_mode_hint(mode)}")
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding={sharding!r} is invalid: choose one of {list(SHARDINGS)}")


def check_local(q: Tensor, k: Tensor, v: Tensor, *, world_size: int, sharding: str, length: bool = True) -> None:
    """Shapes, dtypes and devices of one rank's q, k ``(batch, heads, seq_local, head_dim)`` and v
    ``(batch, kv_heads, seq_local, v_head_dim)`` (V's head dim may differ from q/k's: MLA). ``length=False``
    leaves out :func:`check_local_length`, which a traced multi-rank call leaves to its custom op."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            # a 3-D tensor is most likely flash varlen's packed (total_tokens, heads, head_dim)
            varlen = (" (flash varlen's packed (total_tokens, heads, head_dim): pass t.unsqueeze(0) for each of q, k, "
                      "v with layout='bshd' and the whole sequence's cu_seqlens)" if t.dim() == 3 else "")
            raise ValueError(
                f"{name} has {t.dim()} dimensions (shape {shown(t.shape)}); seqpar.attention expects "
                f"(batch, heads, seq_local, head_dim), or (batch, seq_local, heads, head_dim) with layout='bshd'"
                f"{varlen}"
            )
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; use one of float16, bfloat16, float32, float64")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); cast them to one dtype")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v are on different devices ({q.device}, {k.device}, {v.device}); move them to one")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"k {shown(k.shape)} and v {shown(v.shape)} must agree in batch, kv_heads and seq_local "
            f"(layout (batch, heads, seq_local, head_dim); only the head dims may differ, as in MLA)"
        )
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"q {shown(q.shape)} and k {shown(k.shape)} must agree in batch, seq_local and head_dim "
            f"(layout (batch, heads, seq_local, head_dim); v's head_dim may differ)"
        )
    if k.shape[1] and q.shape[1] % k.shape[1]:
        raise ValueError(
            f"q has {shown(q.shape[1])} heads and k/v have {shown(k.shape[1])}: q_heads must be a multiple of kv_heads (GQA)"
        )
    if q.shape[2] == 0:
        raise ValueError("seq_local is 0: every rank needs at least one token of the sequence")
    if q.shape[1] == 0 or k.shape[1] == 0 or q.shape[3] == 0:
        raise ValueError(
            f"q {shown(q.shape)} and k {shown(k.shape)} need at least one head and a head_dim >= 1 (layout (batch, "
            "heads, seq_local, head_dim)): a size of 0 there is no attention to compute"
        )
    if length:
        check_local_length(q.shape[2], world_size=world_size, sharding=sharding)


def check_local_length(seq_local: int, *, world_size: int, sharding: str) -> None:
    """Zigzag's two chunks per rank need an even local length. Under ``torch.compile`` a multi-rank call runs
    this in its custom op, at the real length (:mod:`seqpar.attn.ops`): raised while dynamo traces, a refusal
    reaches a ``fullgraph=True`` caller as dynamo's "Unsupported: Observed exception" instead."""
    if sharding == "zigzag" and seq_local % 2:
        raise ValueError(
            f"zigzag sharding needs an even local length (two chunks per rank), got seq_local={shown(seq_local)}: "
            f"pad the full sequence to a multiple of 2 * {world_size} (seqpar.sequence.sharding.pad_to_multiple) "
            f"or use sharding='contiguous'"
        )


def check_causal(causal: object, entry: str = "seqpar.attention") -> bool:
    """``causal`` as the bool it must be, or a TypeError naming the fix. Python reads any non-empty string as
    true (``causal="False"`` ran causal), and torch's SDPA, which one rank runs, refused anything but a bool deep
    inside torch while more ranks took ``1`` / ``None`` as their truth value: one rule for every world size. Called
    after the cross-rank check (whose row carries :func:`causal_digest`), so every rank raises alike."""
    if isinstance(causal, bool):
        return causal
    if isinstance(causal, str):
        why = f" (a string is true whatever it says: {causal!r} would have run causal)"
    elif isinstance(causal, Tensor):
        why = f" (a tensor of shape {shown(tuple(causal.shape))}: pass causal=bool(t), a value fixed per call)"
    elif causal is None:
        why = " (None: seqpar has no layer to take causality from; transformers' is_causal=None means module.is_causal)"
    else:
        why = f" ({type(causal).__name__}: pass causal=bool(x))"
    raise TypeError(f"{entry}: causal={causal!r} is not a bool{why}: pass causal=True (causal masking) or "
                    "causal=False (none)")


def causal_digest(causal: object) -> int:
    """``causal`` as an int of the cross-rank row: 1 / 0 for a bool, -1 for anything :func:`check_causal` refuses
    (``int()`` of a string or None raised on one rank before the all-gather, which could leave the others in it)."""
    return int(causal) if isinstance(causal, bool) else -1


def check_scale(scale: object, head_dim: int, entry: str = "seqpar.attention") -> float:
    """The score multiplier a call runs with: ``head_dim ** -0.5`` for None, else ``scale`` as a float, which must be
    finite and > 0. torch's attention kernels, which seqpar runs, return NaN for a scale <= 0 or an infinite one, and
    with a window or documents a NaN scale came out as a finite, wrong output; ``q * scale`` with ``scale=1.0``
    computes what such a scale means. A bool or a string is refused (``True`` ran as 1.0). Called after the
    cross-rank check: every rank raises alike."""
    if scale is None:
        return float(head_dim ** -0.5)
    if not _is_number(scale):
        raise TypeError(f"{entry}: scale={scale!r} ({type(scale).__name__}) is invalid: pass a float > 0 (the score "
                        "multiplier) or None for head_dim ** -0.5")
    value = float(scale)
    if not 0.0 < value < math.inf:
        raise ValueError(
            f"{entry}: scale={value!r} is invalid: pass a finite float > 0 (or None for head_dim ** -0.5). torch's "
            "attention kernels, which seqpar runs, returned NaN for a scale <= 0 or an infinite one (CPU, measured); "
            "for such a score multiplier s, pass q * s and scale=1.0"
        )
    return value


def _describe(t: Tensor) -> list[int]:
    dims = list(t.shape[:4]) + [-1] * (4 - min(t.dim(), 4))
    return [t.dim(), *dims]


def _scale_bits(scale: float) -> int:
    """The float64 bit pattern of ``scale`` as an int64: equal exactly when the scales are.

    While dynamo traces with symbolic sizes the default scale ``head_dim ** -0.5`` is a SymFloat, and dynamo
    2.13's ``struct.pack`` polyfill recurses on it (torch's bug, seqpar.testing.fuzz_compile.TORCH_STRUCT_BUG):
    ``guard_scalar`` makes it this call's number first (a guard that it stays so: the head dim is a model's
    constant, which the head split specialises anyway); any other value goes to ``float()`` as before."""
    if isinstance(scale, (float, torch.SymFloat)):  # (dynamo's isinstance of a SymFloat says float)
        scale = guard_scalar(scale)
    return struct.unpack("<q", struct.pack("<d", float(scale)))[0]


def _scale_digest(scale: object, head_dim: int) -> int:
    """:func:`_scale_bits` of the call's scale (None: ``head_dim ** -0.5``), or -1 (a NaN's bits) where there is no
    float to take (a head_dim of 0, a scale no float: :func:`check_scale` and :func:`check_local` refuse them after the
    all-gather; raised here, on some ranks only, they left the others waiting in it)."""
    if scale is None:
        return _scale_bits(head_dim ** -0.5) if head_dim > 0 else -1
    return _scale_bits(scale) if _is_number(scale) else -1


def _is_number(scale: object) -> bool:
    """A value a scale may be: anything ``float()`` takes as a number (a float, an int, numpy's scalars, a SymFloat, a
    one-element tensor), except a bool and a string (which ``float()`` parses)."""
    if isinstance(scale, (bool, str)):
        return False
    if isinstance(scale, (int, float, torch.SymInt, torch.SymFloat)):  # (dynamo's isinstance of a SymFloat: float)
        return True
    if not hasattr(type(scale), "__float__"):
        return False
    return not isinstance(scale, Tensor) or scale.numel() == 1


def _bits_scale(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def describe_call(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool, mode: str, sharding: str,
    head_chunks: int | str = "auto", extra: Sequence[int] = (), scale: float | None = None,
) -> list[int]:
    """The row of integers the ranks of a group must agree on for one attention call:
    ``[tag, 3 x (ndim, 4 dims), dtype, device type, causal, mode/sharding, head chunks, scale bits,
    len(extra), *extra]``. ``scale=None`` stands for its default ``head_dim ** -0.5``, so a rank
    passing that value explicitly agrees with one passing None."""
    meta = [1]
    for t in (q, k, v):
        meta += _describe(t)
    meta += [
        _DTYPES.index(q.dtype) if q.dtype in _DTYPES else -1,
        {"cpu": 0, "cuda": 1}.get(q.device.type, 2),
        causal_digest(causal),
        MODES.index(mode) * len(SHARDINGS) + SHARDINGS.index(sharding),
        0 if head_chunks == "auto" else (head_chunks if isinstance(head_chunks, int) else -1),
        # a scale differing between ranks would merge partial results of different softmaxes
        _scale_digest(scale, q.shape[-1]),
    ]
    extra = [int(x) for x in extra]
    return meta + [len(extra), *extra]


def _show(row: list[int]) -> str:
    shapes = []
    for i, name in enumerate("qkv"):
        nd, *dims = row[1 + 5 * i: 6 + 5 * i]
        shapes.append(f"{name}{tuple(d for d in dims[:nd] if d >= 0)}")
    dt = _DTYPES[row[16]] if 0 <= row[16] < len(_DTYPES) else "?"
    chunks = "auto" if row[20] == 0 else row[20]
    text = f"{' '.join(shapes)} {dt} causal={bool(row[18])} head_chunks={chunks} scale={_bits_scale(row[21]):.6g}"
    extra = row[_BASE_LEN + 1:]
    return f"{text} extra={extra}" if extra else text


@torch.compiler.disable
def _rows_across_ranks_eagerly(row: list[int], group: dist.ProcessGroup) -> list[list[int]] | None:
    """:func:`~seqpar.comm.agree.rows_across_ranks` outside dynamo: under ``torch.compile`` the agreement is a
    graph break anyway (its verdict is a host read), and traced with symbolic sizes it crashed: after the SP group
    changed between calls, dynamo made the group size a symbol in the resumed frame, and its remapped
    ``all_gather_into_tensor`` copied a ``(group size * 3,)`` result into a buffer of symbolic size
    (TorchRuntimeError "expand: attempting to expand a dimension", fuzz case 499836113). Run eagerly, the row's
    traced sizes arrive as this call's ints."""
    return rows_across_ranks(row, group)


def check_across_ranks(
    q: Tensor, k: Tensor, v: Tensor, *, group: dist.ProcessGroup, causal: bool, mode: str, sharding: str,
    head_chunks: int | str = "auto", extra: Sequence[int] = (), scale: float | None = None,
    entry: str = "seqpar.attention",
) -> None:
    """Raise on every rank if the ranks of ``group`` disagree on shapes, dtype, device, scale or options.

    Args:
        q, k, v: this rank's ``(batch, heads, seq_local, head_dim)`` inputs (only shapes, dtype and
            device are read).
        group: the SP group; collective: every rank of it must call this.
        causal, mode, sharding, head_chunks, scale: the call's options (``scale=None``: the
            default ``head_dim ** -0.5``).
        extra: more integers every rank must agree on (a mask description, a pattern, ...);
            compared with their length, so ranks may even pass different lengths.
        entry: the public function the user called, which the message names.
    Raises:
        ValueError: on every rank, naming each rank's inputs.
    Cost: one all-gather of 3 int64 and one device-to-host read (seqpar.comm.agree).
    """
    row = describe_call(q, k, v, causal=causal, mode=mode, sharding=sharding,
                        head_chunks=head_chunks, extra=extra, scale=scale)
    rows = _rows_across_ranks_eagerly(row, group)
    if rows is None:
        return
    detail = "; ".join(f"rank {r}: {_show(row)}" for r, row in enumerate(rows))
    raise ValueError(
        f"{entry}: the ranks of the sequence-parallel group passed different inputs or options "
        f"({detail}). Every rank must pass its own shard of the same sequences: same batch, heads, "
        "seq_local and head_dim, same dtype, scale and options; cu_seqlens, window and sinks, when given: the "
        "same on every rank, as is a dilated pattern (shard with seqpar.shard_sequence)."
    )
