"""Target features for draft training from a batched Hugging Face forward.

The target runs as a transformers model on its own dequantized weights (bench/hf_baseline.py) so
that whole padded batches go through at once; our DecoderModel is batch-1.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def hf_features(model, ids: torch.Tensor, attention_mask: torch.Tensor, layer_ids) -> torch.Tensor:
    """Outputs of the decoder layers in `layer_ids`, concatenated: (b, S, n_layers * H), the same as
    DecoderModel's `capture`. Read with forward hooks: `output_hidden_states` hands back the last
    layer's output after the final norm. Only the base model runs (no LM head)."""
    captured = {}

    def keep(i):
        return lambda module, args, out: captured.__setitem__(i, out[0] if isinstance(out, tuple) else out)

    hooks = [model.model.layers[i].register_forward_hook(keep(i)) for i in layer_ids]
    try:
        model.model(input_ids=ids, attention_mask=attention_mask, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return torch.cat([captured[i] for i in layer_ids], dim=-1)
