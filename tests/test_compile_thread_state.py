"""A compiled swapped model is traced once: its second call, on a thread that never ran seqpar before the
first, reuses the first graph (issue 31: no recompile during a benchmark's rounds or a training loop).

seqpar keeps per-thread stacks (the swapped SDPA's frames, the MoE router frames, the mixers' document
boundaries, the verified-forward depth) in ``threading.local`` objects. Created lazily, the first compiled
call found them absent and dynamo guarded on that absence (``not hasattr(_local, 'stack')``); the call
itself created them, so the second call failed the guard and recompiled (the whole model: tens of
seconds of inductor time, landing in the first timed round of ``interleave --compile``). A fresh thread
is the only clean place to test this: every thread that ran an eager swapped forward already has them.

Seen failing: with the four thread-locals created lazily again (the code before the fix), 2 graphs: the
model's frame recompiled on ``not hasattr(seqpar.swap.state._local, 'stack')`` and the router pre-hook's
frame on ``seqpar.swap.moe``'s (``TORCH_LOGS=recompiles``). Reverting ``seqpar.swap.state`` alone, or
``seqpar.swap.moe`` alone, passed here (not explained: some traced path at SP = 1 then creates the stack
before the guard is taken); the P = 2 bench's recompile log named both.
"""

from __future__ import annotations

import threading

import torch

import seqpar


def _tiny_llama() -> torch.nn.Module:
    import transformers

    from seqpar.testing.tiny_models import tiny_kwargs

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**tiny_kwargs("llama"))).train()


def test_a_compiled_swapped_model_is_not_recompiled_on_its_second_call() -> None:
    from seqpar.sequence.batch import shard_batch

    graphs: list[int] = []

    def count(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(1)
        return gm.forward

    model = _tiny_llama()
    seqpar.swap_attention(model, {"size": 1})
    ids = torch.randint(3, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(5))
    batch = shard_batch({"input_ids": ids, "labels": ids.clone()})
    compiled = torch.compile(model, fullgraph=True, backend=count)
    losses: list[torch.Tensor] = []
    errors: list[BaseException] = []

    def run() -> None:  # a new thread: seqpar's thread-local state starts empty there
        try:
            # any recompile is an error (a recompile of a frame without tensor work, such as a pre-hook,
            # makes no graph, so counting the backend's graphs alone would miss it)
            with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
                losses.extend(compiled(**batch).loss for _ in range(3))
        except BaseException as e:  # noqa: BLE001 - re-raised on the test's thread
            errors.append(e)

    try:
        thread = threading.Thread(target=run)
        thread.start()
        thread.join(timeout=300)
        assert not thread.is_alive(), "the compiled calls did not finish in 300 s"
        if errors:
            raise errors[0]
        assert len(graphs) == 1, f"{len(graphs)} graphs for three calls on the same batch (a recompile)"
        with torch.no_grad():
            eager = model(**batch).loss
        assert all(torch.allclose(loss, eager, rtol=1e-5, atol=1e-6) for loss in losses), (losses, eager)
    finally:
        torch._dynamo.reset()
