"""A bounded load test on loopback: a real `cachectl serve` process, N requests at 50 concurrent, no errors.

The run stops by itself (a fixed request count). It is bench/server.py's
quick run with 600 requests here (CACHECTL_TEST_LOAD_REQUESTS to change it);
`python bench/server.py` runs 5,000 and writes the numbers to BENCHMARKS.md.
No timing is asserted: this machine is shared.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import server as bench_server  # noqa: E402


def test_load_without_errors() -> None:
    requests = int(os.environ.get("CACHECTL_TEST_LOAD_REQUESTS", "600"))
    result = bench_server.run(quick=True, requests=requests, concurrency=50)
    load = result["load"]
    assert load["errors"] == 0, load["error_samples"]
    assert sum(e["requests"] for e in load["endpoints"].values()) == requests
    assert all(e["errors"] == 0 and e["requests"] > 0 for e in load["endpoints"].values())
    assert result["server_errors_logged"] == 0
    assert result["download"]["http_ms"] > 0 and result["download"]["disk_ms"] > 0
    assert "| GET entry (64 KiB) |" in bench_server.markdown(result)
