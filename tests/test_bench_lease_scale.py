"""bench/lease_scale.py at its smallest: 8 simulated replicas x 3 keys on a real server over
PostgreSQL, and 2 nodes x 2 processes reading the entries into their node tiers.

One compile per key (the lease's promise) and at most one GET per entry per node (the node
tier's), from the script's own JSON: a benchmark whose figures are wrong fails here first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_lease_scale_smallest_run_compiles_each_key_once(pg_admin_url: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHECTL_")}
    env["CACHECTL_TEST_PG_URL"] = pg_admin_url
    done = subprocess.run(
        [
            *[sys.executable, str(REPO / "bench" / "lease_scale.py"), "--json", "--no-write"],
            *["--replicas", "8", "--keys", "3", "--die", "0", "--median", "0.3"],
            *["--workers", "1", "--client-procs", "1"],
            *["--nodes", "2", "--per-node", "2", "--tier-procs", "1"],
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    healthy = out["rounds"][0]
    assert out["index"] == "postgresql"
    assert healthy["misses"] == 8 * 3
    assert healthy["compiles_per_key"] == {"max": 1, "total": 3}
    assert healthy["written_per_key"] == {"min": 1, "max": 1}
    assert healthy["outcomes"] == {"compiled": 3, "read": 21}
    assert healthy["errors"] == {} and healthy["lease_off_replicas"] == 0
    assert healthy["takeovers"] == 0 and healthy["deaths"] == 0
    assert healthy["lease_requests_per_s"] > 0 and healthy["server_cpu_s"] > 0
    tier = out["tier"]
    assert tier["problem_count"] == 0, tier["problems"]
    assert tier["gets_per_entry_per_node"]["max"] == 1
    assert tier["gets"] == 2 * 3
    assert out["server_tracebacks"] == 0
