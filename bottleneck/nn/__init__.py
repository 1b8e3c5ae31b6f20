"""Flax NNX modules: output heads as compositions, the mixture-of-experts dense layer, models."""

from bottleneck.nn.awd_lstm import AWDLSTM
from bottleneck.nn.heads import OutputHead
from bottleneck.nn.mixtape import MixtapeHead
from bottleneck.nn.models import ContextEmbeddingModel
from bottleneck.nn.moe import DenseMoE, dense_moe
from bottleneck.nn.pieces import (
    NORMALIZERS,
    PLIF,
    MonotoneMLP,
    Normalizer,
    param_labels,
    relu_normalizer,
)
from bottleneck.nn.presets import (
    HEAD_NAMES,
    check_head,
    check_heads,
    head_options,
    is_mixture_preset,
    make_head,
)
from bottleneck.nn.transformer import Transformer

__all__ = [
    "AWDLSTM",
    "HEAD_NAMES",
    "NORMALIZERS",
    "PLIF",
    "ContextEmbeddingModel",
    "DenseMoE",
    "MixtapeHead",
    "MonotoneMLP",
    "Normalizer",
    "OutputHead",
    "check_head",
    "check_heads",
    "dense_moe",
    "head_options",
    "Transformer",
    "is_mixture_preset",
    "make_head",
    "param_labels",
    "relu_normalizer",
]
