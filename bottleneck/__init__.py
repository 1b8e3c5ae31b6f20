"""bottleneck: breaking the softmax bottleneck in JAX.

Data flow: hidden states -> logits (W h + b) -> pointwise map (PLIF / sig / none)
-> normalizer (log-space) -> mixture (optional) -> log-probs -> loss / rank diagnostics.
"""

from bottleneck.consequences import (
    estimate_hidden_size,
    gradient_bottleneck_ratio,
    head_gradient_ratio,
    jacobian_gradient_ratio,
    unargmaxable_tokens,
)
from bottleneck.generation import HiddenStateDecoder, generate
from bottleneck.losses import (
    chunked_cross_entropy,
    cross_entropy,
    log_partition,
    target_log_probs,
)
from bottleneck.mixtures import mixture_log_probs
from bottleneck.monotone import monotone_mlp, monotone_mlp_init, plif, plif_init
from bottleneck.normalizers import (
    log_normalize,
    log_relu_normalizer,
    log_sigmoid_normalizer,
    log_sigsoftmax,
    log_softmax,
    relu_log_scores,
    sigmoid_log_scores,
    sigsoftmax_log_scores,
    softmax_log_scores,
)
from bottleneck.spectrum import (
    effective_rank,
    jacobian_singular_values,
    numerical_rank,
    singular_values,
)
from bottleneck.truncation import bat_keep_mask

__version__ = "0.1.0"
# The distribution's name; the import name is shared with NumPy's Bottleneck (experiments/ checks it).
__distribution__ = "softmax-bottleneck"

__all__ = [
    "HiddenStateDecoder",
    "bat_keep_mask",
    "chunked_cross_entropy",
    "cross_entropy",
    "effective_rank",
    "estimate_hidden_size",
    "generate",
    "gradient_bottleneck_ratio",
    "head_gradient_ratio",
    "jacobian_gradient_ratio",
    "jacobian_singular_values",
    "log_normalize",
    "log_relu_normalizer",
    "log_sigmoid_normalizer",
    "log_sigsoftmax",
    "log_softmax",
    "mixture_log_probs",
    "monotone_mlp",
    "monotone_mlp_init",
    "numerical_rank",
    "plif",
    "plif_init",
    "relu_log_scores",
    "sigmoid_log_scores",
    "sigsoftmax_log_scores",
    "singular_values",
    "softmax_log_scores",
    "target_log_probs",
    "log_partition",
    "unargmaxable_tokens",
]
