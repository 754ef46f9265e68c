"""The position-mixing probe: find every module of a model that mixes information across sequence
positions and is not attention seqpar shards, so that :func:`seqpar.swap.swap_attention` can refuse it
by name instead of running it on each rank's shard (where a state-space scan, a causal convolution or a
cumulative sum silently computes something else).

How it works. While :class:`seqpar.swap.state.probing` is active every swapped attention is *self-only*
(each query sees its own key alone: the output is its value, and nothing is communicated), so a model
that seqpar can shard exactly is then *position-wise*: its output at position i depends on its input at
position i alone. :func:`find_mixers` runs the model twice on a short sequence, with the same RNG seed
and under ``no_grad``: plain (run A), then with the input at one position ``p`` changed (run B). Hooks
on every module record each call's tensor inputs and outputs in run A and compare them with the same
module's same call in run B:

- a module whose inputs changed at ``p`` only and whose output changed at another position mixes
  positions in its own forward: it is named, with the first submodule it handed a mixed value to when
  the mixing happened in its body between submodule calls (e.g. ``h.cumsum(1)`` in a layer's forward);
- a module whose *input* already changed at other positions is not judged (the value was mixed in its
  caller's body, or the call belongs to a data-dependent loop, such as over the experts a token picked,
  that does not match run A's calls one to one): its caller's output is.

After each judged module whose output changed elsewhere, the run-B output is spliced back to run A's
values at every position but ``p`` (in place where possible), so the modules after it are judged with
inputs that differ at ``p`` only, and every mixer is found in one pair of runs, not only the first one.

Which dimension of a tensor is the sequence: the first of dims 1, 0, 2, 3, ... whose size is the probe
length (``(batch, seq, ...)``; with batch 1 also the flattened tokens ``(batch*seq, ...)`` of MoE routers
and ``(batch, heads, seq, dim)``). A probe length of 13 rarely equals any other dimension of a model.
Tensors without such a dimension (scalars such as router losses, per-expert counts) and tensors whose
shapes differ between the runs (the tokens one expert receives) are not judged: what they carry shows in
the outputs of the modules that use them, which are.

A position counts as changed when ``|b - a| > rtol * max(|a|, |b|)`` over the tensor, with
``rtol = max(1e-4, 4 * eps(dtype))``: kernels whose rounding depends on the batch shape (grouped expert
matmuls) cannot fake a mixer, while a real mixer moves other positions by O(1) of that scale.

The probe of a real batch (the first forward of a model that cannot run on synthetic inputs) cuts the
batch to the probe length first: :mod:`seqpar.swap.probe_batch`.

Cost: one pair of forwards of a 13-token sequence (plus copies of each module's inputs and outputs at
that length). The model's train/eval mode, parameters, buffers, gradients and RNG state are left as
they were.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from seqpar.swap.state import probing

__all__ = [
    "PROBE_LENGTH",
    "PROBE_POSITION",
    "Mixer",
    "ProbeFailed",
    "raised_by_seqpar",
    "find_mixers",
    "isolated",
    "mixing_refusal",
    "is_materialised",
    "is_simulated",
    "tensor_leaves",
    "replace_tensors",
]

PROBE_LENGTH = 13
"""Tokens in the probe sequence: short (the probe is two tiny forwards) and prime, so that it is rarely
the size of another dimension of the model's tensors."""
PROBE_POSITION = PROBE_LENGTH // 2
"""The position whose input is changed: in the middle, so causal mixers (which move the positions after
it) and anti-causal ones (before it) are both seen."""
_SEED = 20_231
_MAX_DEPTH = 8


@dataclass(frozen=True)
class Mixer:
    """A module that mixes information across sequence positions outside seqpar's attention."""

    path: str
    """Qualified name in the probed model (``""``: the model itself)."""
    cls: str
    """Its class name."""
    how: str
    """What the probe saw."""

    def describe(self, prefix: str = "") -> str:
        path = f"{prefix}.{self.path}" if prefix and self.path else (self.path or prefix)
        return f"'{path or '<model>'}' ({self.cls}): {self.how}"


class ProbeFailed(Exception):
    """The model raised while the probe ran it; ``path``/``cls`` name the innermost module running."""

    def __init__(self, path: str, cls: str, error: BaseException) -> None:
        super().__init__(f"'{path or '<model>'}' ({cls}) raised {type(error).__name__}: {error}")
        self.path, self.cls, self.error = path, cls, error


def raised_by_seqpar(error: BaseException) -> bool:
    """Whether ``error`` was raised by seqpar's own code (a refusal), not by the model."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and str(tb.tb_frame.f_globals.get("__name__", "")).startswith("seqpar.")


# ----------------------------------------------------------------------------- tensor structures
def tensor_leaves(value: Any, out: list[Tensor], depth: int = 0) -> list[Tensor]:
    """The tensors inside ``value`` (tuples, lists, dicts and ModelOutputs walked), in a fixed order."""
    if isinstance(value, Tensor):
        out.append(value)
    elif depth < _MAX_DEPTH and isinstance(value, (tuple, list)):
        for item in value:
            tensor_leaves(item, out, depth + 1)
    elif depth < _MAX_DEPTH and isinstance(value, Mapping):
        for key in value:
            tensor_leaves(value[key], out, depth + 1)
    return out


def replace_tensors(value: Any, new: dict[int, Tensor], depth: int = 0) -> Any:
    """``value`` rebuilt with tensors replaced by ``new[id(tensor)]`` (the rest kept as they are)."""
    if isinstance(value, Tensor):
        return new.get(id(value), value)
    if depth < _MAX_DEPTH and isinstance(value, (tuple, list)):
        items = [replace_tensors(item, new, depth + 1) for item in value]
        if isinstance(value, list):
            return items
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if depth < _MAX_DEPTH and isinstance(value, Mapping):
        if isinstance(value, dict):
            out = value.copy()  # keeps the class (a ModelOutput stays one)
            for key in value:
                out[key] = replace_tensors(value[key], new, depth + 1)
            return out
    return value


def _seq_dim(shape: torch.Size, seq_len: int) -> int | None:
    order = [1, 0, *range(2, len(shape))] if len(shape) > 1 else [0]
    return next((d for d in order if d < len(shape) and shape[d] == seq_len), None)


def _rtol(dtype: torch.dtype) -> float:
    return max(1e-4, 4 * torch.finfo(dtype).eps) if dtype.is_floating_point else 0.0


def _changed_positions(a: Tensor, b: Tensor, dim: int) -> Tensor:
    """Per position along ``dim``: did ``b`` differ from ``a`` beyond rounding? ``(seq,)`` bool."""
    if a.dtype.is_floating_point or a.dtype.is_complex:
        a64, b64 = a.detach().double(), b.detach().double()
        scale = torch.maximum(a64.abs().nan_to_num(0).amax(), b64.abs().nan_to_num(0).amax())
        changed = ((b64 - a64).abs() > _rtol(a.dtype) * scale) | (a64.isnan() != b64.isnan())
    else:
        changed = a != b
    return changed.movedim(dim, 0).reshape(a.shape[dim], -1).any(dim=1)


# ----------------------------------------------------------------------------- the recorder
class _Recorder:
    """The hooks of one probe: record in run A, compare and splice in run B."""

    def __init__(self, seq_len: int, position: int) -> None:
        self.seq_len = seq_len
        self.position = position
        self.phase = "A"
        self.inputs: dict[tuple[int, int], list[Tensor]] = {}  # run A, per (module, call)
        self.outputs: dict[tuple[int, int], list[Tensor]] = {}
        self.calls: dict[int, int] = {}
        self.stack: list[tuple[str, nn.Module, int, bool]] = []  # name, module, call, judged
        self.tainted: dict[tuple[int, int], str] = {}  # call -> first submodule given a mixed input
        self.found: dict[str, Mixer] = {}

    def start(self, phase: str) -> None:
        self.phase = phase
        self.calls.clear()
        self.stack.clear()
        self.tainted.clear()

    def _flag(self, name: str, module: nn.Module, how: str) -> None:
        self.found.setdefault(name, Mixer(name, type(module).__name__, how))

    def _compare(self, before: list[Tensor] | None, leaves: list[Tensor]) -> dict[int, tuple[Tensor, int, int]] | None:
        """Run B: the leaves changed at other positions, as ``id -> (merged value, count, dim)``;
        None when the call cannot be compared with run A's (``before``)."""
        if before is None or len(before) != len(leaves):
            return None
        if any(a.shape != b.shape or a.dtype != b.dtype for a, b in zip(before, leaves)):
            return None  # e.g. the tokens routed to one expert: judged by the enclosing block
        dirty: dict[int, tuple[Tensor, int, int]] = {}
        for a, b in zip(before, leaves):
            if b.device.type == "meta":
                continue
            dim = _seq_dim(b.shape, self.seq_len)
            if dim is None:
                continue  # no sequence dimension: judged through the modules that use it
            changed = _changed_positions(a.to(b.device), b, dim)
            changed[self.position] = False
            count = int(changed.sum())
            if count:
                keep = torch.zeros(self.seq_len, dtype=torch.bool, device=b.device)
                keep[self.position] = True
                shape = [1] * b.dim()
                shape[dim] = self.seq_len
                dirty[id(b)] = (torch.where(keep.view(shape), b, a.to(b.device)), count, dim)
        return dirty

    def _splice(self, value: Any, dirty: dict[int, tuple[Tensor, int, int]]) -> Any:
        """Put run A's values back at every position but the probed one (in place where possible,
        so that aliases of the tensor see it too); returns ``value`` or a rebuilt copy."""
        rebuilt: dict[int, Tensor] = {}
        for leaf in tensor_leaves(value, []):
            if id(leaf) not in dirty:
                continue
            merged = dirty[id(leaf)][0]
            try:
                leaf.copy_(merged)
            except RuntimeError:  # an inference tensor, an expanded view ...: hand a new tensor on
                rebuilt[id(leaf)] = merged
        return replace_tensors(value, rebuilt) if rebuilt else value

    def pre(self, name: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        count = self.calls.get(id(module), 0)
        self.calls[id(module)] = count + 1
        key = (id(module), count)
        leaves = tensor_leaves((args, kwargs), [])
        if self.phase == "A":
            self.stack.append((name, module, count, True))
            self.inputs[key] = [t.detach().clone() for t in leaves]
            return
        dirty = self._compare(self.inputs.get(key), leaves)
        if dirty and self.stack:
            # Mixed in the caller's body (or a call of a data-dependent loop that does not match run A's):
            # not judged here; the caller's output says whether its forward mixes positions.
            caller = self.stack[-1]
            self.tainted.setdefault((id(caller[1]), caller[2]), name)
        self.stack.append((name, module, count, not dirty))

    def post(self, name: str, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        while self.stack:
            _, top_module, count, judged = self.stack.pop()
            if top_module is module:
                break
        else:
            return None
        leaves = tensor_leaves(output, [])
        if self.phase == "A":
            self.outputs[(id(module), count)] = [t.detach().clone() for t in leaves]
            return None
        if not judged:
            return None
        dirty = self._compare(self.outputs.get((id(module), count)), leaves)
        if not dirty:
            return None
        moved = max(c for _, c, _ in dirty.values())
        child = self.tainted.get((id(module), count))
        where = (f", in its own forward before calling '{child}'" if child is not None else "")
        self._flag(name, module,
                   f"its output changed at {moved} of the {self.seq_len - 1} positions whose input did not "
                   f"change: it mixes information across sequence positions{where}")
        return self._splice(output, dirty)


# ----------------------------------------------------------------------------- the probe
def is_materialised(model: nn.Module) -> bool:
    """Whether every parameter holds its values here (not on the meta device, not a ZeRO-3 partition
    of size 0): the probe can run only then."""
    return all(p.device.type != "meta" and (p.numel() > 0 or not hasattr(p, "ds_numel"))
               for p in model.parameters())


def is_simulated(model: nn.Module) -> bool:
    """Whether the model's tensors are fake ones (``FakeTensorMode``: tracing, or seqpar's fake-CUDA
    host-sync checker): such a model computes no values, so there is nothing for the probe to compare,
    and it is skipped (a real run of the same model is probed)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return any(isinstance(t, FakeTensor) for t in (*model.parameters(), *model.buffers()))


def find_mixers(model: nn.Module, run: Callable[[bool], Any], seq_len: int, position: int) -> list[Mixer]:
    """The modules of ``model`` that mix information across sequence positions (see the module docstring).

    Args:
        model: the model, with its attention swapped (or routed to seqpar for the probe).
        run: ``run(perturbed)`` calls ``model`` once on the probe inputs: the plain ones, or the same with
            the input at ``position`` changed; each tensor crossing a module has its sequence dimension of
            size ``seq_len``.
        seq_len: the probe sequence length.
        position: the changed position.

    Returns:
        The mixers, in the order the probe met them (empty: the model is position-wise).

    Raises:
        ProbeFailed: ``run`` raised (the error, and the innermost module that was running).
    """
    recorder = _Recorder(seq_len, position)
    handles = []
    modules: dict[int, tuple[str, nn.Module]] = {}
    for name, module in model.named_modules():
        modules.setdefault(id(module), (name, module))
    try:
        for name, module in modules.values():
            handles.append(module.register_forward_pre_hook(
                _bind(recorder.pre, name), with_kwargs=True, prepend=True))
            handles.append(module.register_forward_hook(_bind(recorder.post, name), with_kwargs=True))
        with isolated(model) as cuda:
            for phase, perturbed in (("A", False), ("B", True)):
                recorder.start(phase)
                torch.random.default_generator.manual_seed(_SEED)  # the same dropout / jitter in both runs
                for index in cuda:
                    torch.cuda.default_generators[index].manual_seed(_SEED)
                try:
                    run(perturbed)
                except Exception as e:
                    name, module = (recorder.stack[-1][0], recorder.stack[-1][1]) if recorder.stack else ("", model)
                    raise ProbeFailed(name, type(module).__name__, e) from e
    finally:
        for handle in handles:
            handle.remove()
    return list(recorder.found.values())


@contextlib.contextmanager
def isolated(model: nn.Module) -> Iterator[list[int]]:
    """A probe's runs of ``model`` leave no trace: no autograd, :class:`probing` on (self-only attention,
    no collective), the CPU generator and those of the CUDA devices the model's tensors are on forked, and
    the model's buffers put back afterwards (e.g. running statistics a train-mode norm updated). Yields
    those CUDA device indices, for runs that seed their generators; none without a driver (CUDA tensors
    are then fake ones, as in the fake-CUDA host-sync checker, and the CUDA RNG cannot even be read)."""
    buffers = {id(b): (b, b.detach().clone()) for b in model.buffers() if b.device.type != "meta"}
    cuda = sorted({t.device.index or 0 for t in [*model.parameters(), *model.buffers()]
                   if t.device.type == "cuda"}) if torch.cuda.is_available() else []
    try:
        with torch.no_grad(), probing(), torch.random.fork_rng(devices=cuda):
            yield cuda
    finally:
        with torch.no_grad():
            for buffer, saved in buffers.values():
                buffer.copy_(saved)


def _bind(hook: Callable[..., Any], name: str) -> Callable[..., Any]:
    def bound(*args: Any) -> Any:
        return hook(name, *args)

    return bound


_NEEDS = (
    "Each such module is one seqpar cannot route: an attention whose scores the model computes in its own "
    "code (not through transformers' attention interface or F.scaled_dot_product_attention: GPT-Neo, xGLM, "
    "XLNet, ...), or a state-space, linear-attention or convolution layer without a sequence-parallel "
    "implementation (seqpar issue 21). "
    "Run this model without sequence parallelism (sequence_parallel.size 1 and swap \"none\": "
    "at size 1 a swap still probes the model), or "
    "with these modules replaced (an attention rewritten to call F.scaled_dot_product_attention is routed)."
)


def mixing_refusal(mixers: list[Mixer], where: str, prefix: str = "") -> str:
    """The SwapError text naming every mixer (path, class, what the probe saw) and what seqpar needs."""
    lines = "\n  - ".join(m.describe(prefix) for m in mixers)
    return (
        f"seqpar cannot shard {where} over the sequence: these modules mix information across sequence "
        f"positions outside any attention seqpar routes, and on a shard each would see only its own rank's "
        f"positions (a silently different model):\n  - {lines}\n{_NEEDS} (Found by seqpar's position-mixing "
        f"probe: two forwards of a {PROBE_LENGTH}-token sequence with self-only attention, one token "
        "changed; see seqpar.swap.probe.)"
    )
