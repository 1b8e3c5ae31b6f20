"""A PyTorch AWD-LSTM training step, the reference of ``benchmarks/lm_step.py``.

The same step as ``bottleneck.train.Trainer.window_step`` with the softmax head at the paper's PTB
shapes, written the way the AWD-LSTM code does it (Merity et al.'s ``salesforce/awd-lstm-lm``):
embedding dropout (whole words), locked dropout, 3 ``torch.nn.LSTM`` layers whose ``weight_hh``
is DropConnect-ed once per step (passed through ``torch.func.functional_call``, so the fused
ATen LSTM kernel runs), a tied softmax decoder, cross-entropy + AR/TAR, backward, global-norm
clipping and SGD with weight decay. Imported only when ``torch`` is installed (``pip install
-e ".[bench]"``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F


def torch_step_call(
    tokens: np.ndarray,
    targets: np.ndarray,
    *,
    vocab_size: int,
    emsize: int,
    nhid: int,
    nlayers: int,
    dropout: float,
    dropouth: float,
    dropouti: float,
    dropoute: float,
    wdrop: float,
    alpha: float = 2.0,
    beta: float = 1.0,
    lr: float = 30.0,
    clip: float = 0.25,
    weight_decay: float = 1.2e-6,
    seed: int = 0,
) -> Callable[[], float]:
    """A zero-argument call running one training step on ``tokens, targets [T, B]``; returns
    the loss (a Python float, so the step has finished when it returns)."""
    torch.manual_seed(seed)
    sizes = [emsize] + [nhid] * (nlayers - 1) + [emsize]
    encoder = torch.nn.Embedding(vocab_size, emsize)
    layers = torch.nn.ModuleList([torch.nn.LSTM(sizes[i], sizes[i + 1]) for i in range(nlayers)])
    decoder_bias = torch.nn.Parameter(torch.zeros(vocab_size))
    params = [*encoder.parameters(), *layers.parameters(), decoder_bias]
    optimizer = torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)
    x = torch.from_numpy(np.asarray(tokens, np.int64))
    y = torch.from_numpy(np.asarray(targets, np.int64))
    steps, batch = x.shape

    def locked(shape: tuple[int, ...], p: float) -> torch.Tensor:
        return torch.empty(shape).bernoulli_(1 - p) / (1 - p)

    def call() -> float:
        optimizer.zero_grad(set_to_none=True)
        row_mask = locked((vocab_size, 1), dropoute)
        h = F.embedding(x, encoder.weight * row_mask) * locked((1, batch, emsize), dropouti)
        for i, layer in enumerate(layers):
            w_hh = layer.weight_hh_l0 * locked(layer.weight_hh_l0.shape, wdrop)
            zeros = torch.zeros(1, batch, sizes[i + 1])
            h, _ = torch.func.functional_call(layer, {"weight_hh_l0": w_hh}, (h, (zeros, zeros)))
            if i < nlayers - 1:
                h = h * locked((1, batch, sizes[i + 1]), dropouth)
        raw = h
        h = h * locked((1, batch, emsize), dropout)
        logits = F.linear(h.reshape(steps * batch, emsize), encoder.weight, decoder_bias)
        loss = F.cross_entropy(logits, y.reshape(-1))
        loss = loss + alpha * h.pow(2).mean() + beta * (raw[1:] - raw[:-1]).pow(2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, clip)
        optimizer.step()
        return loss.item()

    return call
