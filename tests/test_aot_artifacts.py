"""Stored executables (``<key>-aot``) as first-class artifacts: ls, stats, sync, verify, prune, gc, mirror.

Every cache here is warmed for real (JAX on CPU, in this process, through the
CLI) from a small manifest, so the ``-aot`` files are what `cachectl warm`
writes; an entry and its executable are one unit everywhere sizes count.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from cachectl.cli import cli
from cachectl.storage.entries import sha256

AOT_MODULE = """
import jax.numpy as jnp

def aot_affine(x, w):
    return jnp.maximum(x @ w, 0.0)

def aot_tanh(x, w):
    return jnp.tanh(x @ w)
"""

AOT_MANIFEST = """
version: 1
target: {backend: cpu}
functions:
  - fn: aot_tiny:aot_affine
    args:
      - {shape: [batch, 8], dtype: float32}
      - {shape: [8, 8], dtype: float32}
    buckets: {batch: [1, 2]}
  - fn: aot_tiny:aot_tanh
    args:
      - {shape: [batch, 8], dtype: float32}
      - {shape: [8, 8], dtype: float32}
    buckets: {batch: [1]}
"""


def run(*args: str, code: int = 0) -> str:
    result = CliRunner().invoke(cli, list(args))
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    return result.stdout


def run_json(*args: str, code: int = 0) -> Any:
    return json.loads(run(*args, "--json", code=code))


def warm(tmp_path: Path) -> Path:
    """Warm the small manifest into the default cache; the namespace directory."""
    (tmp_path / "aot_tiny.py").write_text(AOT_MODULE)
    manifest = tmp_path / "manifest.yaml"
    manifest.write_text(AOT_MANIFEST)
    report = run_json("warm", str(manifest), "--jobs", "1")
    assert report["summary"]["failed"] == 0 and report["summary"]["buckets"] == 3
    ns = Path(report["namespace"])
    assert len(list(ns.glob("*-aot"))) == 3, sorted(p.name for p in ns.iterdir())
    return ns


def files(ns: Path, suffix: str) -> dict[str, bytes]:
    return {p.name[: -len(suffix)]: p.read_bytes() for p in ns.glob(f"*{suffix}")}


def entries_json(ns: Path) -> dict[str, dict[str, Any]]:
    listing = run_json("ls", "--env", ns.name)
    return {e["key"]: e for e in listing["entries"]}


def index_db() -> Path:
    return Path(os.environ["XDG_DATA_HOME"]) / "cachectl" / "index.db"


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


# --------------------------------------------------------------------------- ls, stats


def test_ls_and_stats_show_executables_as_part_of_each_entry(tmp_path: Path) -> None:
    ns = warm(tmp_path)
    entries, aots = files(ns, "-cache"), files(ns, "-aot")
    aot_total = sum(len(b) for b in aots.values())
    total = sum(len(b) for b in entries.values()) + aot_total

    env = run_json("ls")["environments"][0]
    assert (env["entries"], env["executables"], env["aot_bytes"], env["bytes"]) == (
        3,
        3,
        aot_total,
        total,
    )
    listed = entries_json(ns)
    assert set(listed) == set(entries)
    for key, e in listed.items():
        assert e["size"] == len(entries[key])
        assert e["aot_size"] == len(aots[key]) and e["aot_sha256"] == sha256(aots[key])
    table = run("ls", "--env", ns.name)
    assert " aot " in table or "┃ aot" in table

    stats = run_json("stats")[0]
    assert (stats["entries"], stats["executables"], stats["aot_bytes"], stats["bytes"]) == (
        3,
        3,
        aot_total,
        total,
    )
    assert "aot" in run("stats")


# --------------------------------------------------------------------------- sync


def test_sync_rebuilds_aot_columns_after_the_index_is_deleted(tmp_path: Path) -> None:
    ns = warm(tmp_path)
    before = entries_json(ns)
    root = str(ns.parents[2])
    index_db().unlink()
    run("cache", "add", "default", root)

    result = run_json("sync", "--min-age", "0")
    assert result["entries_added"] == 3 and result["executables_recorded"] == 3
    after = entries_json(ns)
    assert {
        k: (e["size"], e["sha256"], e["aot_size"], e["aot_sha256"]) for k, e in after.items()
    } == {k: (e["size"], e["sha256"], e["aot_size"], e["aot_sha256"]) for k, e in before.items()}

    again = run_json("sync", "--min-age", "0")
    assert (
        again["entries_added"],
        again["entries_updated"],
        again["rows_dropped"],
        again["executables_recorded"],
        again["executables_cleared"],
    ) == (0, 0, 0, 0, 0)
    assert again["plan"]["orphan_executables"] == []
    assert entries_json(ns) == after


def test_sync_clears_a_deleted_aot_and_never_indexes_an_orphan(tmp_path: Path) -> None:
    ns = warm(tmp_path)
    gone, orphaned, *_ = sorted(files(ns, "-aot"))
    (ns / f"{gone}-aot").unlink()
    # An executable whose entry is gone: JAX's entry deleted behind the index's back.
    (ns / f"{orphaned}-cache").unlink()

    result = run_json("sync", "--min-age", "0")
    assert result["executables_cleared"] == 1 and result["rows_dropped"] == 1
    rel = ns.relative_to(ns.parents[2]).as_posix()
    assert result["plan"]["orphan_executables"] == [f"{rel}/{orphaned}-aot"]
    listed = entries_json(ns)
    assert orphaned not in listed and len(listed) == 2
    assert listed[gone]["aot_size"] is None and listed[gone]["aot_sha256"] is None
    assert (ns / f"{orphaned}-aot").exists()  # sync reports it; verify --quarantine moves it

    again = run_json("sync", "--min-age", "0")
    assert (again["rows_dropped"], again["executables_recorded"], again["executables_cleared"]) == (
        0,
        0,
        0,
    )
    assert again["plan"]["orphan_executables"] == [f"{rel}/{orphaned}-aot"]


# --------------------------------------------------------------------------- verify


def test_verify_detects_a_flipped_byte_in_an_aot_and_quarantine_moves_it(tmp_path: Path) -> None:
    ns = warm(tmp_path)
    assert run_json("verify")["plan"]["executables_checked"] == 3
    bad = sorted(files(ns, "-aot"))[0]
    flip_last_byte(ns / f"{bad}-aot")
    rel = ns.relative_to(ns.parents[2]).as_posix()

    report = run_json("verify", code=1)
    findings = report["plan"]["findings"]
    assert [(f["kind"], f["path"]) for f in findings] == [("corrupt", f"{rel}/{bad}-aot")]
    assert "checksum" in findings[0]["detail"] and "sha256 differs" in findings[0]["detail"]

    fixed = run_json("verify", "--quarantine", code=1)
    assert (
        fixed["quarantined"] == 1
        and fixed["executables_cleared"] == 1
        and fixed["rows_dropped"] == 0
    )
    assert not (ns / f"{bad}-aot").exists() and (ns / f"{bad}-cache").exists()
    moved = list((ns.parents[2] / ".quarantine").rglob(f"{bad}-aot"))
    assert len(moved) == 1
    listed = entries_json(ns)
    assert (
        len(listed) == 3 and listed[bad]["aot_sha256"] is None
    )  # the entry stays, without its executable
    assert run_json("verify")["ok"] is True


def test_verify_reports_orphan_unindexed_and_missing_executables(tmp_path: Path) -> None:
    ns = warm(tmp_path)
    orphan, unindexed, missing = sorted(files(ns, "-aot"))
    rel = ns.relative_to(ns.parents[2]).as_posix()
    (
        ns / f"{orphan}-cache"
    ).unlink()  # its -aot is now an orphan (and the entry's row points at nothing)
    (ns / f"{missing}-aot").unlink()
    # An -aot the index does not know: clear its columns (as a writer that never recorded it).
    from cachectl.index import open_index

    index = open_index(f"sqlite:///{index_db()}")
    env = index.environment_stats("default")[0]
    index.set_executables(env.id, {unindexed: None})
    index.close()

    report = run_json("verify", code=1)
    kinds = {(f["kind"], f["path"]) for f in report["plan"]["findings"]}
    assert kinds == {
        ("orphan-aot", f"{rel}/{orphan}-aot"),
        ("missing", f"{rel}/{orphan}-cache"),
        ("unknown-writer", f"{rel}/{unindexed}-aot"),
        ("missing", f"{rel}/{missing}-aot"),
    }

    fixed = run_json("verify", "--quarantine", "--min-age", "0", code=1)
    assert (
        fixed["quarantined"] == 2
        and fixed["rows_dropped"] == 1
        and fixed["executables_cleared"] == 1
    )
    assert {p.name for p in ns.glob("*-aot")} == set()
    assert (ns / f"{unindexed}-cache").exists() and (ns / f"{missing}-cache").exists()
    assert run_json("verify")["ok"] is True


# --------------------------------------------------------------------------- prune, gc


def test_gc_over_a_size_limit_removes_entry_and_aot_together(tmp_path: Path) -> None:
    ns = warm(tmp_path)
    entries, aots = files(ns, "-cache"), files(ns, "-aot")
    total = sum(len(b) for b in entries.values()) + sum(len(b) for b in aots.values())
    smallest_unit = min(len(entries[k]) + len(aots[k]) for k in entries)
    # One byte over the limit: an entry alone would not free enough, the unit does.
    limit = total - 1

    plan = run_json("gc", "--max-size", str(limit), "--dry-run")["plan"]
    assert plan["bytes_before"] == total
    (victim,) = plan["deletion"]["entries"]
    key = victim["key"]
    assert victim["size"] == len(entries[key]) and victim["aot_size"] == len(aots[key])
    assert victim["bytes"] == len(entries[key]) + len(aots[key]) >= smallest_unit
    assert [Path(f).name for f in victim["files"]] == [f"{key}-cache", f"{key}-aot"]
    assert (
        plan["deletion"]["bytes_to_free"] == victim["bytes"]
        and plan["bytes_after"] == total - victim["bytes"]
    )

    done = run_json("gc", "--max-size", str(limit))
    assert done["execution"]["entries_deleted"] == 1
    assert done["execution"]["bytes_freed"] == len(entries[key]) + len(aots[key])
    assert not (ns / f"{key}-cache").exists() and not (ns / f"{key}-aot").exists()
    assert set(files(ns, "-aot")) == set(files(ns, "-cache")) == set(entries) - {key}
    assert run_json("ls")["environments"][0]["bytes"] == total - done["execution"]["bytes_freed"]
    again = run_json("gc", "--max-size", str(limit))
    assert again["execution"]["entries_deleted"] == 0


def test_prune_dry_run_lists_entry_and_aot_and_deletes_both(tmp_path: Path) -> None:
    ns = warm(tmp_path)
    entries, aots = files(ns, "-cache"), files(ns, "-aot")
    tanh = [k for k in entries if k.startswith("jit_aot_tanh-")]
    assert len(tanh) == 1
    key = tanh[0]

    plan = run_json("prune", "--function", "aot_tanh", "--dry-run")["plan"]
    (e,) = plan["entries"]
    rel = ns.relative_to(ns.parents[2]).as_posix()
    assert e["files"] == [f"{rel}/{key}-cache", f"{rel}/{key}-aot"]
    assert (e["size"], e["aot_size"]) == (len(entries[key]), len(aots[key]))
    assert plan["bytes_to_free"] == len(entries[key]) + len(aots[key])
    table = run("prune", "--function", "aot_tanh", "--dry-run")
    assert "aot" in table and (ns / f"{key}-aot").exists()

    done = run_json("prune", "--function", "aot_tanh")
    assert done["execution"]["bytes_freed"] == len(entries[key]) + len(aots[key])
    assert not (ns / f"{key}-cache").exists() and not (ns / f"{key}-aot").exists()
    assert len(files(ns, "-aot")) == 2
    # Re-runnable: nothing left to select, and storage and index agree.
    assert run_json("prune", "--function", "aot_tanh")["plan"]["entries"] == []
    assert run_json("verify")["ok"] is True


# --------------------------------------------------------------------------- mirror


def test_mirror_pull_copies_aot_and_refuses_a_tampered_one(tmp_path: Path) -> None:
    ns = warm(tmp_path)
    aots = files(ns, "-aot")
    mirror = tmp_path / "mirror"
    pulled = run_json("pull", "--to", str(mirror))
    assert (pulled["copied"], pulled["executables_copied"], pulled["executables_indexed"]) == (
        3,
        3,
        3,
    )
    assert files(mirror, "-aot") == aots
    assert pulled["bytes_copied"] == sum(len(b) for b in files(ns, "-cache").values()) + sum(
        len(b) for b in aots.values()
    )
    again = run_json("pull", "--to", str(mirror))
    assert (again["executables_copied"], again["executables_present"]) == (0, 3)

    tampered = sorted(aots)[0]
    flip_last_byte(ns / f"{tampered}-aot")
    fresh = tmp_path / "fresh"
    refused = run_json("pull", "--to", str(fresh), code=1)
    assert [(p["key"], p["reason"].split(":")[0]) for p in refused["refused"]] == [
        (tampered, "stored executable")
    ]
    assert "sha256" in refused["refused"][0]["reason"]
    assert refused["copied"] == 3 and refused["executables_copied"] == 2
    assert not (fresh / f"{tampered}-aot").exists() and (fresh / f"{tampered}-cache").exists()


def test_mirror_push_uploads_executables_with_their_entries(tmp_path: Path) -> None:
    ns = warm(tmp_path)
    aots = files(ns, "-aot")
    mirror = tmp_path / "mirror"
    run_json("pull", "--to", str(mirror))
    other_root = tmp_path / "other-root"
    run("cache", "add", "other", str(other_root))
    # One local executable that is not what its header says: refused, its entry still goes.
    bad = sorted(aots)[0]
    flip_last_byte(mirror / f"{bad}-aot")

    pushed = run_json("--cache", "other", "push", "--from", str(mirror), code=1)
    assert (pushed["uploaded"], pushed["executables_uploaded"]) == (3, 2)
    assert [(p["key"], p["reason"].split(":")[0]) for p in pushed["refused"]] == [
        (bad, "stored executable")
    ]
    shared = other_root / ns.relative_to(ns.parents[2])
    assert files(shared, "-aot") == {k: v for k, v in aots.items() if k != bad}
    listed = {e["key"]: e for e in run_json("--cache", "other", "ls", "--env", ns.name)["entries"]}
    assert {k for k, e in listed.items() if e["aot_sha256"]} == set(aots) - {bad}
    assert all(listed[k]["aot_sha256"] == sha256(aots[k]) for k in set(aots) - {bad})
    assert run_json("--cache", "other", "verify")["ok"] is True
