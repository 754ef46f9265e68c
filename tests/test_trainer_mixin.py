"""The seqpar mixin under any ``transformers.Trainer`` subclass (issue 33 §1, §5): its place in the MRO
is checked, and a loss seqpar does not know to be SP-exact is refused by name at construction, with
what to do. No process group is needed: every check runs before the groups are built.
"""

from __future__ import annotations

import types

import hf_tiny
import pytest
import transformers
from test_trainer import ds_config

from seqpar.config import ConfigError
from seqpar.integrations.trainer import SeqParTrainer, SequenceParallelMixin, sequence_parallel


def _args(tmp, **extra):
    args = transformers.TrainingArguments(output_dir=str(tmp), report_to=[], use_cpu=True, **extra)
    args.deepspeed = ds_config(2, 2)  # as if given; set after construction so no DeepSpeed state is made
    return args


def test_sequence_parallel_composes_once_with_the_mixin_first():
    trl = pytest.importorskip("trl")
    cls = sequence_parallel(trl.SFTTrainer)
    assert cls is sequence_parallel(trl.SFTTrainer) and cls.__name__ == "SeqParSFTTrainer"
    # the mixin first, then its own bases (the save/resume overrides), then the Trainer class
    assert cls.__mro__[1:3 + len(SequenceParallelMixin.__bases__)] == (
        SequenceParallelMixin, *SequenceParallelMixin.__bases__, trl.SFTTrainer)
    assert sequence_parallel(transformers.Trainer) is SeqParTrainer
    assert sequence_parallel(SeqParTrainer) is SeqParTrainer
    with pytest.raises(TypeError, match="transformers.Trainer subclass"):
        sequence_parallel(object)


def test_a_trainer_class_ahead_of_the_mixin_is_refused():
    """Refused at the class statement: SFTTrainer's __init__ and compute_loss would run before seqpar's."""
    trl = pytest.importorskip("trl")
    with pytest.raises(ConfigError, match=r"SFTTrainer comes before seqpar's mixin.*sequence_parallel\(SFTTrainer\)"):
        class Accidental(trl.SFTTrainer, SeqParTrainer):
            pass
    with pytest.raises(ConfigError, match="SequenceParallelMixin must come before a transformers.Trainer"):
        class Behind(transformers.Trainer, SequenceParallelMixin):
            pass

    class Fine(SeqParTrainer):  # a subclass of the composed class: the mixin still runs first
        pass


def test_a_compute_loss_that_reads_the_logits_is_refused_by_name(tmp_path):
    """The subclass reads full-sequence logits itself: under SP they are one shard's, so it is refused
    (at construction) naming the method and the two ways out."""

    class ReadsLogits(SeqParTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            logits = model(**{k: v for k, v in inputs.items() if k != "labels"}).logits
            return logits.logsumexp(-1).mean()

    with pytest.raises(ConfigError, match=r"ReadsLogits.compute_loss is not known to seqpar.*one shard.*"
                                          r"sequence_parallel_mean.*seqpar_exact_loss = True on .*ReadsLogits"):
        ReadsLogits(model=hf_tiny.tiny_llama(), args=_args(tmp_path))

    class Declared(ReadsLogits):
        seqpar_exact_loss = True  # the user says the loss is reduced over the SP group

    assert Declared._seqpar_loss_path(object.__new__(Declared), _args(tmp_path), {}) is None

    class Wrapped(transformers.Trainer):  # composed through sequence_parallel: the mixin comes first
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return model(**inputs).logits.mean()

    with pytest.raises(ConfigError, match="Wrapped.compute_loss is not known to seqpar"):
        sequence_parallel(Wrapped)(model=hf_tiny.tiny_llama(), args=_args(tmp_path))


def test_logit_reading_options_and_unhandled_trl_trainers_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="compute_loss_func= computes the loss from the model's logits"):
        SeqParTrainer(model=hf_tiny.tiny_llama(), args=_args(tmp_path), compute_loss_func=lambda *a, **k: 0)
    with pytest.raises(ConfigError, match="label_smoothing_factor > 0.*set label_smoothing_factor=0"):
        SeqParTrainer(model=hf_tiny.tiny_llama(), args=_args(tmp_path, label_smoothing_factor=0.1))
    trl = pytest.importorskip("trl")
    # Their losses are per-sequence sums of per-token log-probs, which a shard holds only part of: no adapter
    # yet (seqpar.integrations.trl), so refused rather than trained on one shard's sums.
    for name, module in (("RLOOTrainer", "rloo_trainer"), ("KTOTrainer", "kto_trainer")):
        with pytest.raises(ConfigError, match=rf"trl.trainer.{module}.{name}.compute_loss is not known"):
            sequence_parallel(getattr(trl, name))(model=hf_tiny.tiny_llama(), args=_args(tmp_path))
    # DPO is handled (tests/test_trl_dpo.py) but for its precomputed reference log-probs, whose pass gathers
    # per-row results over every process (each SP group's rows SP times); refused before any group is built,
    # with args in DPOTrainer's third place (model, ref_model, args) found by name
    args = trl.DPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, precompute_ref_log_probs=True)
    args.deepspeed = ds_config(2, 2)
    with pytest.raises(ConfigError, match="precompute_ref_log_probs=True under sequence parallelism.*Set "
                                          "precompute_ref_log_probs=False"):
        sequence_parallel(trl.DPOTrainer)(hf_tiny.tiny_llama(), None, args)


@pytest.mark.parametrize(("setting", "said"), [
    ({"scale_rewards": "batch"}, "scale_rewards='batch'.*use scale_rewards='group'"),
    ({"multi_objective_aggregation": "normalize_then_sum"}, "normalize_then_sum.*'sum_then_normalize'"),
    ({"use_vllm": True}, "use_vllm=True under sequence parallelism.*set use_vllm=False"),
    ({"top_entropy_quantile": 0.5}, "top_entropy_quantile < 1.*set top_entropy_quantile=1.0"),
    # as GRPOConfig makes it on 2 processes: generation_batch_size 3 x 2 x 1, a group across the ranks
    ({"per_device_train_batch_size": 3, "num_generations": 2, "generation_batch_size": 6, "steps_per_generation": 1},
     r"whole prompt groups on each rank.*\(3\).*num_generations \(2\)"),
])
def test_grpo_settings_that_reduce_over_copies_are_refused(tmp_path, setting, said):
    """GRPO (tests/test_trl_grpo.py) but for what reduces over every process's rows (each SP group's rows SP
    times) in a way a copy changes, or generates outside the model: refused before any group is built."""
    trl = pytest.importorskip("trl")
    setting = dict(setting)
    steps = setting.pop("steps_per_generation", None)
    args = trl.GRPOConfig(**{"output_dir": str(tmp_path), "report_to": [], "use_cpu": True,
                             "per_device_train_batch_size": 4, "num_generations": 2, **setting})
    if steps is not None:
        args.steps_per_generation = steps
    args.deepspeed = ds_config(2, 2)
    with pytest.raises(ConfigError, match=said):
        sequence_parallel(trl.GRPOTrainer)(hf_tiny.tiny_llama(), lambda completions, **kw: [0.0], args)


def test_fsdp_through_accelerate_is_refused_with_the_fix(tmp_path):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    args.fsdp = "full_shard"
    with pytest.raises(ConfigError, match="drop fsdp= and pass seqpar_config"):
        SeqParTrainer(model=hf_tiny.tiny_llama(), args=args, seqpar_config={"size": 2})


def test_grpo_refuses_a_model_with_absolute_positions(tmp_path):
    """GRPO's left-padded rows are rotated before the cut, which shifts their positions: exact for rotary
    models only (tests/test_trl_grpo.py: Llama), so a GPT-2 (learned ``wpe``) is refused by name."""
    trl = pytest.importorskip("trl")
    from seqpar.integrations.trl import GRPOLoss

    args = trl.GRPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, per_device_train_batch_size=4,
                          num_generations=2)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2))
    with pytest.raises(ConfigError, match=r"rotary-embedding models only \(GPT2LMHeadModel has no rotary"):
        GRPOLoss().before_swap(args, gpt2, manager=None)
    GRPOLoss().before_swap(args, hf_tiny.tiny_llama(), manager=types.SimpleNamespace(dp_size=1))

