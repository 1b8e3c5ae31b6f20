"""The experiment scripts: ``python experiments/NAME.py`` (or ``python -m experiments.NAME`` from
the checkout's root). Each is presets and ``main`` over :mod:`bottleneck`; none imports another,
and none is installed with the package."""
