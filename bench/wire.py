"""The client's decoder: one page of entries (1000 EntryInfo) from JSON, before and after TypeAdapter.

`python bench/wire.py [--quick] [--write]`. The decoder before the change is the
hand-written ``from_jsonable`` of cachectl/core/jsonable.py at commit 83f1114, read
from git; the other side is today's ``cachectl.core.jsonable.from_jsonable``
(pydantic's TypeAdapter). Both decode the same 1000 records, alternating.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
import types
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, stats, write_section
from cachectl.core.jsonable import from_jsonable, to_jsonable
from cachectl.core.records import EntryInfo

SECTION = "## Client wire decoding"
BEFORE = "83f1114"
PAGE = 1000


def _old_decoder() -> Any:
    source = subprocess.run(
        ["git", "show", f"{BEFORE}:cachectl/core/jsonable.py"],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    module = types.ModuleType("jsonable_before")
    sys.modules[module.__name__] = module  # dataclass/type-hint lookups need the module registered
    exec(compile(source, f"{BEFORE}:cachectl/core/jsonable.py", "exec"), module.__dict__)  # noqa: S102
    return module.from_jsonable


def _page() -> list[Any]:
    at = datetime(2026, 1, 2, tzinfo=UTC)
    entries = [
        EntryInfo(
            key=f"jit_f-{i:060d}",
            module="jit_f",
            size=1000 + i,
            sha256=f"{i:064x}",
            compile_time_ms=1200,
            origin="warm",
            function="f",
            bucket={"batch": 8, "seq": 128},
            created_at=at,
            last_access_at=at,
            hit_count=i,
            environment_id=1,
            aot_size=2000,
            aot_sha256=f"{i:064x}",
        )
        for i in range(PAGE)
    ]
    return json.loads(json.dumps(to_jsonable(entries)))


def run(quick: bool = False) -> dict[str, Any]:
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    old = _old_decoder()
    data = _page()
    sides = {
        "before": lambda: [old(EntryInfo, d) for d in data],
        "after": lambda: [from_jsonable(EntryInfo, d) for d in data],
    }
    assert sides["before"]() == sides["after"](), "both decoders must build the same records"
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(5 if quick else 15):
        for name, fn in sides.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    result = {name: stats([t * 1000 for t in ts]) for name, ts in times.items()}
    return {
        "load_average": load,
        "page": PAGE,
        "ms": result,
        "ratio": result["before"]["median"] / result["after"]["median"],
    }


def markdown(r: dict[str, Any]) -> str:
    rows = [
        f"| {name} | {s['median']:.1f} | {s['min']:.1f} – {s['max']:.1f} | {s['n']} |"
        for name, s in (
            ("hand-written decoder (before)", r["ms"]["before"]),
            ("TypeAdapter, cached per type (after)", r["ms"]["after"]),
        )
    ]
    return "\n".join(
        [
            SECTION,
            "",
            "Produced by `python bench/wire.py --write`: decoding one page of entries "
            f"({r['page']} `EntryInfo` from JSON, as `RemoteIndex.list_entries` does), the two "
            "decoders alternating in one process. "
            f"Load average {r['load_average']} at the start; {os.cpu_count()} cores shared with other "
            f"engineers' test runs; Python {platform.python_version()}.",
            "",
            "| decoder | median ms | min – max ms | n |",
            "|---|---:|---:|---:|",
            *rows,
            "",
            f"- before / after: **{r['ratio']:.1f}x**.",
            "",
        ]
    )


if __name__ == "__main__":
    result = run(quick="--quick" in sys.argv)
    text = markdown(result)
    if "--write" in sys.argv:
        write_section(SECTION, text)
    print(json.dumps(result, indent=2) if "--json" in sys.argv else text)
