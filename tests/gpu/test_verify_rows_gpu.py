"""A verify pass computes every token as the AR step does, op for op, with the packed kernels (issue #6).

Lossless greedy decoding with the packed kernels needs every verify row to be bit-identical to the AR
step of the same token: int8-quantized activations turn a last-bit difference into a different int8
now and then, and a random tiny model has near-ties that such a change flips. For tiny qwen35 and qwen3
(Q4_K_M, packed weights forced) this runs 16 AR steps (eager, exact KV length: the reference engine's
steps) and one chain verify of the same 16 tokens from the same prefilled state (KV read in a
power-of-two bucket with the tail masked, as the CUDA-graph engine reads it), records the output of
every torch function and module on the way, and requires every op's verify row i to equal AR step i.
A failure lists, in call order, the ops that differ: the first one listed is the culprit; what follows
it inherits the difference.
"""

from collections import defaultdict

import pytest
import torch
from torch.overrides import TorchFunctionMode

from benchmarks.tiny import tiny_files
from flashtree.models.block import BlockLayout
from flashtree.models.loader import load_target

pytestmark = pytest.mark.gpu

N_TOKENS, PROMPT = 16, 37  # tokens in the verify chain, prompt tokens
SHOWN = 12  # differing ops listed in a failure

# Allocations without contents: the Triton kernels write their outputs into such buffers, which the probe
# sees only as the module outputs that follow (the kernels are not torch functions).
UNINITIALIZED = {"empty", "empty_like", "new_empty", "empty_strided"}


class Recorder(TorchFunctionMode):
    """Every tensor output whose first dim is the pass's token count, keyed by (module, op, k-th call
    of that op inside that module call) so that a 1-token step and an n-token pass line up."""

    def __init__(self, model: torch.nn.Module, n_tokens: int):
        super().__init__()
        self.n_tokens, self.stack, self.records = n_tokens, ["-"], {}
        self.order: list[tuple] = []
        self.counts: dict[tuple, int] = defaultdict(int)
        self.busy = False  # our own copies are not the model's ops
        self.hooks = []
        for name, module in model.named_modules():
            self.hooks.append(module.register_forward_pre_hook(self._enter(name)))
            self.hooks.append(module.register_forward_hook(self._leave(name)))

    def _enter(self, name):
        def hook(module, args):
            self.stack.append(f"{name}#{self.counts[('call', name)]}")
            self.counts[("call", name)] += 1

        return hook

    def _leave(self, name):
        def hook(module, args, out):
            self.stack.pop()
            self._keep((name or "model", "<module output>"), out)

        return hook

    def _keep(self, key: tuple, out) -> None:
        out = out[0] if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor) else out
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            return
        if out.dim() == 0 or out.shape[0] != self.n_tokens:
            return
        k = self.counts[key]
        self.counts[key] += 1
        full = (*key, k)
        self.order.append(full)
        self.busy = True
        self.records[full] = out.detach().clone()
        self.busy = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.busy:
            return out
        name = getattr(func, "__name__", str(func))
        if name in UNINITIALIZED:  # a kernel's output buffer: its bits at creation are whatever was there
            return out
        scope = self.stack[-1].split("#")[0]
        self._keep((scope, name), out)
        return out

    def close(self) -> None:
        for h in self.hooks:
            h.remove()


def record(model, tokens: torch.Tensor, state, **forward_args) -> tuple[Recorder, torch.Tensor]:
    """The pass's recorded ops and its logits."""
    rec = Recorder(model, tokens.shape[0])
    try:
        with rec:
            out = model.forward(tokens, state, logits="all", **forward_args)
    finally:
        rec.close()
    return rec, out.logits


@pytest.mark.parametrize("shape", ("tiny-qwen35", "tiny-qwen3"))
def test_verify_rows_equal_ar_steps_op_for_op(tiny_dir, shape):
    gguf, _ = tiny_files(shape, "q4_k_m", tiny_dir)
    model, _ = load_target(gguf, device="cuda", quantized=True)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab, (PROMPT,), generator=gen).to("cuda")

    ar_state, verify_state = model.new_state(1024), model.new_state(1024)
    first = model.forward(prompt, ar_state, logits="last").logits.argmax(-1)
    model.forward(prompt, verify_state, logits="none")
    tokens, steps = [first], []
    for _ in range(N_TOKENS):  # AR: greedy, one token at a time, exact KV length
        rec, logits = record(model, tokens[-1], ar_state)
        steps.append(rec)
        tokens.append(logits[-1:].argmax(-1))
    chain = torch.cat(tokens[:N_TOKENS])
    n_keys = 1 << (PROMPT + N_TOKENS - 1).bit_length()  # the CUDA-graph engine's bucket
    verify, _ = record(
        model, chain, verify_state, layout=BlockLayout.chain(N_TOKENS, "cuda"), commit=False, n_keys=n_keys
    )

    same, differ = 0, []
    for key in verify.order:
        if not all(key in s.records for s in steps):
            continue  # an op only the n-token pass runs (masks, the chain layout)
        ar, got = torch.cat([s.records[key] for s in steps]), verify.records[key]
        if ar.shape != got.shape:
            continue
        if torch.equal(ar, got):
            same += 1
            continue
        rows = (ar != got).reshape(len(ar), -1).any(-1).nonzero().flatten().tolist()
        diff = (ar.float() - got.float()).abs().max().item()
        differ.append(f"{key[0]} {key[1]} call {key[2]}: rows {rows} max |diff| {diff:.3g}")
    assert same > 0, "no op recorded in both passes"
    assert not differ, (
        f"{len(differ)} of {same + len(differ)} ops differ between a {N_TOKENS}-token chain verify and "
        f"{N_TOKENS} AR steps, in call order:\n  " + "\n  ".join(differ[:SHOWN])
    )
