"""One process of the two-process test in tests/test_sharding.py (2 CPU devices each).

Usage: ``python tests/multihost_worker.py PROCESS_ID PORT``; prints one JSON line.
"""

from __future__ import annotations

import json
import sys

from bottleneck.sharding import initialize_distributed

if __name__ == "__main__":
    process_id, port = int(sys.argv[1]), sys.argv[2]
    initialize_distributed(f"localhost:{port}", 2, process_id)

    import jax
    import numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from bottleneck import nn
    from bottleneck.sharding import make_mesh, shard_model

    tokens, dim, vocab = 16, 8, 30
    rng = np.random.default_rng(0)  # every process builds the same global batch
    h = rng.standard_normal((tokens, dim)).astype(np.float32)
    labels = rng.integers(0, vocab, tokens).astype(np.int32)

    mesh = make_mesh("data=2,vocab=2")  # spans both processes' devices
    with jax.set_mesh(mesh):
        head = shard_model(
            nn.make_head("mos", dim, vocab, rngs=nnx.Rngs(0), num_components=2), mesh
        )
        rows = slice(process_id * tokens // 2, (process_id + 1) * tokens // 2)
        global_h = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), h[rows])
        global_labels = jax.make_array_from_process_local_data(
            NamedSharding(mesh, P("data")), labels[rows]
        )
        sharded = nnx.jit(lambda m, h, y: m.loss(h, y))(head, global_h, global_labels)

    single = nn.make_head("mos", dim, vocab, rngs=nnx.Rngs(0), num_components=2)
    local = jax.jit(lambda m, h, y: m.loss(h, y))(
        single, jax.device_put(h, jax.local_devices()[0]), labels
    )
    print(
        json.dumps(
            {
                "process": jax.process_index(),
                "processes": jax.process_count(),
                "devices": jax.device_count(),
                "sharded_loss": float(sharded),
                "single_device_loss": float(local),
            }
        )
    )
