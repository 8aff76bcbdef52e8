"""Target features for draft training from a batched Hugging Face forward.

The target runs as a transformers model on its own dequantized weights (bench/hf_baseline.py) so
that whole padded batches go through at once; our DecoderModel is batch-1.
"""

from __future__ import annotations

import torch


class _LayersDone(Exception):
    """Raised by the hook on the deepest captured layer: the layers above it are not needed."""


@torch.no_grad()
def hf_features(model, ids: torch.Tensor, layer_ids) -> torch.Tensor:
    """Outputs of the decoder layers in `layer_ids` for right-padded `ids`, concatenated: (b, S, n_layers
    * H), the same as DecoderModel's `capture` at every real position. Read with forward hooks:
    `output_hidden_states` hands back the last layer's output after the final norm. The forward stops
    after the deepest layer in `layer_ids` (SmolLM2's draft reads layer 27 of 30); no LM head runs.

    No attention mask: with right padding a real token's causal context is all real, and the padded
    tail's features are never read (a block sees the features before its anchor, a response token). So
    SDPA can run its causal kernels instead of a masked one on a (b, 1, S, S) padding mask built every
    step (this forward is a large part of a training step: bench/results/draft-training)."""
    captured = {}
    last = max(layer_ids)

    def keep(i):
        def hook(module, args, out):
            captured[i] = out[0] if isinstance(out, tuple) else out
            if i == last:
                raise _LayersDone

        return hook

    hooks = [model.model.layers[i].register_forward_hook(keep(i)) for i in layer_ids]
    try:
        model.model(input_ids=ids, use_cache=False)
    except _LayersDone:
        pass
    finally:
        for h in hooks:
            h.remove()
    return torch.cat([captured[i] for i in layer_ids], dim=-1)
