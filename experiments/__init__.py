"""The experiment scripts: ``python experiments/NAME.py`` or ``python -m experiments.NAME``.

A package (installed with the project, ``pip install -e .``), so that the scripts import one
another as ``from experiments import language_model`` wherever they run from. Each script
imports it first: NumPy's Bottleneck (a pandas dependency) has our import name, and whichever
``bottleneck`` comes first on the path is the one imported, so this checks that it is ours and
otherwise stops with one line saying what to do instead of an attribute error deep in a script.
"""

import sys

import bottleneck

if getattr(bottleneck, "__distribution__", None) != "softmax-bottleneck":
    sys.exit(
        f"error: `import bottleneck` found {bottleneck.__file__} (version "
        f"{getattr(bottleneck, '__version__', 'unknown')}): another project's package of the same "
        "name (NumPy's Bottleneck, which pandas installs), not softmax-bottleneck's; install "
        "softmax-bottleneck in a virtual environment of its own (README, Install)"
    )
