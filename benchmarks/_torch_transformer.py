"""A PyTorch Transformer language-model training step, the peer of ``benchmarks/lm_step.py
--model transformer``.

The same step as ``bottleneck.train.Trainer.window_step`` on ``experiments/language_model.py
transformer-cpu`` with the softmax head, written the way a PyTorch user would: a tied
embedding, dropout on the embeddings and on each block's attention and MLP outputs, pre-norm
blocks (RMSNorm, ``eps = 1e-5``; biased q/k/v, output and MLP projections; RoPE on queries and
keys, half-split as in ``bottleneck.nn.transformer.rotary_embedding``; causal
``scaled_dot_product_attention``; tanh-GELU MLP), a final RMSNorm, a biased tied decoder and
cross-entropy, backward, global-norm clipping and AdamW with weight decay on the matrices only.
Imported only when ``torch`` is installed (``pip install -e ".[bench]"``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


class _Block(nn.Module):
    def __init__(self, d_model: int, num_heads: int, d_ff: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.attention_norm, self.mlp_norm = nn.RMSNorm(d_model, 1e-5), nn.RMSNorm(d_model, 1e-5)
        self.qkv, self.attention_out = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.mlp_in, self.mlp_out = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, p: float
    ) -> torch.Tensor:
        batch, steps, width = x.shape
        qkv = self.qkv(self.attention_norm(x)).view(batch, steps, 3, self.num_heads, -1)
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # [B, H, T, D]
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = self.attention_out(attended.transpose(1, 2).reshape(batch, steps, width))
        x = x + F.dropout(out, p, training=True)
        hidden = F.gelu(self.mlp_in(self.mlp_norm(x)), approximate="tanh")
        return x + F.dropout(self.mlp_out(hidden), p, training=True)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def torch_transformer_step_call(
    tokens: np.ndarray,
    targets: np.ndarray,
    *,
    vocab_size: int,
    d_model: int,
    num_heads: int,
    d_ff: int,
    num_layers: int,
    dropout: float,
    lr: float,
    weight_decay: float,
    clip: float,
    seed: int = 0,
) -> Callable[[], float]:
    """A zero-argument call running one training step on ``tokens, targets [B, T]``; returns
    the loss (a Python float, so the step has finished when it returns)."""
    torch.manual_seed(seed)
    embedding = nn.Embedding(vocab_size, d_model)
    blocks = nn.ModuleList([_Block(d_model, num_heads, d_ff) for _ in range(num_layers)])
    final_norm = nn.RMSNorm(d_model, 1e-5)
    decoder_bias = nn.Parameter(torch.zeros(vocab_size))
    modules = nn.ModuleList([embedding, blocks, final_norm])
    params = [*modules.parameters(), decoder_bias]
    matrices = [p for p in params if p.ndim == 2]
    others = [p for p in params if p.ndim != 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": matrices, "weight_decay": weight_decay},
            {"params": others, "weight_decay": 0.0},
        ],
        lr=lr,
    )
    x = torch.from_numpy(np.asarray(tokens, np.int64))
    y = torch.from_numpy(np.asarray(targets, np.int64))
    steps = x.shape[1]
    half = d_model // num_heads // 2
    inv_freq = 10_000.0 ** (-torch.arange(half, dtype=torch.float32) / half)
    angles = torch.arange(steps, dtype=torch.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos, sin = angles.cos(), angles.sin()

    def call() -> float:
        optimizer.zero_grad(set_to_none=True)
        h = F.dropout(embedding(x), dropout, training=True)
        for block in blocks:
            h = block(h, cos, sin, dropout)
        logits = F.linear(final_norm(h), embedding.weight, decoder_bias)
        loss = F.cross_entropy(logits.reshape(-1, vocab_size), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, clip)
        optimizer.step()
        return loss.item()

    return call
