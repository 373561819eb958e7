"""A bucket writer without a signing key against a cache that trusts keys, end to end.

Every step is a fresh process (`python -m cachectl`, a service in `run_py`) on real files: a
signed warm of a tiny manifest, a file planted or rewritten in the namespace, `sync`, a signed
re-warm, then `pull` and `cachectl.serving`. The planted pickle would create a marker file when
unpickled; it must never exist.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.infra import run_py  # noqa: E402
from support.warming import tiny  # noqa: E402

from cachectl.storage import executables  # noqa: E402

SERVE = """
import json, sys
sys.path.insert(0, {dir!r})
import cachectl
rt = cachectl.serving({manifest!r}, mirror={mirror!r})
report = rt.report()
print(json.dumps({{"loaded": sum(f.loaded for f in report.functions.values()),
                  "fallback": sum(f.fallback for f in report.functions.values()),
                  "warnings": report.warnings,
                  "why": sorted({{w for w in rt.executables().values() if w}})}}))
"""

EVIL_KEY = "jit_evil-" + "e" * 64


class _Marker:
    """Unpickling this runs a shell command: what a planted executable would do."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, (f"touch {self.path}",)


def cachectl(*args: str, code: int | None = 0, env: dict[str, str] | None = None) -> Any:
    done = subprocess.run(
        [sys.executable, "-m", "cachectl", *args],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})},
    )
    if code is not None:
        assert done.returncode == code, (done.returncode, done.stdout[-2000:], done.stderr[-3000:])
    return done


def serve(
    tmp_path: Path,
    manifest: Path,
    env: dict[str, str | None] | None = None,
    mirror: Path | None = None,
) -> Any:
    code = SERVE.format(
        dir=str(tmp_path), manifest=str(manifest), mirror=str(mirror) if mirror else None
    )
    proc = run_py(code, env, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def evil_executable(original: bytes, marker: Path, **fields: Any) -> bytes:
    """An ``-aot`` whose header reads like ``original``'s (overridden by ``fields``) and whose
    payload is a pickle that runs a command."""
    h = executables.read_header(original)
    header = {
        "key": h.key,
        "entry_sha256": h.entry_sha256,
        "function": h.function,
        "bucket": h.bucket,
        "spec_digest": h.spec_digest,
        "source_digest": h.source_digest,
        "custom_calls": h.custom_calls,
        **fields,
    }
    return executables.pack(pickle.dumps(_Marker(marker)), **header)


@pytest.fixture
def signed(tmp_path: Path) -> dict[str, Any]:
    """A cache that trusts one key, warmed in a fresh process with that key."""
    key = tmp_path / "ci.key"
    pub = json.loads(cachectl("key", "generate", str(key), "--json").stdout)["public_path"]
    cachectl("cache", "set", "default", "--trust", pub)
    manifest = tiny(tmp_path)
    report = json.loads(cachectl("warm", str(manifest), "--sign-key", str(key), "--json").stdout)
    assert report["summary"]["compiled"] == 5
    ns = Path(report["namespace"])
    assert (ns / "signature.json").is_file()
    return {"key": key, "pub": pub, "manifest": manifest, "ns": ns, "report": report}


def _layer_key(report: dict[str, Any]) -> str:
    return next(b["key"] for b in report["buckets"] if b["function"] == "layer")


@pytest.mark.timeout(600)
def test_a_planted_entry_is_refused_alone_and_a_signed_rewarm_never_signs_it(
    tmp_path: Path, signed: dict[str, Any]
) -> None:
    """Issue 22 item 1, a file copied in as ``jit_evil-<hex>-cache`` with an ``-aot`` that claims
    the ``layer`` bucket (it sorts before the real one, so a loader that trusts it picks it)."""
    ns, manifest, key = signed["ns"], signed["manifest"], signed["key"]
    marker = tmp_path / "pwned"
    real = _layer_key(signed["report"])
    (ns / f"{EVIL_KEY}-cache").write_bytes((ns / f"{real}-cache").read_bytes())
    (ns / f"{EVIL_KEY}-aot").write_bytes(
        evil_executable((ns / f"{real}-aot").read_bytes(), marker, key=EVIL_KEY)
    )

    synced = json.loads(cachectl("sync", "--min-age", "0", "--json").stdout)
    assert synced["entries_added"] == 1

    # One planted file is not a denial of service: every signed bucket still loads.
    served = serve(tmp_path, manifest)
    assert (served["loaded"], served["fallback"]) == (5, 0), served
    assert not marker.exists()
    # sync marked what it indexed without a signature.
    rel = str(ns.relative_to(ns.parents[2]))
    assert synced["unsigned"] == [f"{rel}/{EVIL_KEY}-aot", f"{rel}/{EVIL_KEY}-cache"]

    # pull copies the signed entries and refuses the planted one, without advising to sign it.
    pulled = cachectl("pull", "--to", str(tmp_path / "m1"), "--json", code=None)
    out = json.loads(pulled.stdout)
    assert out["copied"] == 5 and out["executables_copied"] == 5
    assert {p["key"] for p in out["refused"]} == {EVIL_KEY}
    for problem in out["refused"]:
        assert "signed content list" in problem["reason"]
        assert "warm or push again" not in problem["reason"]
    assert not (tmp_path / "m1" / f"{EVIL_KEY}-cache").exists()

    # A signed re-warm of the manifest compiles nothing, and signs only what it signed before.
    rewarm = cachectl("warm", str(manifest), "--sign-key", str(key), "--json")
    assert json.loads(rewarm.stdout)["summary"]["cached"] == 5
    assert "2 indexed file(s) left unsigned" in rewarm.stderr and EVIL_KEY in rewarm.stderr
    listed = {
        f["name"] for f in json.loads((ns / "signature.json").read_text())["content"]["files"]
    }
    assert f"{EVIL_KEY}-cache" not in listed and f"{EVIL_KEY}-aot" not in listed

    out = json.loads(cachectl("pull", "--to", str(tmp_path / "m2"), "--json", code=None).stdout)
    assert {p["key"] for p in out["refused"]} == {EVIL_KEY} and out["copied"] == 5
    assert not (tmp_path / "m2" / f"{EVIL_KEY}-aot").exists()
    served = serve(tmp_path, manifest)
    assert (served["loaded"], served["fallback"]) == (5, 0), served
    assert not marker.exists()
    # activate(mirror=) pulls the same way: the signed files only.
    mirrored = serve(tmp_path, manifest, mirror=tmp_path / "m3")
    assert mirrored["loaded"] == 5 and not marker.exists(), mirrored
    assert not (tmp_path / "m3" / f"{EVIL_KEY}-cache").exists()
    assert (tmp_path / "m3" / "signature.json").is_file()


@pytest.mark.timeout(600)
def test_a_rewritten_executable_is_refused_and_a_signed_rewarm_replaces_it(
    tmp_path: Path, signed: dict[str, Any]
) -> None:
    """Issue 22 item 1, an ``-aot`` rewritten in place so its payload is a pickle."""
    ns, manifest, key = signed["ns"], signed["manifest"], signed["key"]
    marker = tmp_path / "pwned"
    real = _layer_key(signed["report"])
    target = ns / f"{real}-aot"
    evil = evil_executable(target.read_bytes(), marker)
    target.write_bytes(evil)

    synced = json.loads(cachectl("sync", "--min-age", "0", "--json").stdout)
    assert synced["entries_updated"] + synced["executables_recorded"] >= 1

    served = serve(tmp_path, manifest)  # no Untrusted: that one bucket goes through jax.jit
    assert (served["loaded"], served["fallback"]) == (4, 0), served
    assert not marker.exists()
    assert [p.rsplit("/", 1)[1] for p in synced["unsigned"]] == [f"{real}-aot"]

    rewarm = cachectl("warm", str(manifest), "--sign-key", str(key), "--json")
    summary = json.loads(rewarm.stdout)["summary"]
    assert (summary["compiled"], summary["cached"]) == (1, 4), summary
    assert "left unsigned" not in rewarm.stderr
    assert target.read_bytes() != evil

    out = json.loads(cachectl("pull", "--to", str(tmp_path / "m"), "--json").stdout)
    assert (out["copied"], out["executables_copied"], out["refused"]) == (5, 5, [])
    served = serve(tmp_path, manifest)
    assert (served["loaded"], served["fallback"]) == (5, 0), served
    assert not marker.exists()


@pytest.mark.timeout(600)
def test_serving_without_the_index_verifies_with_the_trusted_key_alone(
    tmp_path: Path, signed: dict[str, Any]
) -> None:
    """Issue 22 item 2: CACHECTL_DB at a missing database, CACHECTL_ROOT set, a tampered ``-aot``."""
    ns, manifest = signed["ns"], signed["manifest"]
    marker = tmp_path / "pwned"
    root = str(ns.parents[2])
    (tmp_path / "not-a-dir").write_text("")  # the database cannot be created under a file
    no_index = {"CACHECTL_DB": f"sqlite:///{tmp_path}/not-a-dir/index.db", "CACHECTL_ROOT": root}

    target = ns / f"{_layer_key(signed['report'])}-aot"
    original = target.read_bytes()
    target.write_bytes(evil_executable(original, marker))
    pinned = {**no_index, "CACHECTL_TRUST": signed["pub"]}
    served = serve(tmp_path, manifest, pinned)
    assert not marker.exists()
    assert (served["loaded"], served["fallback"]) == (4, 0), served
    assert not any("UNVERIFIED" in w for w in served["warnings"])

    # A signature that does not verify (altered, or gone): nothing loads, one warning says why.
    signature = ns / "signature.json"
    doc = json.loads(signature.read_text())
    doc["content"]["files"] = doc["content"]["files"][:-1]
    signature.write_text(json.dumps(doc))
    refused = serve(tmp_path, manifest, pinned)
    assert refused["loaded"] == 0 and not marker.exists()
    assert sum("no stored executable loads" in w for w in refused["warnings"]) == 1
    signature.unlink()
    gone = serve(tmp_path, manifest, pinned)
    assert gone["loaded"] == 0 and not marker.exists()
    assert any("has no signed content list" in w for w in gone["warnings"])

    # No index and no trusted key pinned: loaded, and the warning says they are unverified.
    target.write_bytes(original)
    plain = serve(tmp_path, manifest, no_index)
    assert plain["loaded"] == 5, plain
    assert any("UNVERIFIED" in w for w in plain["warnings"]), plain
