"""Shared pieces of the TRL tests: a word-level tokenizer with a chat template that marks the assistant's
tokens (``{% generation %}``), chat data for it, and what a run records.

Nothing is downloaded: the tokenizer is built from ``tokenizers``' WordLevel model over the tiny Llama's
vocabulary (``hf_tiny.VOCAB``), one token per whitespace-separated word ``t<id>``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import hf_tiny
import torch

PAD, USER, ASSISTANT, EOS = 0, 1, 2, 3  # special token ids; words t4 .. t<VOCAB-1> are the rest
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}<u> {{ m['content'] }} "
    "{% else %}<a> {% generation %}{{ m['content'] }} <eos>{% endgeneration %} {% endif %}{% endfor %}"
)
# Conversations: (user words, assistant words). Packed into rows of MAX_LENGTH tokens by SFTTrainer's
# best-fit packing; lengths chosen so most rows need seqpar's end padding at SP = 2 (zigzag: 4).
TURNS = ((3, 4), (2, 9), (5, 6), (1, 2), (4, 3), (6, 7), (2, 4), (3, 8), (2, 2), (5, 5), (4, 9), (3, 3))
MAX_LENGTH = 24


def tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<u>": USER, "<a>": ASSISTANT, "<eos>": EOS,
             **{f"t{i}": i for i in range(4, hf_tiny.VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _words(n: int, g: torch.Generator) -> str:
    return " ".join(f"t{i}" for i in torch.randint(4, hf_tiny.VOCAB, (n,), generator=g).tolist())


def conversations(seed: int = 7) -> Any:
    """A ``datasets.Dataset`` of fresh random user/assistant conversations (``messages``)."""
    import datasets

    g = torch.Generator().manual_seed(seed)
    rows = [{"messages": [{"role": "user", "content": _words(u, g)},
                          {"role": "assistant", "content": _words(a, g)}]} for u, a in TURNS]
    return datasets.Dataset.from_list(rows)


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, whole (FSDP2's DTensor shards gathered: collective, call on every rank)."""
    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name.replace("_fsdp_wrapped_module.", "")] = full.detach().clone().cpu()
    return out


def snapshots_callback(model: torch.nn.Module, snapshots: list[dict[str, torch.Tensor]]) -> Any:
    """A ``TrainerCallback`` that appends :func:`snapshot` of ``model`` to ``snapshots`` before training
    and after every optimizer step (what :func:`sgd_gradients` reads)."""
    from transformers import TrainerCallback

    class Snapshots(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            snapshots.append(snapshot(model))

        def on_step_end(self, args, state, control, **kwargs):
            snapshots.append(snapshot(model))

    return Snapshots()


def sgd_gradients(snapshots: list[dict[str, torch.Tensor]], lr: float) -> list[dict[str, torch.Tensor]]:
    """The gradient each plain-SGD step applied, ``(p_before - p_after) / lr``, per parameter."""
    return [{k: (a[k].double() - b[k].double()) / lr for k in a} for a, b in zip(snapshots, snapshots[1:])]


def update_resolution(snapshot: dict[str, torch.Tensor], lr: float) -> dict[str, float]:
    """Per parameter, the smallest gradient difference an fp32 SGD update can show: one rounding step
    (machine epsilon) of the parameter's largest value, over ``lr``. A layer norm's weights near 1.0 read
    at lr 0.1 cannot resolve gradients closer than ~1.2e-6, whatever their own scale."""
    eps = torch.finfo(torch.float32).eps
    return {k: eps * v.abs().max().item() / lr for k, v in snapshot.items()}


def assert_gradients_close(got: list[dict[str, torch.Tensor]], ref: list[dict[str, torch.Tensor]],
                           rtol: float = 1e-4, resolution: dict[str, float] | None = None) -> None:
    """Per step and parameter, each on its own scale: ``|got - ref| <= rtol * max|ref| + 1e-8 * model max``
    (plus the parameter's :func:`update_resolution` when given)."""
    assert len(got) == len(ref) and got, (len(got), len(ref))
    for step, (g, r) in enumerate(zip(got, ref, strict=True)):
        assert g.keys() == r.keys(), (sorted(g), sorted(r))
        model_max = max(t.abs().max().item() for t in r.values())
        bad = []
        for name in r:
            err = (g[name] - r[name]).abs().max().item()
            tol = rtol * r[name].abs().max().item() + 1e-8 * model_max + (resolution or {}).get(name, 0.0)
            if err > tol:
                bad.append(f"{name} off by {err:.3e} > {tol:.3e} (scale {r[name].abs().max().item():.3e})")
        assert not bad, f"step {step + 1}: gradients differ:\n" + "\n".join(bad)


def assert_logs_close(got: list[dict[str, float]], ref: list[dict[str, float]], keys: tuple[str, ...],
                      rtol: float = 1e-5, atol_of: Callable[[dict[str, float], str], float] | None = None) -> None:
    """Each logged ``key`` of every step within ``rtol`` of the reference's, plus ``atol_of(ref_step, key)`` where a
    logged value is a difference of larger ones (DPO's rewards: its own scale says nothing of their rounding)."""
    assert len(got) == len(ref) and got, (got, ref)
    for step, (g, r) in enumerate(zip(got, ref, strict=True)):
        for key in keys:
            atol = atol_of(r, key) if atol_of is not None else 0.0
            assert abs(g[key] - r[key]) <= rtol * abs(r[key]) + 1e-12 + atol, \
                f"step {step + 1}: {key} {g[key]} vs SP=1 {r[key]} (all: {got} vs {ref})"


def zero2_config(sp: int) -> dict[str, Any]:
    """The DeepSpeed JSON of the TRL tests: ZeRO-2 for the SP = 1 reference and the SP run alike (its fp32
    gradient buffers round the same way in both); seqpar's block only where ``sp > 1``."""
    ds: dict[str, Any] = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                          "train_batch_size": "auto", "gradient_clipping": "auto", "zero_optimization": {"stage": 2},
                          "steps_per_print": 10**6}
    if sp > 1:
        ds["sequence_parallel"] = {"size": sp, "mode": "ring", "sharding": "zigzag"}
    return ds

