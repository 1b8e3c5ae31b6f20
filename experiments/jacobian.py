"""Orhan's Jacobian spectra: a dense ReLU layer is degenerate, a mixture of experts is not.

Orhan, "The softmax bottleneck is a special case of a more general phenomenon" (2018). For a
width -> width layer evaluated at standard normal inputs x_b, compute the singular values of the
input-output Jacobian J(x_b) = dy/dx and average them over the inputs (sorted descending):

- Dense: y = relu(x W), Glorot-uniform W, no bias. About half of the units are off at any input,
  so J = diag(relu'(x W)) W^T has about half of its singular values exactly 0.
- DenseMoE with K ReLU experts and softmax gates: y = sum_k g_k(x) relu(x W_k), g = softmax(x V).
- DenseMoE with constant gates g_k = 1/K (Orhan's ablation): the sum alone breaks the degeneracy.

Biases are left out as in the note (they start at zero anyway). All layers see the same inputs;
the constant-gate layer with K experts has the same expert kernels as the gated one.

Writes to --out_dir: config.json, results.json (spectra and near-zero counts), results.csv (one
row per layer), singular_values.png (the note's figures), metrics.jsonl (per-layer timing).

    python experiments/jacobian.py smoke --out_dir /tmp/jacobian
"""

from __future__ import annotations

import softmax_bottleneck  # noqa: F401  # isort: skip  (first: checks that `bottleneck` is ours)
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Sequence

# JAX's CPU SVD calls OpenBLAS LAPACK once per small matrix; OpenBLAS's own threads only contend
# with XLA's (on a busy 2-core machine a [300, 128, 128] SVD went from ~0.3 s to 3-70 s). Must be
# set before OpenBLAS loads; an explicit setting in the environment wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import bottleneck as bn
from bottleneck.nn.moe import DenseMoE
from bottleneck.runs import RunDir, markdown_table, open_run, parse_config, progress, pyplot
from bottleneck.runs.cli import Checked, Count


@dataclasses.dataclass(frozen=True)
class Config(Checked):
    """Jacobian singular values of a dense ReLU layer vs. mixture-of-experts layers (Orhan)."""

    width: Count = 128  # input and output size
    num_inputs: Count = 300  # standard normal inputs to average the spectra over
    experts: tuple[Count, ...] = (2, 4, 8, 16)  # numbers of experts K, one MoE layer pair each
    seed: int = 0
    out_dir: str = "runs/jacobian"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.experts:
            raise ValueError("experts must list at least one number of experts")
        if len(set(self.experts)) != len(self.experts):
            raise ValueError(f"experts must be distinct, got {' '.join(map(str, self.experts))}")
        if not self.out_dir:
            raise ValueError("out_dir must not be empty")


PRESETS = {
    "smoke": Config(width=16, num_inputs=20, experts=(2, 4)),
    "paper": Config(num_inputs=1000),
}

# A mean singular value counts as ~0 below this fraction of the dense layer's largest one.
NEAR_ZERO_RELATIVE = 1e-3


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """One analysed layer: the dense baseline (gates "none", K = 1) or a DenseMoE."""

    name: str
    num_experts: int
    gates: str  # "none" (dense), "softmax" (input-dependent) or "constant" (1/K)


def layer_specs(experts: Sequence[int]) -> list[LayerSpec]:
    """Dense first, then the gated MoE layers, then the constant-gate ones, by K."""
    gated = [LayerSpec(f"MoE K={k}", k, "softmax") for k in experts]
    constant = [LayerSpec(f"MoE K={k} (constant gates)", k, "constant") for k in experts]
    return [LayerSpec("Dense", 1, "none"), *gated, *constant]


def build_layer(spec: LayerSpec, width: int, key: jax.Array) -> Callable[[jax.Array], jax.Array]:
    """The layer as a function ``[width] -> [width]``, initialised from ``key``."""
    rngs = nnx.Rngs(params=key)
    if spec.gates == "none":
        dense = nnx.Linear(
            width,
            width,
            use_bias=False,
            kernel_init=nnx.initializers.glorot_uniform(),
            rngs=rngs,
        )
        return lambda x: jax.nn.relu(dense(x))
    return DenseMoE(
        width,
        width,
        spec.num_experts,
        rngs=rngs,
        expert_activation=jax.nn.relu,
        gate_activation=jax.nn.softmax,
        constant_gates=spec.gates == "constant",
        use_bias=False,
    )


def layer_key(params_key: jax.Array, spec: LayerSpec) -> jax.Array:
    """Key for a layer's parameters: one per K, so gated and constant-gate MoEs share experts."""
    return jax.random.fold_in(params_key, 0 if spec.gates == "none" else spec.num_experts)


def mean_jacobian_singular_values(f: Callable[[jax.Array], jax.Array], xs: jax.Array) -> np.ndarray:
    """``[width]`` mean over ``xs [num_inputs, width]`` of the Jacobian's descending singular values."""
    # jit around the vmapped jacfwd + SVD: the layer's parameters become compile-time constants.
    return np.asarray(jax.jit(lambda xs: bn.jacobian_singular_values(f, xs))(xs))


def plot_spectra(layers: list[dict], title: str, path: str) -> None:
    """Orhan's figures side by side: mean singular value against its index, one line per layer."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    ks = sorted({layer["K"] for layer in layers if layer["gates"] != "none"})
    colours = {k: plt.cm.viridis(i / max(len(ks) - 1, 1)) for i, k in enumerate(ks)}
    panels = [("softmax", "input-dependent (softmax) gates"), ("constant", "constant gates 1/K")]
    for ax, (gates, panel_title) in zip(axes, panels, strict=True):
        for layer in layers:
            if layer["gates"] not in ("none", gates):
                continue
            values = np.asarray(layer["singular_values"])
            index = np.arange(1, len(values) + 1)
            if layer["gates"] == "none":
                ax.plot(index, values, color="tab:blue", lw=2, label="Dense")
            else:
                ax.plot(index, values, color=colours[layer["K"]], label=f"MoE (K={layer['K']})")
        ax.set_title(f"Dense vs. MoE, {panel_title}")
        ax.set_xlabel("singular value index")
        ax.legend(frameon=False)
    axes[0].set_ylabel("mean singular value of the Jacobian")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summary_row(layer: dict) -> dict:
    """A layer's row of results.csv: its near-zero count and its spectrum's extremes."""
    return {
        "layer": layer["name"],
        "K": layer["K"],
        "gates": layer["gates"],
        "near_zero_count": layer["near_zero_count"],
        "largest": layer["singular_values"][0],
        "median": float(np.median(layer["singular_values"])),
        "smallest": layer["singular_values"][-1],
    }


def run(config: Config, out: RunDir) -> list[dict]:
    """Compute every layer's mean spectrum; write results.json, results.csv, the plot; return rows."""
    inputs_key, params_key = jax.random.split(jax.random.key(config.seed))
    xs = jax.random.normal(inputs_key, (config.num_inputs, config.width), jnp.float32)

    layers = []
    bar = progress(layer_specs(config.experts), desc="layers")
    for spec in bar:
        bar.set_postfix_str(spec.name)
        # Timed with the initialisation: on CPU, compiling the random initialisers for each new
        # shape costs about as much as the Jacobians themselves.
        start = time.perf_counter()
        f = build_layer(spec, config.width, layer_key(params_key, spec))
        values = mean_jacobian_singular_values(f, xs)
        seconds = time.perf_counter() - start
        out.log_metrics({"layer": spec.name, "seconds": seconds})
        layers.append(
            {
                "name": spec.name,
                "K": spec.num_experts,
                "gates": spec.gates,
                "constant_gates": None if spec.gates == "none" else spec.gates == "constant",
                "singular_values": values.tolist(),
            }
        )

    # The threshold is relative to the dense layer so that every layer is judged on one scale.
    threshold = NEAR_ZERO_RELATIVE * max(layers[0]["singular_values"])
    for layer in layers:
        layer["near_zero_count"] = int(np.sum(np.asarray(layer["singular_values"]) < threshold))

    out.write_json(
        "results.json",
        {
            "description": "mean over inputs of the Jacobian's singular values, descending (Orhan)",
            "near_zero_definition": (
                f"mean singular value < {NEAR_ZERO_RELATIVE:g} x the dense layer's largest mean "
                "singular value"
            ),
            "near_zero_relative": NEAR_ZERO_RELATIVE,
            "near_zero_threshold": threshold,
            "width": config.width,
            "num_inputs": config.num_inputs,
            "seed": config.seed,
            "layers": layers,
        },
    )
    rows = [summary_row(layer) for layer in layers]
    out.write_csv("results.csv", rows)
    title = (
        f"Mean Jacobian singular values over {config.num_inputs} standard normal inputs, "
        f"width {config.width} (~0: < {threshold:.3g})"
    )
    plot_spectra(layers, title, str(out.path("singular_values.png")))
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    config = parse_config(Config, PRESETS, argv)
    out = open_run(config.out_dir, config)
    start = time.perf_counter()
    rows = run(config, out)
    seconds = time.perf_counter() - start

    print(
        f"Jacobian spectra: width {config.width}, {config.num_inputs} standard normal inputs, "
        f"seed {config.seed} ({seconds:.1f} s)"
    )
    threshold = NEAR_ZERO_RELATIVE * rows[0]["largest"]
    print(
        f"near_zero_count: mean singular values < {NEAR_ZERO_RELATIVE:g} x Dense's largest "
        f"= {threshold:.3g}, out of {config.width}\n"
    )
    print(markdown_table(rows))
    print(f"\nwrote config.json, results.json, results.csv, singular_values.png to {out.root}")


if __name__ == "__main__":
    main(sys.argv[1:])
