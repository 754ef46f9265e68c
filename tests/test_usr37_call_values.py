"""Values of ``causal=`` and ``scale=`` that both attention entries (``seqpar.attention``, ``seqpar.dilated_attention``)
ran wrong or refused from deep inside Python or torch, and zero-sized heads; now one refusal on every rank, whatever
the world size, naming the fix (seqpar.attn.checks.check_causal / check_scale / check_local).

What a user migrating from flash-attn, ring-flash-attn or transformers passes:

- ``causal="False"`` (a string from a config): Python reads it as true, so ``check_inputs=False`` at P = 2 and a
  windowed call at P = 1 ran causal attention; with ``check_inputs`` at P > 1 the cross-rank row's ``int(causal)``
  failed with "invalid literal for int()", and at P = 1 without a mask torch's SDPA refused it ("argument
  'is_causal' must be bool"). ``None`` (transformers' ``is_causal=None``), ``1`` and a tensor: the same split.
- ``scale=`` 0, < 0, inf or NaN: NaN outputs (torch's kernels), and a NaN scale with a window gave a finite, wrong
  output with NaN gradients. ``True`` ran as 1.0, ``"0.5"`` as 0.5, ``"x"`` failed in ``float()``.
- q/k with 0 heads or a head_dim of 0: ZeroDivisionError (``q_heads % kv_heads``, ``head_dim ** -0.5``).

Valid values (a bool, a positive float, an int, a one-element tensor, numpy's float32) still run exactly: against an
explicit float64 softmax reference, one process and P = 2."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist

import seqpar

DILATED = {"segment_lengths": [8], "dilation_rates": [1]}  # one dense segment: plain attention, so one reference


def _qkv(seq: int = 8, heads: int = 2, dim: int = 4, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, heads, seq, dim, generator=g, dtype=torch.float64) for _ in range(3))


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float,
               window: int | None = None) -> torch.Tensor:
    s = q.shape[2]
    i, j = torch.arange(s)[:, None], torch.arange(s)[None]
    seen = torch.ones(s, s, dtype=torch.bool)
    if causal:
        seen &= j <= i
    if window is not None:
        seen &= (i - j < window) & (j - i < window)
    return torch.softmax((q @ k.transpose(-1, -2) * scale).masked_fill(~seen, -math.inf), -1) @ v


def _entry(name: str):  # noqa: ANN202
    if name == "dilated":
        return lambda q, k, v, **kw: seqpar.dilated_attention(q, k, v, **DILATED, **kw)
    if name == "window":
        return lambda q, k, v, **kw: seqpar.attention(q, k, v, window=3, **kw)
    return seqpar.attention


ENTRIES = ["attention", "window", "dilated"]


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("causal", ["False", None, 1, torch.tensor(True)], ids=["str", "None", "int", "tensor"])
def test_causal_that_is_no_bool_is_refused_by_name(entry: str, causal: object) -> None:
    """Seen failing (checks.check_causal returning its argument): "False" with a window and every value through the
    dilated entry ran (no error), the others raised torch's "argument 'is_causal' must be bool" naming no fix."""
    q, k, v = _qkv()
    with pytest.raises(TypeError) as e:
        _entry(entry)(q, k, v, causal=causal)
    msg = str(e.value)
    assert "causal=" in msg and "is not a bool" in msg and "pass causal=True" in msg and "causal=False" in msg, msg
    assert msg.startswith("seqpar.dilated_attention" if entry == "dilated" else "seqpar.attention"), msg


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("scale, kind", [(0.0, ValueError), (-0.5, ValueError), (math.inf, ValueError),
                                         (math.nan, ValueError), (True, TypeError), ("0.5", TypeError),
                                         (torch.ones(2), TypeError)])
def test_a_scale_that_is_no_finite_positive_number_is_refused(entry: str, scale: object, kind: type) -> None:
    """Seen failing (check_scale returning float(scale)): 0, -0.5 and inf returned NaN outputs, NaN with a window a
    finite wrong one, True and "0.5" ran as 1.0 and 0.5, a 2-element tensor failed in float()."""
    q, k, v = _qkv()
    with pytest.raises(kind) as e:
        _entry(entry)(q, k, v, causal=True, scale=scale)
    msg = str(e.value)
    assert "scale=" in msg and "is invalid" in msg and "float > 0" in msg, msg


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("scale", [None, 0.3, 2, torch.tensor(0.3, dtype=torch.float64), np.float32(0.3)],
                         ids=["None", "float", "int", "tensor", "np.float32"])
def test_valid_values_still_run_exactly(entry: str, causal: bool, scale: object) -> None:
    """The values the checks let through are the call's: float64, to 1e-12 of an explicit softmax."""
    q, k, v = _qkv()
    out = _entry(entry)(q, k, v, causal=causal, scale=scale)
    want = _reference(q, k, v, causal=causal, scale=4 ** -0.5 if scale is None else float(scale),
                      window=3 if entry == "window" else None)
    assert (out - want).abs().max() <= 1e-12


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("shape", [(1, 0, 8, 4), (1, 2, 8, 0)], ids=["no heads", "head_dim 0"])
def test_zero_heads_or_head_dim_are_refused(entry: str, shape: tuple[int, ...]) -> None:
    """Seen failing (the zero check dropped from check_local): ZeroDivisionError ("integer modulo by zero",
    "0.0 cannot be raised to a negative power")."""
    q = k = v = torch.randn(*shape, dtype=torch.float64)
    with pytest.raises(ValueError, match="at least one head and a head_dim >= 1"):
        _entry(entry)(q, k, v, causal=True, layout="bhsd") if entry == "attention" else \
            _entry(entry)(q, k, v, causal=True)


# ------------------------------------------------------------------------------------------------------ P = 2
def _outcome(fn) -> tuple[str, str]:  # noqa: ANN001
    try:
        fn()
    except (TypeError, ValueError) as e:
        return type(e).__name__, str(e)
    return "", ""


def _two_ranks(rank: int, world: int) -> dict:
    seqpar.init_process_groups(sp_size=world)
    q, k, v = _qkv(seq=8)
    ql, kl, vl = (seqpar.shard_sequence(t, 2) for t in (q, k, v))
    got: dict = {}
    for check in (True, False):
        got[f"str {check}"] = _outcome(lambda c=check: seqpar.attention(ql, kl, vl, causal="False", check_inputs=c))
        got[f"None {check}"] = _outcome(lambda c=check: seqpar.attention(ql, kl, vl, causal=None, check_inputs=c))
        got[f"dilated {check}"] = _outcome(lambda c=check: seqpar.dilated_attention(
            ql, kl, vl, causal="False", check_inputs=c, **DILATED))
        got[f"nan {check}"] = _outcome(lambda c=check: seqpar.attention(
            ql, kl, vl, causal=True, scale=math.nan, window=3, check_inputs=c))
    # one rank's bad value: the row carries it as -1, so every rank names the disagreement (int("False") raised on
    # rank 0 alone before the all-gather, and rank 1 waited in it until the group's timeout)
    got["disagree"] = _outcome(lambda: seqpar.attention(ql, kl, vl, causal="False" if rank == 0 else False))
    got["disagree scale"] = _outcome(lambda: seqpar.attention(ql, kl, vl, causal=True, scale="x" if rank else 0.5))
    errors = []
    for causal in (True, False):
        for name, call in (("ring", lambda c: seqpar.attention(ql, kl, vl, causal=c, scale=0.3)),
                           ("dilated", lambda c: seqpar.dilated_attention(ql, kl, vl, causal=c, scale=0.3, **DILATED))):
            out = seqpar.gather_sequence(call(causal), 2)
            errors.append(float((out - _reference(q, k, v, causal=causal, scale=0.3)).abs().max()))
    got["errors"] = errors
    dist.barrier()
    return got


def test_every_rank_refuses_alike_at_two_ranks(dist_pool) -> None:
    """Seen failing: with checks.causal_digest back to int(causal), "str True" raised "invalid literal for int()" and
    "disagree" left rank 1 in the all-gather (the pool's timeout); with check_causal returning its argument,
    "str False" ran causal attention. With check_scale returning float(scale), "nan" ran (NaN gradients)."""
    got = dist_pool.run(2, _two_ranks, timeout=180)
    for rank in got:
        for key, outcome in rank.items():
            if key == "errors":
                continue
            kind, msg = outcome
            if key.startswith("disagree"):
                assert kind == "ValueError" and "passed different inputs or options" in msg, (key, msg)
            elif key.startswith("nan"):
                assert kind == "ValueError" and "scale=nan is invalid" in msg, (key, msg)
            else:
                assert kind == "TypeError" and "is not a bool" in msg and "pass causal=True" in msg, (key, msg)
        assert max(rank["errors"]) <= 1e-12, rank["errors"]
    assert got[0] == got[1]
