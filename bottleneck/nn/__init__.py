"""Flax NNX modules: output heads, the mixture-of-experts dense layer, models around a head."""

from bottleneck.nn.awd_lstm import AWDLSTM
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
    head_options,
    make_head,
    param_labels,
)
from bottleneck.nn.models import ContextEmbeddingModel
from bottleneck.nn.moe import DenseMoE, dense_moe
from bottleneck.nn.transformer import Transformer

__all__ = [
    "AWDLSTM",
    "HEAD_NAMES",
    "ContextEmbeddingModel",
    "DenseMoE",
    "dense_moe",
    "MixtureHead",
    "MonotoneMLPHead",
    "OutputHead",
    "head_options",
    "PLIFHead",
    "ReLUHead",
    "SigmoidHead",
    "SigsoftmaxHead",
    "SoftmaxHead",
    "Transformer",
    "make_head",
    "param_labels",
]
