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
    # verify names the records that disagree: index rows no signed list vouches for (issue 67).
    checked = json.loads(cachectl("verify", "--json", code=None).stdout)["plan"]["findings"]
    assert {(f["kind"], f["path"].rsplit("/", 1)[-1]) for f in checked} == {
        ("records-disagree", f"{EVIL_KEY}-cache"),
        ("records-disagree", f"{EVIL_KEY}-aot"),
    }, checked

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
    assert sum("nothing is read from cache" in w for w in refused["warnings"]) == 1
    signature.unlink()
    gone = serve(tmp_path, manifest, pinned)
    assert gone["loaded"] == 0 and not marker.exists()
    assert any("has no signed content list" in w for w in gone["warnings"])

    # No index and no trusted key: nothing can verify, so nothing loads (issue 50); only the
    # opt-in that says it runs unverified code loads them, and the warning says so.
    target.write_bytes(original)
    plain = serve(tmp_path, manifest, no_index)
    assert plain["loaded"] == 0, plain
    assert any("cannot be verified" in w for w in plain["warnings"]), plain
    opted = serve(tmp_path, manifest, {**no_index, "CACHECTL_RUN_UNVERIFIED_CODE": "1"})
    assert opted["loaded"] == 5, opted
    assert any("UNVERIFIED" in w for w in opted["warnings"]), opted


# -- issue 50: nothing unverified runs in a service, by default ------------------------------------

CALL = """
import json, sys, logging
import numpy as np
sys.path.insert(0, {dir!r})
import jax
import cachectl
hits = {{"n": 0}}
jax.monitoring.register_event_listener(
    lambda e, **kw: hits.__setitem__("n", hits["n"] + (e == "/jax/compilation_cache/cache_hits")))
report = None
if {serving!r}:
    rt = cachectl.serving({manifest!r})
    f = rt["affine"]
else:
    import wm_tiny
    cachectl.activate()
    f = jax.jit(wm_tiny.affine, static_argnames=["mode"])
x, w = np.ones((1, 8), np.float32), np.ones((8, 8), np.float32)
out = float(np.asarray(f(x, w, mode="relu")).ravel()[0])
loaded = None
if {serving!r}:
    report = rt.report()
    loaded = sum(f.loaded for f in report.functions.values())
print(json.dumps({{"out": out, "hits": hits["n"], "loaded": loaded}}))
"""

RELU = 8.0  # relu(ones(1, 8) @ ones(8, 8)); the tanh bucket's program gives tanh(8.0), about 1.0


def call(
    tmp_path: Path, manifest: Path, env: dict[str, str | None] | None = None, *, serving: bool
) -> tuple[dict[str, Any], str]:
    """One service in a fresh process: its answer for affine(batch 1, relu), and its stderr."""
    code = CALL.format(dir=str(tmp_path), manifest=str(manifest), serving=serving)
    proc = run_py(code, env, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def _affine_keys(report: dict[str, Any]) -> tuple[str, str]:
    """(relu, tanh) keys of affine at batch 1: two programs with the same signature."""
    found = {
        b["bucket"]["mode"]: b["key"]
        for b in report["buckets"]
        if b["function"] == "affine" and b["bucket"]["batch"] == 1
    }
    return found["relu"], found["tanh"]


@pytest.mark.timeout(600)
def test_a_swapped_jax_entry_never_runs_in_a_trusted_service_index_up_or_down(
    tmp_path: Path, signed: dict[str, Any]
) -> None:
    """Issue 50 finding 1: another program's JAX entry copied over ``relu``'s. Its stored
    executable is refused, and the bucket's jax.jit must not read the swapped entry either:
    it compiles in memory and answers relu's value, through cachectl.serving and through a
    plain activate() service, with the index and without it (CACHECTL_TRUST, signature.json)."""
    ns, manifest = signed["ns"], signed["manifest"]
    relu, tanh = _affine_keys(signed["report"])
    before, _ = call(tmp_path, manifest, serving=False)
    assert before["out"] == RELU and before["hits"] == 1, before
    (ns / f"{relu}-cache").write_bytes((ns / f"{tanh}-cache").read_bytes())

    (tmp_path / "not-a-dir").write_text("")
    no_index = {
        "CACHECTL_DB": f"sqlite:///{tmp_path}/not-a-dir/index.db",
        "CACHECTL_ROOT": str(ns.parents[2]),
        "CACHECTL_TRUST": signed["pub"],
    }
    for env in (None, no_index):
        served, err = call(tmp_path, manifest, env, serving=True)
        assert served["out"] == RELU and served["hits"] == 0, (served, err[-3000:])
        assert served["loaded"] == 4  # every bucket but the swapped one
        plain, err = call(tmp_path, manifest, env, serving=False)
        assert plain["out"] == RELU and plain["hits"] == 0, (plain, err[-3000:])
        assert f"refused JAX entry {relu}" in err and err.count("refused JAX entry") == 1, err


@pytest.mark.timeout(600)
def test_an_unreachable_index_without_trusted_keys_loads_nothing_unless_opted_in(
    tmp_path: Path,
) -> None:
    """Issue 50 finding 2: no key anywhere, the index unreachable, CACHECTL_ROOT given. A planted
    ``-aot`` is never unpickled and a swapped JAX entry never runs: nothing can be verified, so
    everything compiles in memory, with one warning that says what to do. Only
    CACHECTL_RUN_UNVERIFIED_CODE=1 reads the cache unverified."""
    manifest = tiny(tmp_path)
    report = json.loads(cachectl("warm", str(manifest), "--json").stdout)
    ns = Path(report["namespace"])
    relu, tanh = _affine_keys(report)
    marker = tmp_path / "pwned"
    (tmp_path / "not-a-dir").write_text("")
    no_index = {
        "CACHECTL_DB": f"sqlite:///{tmp_path}/not-a-dir/index.db",
        "CACHECTL_ROOT": str(ns.parents[2]),
    }
    aot = ns / f"{relu}-aot"
    original = aot.read_bytes()
    aot.write_bytes(evil_executable(original, marker))
    served = serve(tmp_path, manifest, no_index)
    assert served["loaded"] == 0 and not marker.exists(), served
    assert any("cannot be verified" in w for w in served["warnings"]), served
    assert any("CACHECTL_RUN_UNVERIFIED_CODE" in w for w in served["warnings"]), served

    aot.write_bytes(original)
    (ns / f"{relu}-cache").write_bytes((ns / f"{tanh}-cache").read_bytes())
    # With the index up, a cache without keys is checked against the sha256s it recorded.
    out, err = call(tmp_path, manifest, serving=False)
    assert out["out"] == RELU and out["hits"] == 0, (out, err[-3000:])
    assert f"refused JAX entry {relu}" in err, err
    for serving in (True, False):
        out, err = call(tmp_path, manifest, no_index, serving=serving)
        assert out["out"] == RELU and out["hits"] == 0, (out, err[-3000:])
        assert "nothing is read from cache 'default'" in err, err

    # The opt-in, whose name says what it risks: the swapped entry is read (and runs).
    opted = {**no_index, "CACHECTL_RUN_UNVERIFIED_CODE": "1"}
    out, err = call(tmp_path, manifest, opted, serving=False)
    assert out["hits"] == 1 and out["out"] != RELU, (out, err[-3000:])
    assert "UNVERIFIED" in err


@pytest.mark.timeout(600)
def test_clearing_trusted_keys_in_the_index_does_not_switch_trust_off(
    tmp_path: Path, signed: dict[str, Any]
) -> None:
    """Issue 50 finding 2: whoever can write the index runs ``UPDATE caches SET
    trusted_keys=NULL`` (and clears the signed list, and records a planted file's sha256). A
    service that once saw the cache trust keys pinned them in its owner's state directory, and
    keeps refusing what no pinned key signed."""
    import sqlite3

    ns, manifest = signed["ns"], signed["manifest"]
    marker = tmp_path / "pwned"
    relu, tanh = _affine_keys(signed["report"])
    first = serve(tmp_path, manifest)  # the owner's service sees the cache trust a key: pinned
    assert first["loaded"] == 5, first

    aot = ns / f"{_layer_key(signed['report'])}-aot"
    aot.write_bytes(evil_executable(aot.read_bytes(), marker))
    (ns / f"{relu}-cache").write_bytes((ns / f"{tanh}-cache").read_bytes())
    cachectl("sync", "--min-age", "0", "--json")  # the index now records the planted sha256s
    db = Path(os.environ["XDG_DATA_HOME"]) / "cachectl" / "index.db"
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE caches SET trusted_keys=NULL")
        conn.execute("UPDATE environments SET content_signature=NULL")
    (ns / "signature.json").unlink()

    served = serve(tmp_path, manifest)
    assert served["loaded"] == 0 and not marker.exists(), served
    out, err = call(tmp_path, manifest, serving=False)
    assert out["out"] == RELU and out["hits"] == 0 and not marker.exists(), (out, err[-3000:])
    assert "has no signed content list" in err, err
    pins = Path(os.environ["XDG_STATE_HOME"]) / "cachectl" / "trust-pins.json"
    assert pins.stat().st_mode & 0o077 == 0


EXEC_CALL = """
import json, sys
import numpy as np
sys.path.insert(0, {dir!r})
import jax
import wm_tiny
hits = {{"n": 0}}
jax.monitoring.register_event_listener(
    lambda e, **kw: hits.__setitem__("n", hits["n"] + (e == "/jax/compilation_cache/cache_hits")))
f = jax.jit(wm_tiny.affine, static_argnames=["mode"])
x, w = np.ones((1, 8), np.float32), np.ones((8, 8), np.float32)
print(json.dumps({{"out": float(np.asarray(f(x, w, mode="relu")).ravel()[0]), "hits": hits["n"]}}))
"""


@pytest.mark.timeout(600)
def test_a_swapped_jax_entry_never_runs_in_a_process_cachectl_exec_started(tmp_path: Path) -> None:
    """Issue 50 finding 1 through `cachectl exec`: the program never calls activate(), and JAX's
    cache in it still reads only the entries the index recorded (a verified one hits, a swapped
    one compiles in memory, with one warning)."""
    manifest = tiny(tmp_path)
    report = json.loads(cachectl("warm", str(manifest), "--json").stdout)
    ns = Path(report["namespace"])
    relu, tanh = _affine_keys(report)
    script = tmp_path / "exec_call.py"
    script.write_text(EXEC_CALL.format(dir=str(tmp_path)))

    def run() -> tuple[dict[str, Any], str]:
        done = cachectl("exec", "--readonly", "--", sys.executable, str(script))
        return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr

    before, err = run()
    assert before == {"out": RELU, "hits": 1}, (before, err[-3000:])
    (ns / f"{relu}-cache").write_bytes((ns / f"{tanh}-cache").read_bytes())
    after, err = run()
    assert after == {"out": RELU, "hits": 0}, (after, err[-3000:])
    assert f"refused JAX entry {relu}" in err, err


def test_a_pin_file_others_could_write_is_ignored() -> None:
    """A pin another user could have written would make the service trust their key: a pins file
    (or its directory) writable by others is ignored, with a problem line, and never read."""
    from cachectl.trust import pins

    key = "ed25519:" + "A" * 43 + "="
    problems: list[str] = []
    pins.pin("sqlite:///x.db", "default", (key,), problems)
    assert pins.pinned("sqlite:///x.db", "default", problems) == (key,) and problems == []
    assert pins.pins_path().stat().st_mode & 0o077 == 0
    pins.pins_path().chmod(0o666)
    assert pins.pinned("sqlite:///x.db", "default", problems) == ()
    assert "not owned by this user alone" in problems[0]


@pytest.mark.timeout(600)
def test_a_trusted_key_file_others_could_write_is_refused_and_nothing_loads(
    tmp_path: Path, signed: dict[str, Any]
) -> None:
    """Issue 62 finding 2: a ``CACHECTL_TRUST`` key file (or a ``.pub`` given to ``cache set
    --trust``) that is writable by others, owned by another uid, or a symbolic link is refused in
    one line, and a service trusts nothing by it: nothing loads. The same key in a file only its
    owner writes loads every bucket."""
    manifest, pub = signed["manifest"], Path(signed["pub"])
    text = pub.read_text()
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "world.pub").write_text(text)
    (bad / "world.pub").chmod(0o666)
    (bad / "other.pub").write_text(text)
    os.chown(bad / "other.pub", 4242, 4242)  # the tests run as root
    (bad / "link.pub").symlink_to(pub)
    good = serve(tmp_path, manifest, {"CACHECTL_TRUST": str(pub)})
    assert good["loaded"] == 5, good
    for name, why in (
        ("world.pub", "not owned by this user alone"),
        ("other.pub", "not owned by this user alone"),
        ("link.pub", "is a symbolic link"),
    ):
        refused = serve(tmp_path, manifest, {"CACHECTL_TRUST": str(bad / name)})
        assert refused["loaded"] == 0, (name, refused)
        assert any(why in w and "refused" in w for w in refused["warnings"]), refused
        done = cachectl("cache", "set", "default", "--trust", str(bad / name), code=2)
        assert done.stderr.count("\n") == 1 and why in done.stderr, done.stderr
