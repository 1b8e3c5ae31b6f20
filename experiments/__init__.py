"""The experiment scripts: ``python experiments/NAME.py`` or ``python -m experiments.NAME``.

A package (installed with the project, ``pip install -e .``), so that the scripts import one
another as ``from experiments import language_model`` wherever they run from.
"""
