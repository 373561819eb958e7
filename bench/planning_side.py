"""One side of ``bench/lifecycle.py --planning-only --against REV``: the gc plans, timed, with the
cachectl of another tree (a worktree of REV, or this one) over an index already filled.

Run as ``python bench/planning_side.py TREE DB_URL NOW``; prints one JSON object: plan name ->
[best CPU s, entries, a digest of the plan's entries (environment, key, sizes, reason)], every plan
made as at ``NOW`` (ISO), so both trees' plans can be compared; and the same for the lookup of one
environment by digest (its entries and totals in the digest).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from datetime import datetime
from pathlib import Path


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
    index.close()
    return out


LOOKUP = "one environment by digest (install's and pull's lookup)"


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # ``bench``, behind the tree
    print(json.dumps(main(sys.argv[1], sys.argv[2], datetime.fromisoformat(sys.argv[3]))))
