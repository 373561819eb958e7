"""A bounded load test on loopback: a real `cachectl serve` process, N requests at 50 concurrent, no errors.

The run stops by itself (a fixed request count). It is bench/server.py's
quick run with 600 requests here (CACHECTL_TEST_LOAD_REQUESTS to change it);
`python bench/server.py` runs 5,000 and writes the numbers to BENCHMARKS.md.
No timing is asserted: this machine is shared.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import server as bench_server  # noqa: E402

# Read at import: the autouse isolated_home fixture clears CACHECTL_* before each test.
REQUESTS = int(os.environ.get("CACHECTL_TEST_LOAD_REQUESTS", "600"))


def test_load_without_errors() -> None:
    requests = REQUESTS
    result = bench_server.run(quick=True, requests=requests, concurrency=50)
    load = result["load"]
    assert load["errors"] == 0, load["error_samples"]
    assert sum(e["requests"] for e in load["endpoints"].values()) == requests
    assert all(e["errors"] == 0 and e["requests"] > 0 for e in load["endpoints"].values())
    assert result["server_errors_logged"] == 0
    assert result["download"]["http_ms"] > 0 and result["download"]["disk_ms"] > 0
    assert "| GET entry (64 KiB) |" in bench_server.markdown(result)


def test_a_server_process_freezes_its_startup_heap(tmp_path) -> None:
    """What `cachectl serve` builds before the first request is out of the collector's scans: a full
    collection under load (about one a second) then scans only what requests made, not the ~100k
    objects of the app and its modules (a 40-50 ms pause each: POST telemetry's p99). In a fresh
    process, since frozen objects are never collected."""
    code = (
        "import gc, sys\nfrom cachectl_server.app import create_app, freeze_startup_heap\n"
        "create_app(sys.argv[1])\nbefore = len(gc.get_objects())\nfrozen = freeze_startup_heap()\n"
        "print(before, frozen, len(gc.get_objects()))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, f"sqlite:///{tmp_path}/index.db"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    before, frozen, after = map(int, out.split())
    assert frozen >= before // 2 > 10_000
    assert after < before // 100
