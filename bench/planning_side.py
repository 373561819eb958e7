"""One side of ``bench/lifecycle.py --planning-only --against REV``: the gc plans, timed, with the
cachectl of another tree (a worktree of REV, or this one) over an index already filled.

Run as ``python bench/planning_side.py TREE DB_URL NOW``; prints one JSON object: plan name ->
[best CPU s, entries, a digest of the plan's entries (environment, key, sizes, reason)], every plan
made as at ``NOW`` (ISO), so both trees' plans can be compared; and the same for the lookup of one
environment by digest (its entries and totals in the digest), and for an install's delta into it
(which entries are new and conflict, in the digest).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from datetime import datetime
from pathlib import Path
from typing import Any


def main(tree: str, db: str, now: datetime) -> dict[str, list[object]]:
    sys.path.insert(0, tree)
    import cachectl  # the tree's, imported before anything imports this repository's

    assert cachectl.__file__.startswith(tree), cachectl.__file__
    from bench import lifecycle as bl  # helpers only; cachectl stays the tree's
    from cachectl.index import open_index
    from cachectl.index.lifecycle_queries import environments
    from cachectl.lifecycle.gc import plan_gc

    index = open_index(db, auto_migrate=False)
    ctx = bl._context(db)
    ctx.__dict__["index"] = index
    cache = ctx.cache()
    envs = environments(index, bl.CACHE)
    total = sum(e.bytes for e in envs)
    env_max = int(max(e.bytes for e in envs) * 0.8)
    out: dict[str, list[object]] = {}
    for name, (op, spec) in bl.PLANS.items():
        if op != "gc":
            continue
        limited = dataclasses.replace(cache, env_max_size=env_max if spec["env"] else None)
        _, cpu, plan = bl._best(
            lambda limited=limited, spec=spec: plan_gc(
                ctx, limited, policy=spec["policy"], max_size=int(total * 0.9), now=now
            ),
            index,
        )
        rows = "\n".join(
            f"{e.environment_id} {e.key} {e.size} {e.aot_size} {e.reason}"
            for e in plan.deletion.entries
        )
        out[name] = [
            cpu,
            len(plan.deletion.entries),
            hashlib.sha256(rows.encode()).hexdigest()[:16],
        ]
    # One environment by its digest, as every install and pull looks its namespace up: its
    # totals only (1.1 s at 1,000,000 rows when they were the whole cache's).
    largest = max(envs, key=lambda e: e.entries)
    _, cpu, found = bl._best(lambda: index.get_environment(bl.CACHE, largest.digest), index)
    out[LOOKUP] = [
        cpu,
        found.entries,
        hashlib.sha256(f"{found.id} {found.entries} {found.bytes}".encode()).hexdigest()[:16],
    ]
    # An install's delta into it, by the tree's own bundle/install.py: a bundle of 2,000 entries,
    # 1,000 of them held (it read every key of the namespace before).
    _, cpu, delta = bl._best(install_delta(ctx, cache, largest, index), index)
    out[DELTA] = [
        cpu,
        len(delta.new),
        hashlib.sha256(
            f"{delta.conflicts} {[e.key for e in delta.new]} {delta.nbytes}".encode()
        ).hexdigest()[:16],
    ]
    index.close()
    return out


def install_delta(ctx: Any, cache: Any, env: Any, index: Any) -> Any:
    """The call to time: an install's delta (bundle/install.py ``_delta``, the running tree's)
    of a bundle of 2,000 entries into ``env``, 1,000 of them held and 1,000 new: which are new,
    which conflict, their bytes. It read every key of the namespace before. Here, not in
    bench/lifecycle.py (which imports it): this process imports the other tree's bench."""
    import importlib
    from types import SimpleNamespace

    # By name: the package's own `install` is a function of that name.
    install = importlib.import_module("cachectl.bundle.install")
    held = sorted(index.entry_keys(env.id).items())[:1000]
    entries = [
        SimpleNamespace(key=k, size=size, sha256=sha, aot_size=None, aot_sha256=None)
        for k, (size, sha) in held
    ] + [
        SimpleNamespace(
            key=f"jit_new-{i:064x}", size=100, sha256="0" * 64, aot_size=None, aot_sha256=None
        )
        for i in range(2000 - len(held))
    ]
    staged = SimpleNamespace(entries=entries, cache=cache, env=SimpleNamespace(digest=env.digest))
    return lambda: install._delta(ctx, staged)


LOOKUP = "one environment by digest (install's and pull's lookup)"
DELTA = "an install's delta: 2,000 entries into it, 1,000 held"


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # ``bench``, behind the tree
    print(json.dumps(main(sys.argv[1], sys.argv[2], datetime.fromisoformat(sys.argv[3]))))
