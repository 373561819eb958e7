"""A small serving loop over the example LM, dispatched by cachectl.serving.

    cachectl warm examples/manifest.yaml        # once, on the serving hardware
    python examples/serve.py --requests 20      # every request served with zero compiles

Each request is a prompt of random length and batch size. The runtime pads it
to the smallest warmed bucket (on the host), calls the executable warm stored
for that bucket, and cuts the logits back to the prompt's own positions. The
prompt is padded on the right and attention is causal, so the padded positions
change nothing the prompt's own positions see; decoding starts at the prompt's
length and overwrites the padded part of the kv cache as it goes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10, help="how many requests to serve")
    parser.add_argument("--new-tokens", type=int, default=4, help="tokens generated per request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--manifest", default=str(HERE / "manifest.yaml"))
    parser.add_argument(
        "--cache", default=None, help="cachectl cache name (default: CACHECTL_CACHE)"
    )
    parser.add_argument("--json", action="store_true", help="print the runtime report as JSON only")
    parser.add_argument(
        "--writes",
        action="store_true",
        help="write what this replica compiles to the cache (replicas of a fleet on a cold cache: "
        "with the compile lease, one compiles each program and the others read it)",
    )
    args = parser.parse_args(argv)

    started = time.perf_counter()
    import jax

    import cachectl
    from examples import lm

    rt = cachectl.serving(args.manifest, cache=args.cache, readonly=not args.writes)
    prefill, decode = rt["prefill"], rt["decode_step"]
    ready = time.perf_counter() - started
    # Weights and the sampling key come from the host (a real service restores a checkpoint):
    # made with jax.random they would compile programs no manifest warms, each a miss.
    params = jax.device_put(lm.host_params(0))
    key = np.array([0, args.seed], np.uint32)  # = jax.random.PRNGKey(seed) for a 32-bit seed
    rng = np.random.default_rng(args.seed)
    if not args.json:
        print(
            f"ready in {ready:.2f}s ({len(rt.names)} functions, "
            f"{sum(f['loaded'] for f in rt.report().to_dict()['functions'].values())} executables loaded)"
        )

    for n in range(args.requests):
        batch = int(rng.integers(1, 5))
        length = int(rng.integers(1, 65))
        tokens = rng.integers(0, lm.CONFIG.vocab, size=(batch, length), dtype=np.int32)
        t0 = time.perf_counter()
        logits, kv = prefill(params, tokens)  # logits cut to [batch, length, vocab]
        token = np.argmax(logits[:, -1], axis=-1).astype(np.int32)[:, None]
        # decode's bucket is the batch the prefill ran in: the kv cache came back padded to it.
        rows = kv.shape[2]
        token = np.pad(token, ((0, rows - batch), (0, 0)))
        out = [token[:batch, 0]]
        for step in range(args.new_tokens):
            token, kv = decode(params, kv, token, np.int32(length + step), key, sampling="greedy")
            out.append(np.asarray(token)[:batch, 0])
        ms = (time.perf_counter() - t0) * 1000
        if not args.json:
            print(
                f"request {n:3d}: batch {batch} x {length:2d} tokens -> {args.new_tokens + 1} new "
                f"in {ms:7.1f} ms  first row {np.stack(out, 1)[0].tolist()}"
            )

    report = rt.report().to_dict()
    print(json.dumps(report if args.json else report["functions"], indent=None if args.json else 1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
