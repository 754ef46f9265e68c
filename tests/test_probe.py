"""The position-mixing probe at the first forward (issue 28 §1): it takes packed batches, and its refusals
are collective.

When the probe cannot run at swap time (the "sdpa" and "mha" routes; a Hugging Face model that cannot run
on synthetic tokens alone; parameters not materialised), it runs on the first batch cut to 13 positions.
That cut call is a whole sequence of its own: its packed-document inputs (``cu_seq_lens_q/k``,
``max_length_q/k``, restarting ``position_ids``, as ``transformers.DataCollatorWithFlattening`` gives
them) must describe the cut, or the model (or seqpar's own input check) refuses the probe's call. And a
rank whose cut cannot be probed (all padding: one token id) must raise with the others, also with
``check_inputs=False``, instead of waiting for them in its first collective.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from seqpar.sequence.sharding import shard_sequence
from seqpar.swap import SwapError, swap_attention

transformers = pytest.importorskip("transformers")

VOCAB = 61
HIDDEN = 16


def packed(lengths: list[int], seed: int = 0) -> dict:
    """A packed batch of documents of ``lengths`` from transformers' own collator (ids 3..VOCAB-1)."""
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]
    collate = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=True)
    return collate([{"input_ids": d} for d in docs])


def check_packed(seq: int, position_ids: torch.Tensor | None, cu: torch.Tensor | None, longest: int | None) -> None:
    """What a varlen kernel needs of a packed call: boundaries from 0 to the length, the longest document,
    positions counting from 0 in each document."""
    if cu is None:
        return
    bounds = cu.tolist()
    if bounds[0] != 0 or bounds[-1] != seq:
        raise ValueError(f"cu_seq_lens_q {bounds} do not cover the sequence length {seq}")
    if longest != max(b - a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"max_length_q {longest} is not the longest document of {bounds}")
    if position_ids is not None:
        expected = torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])])
        if not torch.equal(position_ids.reshape(-1, seq)[0].cpu(), expected):
            raise ValueError(f"position_ids {position_ids.tolist()} do not restart at {bounds}")


# ----------------------------------------------------------------------------- mixers
class NoMixer(nn.Module):
    def forward(self, x: torch.Tensor, cu: torch.Tensor | None = None) -> torch.Tensor:
        return x


class SequenceCumsum(nn.Module):
    """A running sum over the whole sequence: ``(batch, seq, hidden) -> (batch, seq, hidden)``."""

    def forward(self, x: torch.Tensor, cu: torch.Tensor | None = None) -> torch.Tensor:
        return x.cumsum(dim=1) / x.shape[1]


class DocumentCumsum(nn.Module):
    """A running sum that restarts at each packed document (a mixer that honours the boundaries)."""

    def forward(self, x: torch.Tensor, cu: torch.Tensor | None = None) -> torch.Tensor:
        bounds = cu.tolist() if cu is not None else [0, x.shape[1]]
        return torch.cat([x[:, a:b].cumsum(dim=1) for a, b in zip(bounds, bounds[1:])], dim=1)


MIXERS = {"none": NoMixer, "cumsum": SequenceCumsum, "doc_cumsum": DocumentCumsum}


# ----------------------------------------------------------------------------- models of the sdpa / mha routes
# Named without "Attention": transformers' heuristic (a module defining an `*Attention*(nn.Module)` class that does
# not use its attention interface) would refuse to switch the attention of PositionsRequired, defined here too.
class CausalSdpa(nn.Module):
    """Causal attention by F.scaled_dot_product_attention (the "sdpa" route): ``(B, S, H) -> (B, S, H)``."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, 2, HIDDEN // 2).permute(2, 0, 3, 1, 4)  # 3 x (B, 2, S, H/2)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(x.shape)


class PackedModel(nn.Module):
    """Embeddings (token + position), one causal attention ("sdpa": CausalSdpa;
    "mha": nn.MultiheadAttention), then a mixer; takes a packed batch's keywords and checks them as a
    varlen kernel would."""

    def __init__(self, route: str, mixer: str) -> None:
        super().__init__()
        self.route = route
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Embedding(64, HIDDEN)
        self.attn = CausalSdpa() if route == "sdpa" else nn.MultiheadAttention(HIDDEN, 2, batch_first=True)
        self.mixer = MIXERS[mixer]()

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                cu_seq_lens_q: torch.Tensor | None = None, cu_seq_lens_k: torch.Tensor | None = None,
                max_length_q: int | None = None, max_length_k: int | None = None, labels: object = None) -> torch.Tensor:
        batch, seq = input_ids.shape
        check_packed(seq, position_ids, cu_seq_lens_q, max_length_q)
        if position_ids is None:
            position_ids = torch.arange(seq)[None]
        x = self.embed(input_ids) + self.pos(position_ids)  # (B, S, H)
        if self.route == "sdpa":
            out = self.attn(x)
        else:
            mask = nn.Transformer.generate_square_subsequent_mask(seq)
            out = self.attn(x, x, x, need_weights=False, attn_mask=mask, is_causal=True)[0]
        return self.mixer(x + out, cu_seq_lens_q)


# ----------------------------------------------------------------------------- a Hugging Face model probed at the first forward
class PositionsRequired(transformers.LlamaForCausalLM):
    """A Llama whose forward needs ``position_ids`` (as a model trained on packed batches may): it cannot
    run on the swap-time probe's synthetic tokens, so it is probed on its first batch."""

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, **kwargs: object) -> object:
        return super().forward(input_ids=input_ids, position_ids=position_ids, **kwargs)


class Then(nn.Module):
    def __init__(self, first: nn.Module, then: nn.Module) -> None:
        super().__init__()
        self.first, self.then = first, then

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.then(self.first(x))


def hf_model(mixer: str) -> nn.Module:
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      use_cache=False)
    torch.manual_seed(0)
    model = PositionsRequired(config)
    if mixer != "none":
        model.model.layers[0].mlp = Then(MIXERS[mixer](), model.model.layers[0].mlp)
    return model


def build(route: str, mixer: str) -> nn.Module:
    if route == "hf":
        return hf_model(mixer)
    torch.manual_seed(0)
    return PackedModel(route, mixer)


MIXER_PATH = {"sdpa": "'mixer'", "mha": "'mixer'", "hf": "'model.layers.0.mlp.first'"}


# ----------------------------------------------------------------------------- one process
@pytest.mark.parametrize("route", ["sdpa", "mha", "hf"])
def test_first_forward_probe_takes_a_packed_batch(route):
    """Documents of 3, 9 and 4 tokens: the probe's 13 positions end inside the third. A position-wise model
    runs (its output that of the unswapped model, for the sdpa and mha routes), and a mixer is refused by
    name. Before, the probe's call kept the boundaries [0, 3, 12, 16] of the 16 tokens: the hf route refused
    every packed batch, and the sdpa and mha routes skipped the probe with a warning, running the mixer."""
    batch = packed([3, 9, 4])
    clean, plain = build(route, "none"), build(route, "none")
    swap_attention(clean, {"size": 1})
    out = clean(**batch)
    if route != "hf":
        torch.testing.assert_close(out, plain(**batch), rtol=0, atol=1e-6)
    else:
        assert torch.isfinite(out.logits).all()
    mixed = build(route, "cumsum")
    swap_attention(mixed, {"size": 1})
    for _ in range(2):  # refused, and every later forward too
        with pytest.raises(SwapError, match=rf"{MIXER_PATH[route]} \(SequenceCumsum\)"):
            mixed(**batch)


def test_probe_changes_a_position_whose_document_goes_on():
    """Documents of 7, 6 and 3 tokens: the middle of the probe's 13 positions (6) is the last token of the
    first document, where a causal mixer that honours the documents moves nothing. The probe changes a
    position whose document goes on after it, so that mixer is found too."""
    batch = packed([7, 6, 3])
    model = build("sdpa", "doc_cumsum")
    swap_attention(model, {"size": 1})
    with pytest.raises(SwapError, match=r"'mixer' \(DocumentCumsum\)"):
        model(**batch)


# ----------------------------------------------------------------------------- two ranks
def _hf_shards_probed(rank: int, world_size: int, kind: str, sharding: str) -> list[str]:
    """The hf route at SP=2, first batch cut with shard_batch (16 positions per rank: the probe's 13 are
    a piece of the rank's shard, whose boundaries and positions are global)."""
    from seqpar.sequence.batch import shard_batch

    group = dist.group.WORLD
    if kind == "packed":
        batch = packed([3, 9, 4, 10, 6])
    else:
        ids = torch.randint(3, VOCAB, (1, 32), generator=torch.Generator().manual_seed(1))
        batch = {"input_ids": ids, "labels": ids.clone()}
    shard = shard_batch(batch, group=group, sharding=sharding)
    assert shard["input_ids"].shape[1] > 13
    said = []
    for mixer in ("none", "cumsum"):
        model = hf_model(mixer)
        swap_attention(model, {"size": world_size, "sharding": sharding}, group=group)
        try:
            out = model(**shard)
        except SwapError as e:
            assert mixer == "cumsum" and r"'model.layers.0.mlp.first' (SequenceCumsum)" in str(e), str(e)
            said.append(str(e))
            continue
        assert mixer == "none" and torch.isfinite(out.logits).all()
    assert len(said) == 1, said
    return said


def test_first_forward_probe_of_shards(dist_pool):
    """Before, the probe's call went through seqpar's input check as a rank's shard of 13 x P tokens:
    refused under zigzag (13 does not cut into 2P chunks) and for packed shards (global boundaries)."""
    for kind, sharding in (("packed", "zigzag"), ("packed", "contiguous"), ("plain", "zigzag")):
        texts = dist_pool.run(2, _hf_shards_probed, kind, sharding, timeout=180)
        assert len(texts) == 2, (kind, sharding)


def _padding_shard_refused(rank: int, world_size: int, route: str) -> list[str]:
    group = dist.group.WORLD
    model = build(route, "cumsum")
    swap_attention(model, {"size": world_size, "sharding": "contiguous", "check_inputs": False}, group=group)
    ids = torch.randint(3, VOCAB, (1, 24), generator=torch.Generator().manual_seed(3))
    ids[:, 24 - 24 // world_size:] = 0  # the last shard is all padding: one token id, nothing to probe
    local = shard_sequence(ids, 1, group=group, sharding="contiguous")
    said = []
    for _ in range(2):  # the first forward refuses on every rank; later ones again, with no collective
        try:
            model(input_ids=local)
        except SwapError as e:
            said.append(str(e))
            continue
        raise AssertionError(f"rank {rank}: the forward ran")
    return said


@pytest.mark.parametrize("route", ["sdpa", "mha"])
def test_first_forward_refusal_is_collective_without_check_inputs(dist_pool, route):
    """check_inputs=False: the ranks whose shard holds tokens find the mixer, the rank whose shard is all
    padding cannot probe. Every rank raises the same error, naming the mixer and the fix; before, the
    padding rank went on into its first attention collective and waited there for ever."""
    texts = dist_pool.run(2, _padding_shard_refused, route, timeout=60)
    first = texts[0][0]
    assert all(t == [first, first] for t in texts), texts
    assert "'mixer' (SequenceCumsum)" in first and "without sequence parallelism" in first, first
    assert "SP rank(s) [0]" in first, first


# ----------------------------------------------------------------------------- a forward that gathers parameters
class Gathering(nn.Module):
    """``model`` behind a stand-in for an engine's parameter gather: every forward all-reduces its kind
    (1: one of the probe's forwards, 2: a real one) over the world, as ZeRO-3 gathers each module's
    parameters over its group, and checks every rank ran the same kind. Its parameter carries the group
    as ZeRO-3's partitioned parameters do (``ds_process_group``)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.gathered = nn.Parameter(torch.zeros(1))
        self.gathered.ds_process_group = dist.group.WORLD

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        from seqpar.swap.state import is_probing

        kind = torch.tensor([1.0 if is_probing() else 2.0])
        total = kind.clone()
        dist.all_reduce(total)
        if total.item() != kind.item() * dist.get_world_size():
            raise AssertionError(f"rank {dist.get_rank()} ran a forward of kind {kind.item()} while the others' "
                                 f"kinds sum to {total.item() - kind.item()}: the ranks' forwards are out of step")
        return self.model(input_ids) + self.gathered


class WhereFive(nn.Module):
    """A running sum over the sequence only when token id 5 is in the batch: a probe of a batch without 5
    sees no mixing. ``(B, S, H) -> (B, S, H)``; the ids are set by the test before the forward."""

    ids: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, cu: torch.Tensor | None = None) -> torch.Tensor:
        return x.cumsum(dim=1) / x.shape[1] if bool((WhereFive.ids == 5).any()) else x


def _gathered_probe(rank: int, world_size: int, case: str) -> list[str]:
    """DP ``world_size`` x SP 1 (each rank its own one-rank SP group) over a forward that gathers over the world,
    as ZeRO-3 does: each rank probes its own batch at its first forward."""
    ones = [dist.new_group([r]) for r in range(world_size)]
    torch.manual_seed(0)
    inner = PackedModel("sdpa", "none")
    if case == "verdict":
        inner.mixer = WhereFive()
    model = Gathering(inner)
    swap_attention(model, {"size": 1}, group=ones[rank])
    ids = torch.randint(6, VOCAB, (1, 16), generator=torch.Generator().manual_seed(rank))
    if case == "skip" and rank == 1:
        ids = ids[:, :2]  # too short to probe (an empty micro-batch under dynamic CP is the real one)
    if case == "verdict" and rank == 0:
        ids[0, 7] = 5  # rank 0's probe sees the mixer, rank 1's does not
    WhereFive.ids = ids
    said = []
    for _ in range(2):
        try:
            model(input_ids=ids)
        except SwapError as e:
            said.append(str(e))
    return said


@pytest.mark.parametrize("case", ["skip", "verdict"])
def test_the_probe_is_collective_where_the_forward_gathers_parameters(dist_pool, case):
    """Where the model's forward gathers parameters over a group wider than the SP group (ZeRO-3 or FSDP over
    DP x SP, or a dynamic-CP pool whose call groups are smaller), the first-forward probe's forwards are
    collectives too: every rank of that group runs them, or none does ("skip": rank 1's batch is too short to
    probe, so neither rank probes and both forwards run), and a refusal is raised on every rank of it
    ("verdict": only rank 0's batch shows the mixer; both ranks refuse, naming rank 0, and keep refusing).

    Seen failing: before the agreement (``flagged_ranks`` over ``forward_group`` in
    ``seqpar.swap.probe_batch.first_forward_probe``) rank 0's probe forward met rank 1's real forward in the
    gather ("skip": "out of step"), and rank 1 ran on into a gather rank 0 never joined ("verdict": the pool's
    timeout). Found by the fuzzer: tiny Falcon under dynamic CP and ZeRO-3, an empty micro-batch pair."""
    texts = dist_pool.run(2, _gathered_probe, case, timeout=60)
    if case == "skip":
        assert texts == [[], []], texts
        return
    assert all(len(t) == 2 for t in texts), texts
    assert "'model.mixer' (WhereFive)" in texts[0][0], texts[0][0]
    assert "rank(s) [0]" in texts[1][0] and "'model.mixer' (WhereFive)" in texts[1][0], texts[1][0]


def _forward_groups(rank: int, world_size: int) -> list[str]:
    from torch.distributed.fsdp import fully_shard

    from seqpar.runtime.forward_group import forward_group

    plain = nn.Linear(4, 4)
    zero3 = nn.Linear(4, 4)
    zero3.weight.ds_process_group = dist.group.WORLD
    fsdp2 = fully_shard(nn.Linear(4, 4))
    one = dist.new_group([0])
    lonely = nn.Linear(4, 4)
    lonely.weight.ds_process_group = one if rank == 0 else dist.group.WORLD
    return [forward_group(m) is dist.group.WORLD for m in (zero3,)] + [
        forward_group(plain) is None, dist.get_world_size(forward_group(fsdp2)) == world_size,
        rank != 0 or forward_group(lonely) is None]


def test_forward_group_finds_the_engines_gather_group(dist_pool):
    """``forward_group``: ZeRO-3's parameter group, FSDP2's mesh group, none for plain parameters or a
    one-rank group. Seen failing: with ``_fsdp2_group`` returning None (FSDP2 models were not agreed over)."""
    assert dist_pool.run(2, _forward_groups, timeout=60) == [[True] * 4] * 2


def _gathered_refusal(rank: int, world_size: int, checking: bool) -> list[str]:
    """DP 2 x SP 1 over a forward that gathers over the world: rank 1's preparer refuses its batch."""
    from seqpar.swap.batch import install_batch_check, installed_check

    ones = [dist.new_group([r]) for r in range(world_size)]
    torch.manual_seed(0)
    model = Gathering(PackedModel("sdpa", "none"))
    swap_attention(model, {"size": 1, "check_inputs": checking}, group=ones[rank])
    model(input_ids=torch.randint(6, VOCAB, (1, 16), generator=torch.Generator().manual_seed(rank)))  # passes

    def refuse(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if rank == 1:
            raise ValueError("rank 1's batch is bad: cut it with shard_batch")
        return args, kwargs

    install_batch_check(model, installed_check(model).options, ["gathering"], [refuse])
    said = []
    try:
        model(input_ids=torch.randint(6, VOCAB, (1, 16)))
    except ValueError as e:
        said.append(str(e))
    return said


@pytest.mark.parametrize("checking", [True, False])
def test_a_refusal_reaches_every_rank_the_forward_gathers_over(dist_pool, checking):
    """DP 2 x SP 1 under a parameter-gathering forward (ZeRO-3 over DP x SP): a batch refused on rank 1 alone
    (its one-rank SP group agrees with itself at once) stops rank 0 too, naming rank 1 and its message.
    (With ``check_inputs`` off this holds until a forward has passed: here the refused forward is a fresh check's
    first.) Seen failing: without ``_agree_wide`` in ``seqpar.swap.batch`` rank 1 raised alone and rank 0
    waited in the gather (the pool's timeout)."""
    texts = dist_pool.run(2, _gathered_refusal, checking, timeout=60)
    assert texts[1] == ["rank 1's batch is bad: cut it with shard_batch"], texts
    assert len(texts[0]) == 1 and "rank(s) [1]" in texts[0][0] and "cut it with shard_batch" in texts[0][0], texts


# ------------------------------------------------------------- audit 24: a refusal vs a crash while probing
def _seqpar_refusal() -> BaseException:
    """A refusal seqpar's code wrote: ``raise`` in a helper two calls below the caller (``config._fail``)."""
    from seqpar.config import ConfigError, SeqParConfig

    try:
        SeqParConfig.from_dict({"tp_loss_parallel": "yes"})
    except ConfigError as error:
        return error
    raise AssertionError("the config was accepted")


def _op_error_in_a_frame_that_also_raises() -> BaseException:
    """An IndexError from an operation, in a frame whose code holds a ``raise`` statement it did not reach."""
    def index(x: torch.Tensor, bad: bool) -> torch.Tensor:
        if bad:
            raise ValueError("never reached")
        return x[10]

    try:
        index(torch.zeros(3), False)
    except IndexError as error:
        return error
    raise AssertionError("no IndexError")


def test_a_refusal_while_probing_stays_a_refusal_and_a_crash_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """``hf_probe._probe_tops`` words a seqpar error raised by a ``raise`` statement (a refusal, however deep in
    seqpar's helpers) as "seqpar refused a layer while probing the model", and raises an error a seqpar frame's
    operation hit (a bug of seqpar's, case 1410858051) as it is. ``_raise_statement`` judges the innermost
    frame at its last instruction: a raise statement elsewhere in that frame's code is not enough.
    Seen failing: ``_raise_statement`` without its walk to the innermost frame (the refusal, raised two frames
    down, came out bare: "a ConfigError, not SwapError"); without its ``ins.offset == tb.tb_lasti`` (the op's
    IndexError in a frame holding a ``raise`` read as a refusal)."""
    from seqpar.config import ConfigError
    from seqpar.swap import hf_probe
    from seqpar.swap.probe import ProbeFailed

    refusal, crash = _seqpar_refusal(), _op_error_in_a_frame_that_also_raises()
    assert hf_probe._raise_statement(refusal)
    assert not hf_probe._raise_statement(crash)

    class Top(nn.Module):
        pass

    def probe_raising(error: BaseException):  # noqa: ANN202
        def find_mixers(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            raise ProbeFailed("layers.0", "Layer", error)
        return find_mixers

    monkeypatch.setattr(hf_probe, "_synthetic_run", lambda top: None)
    monkeypatch.setattr(hf_probe, "find_mixers", probe_raising(refusal))
    with pytest.raises(SwapError, match=r"Top: seqpar refused a layer while probing the model: .*tp_loss_parallel"
                                        r".*Nothing changed\.$") as raised:
        hf_probe._probe_tops([("", Top())], "Nothing changed.")
    assert raised.value.__cause__ is refusal
    # a seqpar frame's own operation failing (raised_by_seqpar: the innermost frame is seqpar's) is raised bare
    monkeypatch.setattr(hf_probe, "raised_by_seqpar", lambda error: True)
    monkeypatch.setattr(hf_probe, "find_mixers", probe_raising(crash))
    with pytest.raises(IndexError) as raised:
        hf_probe._probe_tops([("", Top())], "Nothing changed.")
    assert raised.value is crash and not isinstance(raised.value, (SwapError, ConfigError))
