"""Length-aware dynamic CP on every model family (issue 32 §2, §4): each swapped layer takes its SP group from
the call, and ``launch/train.py --dynamic`` equals one process on a Llama, a Mixtral with router loss, an MLA
model and a Jamba.

Layers (4 gloo ranks): the model is swapped over a group other than the one its calls carry, as under dynamic
CP, where the swap's group is the manager's and each micro-batch carries its own. Ranks 0 and 1 run one
document over the pair {0, 1}, ranks 2 and 3 another over {2, 3}. Each rank's loss, and its gradients summed
over its pair, equal the float64 one-process run of its pair's document.

- ALiBi (BLOOM, MPT, Falcon): swapped over the whole world. Its attention and its bias's global key positions
  follow the pair's group. Seen failing with ``install_alibi``'s forwards on ``options.group`` (the swap's):
  a ring over all 4 ranks mixes both pairs' documents; BLOOM's embedding gradient is 5.4e-3 of its scale
  off (the loss of a freshly initialised model, about ln(vocab), moves by 7e-6 only: the gradients catch it).
- MLA with aux-loss-free routing (DeepSeek-V3): swapped over each rank's own group of one, as a manager of SP
  size 1 (a DP pool) would give it. The latent transfer runs over the call's pair: ``expand_kv`` decides on
  the call's group, and every MLA layer's latent verdict is taken. ``ExpertCounter`` (given the rank's group
  of one) sums the routed counts over the pair, so they equal one process's counts of the pair's document.
  Seen failing: with ``_ring_will_run`` reading ``options.group`` the verdicts stay None (K/V move expanded,
  still exact, so only the verdicts show it); with the hooks holding no group in the backward's recompute
  (activation checkpointing is on), a CheckpointError (the recompute moves K/V expanded); with the counter
  all-reducing over its own ``group``, each rank's counts are its shard's alone ([3, 1, 4, 8] vs one
  process's [4, 7, 5, 16]).

Launcher: one pool task at 4 ranks runs ``launch/train.py --dynamic`` (FSDP2) for the four families, with the
launcher's AdamW replaced by plain SGD in the ranks and in the reference (AdamW hides a factor of P in the
gradients; with SGD a wrong gradient changes step 2's loss), clipping off; step 1's reduced gradients are compared
too, each parameter on its own scale (one parameter's gradient x2 leaves the losses within their tolerance). The reference is one process
running each step's planned micro-batches in sequence, packed, accumulating gradients, each micro-batch's
loss its targets' summed loss over the step's targets plus (Mixtral) its own router loss. Seen failing, one
break at a time: the backward's loss multiplier scaled by 4 (then in the launcher's ``_dynamic_step``, now
``seqpar.integrations.dynamic.run_dynamic_step``; a factor of P: Llama's step-2 loss 4.39 vs 2.89); the
router-loss frame on the swap's group (Mixtral step 1: 8.2300 vs 8.2363); the mixers' ``group`` on the swap's
(Jamba: a ValueError naming the boundaries); the MLA latent attention resolved on the manager's group (a
ValueError naming the boundaries). The model block's ``"architecture"`` key (``launch/train.py``) picks each
family; an unknown one is refused by name (tests/test_train.py).
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")

from seqpar.config import SeqParConfig  # noqa: E402
from seqpar.sequence.batch import shard_batch  # noqa: E402
from seqpar.sequence.call_group import GROUP_KEY  # noqa: E402
from seqpar.swap import swap_attention  # noqa: E402

VOCAB = 61
SEQ = 16  # tokens of each pair's document


def _documents() -> list[torch.Tensor]:
    """Pair k's document ``(1, SEQ)``: fresh random tokens, one per pair."""
    g = torch.Generator().manual_seed(321)
    return [torch.randint(3, VOCAB, (1, SEQ), generator=g) for _ in range(2)]


def _pairs() -> tuple[list, int]:
    """The groups {0, 1} and {2, 3} (every rank creates both) -> (both, this rank's pair index)."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    return pairs, dist.get_rank() // 2


def _check_grads(model: torch.nn.Module, ref: dict[str, torch.Tensor], group, what: str) -> None:  # noqa: ANN001
    """Every gradient summed over ``group`` equals the reference's, judged on its own scale."""
    for name, p in model.named_parameters():
        grad = torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
        dist.all_reduce(grad, group=group)
        want = ref[name]
        scale = float(want.abs().max()) or 1.0
        err = float((grad.double() - want).abs().max()) / scale
        assert err <= 1e-4, f"{what}: grad of {name} is {err:.3g} of its scale off"


def _reference(build, ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor], torch.nn.Module]:  # noqa: ANN001
    ref = build(torch.float64)
    out = ref(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    grads = {n: (torch.zeros_like(p) if p.grad is None else p.grad.clone()) for n, p in ref.named_parameters()}
    return float(out.loss), grads, ref


# ----------------------------------------------------------------------------------------------- ALiBi
def _alibi(kind: str, dtype: torch.dtype) -> torch.nn.Module:
    import test_hf_alibi

    return test_hf_alibi.build(kind, dtype)


def _alibi_pairs(rank: int, world: int) -> None:
    import functools

    pairs, mine = _pairs()
    ids = _documents()[mine]
    for kind in ("bloom", "mpt", "falcon"):
        build = functools.partial(_alibi, kind)
        ref_loss, ref_grads, _ = _reference(build, ids)
        model = build(torch.float32)
        # swapped over the whole world (the manager's group); each call carries its pair
        swap_attention(model, SeqParConfig(size=world, mode="ring", sharding="zigzag"), group=dist.group.WORLD)
        local = shard_batch({"input_ids": ids, "labels": ids}, group=pairs[mine], sharding="zigzag")
        out = model(**local, use_cache=False, **{GROUP_KEY: pairs[mine]})
        out.loss.backward()
        assert abs(float(out.loss) - ref_loss) <= 1e-5 * ref_loss, (kind, rank, float(out.loss), ref_loss)
        _check_grads(model, ref_grads, pairs[mine], f"{kind} rank {rank}")


@pytest.mark.timeout(240)
def test_alibi_takes_the_call_group(dist_pool) -> None:
    dist_pool.run(4, _alibi_pairs, timeout=200)


# ---------------------------------------------------------------------------- MLA and ExpertCounter
def _deepseek_v3(dtype: torch.dtype) -> torch.nn.Module:
    """test_mla_models' tiny DeepSeek-V3 (MLA, MoE after one dense layer) with a random ``e_score_correction_bias``."""
    from test_mla_models import tiny_mla

    model = tiny_mla("deepseek_v3", dtype)
    with torch.no_grad():
        g = torch.Generator().manual_seed(5)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=g, dtype=torch.float64).to(buf.dtype) * 0.1)
    return model


def _mla_pairs(rank: int, world: int) -> None:
    from seqpar.swap import moe
    from seqpar.swap.mla import mla_dims

    pairs, mine = _pairs()
    alone = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    ids = _documents()[mine]
    ref_loss, ref_grads, ref = _reference(_deepseek_v3, ids)
    ref_counts = moe.ExpertCounter(ref, group=alone[rank])  # one process: the document's counts
    with torch.no_grad():
        ref(input_ids=ids, use_cache=False)

    model = _deepseek_v3(torch.float32).train()
    # the backward recomputes each layer: expand_kv must see the call's group again there
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # the swap's (and the counter's) group is this rank alone, a manager of SP size 1; each call carries its pair
    swap_attention(model, SeqParConfig(size=1, mode="ring", sharding="zigzag", mla_transfer="latent"),
                   group=alone[rank])
    counter = moe.ExpertCounter(model, group=alone[rank])
    local = shard_batch({"input_ids": ids, "labels": ids}, group=pairs[mine], sharding="zigzag")
    out = model(**local, use_cache=False, **{GROUP_KEY: pairs[mine]})
    out.loss.backward()
    assert abs(float(out.loss) - ref_loss) <= 1e-5 * ref_loss, (rank, float(out.loss), ref_loss)
    _check_grads(model, ref_grads, pairs[mine], f"deepseek_v3 rank {rank}")
    layers = [m for m in model.modules() if mla_dims(m) is not None]
    assert len(layers) == 2 and all(m.__dict__.get("_seqpar_latent_ok") is True for m in layers), \
        [m.__dict__.get("_seqpar_latent_ok") for m in layers]  # the latent ring ran over the pair
    assert set(counter.counts) == set(ref_counts.counts) and counter.counts, counter.counts
    for name, counts in counter.counts.items():
        assert torch.equal(counts, ref_counts.counts[name]), (rank, name, counts, ref_counts.counts[name])


@pytest.mark.timeout(240)
def test_mla_and_expert_counts_take_the_call_group(dist_pool) -> None:
    dist_pool.run(4, _mla_pairs, timeout=200)


# ------------------------------------------------------------------------ launch/train.py --dynamic
BASE = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
FAMILIES = {
    "llama": {**BASE, "intermediate_size": 64, "num_key_value_heads": 2},
    "mixtral": {**BASE, "architecture": "mixtral", "intermediate_size": 48, "num_key_value_heads": 2,
                "num_local_experts": 4, "num_experts_per_tok": 2, "output_router_logits": True,
                "router_aux_loss_coef": 0.5},
    "deepseek_v3": {**BASE, "architecture": "deepseek_v3", "intermediate_size": 48, "moe_intermediate_size": 16,
                    "num_key_value_heads": 4, "q_lora_rank": 16, "kv_lora_rank": 12, "qk_rope_head_dim": 4,
                    "qk_nope_head_dim": 6, "v_head_dim": 6, "n_routed_experts": 4, "num_experts_per_tok": 2,
                    "n_group": 1, "topk_group": 1, "n_shared_experts": 1, "first_k_dense_replace": 1},
    "jamba": {**BASE, "architecture": "jamba", "intermediate_size": 64, "num_key_value_heads": 2,
              "attn_layer_period": 2, "attn_layer_offset": 1, "num_experts": 1, "mamba_d_state": 8,
              "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": 4},
}
LR = 0.5  # SGD: step 2's loss sees step 1's gradients
# with activation checkpointing: the recompute in the backward must replay its own micro-batch's group where
# transformers does not pass the call's keyword arguments (the MLA layer's expand_kv, Jamba's Mamba mixer)
RECOMPUTED = ("deepseek_v3", "jamba")


def _config(family: str) -> dict:
    """The family's launcher config: 4 ranks, ``max_tokens_per_rank`` 24, SGD's lr, no clipping (a clipped
    gradient would hide a scale error too), activation checkpointing for :data:`RECOMPUTED`."""
    return {
        "sequence_parallel": {"size": 4, "mode": "ring", "sharding": "zigzag",
                              "dynamic": {"max_tokens_per_rank": 24, "min_size": 1}},
        "model": FAMILIES[family],
        # long-tailed packed rows of 80 tokens: log-normal lengths (median 20, sigma 1.2) clipped to [12, 80]
        "train": {"engine": "fsdp", "seq_len": 80, "steps": 2, "grad_accum": 2, "seed": 3, "lr": LR,
                  "weight_decay": 0.0, "grad_clip": 0.0, "dtype": "fp32", "packed": True,
                  "packed_lengths": "log-normal", "packed_median": 20, "packed_sigma": 1.2, "packed_min": 12,
                  "num_pairs": 2, "num_queries": 2, "num_keys": 8, "num_values": 4, "filler_vocab": 8,
                  "eval_samples": 0, "activation_checkpointing": family in RECOMPUTED},
        "fsdp": {"version": 2, "reshard_after_forward": True},
    }


def _argv(path) -> list[str]:  # noqa: ANN001
    return ["--config", str(path), "--dynamic", "--no-progress", "--log-level", "WARNING"]


@contextlib.contextmanager
def _sgd_for_adamw():
    """The launcher builds ``torch.optim.AdamW(params, lr=, weight_decay=)``: plain SGD instead, while inside."""
    adamw = torch.optim.AdamW
    torch.optim.AdamW = lambda params, lr, weight_decay: torch.optim.SGD(params, lr=lr)  # noqa: ARG005
    try:
        yield
    finally:
        torch.optim.AdamW = adamw


def _train_families(rank: int, world: int, argvs: dict[str, list[str]]
                    ) -> dict[str, tuple[list[float], dict[str, torch.Tensor]]]:
    """Every family's run on this rank -> its per-step losses and step 1's reduced gradients (whole, by parameter
    name, fp32; read where the launcher's FSDP engine updates: test_train's ``_run_main_first_grads``)."""
    from test_train import _run_main_first_grads

    import seqpar

    out = {}
    with _sgd_for_adamw():
        for family, argv in argvs.items():
            try:
                got = _run_main_first_grads(rank, world, argv)
                out[family] = got["metrics"]["loss"], got["grads"]
            finally:
                seqpar.destroy_process_groups()
    return out


def _launcher_reference(argv: list[str]) -> tuple[list[float], list[set[int]], dict[str, torch.Tensor]]:
    """One process, fp32, the launcher's own model and task, SGD: every step's planned micro-batches in
    sequence, packed (Mixtral: each with its own router loss), gradients accumulated -> per-step losses, each
    step's group sizes in use and step 1's gradients by parameter name."""
    from dynamic_reference import launcher_reference

    grads: dict[str, torch.Tensor] = {}
    losses, sizes = launcher_reference(argv, sgd=True, first_grads=grads)
    return losses, sizes, grads


@pytest.mark.timeout(600)
def test_train_dynamic_every_family_equals_one_process(dist_pool, tmp_path) -> None:
    """Acceptance (issue 32): ``launch/train.py --dynamic`` at 4 ranks gives the reference's step 1 reduced
    gradients, each parameter on its own scale (``hf_tiny.assert_gradients_close``: rtol 1e-4, atol 1e-5 of its
    largest), and its per-step losses (1e-5 fp32), for a Llama, a Mixtral with router loss, an MLA model and a
    Jamba. The losses alone cannot see one parameter's gradient off by a factor (tolerance audit 32: q_proj's x2
    moves SGD's losses by ~1e-7 relative). Seen failing (tolerance audit 33): the second layer's query projection's
    reduced gradient doubled in ``run_dynamic_step`` before ``update`` (every family) -> Llama's
    ``layers.1.self_attn.q_proj.weight`` off in all its elements (1.0 relative, 8.9e-9 allowed), where the losses
    alone passed it; seqpar's attention with dq doubled on a world > 1 the losses saw too (Llama's step 2 8.7e-5
    off, allowed 1e-5). Every family is judged and the message holds each family's verdict (tst34): seen failing
    together, at world > 1 only, the router loss's gradient doubled in ``swap/moe.py``'s switch form (mixtral: its
    gradients and step-2 loss off), ``kv_b_proj``'s weight gradient doubled in ``swap/mla.py``'s ``_local_weight``
    (deepseek_v3: ``layers.0.self_attn.kv_b_proj.weight`` 99% of elements) and the mixers' conv weight's doubled in
    ``conv_shard`` (jamba: ``layers.0.mamba.conv1d.weight``, where the losses passed), llama reported ok."""
    import hf_tiny

    argvs = {}
    for family in FAMILIES:
        path = tmp_path / f"{family}.json"
        path.write_text(json.dumps(_config(family)))
        argvs[family] = _argv(path)
    refs = {family: _launcher_reference(argv) for family, argv in argvs.items()}
    got = dist_pool.run(4, _train_families, argvs, timeout=500)
    # every family judged, its verdict in the message: a break on one family's path is named with the others'
    # verdicts (the test stopped at the first failing family before, so only Llama's breaks were seen: tst34)
    verdicts = {}
    for family, (ref, sizes, ref_grads) in refs.items():
        problems = []
        if not all(g[family][0] == got[0][family][0] for g in got):
            problems.append(f"ranks report different losses: {[g[family][0] for g in got]}")
        if not set().union(*sizes) >= {1, 2}:  # more than one group size in the plans
            problems.append(f"the plans use one group size: {sizes}")
        losses, grads = got[0][family]
        try:
            hf_tiny.assert_gradients_close(grads, ref_grads, f"{family} --dynamic step 1")
        except AssertionError as e:
            problems.append(str(e).split("\n")[0] + " " + " ".join(str(e).split("\n")[1:4]))
        if len(losses) != len(ref):
            problems.append(f"{len(losses)} losses, the reference has {len(ref)}")
        problems += [f"step {step}: --dynamic loss {a} vs one process {b}"
                     for step, (a, b) in enumerate(zip(losses, ref)) if not abs(a - b) <= 1e-5 * abs(b)]
        verdicts[family] = "; ".join(problems) or "ok"
    assert all(v == "ok" for v in verdicts.values()), "\n".join(f"{f}: {v}" for f, v in verdicts.items())
