"""Flax NNX modules: output heads and the mixture-of-experts dense layer."""

from bottleneck.nn.heads import (
    HEAD_NAMES,
    MixtureHead,
    MonotoneMLPHead,
    OutputHead,
    PLIFHead,
    ReLUHead,
    SigmoidHead,
    SigsoftmaxHead,
    SoftmaxHead,
    make_head,
    param_labels,
)

__all__ = [
    "HEAD_NAMES",
    "MixtureHead",
    "MonotoneMLPHead",
    "OutputHead",
    "PLIFHead",
    "ReLUHead",
    "SigmoidHead",
    "SigsoftmaxHead",
    "SoftmaxHead",
    "make_head",
    "param_labels",
]
