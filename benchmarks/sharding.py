"""Per-device memory and step time of the vocabulary/data-parallel head loss on fake CPU devices.

Two parts, both on ``XLA_FLAGS=--xla_force_host_platform_device_count=n`` fake CPU devices. The
number of devices is fixed when JAX starts, so every device count runs in a subprocess of this
script (``--worker TASK --devices n``, printing one JSON line) and the parent collects them.

* Memory scaling at the WikiText-2 shape (``N = 80 x 70 = 5600`` tokens, ``d = 400``,
  ``M = 33,278``) on 1, 2, 4 and 8 devices with the vocabulary sharded over all of them
  (``make_mesh("vocab=n")``), for the softmax, PLIF (1e5 knots) and MoS-15 heads: the compiled
  temporaries of ``jax.value_and_grad`` of ``head.loss`` w.r.t. (parameters, h)
  (``compiled.memory_analysis().temp_size_in_bytes``) and the parameter bytes held by one
  device, each against the 1-device value (ideal: ``1/n``). It is compiled only: ``h`` and the
  labels are ``jax.ShapeDtypeStruct``\\ s with a ``NamedSharding``; the parameters are real.
  For an SPMD-partitioned executable ``memory_analysis()`` describes one device's program: each
  worker checks that on a vocab-sharded ``[n * 1024, 256]`` input, whose argument bytes must
  be ``1/n`` of the global array (recorded as ``per_device_check``). The largest regions of
  the temporary allocation come from XLA's buffer assignment (``--xla_dump_to`` of the loss
  module only), to say where memory that does not fall as ``1/n`` goes. With 8 devices the
  meshes ``data=2,vocab=4`` and ``data=8`` are compiled too, for comparison.
* Step time of the softmax head's ``value_and_grad`` at the PTB shape (``N = 1400``,
  ``d = 400``, ``M = 10,000``): data=1 on one device against data=8 on 8 fake devices,
  interleaved in the 8-device process, plus data=1 alone in a 1-device process; and the
  difference between their losses and gradients. The fake devices share the machine's
  cores, so the total work, and roughly the time, stay the same: this part checks correctness
  and that sharding costs little, not a speed-up.

Run from the repository root:

    python benchmarks/sharding.py [--quick] [--out benchmarks/results/sharding.json]

``--quick`` times 1 repetition instead of 3 (the memory part is the same). The markdown tables
are printed and saved next to the JSON file, with the suffix ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from _shapes import PTB, WT2
from _timing import (
    machine_info,
    markdown_table,
    median_ratio,
    medians,
    time_interleaved,
    write_results,
)
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from bottleneck import nn
from bottleneck.losses import DEFAULT_MEMORY_BUDGET, chunk_size_for_budget
from bottleneck.sharding import DATA, VOCAB, make_mesh, padded_vocab_size, shard_batch, shard_model

DEVICE_COUNTS = (1, 2, 4, 8)
MEMORY_HEADS = {
    "softmax": {},
    "plif": {"num_knots": 100_000, "plif_noise": 1.0},
    "mos": {"num_components": 15},
}
# Meshes compiled on the largest device count besides vocab=n, to show the data axis' share.
EXTRA_LAYOUTS = ("data=2,vocab=4", "data=8")
TIMED_HEAD = "softmax"
INPUT_SEED = 1
LOSS_MODULE = "sharded_head_loss"  # name of the jitted function: XLA dumps only this module
BUFFER_REGION_MIN_BYTES = 2**20
MIB = 2**20


def loadavg() -> list[float]:
    return [round(load, 2) for load in os.getloadavg()]


# ----------------------------------------------------------------------------- worker side


def make_loss_grad(head: nn.OutputHead) -> tuple[Callable, nnx.State]:
    """Jitted ``value_and_grad`` of ``head.loss`` w.r.t. (state, h), and the head's state."""
    graphdef, state = nnx.split(head)

    def sharded_head_loss(state: nnx.State, h: jax.Array, labels: jax.Array) -> jax.Array:
        return nnx.merge(graphdef, state).loss(h, labels)

    assert sharded_head_loss.__name__ == LOSS_MODULE
    return jax.jit(jax.value_and_grad(sharded_head_loss, argnums=(0, 1))), state


def per_device_param_bytes(state: nnx.State) -> int:
    """Bytes of every parameter's shard on the first device."""
    return sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(state))


def global_param_bytes(state: nnx.State) -> int:
    return sum(leaf.nbytes for leaf in jax.tree.leaves(state))


def temp_regions(dump_dir: Path, seen: set[Path]) -> dict[str, Any]:
    """The ``preallocated-temp`` allocation of the newest loss module XLA dumped.

    Returns its size and its regions of at least 1 MiB: byte offset, size, and the shapes and
    HLO values that occupy the region at different times (buffer assignment reuses memory).
    """
    new = sorted(set(dump_dir.glob(f"*{LOSS_MODULE}*buffer-assignment.txt")) - seen)
    seen.update(new)
    if not new:
        return {"error": "no buffer assignment dumped"}
    allocation = re.compile(r"^allocation \d+: size (\d+), (.*):$")
    value = re.compile(r"^ value: <\d+ (\S+) @\S+> \(size=(\d+),offset=(\d+)\): (\S+)")
    size, regions, in_temp = None, {}, False
    for line in new[-1].read_text().splitlines():
        match = allocation.match(line)
        if match:
            in_temp = "preallocated-temp" in match.group(2)
            size = int(match.group(1)) if in_temp else size
            continue
        match = value.match(line) if in_temp else None
        if match and int(match.group(2)) >= BUFFER_REGION_MIN_BYTES:
            name, nbytes, offset = match.group(1), int(match.group(2)), int(match.group(3))
            shape = re.sub(r"\{[^}]*\}", "", match.group(4))
            region = regions.setdefault((offset, nbytes), {"shapes": [], "values": []})
            if shape not in region["shapes"]:
                region["shapes"].append(shape)
            region["values"].append(name)
    ordered = sorted(regions.items(), key=lambda item: (-item[0][1], item[0][0]))
    return {
        "allocation_bytes": size,
        "regions": [
            {
                "offset": offset,
                "mib": round(nbytes / MIB, 3),
                "shapes": region["shapes"],
                "values": region["values"][:6],
            }
            for (offset, nbytes), region in ordered
        ],
    }


def per_device_check(mesh: jax.sharding.Mesh) -> dict[str, Any]:
    """Argument bytes of a vocab-sharded input: ``1/n`` of the array iff per-device stats."""
    shards = dict(mesh.shape)[VOCAB]
    spec = jax.ShapeDtypeStruct(
        (shards * 1024, 256), jnp.float32, sharding=NamedSharding(mesh, P(VOCAB))
    )
    stats = jax.jit(lambda x: 2 * x).lower(spec).compile().memory_analysis()
    global_bytes = shards * 1024 * 256 * 4
    return {
        "devices": shards,
        "global_array_bytes": global_bytes,
        "argument_size_in_bytes": int(stats.argument_size_in_bytes),
        "per_device": int(stats.argument_size_in_bytes) == global_bytes // shards,
    }


def memory_case(name: str, layout: str, dump_dir: Path | None, seen: set[Path]) -> dict[str, Any]:
    """Compiled memory of one head's loss value_and_grad at the WT2 shape on ``layout``."""
    mesh = make_mesh(layout)
    with jax.set_mesh(mesh):  # the head is built and traced for the mesh
        head = nn.make_head(name, WT2.dim, WT2.vocab, rngs=nnx.Rngs(0), **MEMORY_HEADS[name])
        shard_model(head, mesh)
        loss_grad, state = make_loss_grad(head)
        tokens = NamedSharding(mesh, P(DATA))
        h = jax.ShapeDtypeStruct((WT2.tokens, WT2.dim), jnp.float32, sharding=tokens)
        labels = jax.ShapeDtypeStruct((WT2.tokens,), jnp.int32, sharding=tokens)
        start = time.perf_counter()
        compiled = loss_grad.lower(state, h, labels).compile()
        compile_s = time.perf_counter() - start
    stats = compiled.memory_analysis()
    sizes = dict(mesh.shape)
    # As head.loss sizes them: each device's tokens and columns, its share of the budget.
    local_tokens = -(-WT2.tokens // sizes[DATA])
    chunk = chunk_size_for_budget(
        local_tokens,
        -(-head.elements_per_token // sizes[VOCAB]),
        DEFAULT_MEMORY_BUDGET // mesh.size,
        head.buffers_per_element,
    )
    result = {
        "layout": layout,
        "mesh": sizes,
        "options": MEMORY_HEADS[name],
        "padded_vocab": padded_vocab_size(WT2.vocab, mesh),
        "temp_bytes": int(stats.temp_size_in_bytes),
        "argument_bytes": int(stats.argument_size_in_bytes),
        "output_bytes": int(stats.output_size_in_bytes),
        "alias_bytes": int(stats.alias_size_in_bytes),
        "peak_bytes": int(stats.peak_memory_in_bytes),
        "param_bytes": per_device_param_bytes(state),
        "global_param_bytes": global_param_bytes(state),
        "hidden_bytes_per_device": WT2.tokens * WT2.dim * 4 // sizes[DATA],
        "chunk_tokens_per_device": chunk,
        "num_chunks": -(-local_tokens // chunk),
        "chunk_columns_per_device": head.num_components
        * padded_vocab_size(WT2.vocab, mesh)
        // sizes[VOCAB],
        "compile_s": round(compile_s, 2),
    }
    if dump_dir is not None:
        result["temp_buffers"] = temp_regions(dump_dir, seen)
    return result


def worker_memory(devices: int, dump_dir: Path | None) -> dict[str, Any]:
    layouts = [f"vocab={devices}"] + (list(EXTRA_LAYOUTS) if devices == max(DEVICE_COUNTS) else [])
    seen: set[Path] = set()
    return {
        "per_device_check": per_device_check(make_mesh(f"vocab={devices}")),
        "cases": {
            f"{name}:{layout}": memory_case(name, layout, dump_dir, seen)
            for layout in layouts
            for name in MEMORY_HEADS
        },
    }


def max_abs_difference(a: Any, b: Any) -> float:
    """Largest ``|a - b|`` over the leaves, on the host (the arrays live on different devices)."""
    return max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def worker_timing(devices: int, repeats: int) -> dict[str, Any]:
    """data=1 on the first device (and data=n on all n, interleaved): times and agreement."""
    # Not key(0): the head's parameters come from nnx.Rngs(0), and h drawn from the same key
    # bits would be nearly parallel to decoder rows (a loss of ~22.6 instead of ~log M).
    hidden_key, labels_key = jax.random.split(jax.random.key(INPUT_SEED))
    h = jax.random.normal(hidden_key, (PTB.tokens, PTB.dim), jnp.float32)
    labels = jax.random.randint(labels_key, (PTB.tokens,), 0, PTB.vocab)
    meshes = {"data=1": make_mesh("data=1", jax.devices()[:1])}
    if devices > 1:
        meshes[f"data={devices}"] = make_mesh(f"data={devices}")
    calls: dict[str, Callable[[], Any]] = {}
    outputs: dict[str, Any] = {}
    for layout, mesh in meshes.items():
        with jax.set_mesh(mesh):
            head = nn.make_head(TIMED_HEAD, PTB.dim, PTB.vocab, rngs=nnx.Rngs(0))
        shard_model(head, mesh)
        loss_grad, state = make_loss_grad(head)
        args = (state, shard_batch(h, mesh), shard_batch(labels, mesh))

        def call(loss_grad=loss_grad, args=args, layout=layout, mesh=mesh) -> Any:
            with jax.set_mesh(mesh):
                outputs[layout] = loss_grad(*args)
            return outputs[layout]

        calls[layout] = call
    load_before = loadavg()
    times = time_interleaved(calls, repeats)
    median_ms = medians(times)
    result: dict[str, Any] = {
        "loadavg_before": load_before,
        "loadavg_after": loadavg(),
        "repeats": repeats,
        "layouts": {
            layout: {
                "median_ms": median_ms[layout],
                "times_ms": [round(t, 2) for t in times[layout]],
                "loss": float(outputs[layout][0]),
            }
            for layout in calls
        },
    }
    if devices > 1:
        sharded = f"data={devices}"
        result["ratio_sharded_to_single"] = median_ratio(times[sharded], times["data=1"])
        result["loss_abs_difference"] = abs(
            float(outputs[sharded][0]) - float(outputs["data=1"][0])
        )
        result["grad_max_abs_difference"] = max_abs_difference(
            outputs[sharded][1], outputs["data=1"][1]
        )
    return result


def worker(task: str, devices: int, repeats: int, dump_dir: Path | None) -> None:
    assert jax.device_count() == devices, f"expected {devices} devices, got {jax.device_count()}"
    if task == "memory":
        result = worker_memory(devices, dump_dir)
    else:
        result = worker_timing(devices, repeats)
    print(json.dumps({"devices": devices, "task": task, **result}))


# ----------------------------------------------------------------------------- parent side


def run_worker(task: str, devices: int, repeats: int, dump_root: Path) -> dict[str, Any]:
    """Runs this script as ``--worker task`` on ``devices`` fake CPU devices; its JSON line."""
    flags = [
        flag
        for flag in os.environ.get("XLA_FLAGS", "").split()
        if not flag.startswith(("--xla_force_host_platform_device_count", "--xla_dump"))
    ]
    flags.append(f"--xla_force_host_platform_device_count={devices}")
    command = [sys.executable, __file__, "--worker", task, "--devices", str(devices)]
    command += ["--repeats", str(repeats)]
    if task == "memory":
        dump_dir = dump_root / f"{task}{devices}"
        flags += [f"--xla_dump_to={dump_dir}", f"--xla_dump_hlo_module_re={LOSS_MODULE}"]
        command += ["--dump-dir", str(dump_dir)]
    env = {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stderr)
        raise RuntimeError(f"worker {task} on {devices} devices failed ({done.returncode})")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["wall_s"] = round(time.perf_counter() - start, 1)
    return result


def ratio(value: float, baseline: float) -> str:
    return f"{value / baseline:.3f}"


def memory_rows(memory: dict[int, dict[str, Any]]) -> list[list[object]]:
    rows = []
    for devices, result in memory.items():
        for name in MEMORY_HEADS:
            case = result["cases"][f"{name}:vocab={devices}"]
            single = memory[1]["cases"][f"{name}:vocab=1"]
            rows.append(
                [
                    devices,
                    name,
                    case["temp_bytes"] / MIB,
                    case["param_bytes"] / MIB,
                    ratio(case["temp_bytes"], single["temp_bytes"]),
                    ratio(case["param_bytes"], single["param_bytes"]),
                    f"{1 / devices:.3f}",
                ]
            )
    return rows


def layout_rows(memory: dict[int, dict[str, Any]]) -> list[list[object]]:
    devices = max(DEVICE_COUNTS)
    rows = []
    for layout in (f"vocab={devices}", *EXTRA_LAYOUTS):
        for name in MEMORY_HEADS:
            case = memory[devices]["cases"][f"{name}:{layout}"]
            single = memory[1]["cases"][f"{name}:vocab=1"]
            rows.append(
                [
                    layout,
                    name,
                    case["temp_bytes"] / MIB,
                    case["param_bytes"] / MIB,
                    ratio(case["temp_bytes"], single["temp_bytes"]),
                    ratio(case["param_bytes"], single["param_bytes"]),
                ]
            )
    return rows


def largest_regions(case: dict[str, Any], count: int = 4) -> str:
    regions = case.get("temp_buffers", {}).get("regions", [])[:count]
    return "; ".join(f"{r['mib']:.1f} MiB {'/'.join(r['shapes'][:3])}" for r in regions)


def report(
    memory: dict[int, dict[str, Any]],
    single: dict[str, Any],
    sharded: dict[str, Any],
    repeats: int,
    load: Sequence[list[float]],
    runtime: float,
) -> str:
    top = max(DEVICE_COUNTS)
    check = {n: memory[n]["per_device_check"] for n in memory}
    text = (
        "# Sharded head loss: per-device memory and step time (fake CPU devices)\n\n"
        f"## Memory: WikiText-2 batch, N = {WT2.batch} x {WT2.steps} = {WT2.tokens} tokens, "
        f"d = {WT2.dim}, M = {WT2.vocab:,}, mesh vocab=n\n\n"
        "Compiled temporaries of `value_and_grad(head.loss)` w.r.t. (parameters, h) "
        "(`memory_analysis().temp_size_in_bytes`) and parameter bytes, per device; ratios to the "
        "1-device value (ideal: 1/devices). PLIF: 1e5 knots; MoS: 15 components. "
        "`memory_analysis()` describes one device: a vocab-sharded array's argument bytes are "
        "1/n of its size on every device count: "
        f"{'yes' if all(c['per_device'] for c in check.values()) else '**no**'}.\n\n"
    )
    text += markdown_table(
        [
            "devices",
            "head",
            "temp MiB/device",
            "params MiB/device",
            "ratio to 1 device (temp)",
            "ratio to 1 device (params)",
            "1/devices",
        ],
        memory_rows(memory),
    )
    text += (
        f"\nLargest temporary regions on {top} devices (XLA buffer assignment; a region holds "
        "several buffers in turn). The chunk loop runs inside one `shard_map` and reads `h` and "
        "writes `dL/dh` in place, so no temporary the size of the replicated hidden states "
        f"`[N, d]` ({WT2.tokens * WT2.dim * 4 / MIB:.1f} MiB) remains; the decoder gradient "
        "shard `[M/n, d]` falls as 1/n. What does not shrink with vocabulary sharding: the "
        "replicated parameters and their gradients (MoS's latent projection `[400, 6000]`):\n\n"
    )
    for name in MEMORY_HEADS:
        text += f"- {name}: {largest_regions(memory[top]['cases'][f'{name}:vocab={top}'])}\n"
    text += f"\n## Memory on {top} devices by mesh layout (same shape)\n\n"
    text += markdown_table(
        [
            "mesh",
            "head",
            "temp MiB/device",
            "params MiB/device",
            "ratio to 1 device (temp)",
            "ratio to 1 device (params)",
        ],
        layout_rows(memory),
    )
    layouts = sharded["layouts"]
    text += (
        f"\n## Step time: PTB batch, N = {PTB.tokens}, d = {PTB.dim}, M = {PTB.vocab:,}, "
        f"{TIMED_HEAD} head\n\n"
        f"`value_and_grad(head.loss)`, median of {repeats} repetition(s); data=1 and "
        f"data={top} interleaved in one {top}-device process. The {top} fake devices share "
        f"the machine's {os.cpu_count()} cores, so the total work (and about the time) is the "
        "same: this checks correctness and memory scaling, not a speed-up.\n\n"
    )
    text += markdown_table(
        ["mesh", "process", "median ms", "loss"],
        [
            [
                "data=1",
                "1 device",
                single["layouts"]["data=1"]["median_ms"],
                f"{single['layouts']['data=1']['loss']:.6f}",
            ],
            *[
                [layout, f"{top} devices", r["median_ms"], f"{r['loss']:.6f}"]
                for layout, r in layouts.items()
            ],
        ],
    )
    text += (
        f"\ndata={top} / data=1 (median per-repetition ratio): "
        f"{sharded['ratio_sharded_to_single']:.2f}; |loss difference| "
        f"{sharded['loss_abs_difference']:.2e}; max |gradient difference| "
        f"{sharded['grad_max_abs_difference']:.2e}.\n\n"
        f"Load average (1, 5, 15 min): {load[0]} before, {load[1]} after; "
        f"{os.cpu_count()} CPUs. Total runtime {runtime:.0f} s.\n"
    )
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 timed repetition instead of 3")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/sharding.json"))
    parser.add_argument("--worker", choices=("memory", "timing"), help=argparse.SUPPRESS)
    parser.add_argument("--devices", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=3, help=argparse.SUPPRESS)
    parser.add_argument("--dump-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.devices, args.repeats, args.dump_dir)
        return

    start = time.perf_counter()
    repeats = 1 if args.quick else 3
    load_start = loadavg()
    tasks = [("memory", n) for n in DEVICE_COUNTS] + [("timing", 1), ("timing", max(DEVICE_COUNTS))]
    results: dict[tuple[str, int], dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="sharding-bench-") as dump_root:
        progress = tqdm(tasks, desc="workers", unit="process")
        for task, devices in progress:
            progress.set_postfix_str(f"{task} on {devices} device(s)")
            results[task, devices] = run_worker(task, devices, repeats, Path(dump_root))
    load_end = loadavg()
    runtime = time.perf_counter() - start

    memory = {n: results["memory", n] for n in DEVICE_COUNTS}
    single, sharded = results["timing", 1], results["timing", max(DEVICE_COUNTS)]
    text = report(memory, single, sharded, repeats, (load_start, load_end), runtime)
    print(text, end="")
    write_results(
        args.out,
        {
            "benchmark": "sharding",
            "machine": machine_info(),
            "command": "python benchmarks/sharding.py" + (" --quick" if args.quick else ""),
            "loadavg_before": load_start,
            "loadavg_after": load_end,
            "runtime_s": runtime,
            "dtype": "float32",
            "memory_budget_bytes": DEFAULT_MEMORY_BUDGET,
            "loss": "value_and_grad(head.loss, argnums=(state, h)); compiled only for memory",
            "memory_analysis": "per device (per_device_check: argument bytes of a vocab-sharded "
            "array = global bytes / n)",
            "memory": {
                "shape": {**asdict(WT2), "tokens": WT2.tokens},
                "heads": MEMORY_HEADS,
                "ratios_to_1_device": {
                    f"{name}:vocab={n}": {
                        "temp": memory[n]["cases"][f"{name}:vocab={n}"]["temp_bytes"]
                        / memory[1]["cases"][f"{name}:vocab=1"]["temp_bytes"],
                        "params": memory[n]["cases"][f"{name}:vocab={n}"]["param_bytes"]
                        / memory[1]["cases"][f"{name}:vocab=1"]["param_bytes"],
                        "ideal": 1 / n,
                    }
                    for n in DEVICE_COUNTS
                    for name in MEMORY_HEADS
                },
                "by_devices": {str(n): result for n, result in memory.items()},
            },
            "timing": {
                "shape": {**asdict(PTB), "tokens": PTB.tokens},
                "head": TIMED_HEAD,
                "repeats": repeats,
                "note": "fake CPU devices share the cores: equal total work, so about equal "
                "time is expected; the point is correctness and memory scaling",
                "single_device_process": single,
                f"{max(DEVICE_COUNTS)}_device_process": sharded,
            },
        },
        text,
    )


if __name__ == "__main__":
    main()
