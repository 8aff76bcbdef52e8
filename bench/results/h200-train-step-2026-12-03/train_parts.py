"""Time the parts of a draft-training step at the fourth run's shapes (an experiment; output in NOTES.md)."""

import sys
import time

import torch
import torch.nn.functional as F
import transformers as tf

dev = "cuda" if torch.cuda.is_available() else "cpu"
small = dev == "cpu"
B, S, Q, NH, NKV, D, H, V = (
    (2, 40, 64, 9, 3, 64, 576, 4096) if small else (32, 400, 1024, 9, 3, 64, 576, 49152)
)


def timed(name, fn, n=5):
    fn()
    if dev == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    if dev == "cuda":
        torch.cuda.synchronize()
    print(f"{name:40s} {(time.perf_counter() - t0) / n * 1e3:8.2f} ms", flush=True)


cfg = tf.LlamaConfig(
    vocab_size=V,
    hidden_size=H,
    intermediate_size=1536,
    num_hidden_layers=2 if small else 30,
    num_attention_heads=9,
    num_key_value_heads=3,
    tie_word_embeddings=True,
)
model = tf.LlamaForCausalLM(cfg).to(dev, torch.bfloat16).eval().requires_grad_(False)
ids = torch.randint(0, V, (B, S), device=dev)
att = torch.ones(B, S, dtype=torch.long, device=dev)
att[: B // 2, : S // 4] = 0
with torch.no_grad():
    timed(
        "target forward (features)", lambda: model.model(input_ids=ids, attention_mask=att, use_cache=False)
    )

q = torch.randn(B, NH, Q, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
k = torch.randn(B, NKV, S + Q, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
v = torch.randn(B, NKV, S + Q, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
mask = torch.rand(B, 1, Q, S + Q, device=dev) < 0.5
mask[..., S:] = True


def gqa():
    F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).sum().backward()


def folded():
    g = NH // NKV
    m = mask[:, :, None].expand(B, 1, g, Q, S + Q).reshape(B, 1, g * Q, S + Q)
    out = F.scaled_dot_product_attention(q.reshape(B, NKV, g * Q, D), k, v, attn_mask=m)
    out.view(B, NH, Q, D).sum().backward()


timed("draft attention fwd+bwd, enable_gqa (1 layer)", gqa)
timed("draft attention fwd+bwd, folded (1 layer)", folded)
a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
g = NH // NKV
b2 = F.scaled_dot_product_attention(
    q.reshape(B, NKV, g * Q, D),
    k,
    v,
    attn_mask=mask[:, :, None].expand(B, 1, g, Q, S + Q).reshape(B, 1, g * Q, S + Q),
)
print("max diff", (a - b2.view(B, NH, Q, D)).abs().max().item())
hid = torch.randn(B * Q, H, device=dev, dtype=torch.bfloat16, requires_grad=True)
labels = torch.randint(0, V, (B * Q,), device=dev)
W = model.lm_head.weight


def head():
    logits = (hid @ W.t()).float()
    F.cross_entropy(logits, labels).backward()


timed("LM head + CE fwd+bwd (all block tokens)", head)
x = torch.randn(B, Q + S, H, device=dev, dtype=torch.bfloat16, requires_grad=True)
lin = [torch.nn.Linear(H, n, bias=False, device=dev, dtype=torch.bfloat16) for n in (H, 192, 192, H, 3072)]
down = torch.nn.Linear(1536, H, bias=False, device=dev, dtype=torch.bfloat16)


def layer_mm():
    y = sum(lin_(x).sum() for lin_ in lin[:4])
    gu = lin[4](x)
    y = y + down(F.silu(gu[..., :1536]) * gu[..., 1536:]).sum()
    y.backward()


timed("draft layer matmuls fwd+bwd (1 layer)", layer_mm)
print("peak GiB", torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else 0, file=sys.stderr)
