"""The fuzzer's ``trainer`` kind, run and judged: the data (:func:`trainer_data`) and model each rank rebuilds
from the draws, the installed runner (:func:`trainer_runner`), the plants, the pool task (:func:`trainer_task`),
the judging against one process (:func:`judge_trainer`) and :func:`run_trainer_case`. The draws are
:mod:`seqpar.testing.fuzz_trainers_draw`'s; what is drawn and why is :mod:`seqpar.testing.fuzz_trainers`' docstring.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from seqpar.testing.fuzz_trainers_draw import MOE_TYPES, TRAINERS, empty_rows, router_loss

# Each trainer's runner is the entry point of its name in setup.cfg; seqpar's are one function
# (seqpar.integrations.fuzz_trainer:run_trainer), which dispatches on the trainer name it is given
RUNNER_NAME = {name: name for name in TRAINERS}
ENTRY_POINT_GROUP = "seqpar.fuzz_trainers"
PLANTS = ("loss_over_world", "trl_loss_over_world", "lora_grad_over_world", "adapter_grad_over_world",
          "bias_grad_over_world", "rslora_ignored")
LR = 0.1
SFT_MAX_LENGTH = 24
# fp32 ranks against a float64 reference: the logged numbers, and each parameter's update on its own scale
# (plus one fp32 rounding step of the parameter per optimizer step: the update is read from fp32 parameters)
LOSS_RTOL = 2e-5
UPDATE_RTOL = 1e-4


# --------------------------------------------------------------------------------------------------
# Data (rebuilt on each rank from the draws: the same everywhere)
# --------------------------------------------------------------------------------------------------

PAD, USER, ASSISTANT, EOS = 0, 1, 2, 3  # the chat tokenizer's special tokens; words t4 .. t<VOCAB-1> are the rest
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}<u> {{ m['content'] }} "
    "{% else %}<a> {% generation %}{{ m['content'] }} <eos>{% endgeneration %} {% endif %}{% endfor %}"
)


def _tokenizer(padding_side: str = "right") -> Any:
    """A word-level tokenizer over the tiny models' vocabulary (one token per word ``t<id>``), with a chat
    template marking the assistant's tokens (``{% generation %}``): nothing is downloaded."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from seqpar.testing.tiny_models import VOCAB

    vocab = {"<pad>": PAD, "<u>": USER, "<a>": ASSISTANT, "<eos>": EOS, **{f"t{i}": i for i in range(4, VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                  padding_side=padding_side, model_input_names=["input_ids", "attention_mask"])
    tok.chat_template = CHAT_TEMPLATE
    return tok


class _Rows(torch.utils.data.Dataset):
    def __init__(self, items: list[dict[str, Any]]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.items[i]


def trainer_data(draws: dict[str, Any]) -> dict[str, Any]:
    """The case's data sets, collator and tokenizer (from ``data_seed``): ``{"train", "eval", "collator",
    "tokenizer"}`` as :func:`seqpar.integrations.fuzz_trainer.run_trainer` takes them. Evaluation: ``2 x dp``
    rows, one per rank and evaluation step (the reference takes ``dp`` rows a step: the global eval batch)."""
    import transformers

    from seqpar.testing.tiny_models import VOCAB

    g = torch.Generator().manual_seed(draws["data_seed"])
    n_eval = 2 * draws["dp"] if draws["evaluate"] else 0
    if draws["trainer"] in ("dpo", "grpo"):
        import datasets

        def text(n: int) -> str:
            return " ".join(f"t{i}" for i in torch.randint(4, VOCAB, (n,), generator=g).tolist())

        if draws["trainer"] == "grpo":
            rows = [{"prompt": text(n)} for n in draws["prompts"]]
            return {"train": datasets.Dataset.from_list(rows), "eval": None, "collator": None,
                    "tokenizer": _tokenizer("left")}
        # the prompt ends in a space: DPOTrainer joins prompt and completion texts as they are
        pairs = [{"prompt": text(p) + " ", "chosen": text(c), "rejected": text(r)} for p, c, r in draws["pairs"]]
        evals = [{"prompt": text(3) + " ", "chosen": text(4), "rejected": text(2)} for _ in range(n_eval)]
        return {"train": datasets.Dataset.from_list(pairs),
                "eval": datasets.Dataset.from_list(evals) if n_eval else None, "collator": None,
                "tokenizer": _tokenizer()}
    if draws["trainer"] == "sft":
        import datasets

        def words(n: int) -> str:
            return " ".join(f"t{i}" for i in torch.randint(4, VOCAB, (n,), generator=g).tolist())

        convs = [{"messages": [{"role": "user", "content": words(u)}, {"role": "assistant", "content": words(a)}]}
                 for u, a in draws["turns"]]
        evals = [{"messages": [{"role": "user", "content": words(3)}, {"role": "assistant", "content": words(4)}]}
                 for _ in range(n_eval)]
        return {"train": datasets.Dataset.from_list(convs), "eval": datasets.Dataset.from_list(evals) if n_eval else None,
                "collator": None, "tokenizer": _tokenizer()}

    def row(n: int, masked: int) -> dict[str, Any]:
        ids = torch.randint(4, VOCAB, (n,), generator=g).tolist()
        return {"input_ids": ids, "labels": [-100] * masked + ids[masked:]}

    train = [row(n, m) for n, m in zip(draws["lengths"], draws["masked"], strict=True)]
    for i in empty_rows(draws):  # a zero-length example (fz29), drawn after the rows: the others' tokens unchanged
        train[i] = {"input_ids": [], "labels": []}
    evals = [row(draws["lengths"][i % len(draws["lengths"])], 0) for i in range(n_eval)]
    collator = draws["collator"]
    tok = _tokenizer("left" if collator == "padded-left" else "right")
    if collator == "packed":
        fn = transformers.DataCollatorWithFlattening()
    elif collator.startswith("padded"):
        fn = transformers.DataCollatorForSeq2Seq(tok, padding=True, label_pad_token_id=-100)
    else:
        fn = None
    return {"train": _Rows(train), "eval": _Rows(evals) if n_eval else None, "collator": fn, "tokenizer": tok}


def _build_model(draws: dict[str, Any], dtype: torch.dtype) -> Any:
    from seqpar.testing.tiny_models import build_model

    model = build_model(draws["model_type"], dtype)
    model.config.use_cache = False
    if draws["model_type"] in MOE_TYPES:
        model.config.output_router_logits = router_loss(draws)
        # SFTTrainer turns the router loss on whenever the coefficient is not 0, whatever output_router_logits says
        model.config.router_aux_loss_coef = 0.5 if router_loss(draws) else 0.0
    return model


# --------------------------------------------------------------------------------------------------
# The pool task
# --------------------------------------------------------------------------------------------------

def trainer_runner(trainer: str) -> Any:
    """The installed runner of ``trainer`` (the entry point of that name in :data:`ENTRY_POINT_GROUP`).

    Raises:
        LookupError: none is installed (``pip install -e .`` declares seqpar's own).
    """
    from seqpar.testing.fuzz_engines_lookup import engine_runner

    return engine_runner(RUNNER_NAME.get(trainer, trainer), ENTRY_POINT_GROUP, "trainer runner", "run_trainer")


def _plant(name: str | None, world: int, sp: int) -> Any:
    """A deliberately broken composition, for the fuzzer's own tests (undo callable returned):
    ``"lora_grad_over_world"``: every LoRA adapter's gradient times ``dp / world`` (:func:`_plant_lora_grad`);
    ``"trl_loss_over_world"``: DPOTrainer's and GRPOTrainer's own ``compute_loss`` (which seqpar's adapters wrap)
    times ``sp / world`` (the loss divided by the world instead of SP: at DP > 1 every gradient ``1 / dp`` of one
    process's); ``"loss_over_world"``: ``transformers.Trainer.compute_loss``'s result times ``sp / world``, so that
    SeqParTrainer's division of Trainer's process-count factor by ``sp`` divides by the world instead (the
    gradient is ``1 / dp`` of one process's; the ``trainer`` trainer, DP > 1 shows it)."""
    if name is None:
        return lambda: None
    if name not in PLANTS:
        raise ValueError(f"unknown plant {name!r}: choose from {list(PLANTS)}")
    import transformers

    if name == "lora_grad_over_world":
        return _plant_lora_grad((world // sp) / world)  # dp / world
    if name == "adapter_grad_over_world":
        return _plant_adapter_grad((world // sp) / world)
    if name == "bias_grad_over_world":
        return _plant_bias_grad((world // sp) / world)
    if name == "rslora_ignored":
        return _plant_rslora_ignored()

    def scaled(original: Any) -> Any:
        def compute_loss(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, *args, **kwargs)
            if isinstance(result, tuple):
                return (result[0] * sp / world, *result[1:])
            return result * sp / world
        return compute_loss

    if name == "trl_loss_over_world":
        # DPOTrainer's / GRPOTrainer's own compute_loss (what seqpar's adapters call) times sp / world
        import trl

        return _patch((trl.DPOTrainer, trl.GRPOTrainer), "compute_loss", scaled)
    return _patch((transformers.Trainer,), "compute_loss", scaled)


def _patch(classes: tuple[type, ...], name: str, planted: Any) -> Any:
    """Replace the method ``name`` of each class in ``classes`` (its own, in its ``__dict__``) by
    ``planted(original)``, the plants' one way to install; the undo callable (restoring each) returned."""
    originals = {cls: cls.__dict__[name] for cls in classes}
    for cls, original in originals.items():
        setattr(cls, name, planted(original))

    def undo() -> None:
        for cls, original in originals.items():
            setattr(cls, name, original)
    return undo


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the incoming gradient times ``factor`` backward (a planted bug)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


def _plant_lora_grad(factor: float) -> Any:
    """``"lora_grad_over_world"``: every LoRA adapter's gradient times ``dp / world`` (= ``1 / sp``: divided by the
    world where DP is due, or an SP share left unsummed). The forward is unchanged (the logged loss is right); the
    gradient flowing into each ``lora_B`` output is scaled, so A's and B's gradients (and what flows on through the
    adapter branch) are. Undo callable returned."""
    from peft.tuners.lora import layer

    def planted(original: Any) -> Any:
        def forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            handles = [m.register_forward_hook(lambda mod, inp, out: _ScaleGrad.apply(out, factor))
                       for m in self.lora_B.values()]
            try:
                return original(self, x, *args, **kwargs)
            finally:
                for h in handles:
                    h.remove()
        return forward

    return _patch((layer.Linear,), "forward", planted)


def _plant_adapter_grad(factor: float) -> Any:
    """``"adapter_grad_over_world"``: the gradient of every LoRA layer's adapter branch (its output less its base
    layer's: A, B, DoRA's magnitude, on ``nn.Linear`` and ``nn.Embedding`` alike) times ``factor`` (``dp / world``);
    the forward unchanged (to a rounding). Undo callable returned."""
    from peft.tuners.lora import layer

    def planted(original: Any) -> Any:
        def forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            out = original(self, x, *args, **kwargs)
            if not torch.is_grad_enabled() or self.disable_adapters:
                return out
            base = self.base_layer(x, *args, **{k: v for k, v in kwargs.items() if k != "adapter_names"})
            return base + _ScaleGrad.apply(out - base, factor)
        return forward

    return _patch((layer.Linear, layer.Embedding), "forward", planted)


def _plant_bias_grad(factor: float) -> Any:
    """``"bias_grad_over_world"``: every trainable ``nn.Linear`` bias's gradient times ``factor`` (``dp / world``;
    LoRA's ``bias="lora_only"`` / ``"all"``), the forward unchanged. Undo callable returned."""
    def planted(original: Any) -> Any:  # the original is restored by the undo, not called
        def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
            bias = self.bias
            if bias is not None and bias.requires_grad and torch.is_grad_enabled():
                bias = _ScaleGrad.apply(bias, factor)
            return torch.nn.functional.linear(x, self.weight, bias)
        return forward

    return _patch((torch.nn.Linear,), "forward", planted)


def _plant_rslora_ignored() -> Any:
    """``"rslora_ignored"``: ``use_rslora`` dropped when peft builds an adapter (its scale ``alpha / r``, not
    ``alpha / sqrt(r)``). Undo callable returned."""
    from peft.tuners.lora import layer

    def planted(original: Any) -> Any:
        def update_layer(self: Any, adapter_name: str, r: int, lora_alpha: int, *args: Any, **kwargs: Any) -> Any:
            result = original(self, adapter_name, r, lora_alpha, *args, **kwargs)
            self.scaling[adapter_name] = lora_alpha / r
            return result
        return update_layer

    return _patch((layer.LoraLayer, layer.Embedding), "update_layer", planted)


def trainer_task(ctx: Any, draws: dict[str, Any], role: str, dtype_name: str, plant: str | None = None) -> dict[str, Any]:
    """Pool task (every rank): the case's trainer, ``role`` ``"seqpar"`` (the drawn engine and SP block, on the
    case's world) or ``"reference"`` (the trainer without seqpar on one process, the global batch per step).
    Every rank returns ``{"ok": True, "logs", "evals", "dp_sp"}``, rank 0 the parameter snapshots too
    (``before``, ``after``); ``{"ok": False, "error"}`` on an exception."""
    import warnings

    import transformers

    from seqpar.testing.deepspeed_teardown import released_deepspeed_engines
    from seqpar.testing.fuzz_engines_lookup import runner_dir
    from seqpar.testing.launcher_env import launcher_env
    from seqpar.testing.verdicts import error_record

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    env = contextlib.ExitStack()
    env.enter_context(launcher_env(ctx.rank, ctx.world_size))
    runner = None
    undo = _plant(plant if role == "seqpar" else None, draws["world"], draws["sp"])
    try:
        runner = trainer_runner(draws["trainer"])
        reference = role == "reference"
        knobs = {"micro": draws["micro"] * (draws["dp"] if reference else 1), "accumulation": draws["accumulation"],
                 "steps": draws["steps"], "lr": LR, "max_grad_norm": draws["max_grad_norm"],
                 "average_tokens": draws["average_tokens"], "label_smoothing": draws["label_smoothing"],
                 "eval_batch": draws["dp"] if reference else 1}
        if draws["trainer"] == "sft":
            knobs.update(packing=draws["packing"], padding_free=draws["padding_free"],
                         assistant_only_loss=draws["assistant_only_loss"], loss_type=draws["loss_type"],
                         # TRL refuses max_length with padding_free and no packing (it would not truncate)
                         max_length=SFT_MAX_LENGTH if draws["packing"] or not draws["padding_free"] else None)
        if draws["trainer"] == "dpo":
            knobs.update({k: draws[k] for k in ("dpo_loss", "loss_weights", "dpo_smoothing", "beta", "ld_alpha",
                                                "use_weighting", "ref_model", "sync_ref_model", "precompute_ref")})
        if draws["trainer"] == "grpo":
            knobs.update({k: draws[k] for k in ("num_generations", "num_iterations", "scale_rewards", "grpo_loss",
                                                "beta", "epsilon", "rewards", "reward_weights",
                                                "max_completion_length")})
        knobs["lora"] = draws["lora"] if draws.get("peft") else None
        if knobs["lora"] is not None and "sync_ref_model" in knobs:
            knobs["sync_ref_model"] = False  # --set peft=true on a TR-DPO case: DPOTrainer's own refusal otherwise
        config = {"size": draws["sp"], "mode": draws["mode"], "sharding": draws["sharding"]}
        if draws.get("dkv_wire") and not reference:  # the bf16 dK/dV wire (fz33), as a user's block sets it
            config["dkv_wire_dtype"] = draws["dkv_wire"]
        model = _build_model(draws, getattr(torch, dtype_name))
        with warnings.catch_warnings(), released_deepspeed_engines():
            warnings.simplefilter("ignore")
            out = runner(draws["trainer"], "plain" if reference else draws["engine"], model, trainer_data(draws),
                         knobs, config)
        if ctx.rank != 0:
            out = {**out, "before": None, "after": None}
        return {"ok": True, **out}
    except Exception as e:  # noqa: BLE001 - classified by the driver
        return {"ok": False, "error": error_record(e, also=() if runner is None else (runner_dir(runner),))}
    finally:
        undo()
        env.close()
        transformers.logging.set_verbosity(verbosity)


# --------------------------------------------------------------------------------------------------
# Verdict
# --------------------------------------------------------------------------------------------------

# The logged metrics judged beside the loss (and grad_norm): those seqpar promises equal to one process's
# (integrations/trl.py; tests/test_trl_dpo.py, tests/test_trl_grpo.py). A key ending in "/" stands for every logged
# key under it (GRPO's per-reward-function mean and std).
METRICS = {
    "dpo": ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
            "logps/rejected", "entropy", "logits/chosen", "logits/rejected", "mean_token_accuracy", "num_tokens"),
    "grpo": ("kl", "entropy", "clip_ratio/", "reward", "reward_std", "rewards/", "completions/mean_length",
             "num_tokens"),
}


def _floor(draws: dict[str, Any], key: str, ref_log: dict[str, Any]) -> float:
    """The absolute difference below which a logged number counts as equal (its own relative tolerance above):
    a number that is a small difference of large ones carries their rounding. DPO's rewards and margins are
    ``beta x`` differences of per-sequence log-prob sums (0 at the first step, the policy being its reference);
    GRPO's loss is a mean of advantages (0 at the first step with group scaling, the advantages summing to 0 in
    each group) of the rewards' scale, and ``kl`` a difference of log-probs (0 at the first step); DPO's mean
    logits are means of logits that cancel, judged within ``LOSS_RTOL x 0.01`` absolute too."""
    if draws["trainer"] == "dpo" and key.startswith("rewards/") and key != "rewards/accuracies":
        scale = max(abs(ref_log.get("logps/chosen", 0.0)), abs(ref_log.get("logps/rejected", 0.0)))
        return LOSS_RTOL * draws["beta"] * scale
    if draws["trainer"] == "dpo" and key.startswith("logits/"):
        # the mean logit over the vocabulary and the completion tokens: ~1e-3, a sum of logits of order 0.1-1 that
        # cancel (fp32 rounding of the sum 2e-10 in case 647925007, 5.8e-5 of the mean)
        return LOSS_RTOL * 1e-2
    if draws["trainer"] == "grpo" and key in ("loss", "kl"):
        return LOSS_RTOL * max(1.0, abs(ref_log.get("reward", 0.0)))
    return 0.0


def _rel(got: float, ref: float) -> float:
    return abs(got - ref) / max(abs(ref), 1e-30)


def judge_trainer(draws: dict[str, Any], ref: dict[str, Any], per_rank: list[dict[str, Any]]) -> tuple[str, str]:
    """``("exact" | "WRONG", detail)``: every rank logged the reference's steps (loss within :data:`LOSS_RTOL`
    relative, ``grad_norm`` too when clipping) and evaluations; rank 0's total update of every parameter,
    ``before - after``, within ``UPDATE_RTOL x`` that parameter's reference update ``+ 1e-8 x`` the model's
    largest update ``+ steps x`` one fp32 rounding step of the parameter (its largest value x eps). A WRONG
    detail names the first problem of each sort (logs, updates), so a wrong logged number with right updates
    (a logging error) reads apart from wrong updates.

    ``dkv_wire`` (fz33, ``dkv_wire_dtype: "bf16"``): the gradients are off by up to ``bound``
    (:func:`~seqpar.testing.fuzz_models.kind_dkv_wire_bound`) of their norm, so what follows a backward is judged at
    it: ``grad_norm``, every number logged after the first step and every evaluation within ``bound`` relative (an
    SGD step moves the next loss by ``lr g.dg``, at most ``lr |g|^2 bound``, less than the loss's own decrease times
    the bound), each parameter's update within ``min(0.5, steps x bound)`` of its norm plus the exact allowance in
    norm. The first step's forward numbers (its loss, DPO's and GRPO's metrics) stay exact: the wire is the
    backward's."""
    wire = 0.0
    if draws.get("dkv_wire"):
        from seqpar.testing.fuzz_models import decoder_layers, kind_dkv_wire_bound

        wire = kind_dkv_wire_bound(draws["sp"], decoder_layers(draws["model_type"]))
    n_logs = len(ref["logs"])
    if n_logs != draws["steps"]:
        return "WRONG", f"the reference logged {n_logs} steps, not {draws['steps']}"
    problems: list[str] = []
    worst = ("", 0.0)
    for rank, r in enumerate(per_rank):
        if len(r["logs"]) != n_logs or len(r["evals"]) != len(ref["evals"]):
            return "WRONG", (f"rank {rank} logged {len(r['logs'])} steps and {len(r['evals'])} evaluations "
                             f"(reference {n_logs}, {len(ref['evals'])})")
        keys = ("loss", "grad_norm", *METRICS.get(draws["trainer"], ()))
        pairs = [(f"step {i + 1}: {key}", g.get(key, float("nan")), e[key], _floor(draws, key, e),
                  max(LOSS_RTOL, wire) if i or key == "grad_norm" else LOSS_RTOL)
                 for i, (g, e) in enumerate(zip(r["logs"], ref["logs"], strict=True))
                 for key in keys if (key in e or key.endswith("/")) and (key != "grad_norm" or draws["max_grad_norm"])
                 for key in ([key] if not key.endswith("/") else sorted(k for k in e if k.startswith(key)))]
        pairs += [(f"evaluation {i + 1}: eval_loss", g["eval_loss"], e["eval_loss"], 0.0, max(LOSS_RTOL, wire))
                  for i, (g, e) in enumerate(zip(r["evals"], ref["evals"], strict=True))]
        for what, g, e, floor, rtol in pairs:
            # (a NaN, or a number missing on one side, is never within the floor)
            rel = 0.0 if abs(float(g) - float(e)) <= floor else _rel(float(g), float(e))
            if not rel <= rtol:
                problems.append(f"rank {rank} {what} {g} vs {e} ({rel:.1e} relative, tol {rtol:.0e})")
                break
            worst = max(worst, (what.split(": ")[1], rel), key=lambda x: x[1])
        if problems:
            break
    got = per_rank[0]
    if set(got["before"]) != set(ref["before"]):
        return "WRONG", f"parameters on one side only: {sorted(set(got['before']) ^ set(ref['before']))[:4]}"
    eps = torch.finfo(torch.float32).eps
    deltas = {n: ref["before"][n].double() - ref["after"][n].double() for n in ref["before"]}
    model_max = max(float(d.abs().max()) for d in deltas.values())
    if model_max == 0.0 and draws["trainer"] != "grpo":
        return "WRONG", "the reference did not move any parameter"
    if draws.get("peft"):
        # LoRA: the same parameters train on both sides, only adapters (and modules_to_save's copies), and every
        # frozen one (the base weights, the originals of modules_to_save) is bit-for-bit where it started
        trainable = set(got.get("trainable", ()))
        if trainable != set(ref.get("trainable", ())) or not trainable:
            return "WRONG", (f"trainable parameters differ: {sorted(trainable ^ set(ref.get('trainable', ())))[:4]}"
                             if trainable else "no trainable parameter under LoRA")
        bias = draws["lora"].get("bias", "none") if draws.get("lora") else "none"
        # bias="all": every bias trains; "lora_only": the adapted layers' (their base_layer's) biases
        biases = (lambda n: n.endswith(".bias")) if bias == "all" else \
            (lambda n: n.endswith(".base_layer.bias")) if bias == "lora_only" else (lambda n: False)
        stray = sorted(n for n in trainable if "lora_" not in n and ".modules_to_save." not in n and not biases(n))
        if stray:
            return "WRONG", f"base parameters trainable under LoRA: {stray[:4]}"
        for name in sorted(set(deltas) - trainable):
            moved = float((got["before"][name] - got["after"][name]).abs().max())
            if moved or float(deltas[name].abs().max()):
                return "WRONG", f"frozen {name} moved by {moved:.1e} (reference {float(deltas[name].abs().max()):.1e})"
    # GRPO without KL (beta 0) whose groups each scored their completions alike has every advantage 0 and moves
    # nothing: seqpar's run must not move anything either (the tolerance below is then one rounding step)
    for name, d_ref in deltas.items():
        start = ref["before"][name].double()
        # DoRA's magnitude is not drawn but computed at init, in the model's dtype, as the norm of each row of
        # W + scale x BA (fp32 on the ranks: 1.2 eps of the largest norm, ~39, on embed_tokens, case 1171 with DoRA)
        slack = 4 if "lora_magnitude_vector" in name else 1
        if float((got["before"][name].double() - start).abs().max()) > slack * eps * float(start.abs().max()) + 1e-12:
            return "WRONG", f"{name} differs before training (the case's models are not the same)"
        d_got = got["before"][name].double() - got["after"][name].double()
        own = float(d_ref.abs().max())
        tol = UPDATE_RTOL * own + 1e-8 * model_max + draws["steps"] * eps * float(start.abs().max())
        diff = float((d_got - d_ref).abs().max())
        if wire:  # the bf16 wire: in norm, within the steps' bound of the update's norm (docstring)
            tol = min(0.5, draws["steps"] * wire) * float(d_ref.norm()) + d_ref.numel() ** 0.5 * tol
            diff = float((d_got - d_ref).norm())
        if not diff <= tol:
            problems.append(f"update of {name} off by {diff / max(own, 1e-300):.1e} of its max "
                            f"(tol {tol / max(own, 1e-300):.1e})")
            break
        worst = max(worst, (f"update {name}", diff / tol if tol else 0.0), key=lambda x: x[1])  # tol 0: nothing moved (a zero-init LoRA B)
    if problems:
        return "WRONG", "; ".join(problems) + ("" if len(problems) > 1 else " (the other checks pass)")
    return "exact", f"worst {worst[0]} {worst[1]:.1e} (logs: relative error; updates: of the tolerance)"


def run_trainer_case(pools: Any, draws: dict[str, Any], timeout: float, plant: str | None = None) -> tuple[str, str]:
    """Verdict and detail of a ``trainer`` case: the seqpar run on the case's world first (a refusal or crash
    decides there), then the reference on one process (``"skipped"`` when it cannot run), then
    :func:`judge_trainer`."""
    from seqpar.testing.verdicts import classify_errors

    if draws["world"] != draws["dp"] * draws["sp"]:  # fuzz.force re-derives or skips a forced split: a bug
        raise ValueError(f"trainer draws inconsistent: world {draws['world']} != dp {draws['dp']} x sp {draws['sp']}")
    per_rank = pools.run(draws["world"], trainer_task, draws, "seqpar", "float32", plant, timeout=timeout)
    bad = classify_errors(per_rank)
    if bad is not None:
        return bad
    ref = pools.run(1, trainer_task, draws, "reference", "float64", timeout=timeout)[0]
    if not ref["ok"]:
        return "skipped", f"cannot run without seqpar: {ref['error']['type']}: {ref['error']['message'][:200]}"
    return judge_trainer(draws, ref, per_rank)
