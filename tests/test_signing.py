"""Signatures: the trust root is a key. Signed warm, push and bundles; readers refuse the rest."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from support.infra import run_py  # noqa: E402
from support.warming import REPO, invoke, tiny, warm_json  # noqa: E402

from cachectl.core.errors import BadInput  # noqa: E402
from cachectl.storage.entries import make_entry, sha256  # noqa: E402
from cachectl.trust import signing  # noqa: E402

SERVE = """
import json, sys
sys.path.insert(0, {dir!r})
import cachectl
from cachectl.trust.signing import Untrusted
try:
    rt = cachectl.serving({manifest!r})
    report = rt.report()
    print(json.dumps({{"ok": True, "loaded": sum(f.loaded for f in report.functions.values()),
                      "fallback": sum(f.fallback for f in report.functions.values())}}))
except Untrusted as exc:
    print(json.dumps({{"ok": False, "error": str(exc)}}))
"""


def keypair(tmp_path: Path, name: str = "ci.key") -> tuple[Path, Path]:
    key = tmp_path / name
    out = json.loads(invoke("key", "generate", str(key), "--json").stdout)
    assert out["public_key"].startswith("ed25519:") and len(out["key_id"]) == 16
    return key, Path(out["public_path"])


def test_key_generate(tmp_path: Path) -> None:
    key, pub = keypair(tmp_path)
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and b"PRIVATE KEY" in key.read_bytes()
    assert signing.parse_public_key(str(pub)) == pub.read_text().strip()
    again = invoke("key", "generate", str(key), code=2)
    assert "exists" in again.stderr and again.stderr.count("\n") == 1
    dry = tmp_path / "dry.key"
    invoke("key", "generate", str(dry), "--dry-run")
    assert not dry.exists() and not Path(str(dry) + ".pub").exists()


def test_sign_and_verify_round_trip(tmp_path: Path) -> None:
    key, pub = keypair(tmp_path)
    sk = signing.load_signing_key(key)
    content = signing.content_list("ab" * 32, [("env.json", 3, "0" * 64), ("x-cache", 5, "1" * 64)])
    signed = signing.sign(sk, content)
    assert signing.verify(signed, [pub.read_text()], "t") == content
    forged = dict(signed, content=signing.content_list("ab" * 32, [("env.json", 3, "0" * 64)]))
    with pytest.raises(signing.Untrusted, match="does not match its content list"):
        signing.verify(forged, [pub.read_text()], "t")
    with pytest.raises(signing.Untrusted, match="not signed"):
        signing.verify(None, [pub.read_text()], "t")
    _, other = keypair(tmp_path, "other.key")
    with pytest.raises(signing.Untrusted, match="does not trust"):
        signing.verify(signed, [other.read_text()], "t")


def test_cache_set_trust_rejects_a_bad_key(tmp_path: Path) -> None:
    result = invoke("cache", "set", "default", "--trust", "ed25519:nope", code=2)
    assert "bad base64" in result.stderr or "32 bytes" in result.stderr
    with pytest.raises(BadInput):
        signing.parse_public_key("ssh-ed25519 AAAA")
    _, pub = keypair(tmp_path)
    listed = json.loads(invoke("cache", "set", "default", "--trust", str(pub), "--json").stdout)
    assert listed["trusted_keys"] == [pub.read_text().strip()]
    cleared = json.loads(invoke("cache", "set", "default", "--trust", "", "--json").stdout)
    assert cleared["trusted_keys"] == []


def test_signed_cache_warm_push_pull_and_serving(tmp_path: Path) -> None:
    key, pub = keypair(tmp_path)
    manifest = tiny(tmp_path)
    invoke("cache", "set", "default", "--trust", str(pub))

    # Writers must sign: an unsigned warm, or one with an untrusted key, writes nothing.
    refused = invoke("warm", str(manifest), code=4)
    assert "accepts only signed content" in refused.stderr and refused.stderr.count("\n") == 1
    stranger, _ = keypair(tmp_path, "stranger.key")
    assert (
        "does not trust signing key"
        in invoke("warm", str(manifest), "--sign-key", str(stranger), code=4).stderr
    )
    assert json.loads(invoke("ls", "--json").stdout)["environments"] == []

    report = warm_json(str(manifest), "--sign-key", str(key))
    assert report["summary"]["compiled"] == 5
    mirror = tmp_path / "mirror"
    pulled = json.loads(invoke("pull", "--to", str(mirror), "--json").stdout)
    assert pulled["copied"] == 5 and pulled["executables_copied"] == 5
    served = json.loads(
        run_py(SERVE.format(dir=str(tmp_path), manifest=str(manifest)), check=True)
        .stdout.strip()
        .splitlines()[-1]
    )
    assert served["ok"] and served["loaded"] == 5 and served["fallback"] == 0, served

    # A signed cache refuses an unsigned push: nothing uploaded, nothing indexed.
    new = make_entry(b"a local run's program", 2)
    name = "jit_extra-" + "e" * 64
    (mirror / f"{name}-cache").write_bytes(new)
    ns = Path(report["namespace"])
    result = invoke("push", "--from", str(mirror), code=4)
    assert "accepts only signed content" in result.stderr and not (ns / f"{name}-cache").exists()
    pushed = json.loads(
        invoke("push", "--from", str(mirror), "--sign-key", str(key), "--json").stdout
    )
    assert pushed["uploaded"] == 1 and (ns / f"{name}-cache").read_bytes() == new
    assert json.loads(invoke("pull", "--to", str(tmp_path / "m2"), "--json").stdout)["copied"] == 6

    # Content nobody trusted signed: untrust, warm more unsigned, trust again -> readers refuse
    # exactly that entry and its executable, and serve the rest.
    invoke("cache", "set", "default", "--trust", "")
    more = tiny(
        tmp_path, manifest.read_text().replace("batch: [3]", "batch: [5]"), name="more.yaml"
    )
    assert warm_json(str(more))["summary"]["compiled"] == 1
    invoke("cache", "set", "default", "--trust", str(pub))
    refused = json.loads(invoke("pull", "--to", str(tmp_path / "m3"), "--json", code=1).stdout)
    assert refused["copied"] == 6 and len({p["key"] for p in refused["refused"]}) == 1
    assert all(
        "not in the namespace's signed content list" in p["reason"] for p in refused["refused"]
    )
    served = json.loads(
        run_py(SERVE.format(dir=str(tmp_path), manifest=str(more)), check=True)
        .stdout.strip()
        .splitlines()[-1]
    )
    assert served["ok"] and served["loaded"] == 4, served  # the unsigned bucket: jax.jit

    # A signed warm never signs what it did not write: it compiles that bucket again and signs its own.
    again = warm_json(str(more), "--sign-key", str(key))
    assert (again["summary"]["compiled"], again["summary"]["cached"]) == (1, 4)
    assert json.loads(invoke("pull", "--to", str(tmp_path / "m4"), "--json").stdout)["copied"] == 7


def test_bundle_carries_the_namespace_signature(tmp_path: Path) -> None:
    key, pub = keypair(tmp_path)
    manifest = tiny(tmp_path)
    warm_json(str(manifest), "--sign-key", str(key))
    out = tmp_path / "b.tar.zst"
    created = json.loads(invoke("bundle", "create", "-o", str(out), "--json").stdout)
    assert created["signed_by"] == signing.key_id(pub.read_text())
    assert sha256(out.read_bytes())  # written
    assert os.path.getsize(out) == created["bundle_bytes"]
    assert REPO.is_dir()


def test_key_generate_creates_missing_parent_directories(tmp_path) -> None:
    from cachectl.trust import signing

    target = tmp_path / "new" / "dir" / "ci.key"
    info = signing.generate(target)
    assert target.exists() and (target.stat().st_mode & 0o777) == 0o600
    assert (target.parent.stat().st_mode & 0o777) == 0o700 and info.public_key.startswith(
        "ed25519:"
    )
