"""Blocks, masks and the loss of DFlash training (dflash.md §5).

Each sequence gets up to N random anchor positions p. Block n is [x_p, MASK x (B - 1)] at positions
p .. p + B - 1; its token k is trained to predict x_{p+k} (same position, no shift) with weight
exp(-(k - 1) / gamma), k >= 1, on response tokens only. A block sees the target features of positions
< p (strictly) and its own tokens in both directions, exactly what the draft sees at inference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashtree.kernels.cross_entropy import cross_entropy_rows


@dataclass
class Blocks:
    anchors: torch.Tensor  # (b, N) long, sorted; padding anchors are 0 with keep False
    keep: torch.Tensor  # (b, N) bool
    ids: torch.Tensor  # (b, N * B) long: [x_p, MASK...] per block
    positions: torch.Tensor  # (b, N * B) long
    labels: torch.Tensor  # (b, N, B) long: x_{p+k}
    weights: torch.Tensor  # (b, N, B) float: loss weight of each block token (0 where untrained)
    mask: torch.Tensor  # (b, N * B, S + N * B) bool attention mask


def sample_anchors(
    loss_mask: torch.Tensor, n_anchors: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `n_anchors` distinct anchors per row, uniformly among positions p where both x_p and
    x_{p+1} are response tokens (an anchor is a committed response token with something to predict).
    Returns sorted anchors (b, N) and keep (b, N); rows with fewer candidates pad with keep False."""
    b, s = loss_mask.shape
    n = min(n_anchors, s - 1)
    ok = loss_mask[:, :-1] & loss_mask[:, 1:]  # (b, S - 1)
    scores = torch.rand(b, s - 1, generator=generator).to(loss_mask.device)
    scores = scores.masked_fill(~ok, -1.0)
    top, anchors = scores.topk(n, dim=1)  # random subset without replacement
    keep = top >= 0
    anchors = anchors.masked_fill(~keep, s)  # padding sorts last
    anchors, order = anchors.sort(dim=1)
    keep = keep.gather(1, order)
    return anchors.masked_fill(~keep, 0), keep


def make_blocks(
    ids: torch.Tensor,  # (b, S) long
    loss_mask: torch.Tensor,  # (b, S) bool: response tokens
    anchors: torch.Tensor,  # (b, N)
    keep: torch.Tensor,  # (b, N)
    block_size: int,
    mask_token_id: int,
    gamma: float,
) -> Blocks:
    b, s = ids.shape
    n = anchors.shape[1]
    offsets = torch.arange(block_size, device=ids.device)
    pos = anchors[:, :, None] + offsets  # (b, N, B)
    inside = pos < s
    labels = ids.gather(1, pos.clamp(max=s - 1).view(b, -1)).view(b, n, block_size)
    trained = loss_mask.gather(1, pos.clamp(max=s - 1).view(b, -1)).view(b, n, block_size)
    decay = torch.exp(-(offsets - 1).clamp(min=0) / gamma) * (offsets >= 1)  # (B,): no loss on the anchor
    weights = decay * (keep[:, :, None] & inside & trained)
    block_ids = torch.full_like(labels, mask_token_id)
    block_ids[:, :, 0] = labels[:, :, 0]
    return Blocks(
        anchors=anchors,
        keep=keep,
        ids=block_ids.view(b, -1),
        positions=pos.view(b, -1),
        labels=labels,
        weights=weights.float(),
        mask=block_attention_mask(anchors, s, block_size),
    )


def block_attention_mask(anchors: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """(b, N * B, S + N * B) bool. Context key j is visible to block n iff j < anchor_n; block keys are
    visible within the same block only. No row is empty (a block always sees itself), so attention
    never produces NaN, even for padding blocks."""
    b, n = anchors.shape
    dev = anchors.device
    ctx = (
        torch.arange(seq_len, device=dev)[None, None, :]
        < anchors.repeat_interleave(block_size, 1)[:, :, None]
    )
    block_of = torch.arange(n * block_size, device=dev) // block_size
    own = (block_of[:, None] == block_of[None, :]).expand(b, -1, -1)  # (b, N * B, N * B)
    return torch.cat([ctx, own], dim=2)


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, weighted mean CE over trained block tokens
    accept_len: float  # mean over kept blocks of 1 + accepted draft tokens (teacher-forced context)
    accuracy: float  # argmax == label over trained block tokens


def dflash_loss(hidden: torch.Tensor, lm_head, blocks: Blocks) -> LossOutput:
    """Weighted cross-entropy of the draft states (b, N * B, H) against the same-position labels.
    Only trained tokens go through the LM head (the rest carry weight 0)."""
    b, n, bs = blocks.labels.shape
    w = blocks.weights.view(-1)
    chosen = (w > 0).nonzero().squeeze(1)
    labels = blocks.labels.view(-1)[chosen]
    dev = hidden.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else hidden.dtype
    loss, chosen_correct = FrozenHeadCrossEntropy.apply(
        hidden.reshape(b * n * bs, -1)[chosen].to(dtype),
        lm_head.dense_weight(dtype),
        labels,
        w[chosen] / w.sum().clamp(min=1e-9),
    )
    with torch.no_grad():
        correct = torch.zeros(b * n * bs, dtype=torch.bool, device=hidden.device)
        correct[chosen] = chosen_correct
        accepted = correct.view(b, n, bs)[:, :, 1:].long().cumprod(-1).sum(-1)  # (b, N)
        kept = blocks.keep.sum().clamp(min=1)
        accept_len = float((1 + accepted)[blocks.keep].sum() / kept)
        accuracy = float(chosen_correct.float().mean()) if chosen.numel() else 0.0
    return LossOutput(loss, accept_len, accuracy)


class FrozenHeadCrossEntropy(torch.autograd.Function):
    """sum_i w_i * CE(h_i @ W^T, y_i) for a frozen W, a chunk of rows at a time: each chunk's logits
    (fp32, rows x vocab) exist only inside the forward, which also computes d loss / d h, so the
    (tokens x vocab) logits and their gradient are never stored (~30k x 49k x 4 bytes, twice, per
    training step before). Also returns whether each row's argmax is its label."""

    CHUNK_ELEMENTS = 1 << 28  # fp32 logits per chunk: 1 GiB

    @staticmethod
    def forward(ctx, h, weight, labels, w):
        grad = torch.empty_like(h)
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        correct = torch.empty(h.shape[0], dtype=torch.bool, device=h.device)
        rows = max(1, FrozenHeadCrossEntropy.CHUNK_ELEMENTS // weight.shape[0])
        with torch.autocast(h.device.type, enabled=False):
            for s in range(0, h.shape[0], rows):
                part = slice(s, s + rows)
                logits = h[part] @ weight.t()
                part_loss, correct[part], d_logits = cross_entropy_rows(logits, labels[part], w[part])
                loss += part_loss
                grad[part] = d_logits.to(h.dtype) @ weight
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_correct):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss, None, None, None


def gamma_for(block_size: int) -> float:
    """The loss decay SpecForge uses per block size (7 for 16, 5 for 10, 4 for 8); about 0.45 B between."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, 0.45 * block_size)
