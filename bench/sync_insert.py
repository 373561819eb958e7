"""Where `cachectl sync`'s index writes spend their CPU: its 20,000 new rows, written the ways issue 49 asked about.

    python bench/sync_insert.py [--quick]

Prints a table (no BENCHMARKS.md section of its own: "sync as a whole process" quotes it). Each
round copies one fresh SQLite index (made by ``open_index``, the cache and one environment added
through sync's own ``SyncIndex``), then times, in a shuffled order, one transaction of the same
20,000 rows (keys, modules, sizes and digests as sync makes them, in key order as sync reads them):

- ``sync``: sync's own write (``SyncIndex.insert_observed_rows`` on the ``stdlib`` driver: one
  ``INSERT ... SELECT`` over ``json_each`` a 10,000 rows);
- ``executemany``: the same rows bound a row at a time (sqlite3's ``executemany``);
- ``sync + PRAGMA X``: sync's write on a connection with one more setting that keeps the index's
  promise (a committed sync survives a crash of the process): ``temp_store = MEMORY``, ``mmap_size``,
  ``cache_spill = OFF``;
- ``sync, without index I``: sync's write where index I was dropped from the scratch copy: what each
  of the entries table's b-trees costs the insert (a measurement, not a proposal to drop one).

CPU is this process's ``time.process_time()`` around the transaction (SQLite runs in it); medians
with min-max.
"""

from __future__ import annotations

import hashlib
import random
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import machine_line  # noqa: E402

N = 20_000
INDEXES = (
    "ix_entries_created",
    "ix_entries_env_created",
    "ix_entries_env_last_access",
    "ix_entries_function",
    "ix_entries_warm_run",
    "ix_entries_last_used",
    "ix_entries_env_last_used",
    "ix_entries_env_plan",
)
PRAGMAS = ("temp_store = MEMORY", "mmap_size = 268435456", "cache_spill = OFF")


def _rows() -> list[tuple[str, str, int, str]]:
    rng = random.Random(0)
    rows = []
    for i in range(N):
        module = f"jit_f{i % 50}"
        key = f"{module}-{hashlib.sha256(str(i).encode()).hexdigest()}"
        rows.append((key, module, rng.randint(256, 2048), hashlib.sha256(key.encode()).hexdigest()))
    return sorted(rows)


def _template(work: Path) -> tuple[Path, int]:
    """A fresh index at the current schema with cache ``default`` and one environment; its id."""
    from cachectl.core.fingerprint import Environment
    from cachectl.index import open_index
    from cachectl.index.reads import SqliteReader
    from cachectl.index.sync_queries import SyncIndex, open_driver

    path = work / "template.db"
    url = f"sqlite:///{path}"
    index = open_index(url)
    index.add_cache("default", str(work / "cache"))
    index.close()
    reader = SqliteReader.open(url)
    assert reader is not None
    driver = open_driver("stdlib", url, reader)
    assert driver is not None, "this SQLite cannot serve sync's stdlib driver"
    writes = SyncIndex(driver)
    env = Environment(
        "0.10.2", "0.10.2", "cpu", "cpu", "cpu", 1, 1, "kinds:cpu", (), "zstandard", "none", False
    )
    env_id = writes.ensure_environment("default", env)
    writes.close()
    reader.conn.close()
    return path, env_id


def _fresh(template: Path, work: Path) -> Path:
    path = work / "round.db"
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    shutil.copyfile(template, path)
    return path


def _sync_write(path: Path, env_id: int, rows: list, pragma: str | None) -> float:
    """Sync's own row write on its stdlib driver; ``pragma`` set on its connection first."""
    from cachectl.index.reads import SqliteReader
    from cachectl.index.sync_queries import SyncIndex, open_driver

    url = f"sqlite:///{path}"
    reader = SqliteReader.open(url)
    assert reader is not None
    driver = open_driver("stdlib", url, reader)
    assert driver is not None
    if pragma:
        driver.conn.execute(f"PRAGMA {pragma}")  # type: ignore[attr-defined]
    writes = SyncIndex(driver)
    started = time.process_time()
    inserted, _ = writes.insert_observed_rows(env_id, rows)
    cpu = time.process_time() - started
    assert inserted == len(rows)
    writes.close()
    reader.conn.close()
    return cpu


def _executemany(path: Path, env_id: int, rows: list) -> float:
    """The same rows and shared values, bound a row at a time."""
    from cachectl.core.sqlite_file import SQLITE_CACHE_KIB, stamp
    from cachectl.index.sync_queries import shared_columns

    conn = sqlite3.connect(path, isolation_level=None)
    for pragma in (
        "foreign_keys = ON",
        "synchronous = NORMAL",
        f"cache_size = -{SQLITE_CACHE_KIB}",
    ):
        conn.execute(f"PRAGMA {pragma}")
    shared = shared_columns()
    shared["created_at"] = stamp(shared["created_at"])
    shared["bucket"] = "null"
    names = ("key", "module", "size_bytes", "sha256", "environment_id", *shared)
    sql = (
        f"INSERT INTO entries ({', '.join(names)}) VALUES ({', '.join('?' * len(names))}) "
        "ON CONFLICT DO NOTHING"
    )
    values = (env_id, *shared.values())
    started = time.process_time()
    conn.execute("BEGIN IMMEDIATE")
    conn.executemany(sql, [(*row, *values) for row in rows])
    conn.execute("COMMIT")
    cpu = time.process_time() - started
    conn.close()
    return cpu


def _with(pragma: str | None) -> Callable[[Path, int, list], float]:
    return lambda path, env_id, rows: _sync_write(path, env_id, rows, pragma)


def _without(index_name: str) -> Callable[[Path, int, list], float]:
    def run(path: Path, env_id: int, rows: list) -> float:
        conn = sqlite3.connect(path)
        conn.execute(f"DROP INDEX {index_name}")
        conn.commit()
        conn.close()
        return _sync_write(path, env_id, rows, None)

    return run


def run(quick: bool = False) -> dict[str, list[float]]:
    rounds = 3 if quick else 5
    work = Path(tempfile.mkdtemp(prefix="cachectl-bench-insert-"))
    try:
        (work / "cache").mkdir()
        template, env_id = _template(work)
        rows = _rows()
        sides: dict[str, Callable[[Path, int, list], float]] = {
            "sync": _with(None),
            "executemany": _executemany,
        }
        for pragma in PRAGMAS:
            sides[f"sync + PRAGMA {pragma}"] = _with(pragma)
        for name in INDEXES:
            sides[f"sync, without {name}"] = _without(name)
        samples: dict[str, list[float]] = {side: [] for side in sides}
        for _ in range(rounds):
            for side in random.sample(list(sides), len(sides)):
                samples[side].append(sides[side](_fresh(template, work), env_id, rows))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return samples


def markdown(samples: dict[str, list[float]]) -> str:
    base = statistics.median(samples["sync"])
    lines = [
        f"{N:,} new rows in one transaction, {len(samples['sync'])} rounds shuffled. {machine_line()} "
        "CPU medians (min–max).",
        "",
        "| write | CPU | against sync's |",
        "|---|---|---|",
    ]
    for side, values in samples.items():
        median = statistics.median(values)
        lines.append(
            f"| {side} | {median:.3f} s ({min(values):.3f}–{max(values):.3f}) | {median / base:.2f}x |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(run(quick="--quick" in sys.argv)))
