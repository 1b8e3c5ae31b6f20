"""The XLA flags under which the suite compiles, and the way back to the flags a user runs with.

The suite compiles far more than it computes (hundreds of small programs, most run once), so it
asks XLA:CPU for its cheapest compiles: no LLVM -O2 backend, and XLA's older elemental emitters
for fused loops instead of its MLIR fusion emitters. Four of tests/nn/test_heads.py's composition
programs (2-core Zen 3, other work running: ratios only) compiled in 7.8 s with neither and 4.8 s
with the first in one run, in 6.3 s with the first and 2.5 s with both in another.
Neither changes a result beyond float32 round-off, which every comparison's tolerance already
allows for between x86 CPUs.
"""

from __future__ import annotations

FAST_COMPILE_FLAGS = (
    "--xla_backend_optimization_level=0",
    "--xla_cpu_use_fusion_emitters=false",
)


def with_fast_compile(flags: str) -> str:
    """``flags`` (an ``XLA_FLAGS`` value) with :data:`FAST_COMPILE_FLAGS` added."""
    return " ".join([*without_fast_compile(flags).split(), *FAST_COMPILE_FLAGS])


def without_fast_compile(flags: str) -> str:
    """``flags`` without :data:`FAST_COMPILE_FLAGS`: how a user's run compiles."""
    return " ".join(flag for flag in flags.split() if flag not in FAST_COMPILE_FLAGS)
