"""Checks that ``import bottleneck`` finds this project's package; the experiment scripts import
this module first.

NumPy's Bottleneck (a pandas dependency) has our import name, and whichever ``bottleneck`` comes
first on the path is the one imported: this stops with one line saying what to do instead of an
attribute or import error deep in a script. It is installed beside ``bottleneck`` (a module of
its own, since the check cannot live in a package that may be the one shadowed).
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
