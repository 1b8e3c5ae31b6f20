"""Named heads for CLIs and configs: the papers' output layers as compositions of pieces.

Each preset of :func:`make_head` is an :class:`~bottleneck.nn.OutputHead` with a normalizer, an
optional pointwise module and an optional mixture; its options are the constructor arguments of
those pieces, found by signature, so a new piece needs no registry entry here.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any, Literal

from flax import nnx

from bottleneck._checks import require_int
from bottleneck.nn.heads import OutputHead
from bottleneck.nn.mixtape import MixtapeHead
from bottleneck.nn.pieces import PLIF, MonotoneMLP, relu_normalizer


@dataclasses.dataclass(frozen=True)
class _Preset:
    """A named composition: normalizer, pointwise module, whether it is a mixture, head class."""

    normalizer: str = "softmax"
    pointwise: type[nnx.Module] | None = None
    mixture: bool = False
    defaults: tuple[tuple[str, Any], ...] = ()  # of the pointwise map's options
    head: type[OutputHead] = OutputHead
    num_components: int = 15  # a mixture's default K


_PRESETS: dict[str, _Preset] = {
    "softmax": _Preset(),
    "sigsoftmax": _Preset("sigsoftmax"),
    "sigmoid": _Preset("sigmoid"),
    "relu": _Preset("relu"),
    "plif": _Preset(pointwise=PLIF, defaults=(("num_knots", 100_000),)),
    "monotone_mlp": _Preset(pointwise=MonotoneMLP, defaults=(("num_hidden", 16),)),
    "mos": _Preset(mixture=True),
    "moss": _Preset("sigsoftmax", mixture=True),  # sigsoftmax components and prior, as Kanai
    "mos_plif": _Preset(pointwise=PLIF, mixture=True, defaults=(("num_knots", 100_000),)),
    # Yang et al. 2019: one softmax over gated logits, K = 4 with a sigmoid-tree gate.
    "mixtape": _Preset(mixture=True, head=MixtapeHead, num_components=4),
}
# The presets' names: "softmax", "sigsoftmax", "sigmoid", "relu", "plif", "monotone_mlp" (one
# distribution), "mos", "moss", "mos_plif" (mixtures of K distributions), "mixtape" (one softmax
# over K components' gated logits).
HEAD_NAMES = tuple(_PRESETS)
HeadName = Literal[HEAD_NAMES]  # a preset's name, as a config field's type (its CLI choices)

# The presets' option names for a piece's constructor arguments, where they differ (configs
# and CLIs hold PLIF's noise as "plif_noise").
_OPTION_NAMES = {"noise": "plif_noise"}
_CONSTRUCTOR_NAMES = {v: k for k, v in _OPTION_NAMES.items()}
_MIXTURE_OPTIONS = ("num_components", "latent_features", "latent")
# Mixtape's own options (its gates), beyond a mixture's.
_MIXTAPE_OPTIONS = ("gate", "gate_features", "token_counts", "shared_gate_below")


def _keyword_options(callable_: Callable[..., Any]) -> tuple[str, ...]:
    """Keyword arguments of ``callable_`` (rngs excluded) with their preset names."""
    parameters = inspect.signature(callable_).parameters.items()
    return tuple(
        _OPTION_NAMES.get(name, name)
        for name, parameter in parameters
        if name not in ("self", "rngs", "in_features", "vocab_size")
        and parameter.kind in (parameter.KEYWORD_ONLY, parameter.POSITIONAL_OR_KEYWORD)
    )


_HEAD_OPTIONS = tuple(
    name
    for name in _keyword_options(OutputHead.__init__)
    if name not in ("pointwise", "normalizer", *_MIXTURE_OPTIONS)
)


def _preset_options(name: str) -> tuple[str, ...]:
    """Options a preset takes beyond the head's common ones."""
    preset = _PRESETS[name]
    options = _keyword_options(preset.pointwise.__init__) if preset.pointwise is not None else ()
    if preset.normalizer == "relu":
        options += _keyword_options(relu_normalizer)
    if preset.mixture:
        options += _MIXTURE_OPTIONS
    if preset.head is MixtapeHead:
        options += _MIXTAPE_OPTIONS
    return options


def _check_preset_name(name: str) -> _Preset:
    if name not in _PRESETS:
        raise ValueError(f"unknown head {name!r}; choose one of {', '.join(HEAD_NAMES)}")
    return _PRESETS[name]


def make_head(
    name: str, in_features: int, vocab_size: int, *, rngs: nnx.Rngs, **options: Any
) -> OutputHead:
    """Builds a named preset (for CLIs): one of :data:`HEAD_NAMES`, each an :class:`OutputHead`.

    "softmax", "sigsoftmax", "sigmoid", "relu" (option ``eps``): a normalizer; "plif"
    (``num_knots``, ``bound``, ``plif_noise``) and "monotone_mlp" (``num_hidden``): a pointwise
    map under softmax; "mos", "moss" (sigsoftmax components and prior, as Kanai et al.),
    "mos_plif": mixtures (``num_components`` >= 2, default 15; ``latent_features``; ``latent``:
    ``"tanh"``, the default and Yang et al.'s for the AWD-LSTM, ``"linear"`` or a callable, see
    :class:`OutputHead`; in a Transformer prefer ``"linear"``: with tanh latents MoS trailed
    softmax badly in our runs, docs/guides/language_models.md); "mixtape":
    Yang et al. 2019's one softmax over gated logits (:class:`MixtapeHead`: ``num_components``
    default 4, ``latent_features``, ``latent``, ``gate``, ``gate_features``, and gate sharing
    by ``token_counts`` [M] with ``shared_gate_below``). Every
    preset takes :class:`OutputHead`'s common options (``tied_embedding``, ``use_bias``,
    ``memory_budget``, ``param_dtype``); any other option is a ``ValueError`` that lists those
    it does take. A seed gives the same parameters as the heads of bottleneck 0.1.0 did.
    """
    preset = _check_preset_name(name)
    accepted = _HEAD_OPTIONS + _preset_options(name)
    refused = sorted(set(options) - set(accepted))
    if refused:
        raise ValueError(
            f"head {name!r} takes no option {', '.join(refused)}; it takes {', '.join(accepted)}"
        )
    head_options = {k: v for k, v in options.items() if k in _HEAD_OPTIONS}
    mixture_names = _MIXTURE_OPTIONS + _MIXTAPE_OPTIONS
    mixture_options = {k: v for k, v in options.items() if k in mixture_names}
    piece_options = dict(preset.defaults) | {
        _CONSTRUCTOR_NAMES.get(k, k): v
        for k, v in options.items()
        if k not in _HEAD_OPTIONS and k not in mixture_names
    }
    if preset.mixture:
        mixture_options.setdefault("num_components", preset.num_components)
        require_int(
            "num_components",
            mixture_options["num_components"],
            2,
            f" for the mixture preset {name!r} (one component is a plain head)",
        )
    if preset.pointwise is not None:  # a bad option fails before any parameter is drawn
        inspect.signature(preset.pointwise.__init__).bind(None, **piece_options, rngs=rngs)
    normalizer = (
        relu_normalizer(**piece_options) if preset.normalizer == "relu" else preset.normalizer
    )
    head = preset.head(
        in_features, vocab_size, rngs=rngs, normalizer=normalizer, **mixture_options,
        **head_options,
    )  # fmt: skip
    if preset.pointwise is not None:
        # Drawn after the head's parameters, the order the heads of bottleneck 0.1.0 drew them
        # in, so that a seed gives the same parameters as before heads became compositions.
        head.pointwise = nnx.data(preset.pointwise(**piece_options, rngs=rngs))
    return head


def check_head(name: str, in_features: int = 8, vocab_size: int = 16, **options: Any) -> None:
    """``ValueError`` naming the option if :func:`make_head` would refuse ``name`` and ``options``.

    For configs and CLIs, which check a head's options before they write anything: the head is
    built abstractly (:func:`flax.nnx.eval_shape`: every check its pieces make, no parameter
    drawn, microseconds to milliseconds), so any option a piece refuses (``num_components`` of
    a mixture below 2, ``num_knots`` of a PLIF below 2, a bad ``bound``, ...) is refused here
    with the message :func:`make_head` would give. ``in_features`` and ``vocab_size`` default
    to small placeholders, enough for options that do not depend on them (those a config holds
    apart from the model); pass the real ones to check the rest (``latent_features``,
    ``token_counts``, ...).

    Example:
      >>> check_head("mos", num_components=1)
      Traceback (most recent call last):
      ValueError: num_components must be >= 2 for the mixture preset 'mos' (one component is a plain head), got 1
    """  # noqa: E501
    try:
        key = (name, in_features, vocab_size, tuple(sorted(options.items())))
        hash(key)
    except TypeError:  # an unhashable option (an array of token counts): not cached
        _build_abstractly(name, in_features, vocab_size, options)
        return
    _check_head_cached(*key)


@functools.lru_cache(maxsize=256)
def _check_head_cached(
    name: str, in_features: int, vocab_size: int, options: tuple[tuple[str, Any], ...]
) -> None:
    _build_abstractly(name, in_features, vocab_size, dict(options))


def _build_abstractly(
    name: str, in_features: int, vocab_size: int, options: dict[str, Any]
) -> None:
    try:
        nnx.eval_shape(
            lambda: make_head(name, in_features, vocab_size, rngs=nnx.Rngs(0), **options)
        )
    except ValueError as err:  # a piece names its own argument: give the preset's option name
        message = str(err)
        for constructor, option in _OPTION_NAMES.items():
            if message.startswith(f"{constructor} ") and option in options:
                message = option + message[len(constructor) :]
        raise ValueError(message) from None  # without eval_shape's frames


def check_heads(names: Iterable[str], **candidates: Any) -> None:
    """:func:`check_head` of each preset in ``names`` with the ``candidates`` it takes
    (:func:`head_options`): for configs holding several heads and every preset's options."""
    for name in dict.fromkeys(names):
        check_head(name, **head_options(name, **candidates))


def head_options(name: str, **candidates: Any) -> dict[str, Any]:
    """The subset of ``candidates`` that preset ``name`` takes beyond the common options.

    For configs that hold every preset's options.

    Example:
      >>> head_options("mos_plif", num_knots=10, num_components=4, num_hidden=8, seed=0)
      {'num_knots': 10, 'num_components': 4}
    """
    _check_preset_name(name)
    accepted = _preset_options(name)
    return {key: value for key, value in candidates.items() if key in accepted}


def is_mixture_preset(name: str) -> bool:
    """Whether preset ``name`` is a mixture (its decoder width is ``latent_features``)."""
    return _check_preset_name(name).mixture
