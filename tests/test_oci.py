"""Bundles as OCI artifacts, against real registries on loopback (Debian's docker-registry).

The shared registry is the one scripts/test starts (TLS with its own CA, htpasswd basic auth;
CACHECTL_TEST_OCI_*): credentials reach cachectl only through a docker config.json. Tests that
tamper with a registry's storage, or need plain HTTP, start a private one from the same package
(no auth, --insecure on loopback). The source namespace is warmed once per module, for real.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from support.bundles import environments
from support.registry import put_blob
from support.warming import counting_opens, invoke, tiny

from cachectl.core import temps

OCI_URL = os.environ.get("CACHECTL_TEST_OCI_URL")
OCI_USER = os.environ.get("CACHECTL_TEST_OCI_USER", "")
OCI_PASSWORD = os.environ.get("CACHECTL_TEST_OCI_PASSWORD", "")
OCI_CA = os.environ.get("CACHECTL_TEST_OCI_CA", "")
NO_REGISTRY = os.environ.get("CACHECTL_TEST_NO_REGISTRY") == "1"
REGISTRY_BIN = shutil.which("docker-registry")
XDG = ("XDG_DATA_HOME", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_STATE_HOME")


def _need_registry() -> str:
    if OCI_URL:
        return OCI_URL
    if NO_REGISTRY:
        pytest.skip("OCI registry tests skipped: CACHECTL_TEST_NO_REGISTRY=1")
    pytest.fail(
        "CACHECTL_TEST_OCI_URL is not set: run the tests through scripts/test, which starts "
        "docker-registry, or set CACHECTL_TEST_NO_REGISTRY=1 to skip them",
        pytrace=False,
    )


def _docker_config(where: Path, auths: dict[str, Any]) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    (where / "config.json").write_text(json.dumps(auths))
    return where


def _basic(user: str, password: str) -> str:
    return base64.b64encode(f"{user}:{password}".encode()).decode()


def _home(base: Path) -> dict[str, str]:
    env = {}
    for var in XDG:
        d = base / var.split("_")[1].lower()
        d.mkdir(parents=True, exist_ok=True)
        env[var] = str(d)
    return env


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A real warm of the tiny manifest in its own home, pushed with `warm --push` (unsigned)
    and with `bundle push --sign-key` (signed) to the shared registry."""
    url = _need_registry()
    base = tmp_path_factory.mktemp("oci-source")
    manifest = tiny(base)
    docker = _docker_config(
        base / "docker", {"auths": {url: {"auth": _basic(OCI_USER, OCI_PASSWORD)}}}
    )
    home = _home(base / "home")
    env = {**home, "DOCKER_CONFIG": str(docker), "CACHECTL_OCI_CA_FILE": OCI_CA}
    repo = f"cachectl/t{os.getpid()}-{int(time.time() * 1000) % 10**8}"
    key = base / "signer.key"
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        # A real `cachectl warm --push` process: the warm and the push share one read of the
        # manifest (tests/test_warm_manifest_once.py counts a plain warm).
        warmed, opens = counting_opens(
            manifest, ["warm", str(manifest), "--json", "--push", f"oci://{url}/{repo}:v1"]
        )
        assert warmed.returncode == 0, warmed.stderr[-3000:]
        assert opens == 1
        report = json.loads(warmed.stdout)
        assert "pushed oci://" in warmed.stderr, warmed.stderr
        invoke("key", "generate", str(key))
        signed = json.loads(
            invoke(
                "bundle",
                "push",
                f"oci://{url}/{repo}-signed:v1",
                "--manifest",
                str(manifest),
                "--sign-key",
                str(key),
                "--json",
            ).stdout
        )
    yield {
        "url": url,
        "repo": repo,
        "manifest": manifest,
        "report": report,
        "signed": signed,
        "key": key,
        "pub": Path(str(key) + ".pub"),
        "env": env,
        "docker": docker,
    }


@pytest.fixture
def node(source: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """This test's node: a fresh home (autouse isolated_home), the shared registry's CA and
    credentials through a docker config.json."""
    monkeypatch.setenv("DOCKER_CONFIG", str(source["docker"]))
    monkeypatch.setenv("CACHECTL_OCI_CA_FILE", OCI_CA)
    return source


def _as_source(monkeypatch: pytest.MonkeyPatch, source: dict[str, Any]) -> None:
    for k, v in source["env"].items():
        monkeypatch.setenv(k, v)


def _namespace_files() -> list[Path]:
    root = Path(os.environ["XDG_CACHE_HOME"]) / "cachectl" / "default"
    return [p for p in root.rglob("*") if p.is_file()] if root.exists() else []


def _assert_nothing_installed() -> None:
    assert _namespace_files() == [] and environments() == []


def _one_line(err: str) -> None:
    assert err.count("\n") == 1 and "Traceback" not in err, err


# --------------------------------------------------------------------------- a private registry


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def private(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A registry of this test's own (plain HTTP on loopback, no auth), whose storage the test
    may damage: the same docker-registry package scripts/test starts."""
    _need_registry()
    if REGISTRY_BIN is None:
        pytest.fail("docker-registry is not installed (scripts/test installs it)", pytrace=False)
    port = _free_port()
    data = tmp_path / "registry"
    config = tmp_path / "registry.yml"
    config.write_text(
        "version: 0.1\nlog: {level: error}\n"
        f"storage: {{filesystem: {{rootdirectory: {data}}}, delete: {{enabled: true}}}}\n"
        f"http: {{addr: 127.0.0.1:{port}}}\n"
    )
    proc = subprocess.Popen(
        [REGISTRY_BIN, "serve", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                if requests.get(f"http://{url}/v2/", timeout=1).status_code == 200:
                    break
            except requests.RequestException:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "registry did not start"
            time.sleep(0.1)
        yield {"url": url, "data": data}
    finally:
        proc.kill()
        proc.wait()


def _blob_file(data: Path, digest: str) -> Path:
    hexd = digest.split(":")[1]
    return data / "docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"


def _push_private(monkeypatch: pytest.MonkeyPatch, source: dict[str, Any], url: str) -> dict:
    """The source namespace pushed to a private registry (from the source's home)."""
    saved = {k: os.environ.get(k) for k in XDG}
    _as_source(monkeypatch, source)
    pushed = json.loads(
        invoke(
            "bundle",
            "push",
            f"oci://{url}/lm/cache:v1",
            "--manifest",
            str(source["manifest"]),
            "--insecure",
            "--json",
        ).stdout
    )
    for k, v in saved.items():
        assert v is not None
        monkeypatch.setenv(k, v)
    return pushed


def _get_json(url: str, path: str, accept: str = "") -> tuple[dict[str, Any], bytes]:
    r = requests.get(f"http://{url}/v2/{path}", headers={"Accept": accept}, timeout=10)
    r.raise_for_status()
    return r.json(), r.content


MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"


def _forge(url: str, pushed: dict[str, Any], tag: str, change: dict[str, Any]) -> dict:
    """A copy of the pushed artifact under ``tag`` whose config says ``change`` (its own digests
    consistent, so only the check under test can refuse it); its bundle blob then deleted from
    the registry's storage: a pull that tried to download it would fail on that, not the check."""
    from cachectl.core.fingerprint import Environment

    manifest, _ = _get_json(url, f"lm/cache/manifests/{pushed['digest']}", MANIFEST_TYPE)
    config, _ = _get_json(url, f"lm/cache/blobs/{manifest['config']['digest']}")
    environment = {**config["environment"], **change.get("environment", {})}
    digest = Environment.from_dict(environment).digest
    config.update(change.get("config", {}), environment=environment, digest=digest)
    body = json.dumps(config).encode()
    manifest["config"] = {
        **manifest["config"],
        "digest": put_blob(url, "lm/cache", body),
        "size": len(body),
    }
    manifest["annotations"]["io.cachectl.environment"] = digest
    manifest["annotations"]["io.cachectl.bytes"] = str(config["bytes"])
    for k, v in change.get("environment", {}).items():
        manifest["annotations"][f"io.cachectl.{k.replace('_', '-')}"] = str(v)
    raw = json.dumps(manifest).encode()
    for t in (tag, f"env-{digest}") if change.get("environment") else (tag,):
        requests.put(
            f"http://{url}/v2/lm/cache/manifests/{t}",
            data=raw,
            headers={"Content-Type": MANIFEST_TYPE},
            timeout=10,
        ).raise_for_status()
    return {"layer": manifest["layers"][0]["digest"], "digest": digest}


# --------------------------------------------------------------------------- round trip


def test_warm_push_then_pull_for_this_machine_into_an_empty_cache_hits_every_bucket(
    tmp_path: Path, node: dict[str, Any]
) -> None:
    url, repo = node["url"], node["repo"]
    pulled = json.loads(
        invoke("bundle", "pull", f"oci://{url}/{repo}", "--for-this-machine", "--json").stdout
    )
    assert pulled["install"]["installed"] == 5 and pulled["tag"].startswith("env-")
    check = json.loads(invoke("warm-check", str(node["manifest"]), "--json").stdout)
    assert check["summary"]["coverage"] == 100.0 and check["summary"]["aot_coverage"] == 100.0
    assert not (Path(pulled["install"]["dest"]).parent.parent / temps.STAGING_DIR).exists()
    again = json.loads(invoke("bundle", "pull", f"oci://{url}/{repo}:v1", "--json").stdout)
    assert (again["install"]["installed"], again["install"]["already_present"]) == (0, 5)
    assert again["digest"] == pulled["digest"]

    # The artifact: its own media types, the environment in its annotations (read with curl's
    # peer, requests, and the registry's basic auth).
    r = requests.get(
        f"https://{url}/v2/{repo}/manifests/v1",
        auth=(OCI_USER, OCI_PASSWORD),
        verify=OCI_CA,
        headers={"Accept": MANIFEST_TYPE},
        timeout=10,
    )
    m = r.json()
    assert m["artifactType"] == "application/vnd.cachectl.bundle.v1"
    assert [layer["mediaType"] for layer in m["layers"]] == [
        "application/vnd.cachectl.bundle.v1+zstd"
    ]
    notes = m["annotations"]
    env = environments()[0]
    assert notes["io.cachectl.environment"] == env["digest"] == pulled["environment"]
    for k in (
        "jax-version",
        "jaxlib-version",
        "platform-version",
        "backend",
        "device-kind",
        "topology",
        "manifest-digest",
    ):
        assert notes[f"io.cachectl.{k}"], k
    assert notes["io.cachectl.entries"] == "5" and int(notes["io.cachectl.bytes"]) > 0


def test_a_signed_bundle_is_verified_before_download_and_an_unsigned_one_refused(
    node: dict[str, Any],
) -> None:
    url, repo, signed = node["url"], node["repo"], node["signed"]
    # docker-registry 2.8 has no referrers API: the signature is listed in the tag schema's index.
    assert signed["signed_by"] and signed["referrers"] == "tag-schema", signed
    invoke("cache", "set", "default", "--trust", str(node["pub"]))
    refused = invoke("bundle", "pull", f"oci://{url}/{repo}:v1", code=2)
    assert "has no signature by a key cache 'default' trusts" in refused.stderr, refused.stderr
    assert "nothing downloaded" in refused.stderr
    _one_line(refused.stderr)
    _assert_nothing_installed()
    done = json.loads(invoke("bundle", "pull", f"oci://{url}/{repo}-signed:v1", "--json").stdout)
    assert done["signature_verified_by"] == signed["signed_by"]
    assert done["install"]["installed"] == 5 and done["install"]["signed_by"] == signed["signed_by"]


def test_a_signature_by_an_untrusted_key_is_refused_before_download(
    tmp_path: Path, node: dict[str, Any]
) -> None:
    other = tmp_path / "other.key"
    invoke("key", "generate", str(other))
    invoke("cache", "set", "default", "--trust", str(other) + ".pub")
    refused = invoke("bundle", "pull", f"oci://{node['url']}/{node['repo']}-signed:v1", code=2)
    assert "which the cache does not trust" in refused.stderr and "nothing downloaded" in (
        refused.stderr
    ), refused.stderr
    _assert_nothing_installed()


# --------------------------------------------------------------------------- refusals


def test_a_tampered_blob_is_refused_and_nothing_installed(
    private: dict[str, Any], node: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    pushed = _push_private(monkeypatch, node, private["url"])
    manifest, _ = _get_json(private["url"], f"lm/cache/manifests/{pushed['digest']}", MANIFEST_TYPE)
    blob = _blob_file(private["data"], manifest["layers"][0]["digest"])
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 1
    blob.write_bytes(bytes(data))
    refused = invoke("bundle", "pull", f"oci://{private['url']}/lm/cache:v1", "--insecure", code=2)
    assert "does not match its digest" in refused.stderr, refused.stderr
    _one_line(refused.stderr)
    _assert_nothing_installed()


def test_a_blob_whose_files_verify_but_whose_digest_does_not_is_refused_before_publishing(
    private: dict[str, Any], node: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pull installs the blob as it arrives: here every file it holds is intact (the same tar
    stream, compressed again) and only bytes past the tar's end differ (a skippable zstd frame
    pads it to the manifest's size), so only the blob's digest, checked once the last byte is
    in, can refuse it: nothing is published before that."""
    import zstandard

    pushed = _push_private(monkeypatch, node, private["url"])
    manifest, _ = _get_json(private["url"], f"lm/cache/manifests/{pushed['digest']}", MANIFEST_TYPE)
    blob = _blob_file(private["data"], manifest["layers"][0]["digest"])
    original = blob.read_bytes()
    reader = zstandard.ZstdDecompressor().stream_reader(original, read_across_frames=True)
    again = zstandard.ZstdCompressor(level=19).compress(reader.read())
    pad = len(original) - len(again) - 8
    assert pad >= 0, (len(original), len(again))
    blob.write_bytes(again + b"\x50\x2a\x4d\x18" + pad.to_bytes(4, "little") + b"\x01" * pad)
    refused = invoke("bundle", "pull", f"oci://{private['url']}/lm/cache:v1", "--insecure", code=2)
    assert "does not match its digest" in refused.stderr, refused.stderr
    _one_line(refused.stderr)
    _assert_nothing_installed()


def test_a_wrong_environment_is_refused_before_download_naming_the_field(
    private: dict[str, Any], node: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    url = private["url"]
    pushed = _push_private(monkeypatch, node, url)
    forged = _forge(url, pushed, "v2", {"environment": {"platform_version": "libtpu 0.0.99"}})
    requests.delete(  # only the forged environment stays in the repository
        f"http://{url}/v2/lm/cache/manifests/{pushed['digest']}", timeout=10
    ).raise_for_status()
    _blob_file(private["data"], forged["layer"]).unlink()  # a download would fail on this
    picked = invoke(
        "bundle", "pull", f"oci://{url}/lm/cache", "--for-this-machine", "--insecure", code=3
    )
    assert "holds no bundle for this machine" in picked.stderr, picked.stderr
    assert "platform_version:" in picked.stderr and "libtpu 0.0.99" in picked.stderr
    _one_line(picked.stderr)
    tagged = invoke("bundle", "pull", f"oci://{url}/lm/cache:v2", "--insecure", code=3)
    assert "made for another environment" in tagged.stderr and "nothing downloaded" in (
        tagged.stderr
    ), tagged.stderr
    _assert_nothing_installed()


def test_a_bundle_larger_than_the_free_disk_is_refused_before_download(
    private: dict[str, Any], node: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    url = private["url"]
    pushed = _push_private(monkeypatch, node, url)
    forged = _forge(url, pushed, "huge", {"config": {"bytes": 1 << 60}})
    _blob_file(private["data"], forged["layer"]).unlink()
    refused = invoke("bundle", "pull", f"oci://{url}/lm/cache:huge", "--insecure", code=2)
    assert "not enough free disk" in refused.stderr and "nothing downloaded" in refused.stderr, (
        refused.stderr
    )
    _assert_nothing_installed()


def test_a_bundle_over_the_cache_quota_is_refused_before_download(
    private: dict[str, Any], node: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    url = private["url"]
    _push_private(monkeypatch, node, url)
    manifest, _ = _get_json(url, "lm/cache/manifests/v1", MANIFEST_TYPE)
    _blob_file(private["data"], manifest["layers"][0]["digest"]).unlink()
    invoke("cache", "set", "default", "--max-size", "10KB")
    refused = invoke("bundle", "pull", f"oci://{url}/lm/cache:v1", "--insecure", code=2)
    assert "quota" in refused.stderr.lower() or "max" in refused.stderr.lower(), refused.stderr
    _one_line(refused.stderr)
    _assert_nothing_installed()


# --------------------------------------------------------------------------- kill -9, concurrency


class _StallingProxy:
    """A TCP proxy in front of a registry that stops passing the response to a GET of one blob
    after its first bytes: a pull stuck mid-download, to be killed."""

    def __init__(self, upstream: str, blob: str, limit: int = 4096) -> None:
        self.upstream = upstream.split(":")
        self.limit = limit  # bytes of the blob's response (its headers too) passed on
        self.blob = blob.encode()
        self.stalled = threading.Event()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            up = socket.create_connection((self.upstream[0], int(self.upstream[1])))
            state = {"limit": None, "sent": 0}
            threading.Thread(target=self._up, args=(client, up, state), daemon=True).start()
            threading.Thread(target=self._down, args=(up, client, state), daemon=True).start()

    def _up(self, client: socket.socket, up: socket.socket, state: dict[str, Any]) -> None:
        with client, up:
            try:
                while data := client.recv(65536):
                    if b"/blobs/" + self.blob in data:
                        state["limit"] = state["sent"] + self.limit
                    up.sendall(data)
            except OSError:  # the pull was killed: its connection resets (that is the test)
                return

    def _down(self, up: socket.socket, client: socket.socket, state: dict[str, Any]) -> None:
        try:
            while data := up.recv(65536):
                if state["limit"] is not None and state["sent"] + len(data) > state["limit"]:
                    client.sendall(data[: max(0, state["limit"] - state["sent"])])
                    self.stalled.set()
                    time.sleep(600)
                    return
                client.sendall(data)
                state["sent"] += len(data)
        except OSError:
            return

    def close(self) -> None:
        self.server.close()


def _cachectl(*args: str, **kw: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "cachectl", *args],
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **kw,
    )


def test_a_pull_killed_mid_download_leaves_nothing_the_next_pull_keeps(
    private: dict[str, Any], node: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    url = private["url"]
    pushed = _push_private(monkeypatch, node, url)
    manifest, _ = _get_json(url, f"lm/cache/manifests/{pushed['digest']}", MANIFEST_TYPE)
    layer = manifest["layers"][0]
    assert layer["size"] > 8192, layer  # bigger than what the proxy lets through (4 KiB)
    proxy = _StallingProxy(url, layer["digest"])
    try:
        proc = _cachectl(
            "bundle", "pull", f"oci://127.0.0.1:{proxy.port}/lm/cache:v1", "--insecure"
        )
        assert proxy.stalled.wait(120), proc.communicate()
        staging = Path(os.environ["XDG_CACHE_HOME"]) / "cachectl/default" / temps.STAGING_DIR
        deadline = time.monotonic() + 30
        while not staging.is_dir() or not list(staging.iterdir()):
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    finally:
        proxy.close()
    dead = list(staging.iterdir())  # the killed pull's staging, named for its (dead) pid
    assert dead and all(d.name.startswith(temps.STAGING_PREFIX) for d in dead), dead
    assert (
        environments() == [] and [p for p in _namespace_files() if staging not in p.parents] == []
    )
    done = json.loads(
        invoke("bundle", "pull", f"oci://{url}/lm/cache:v1", "--insecure", "--json").stdout
    )
    assert done["install"]["installed"] == 5 and not staging.exists()
    assert json.loads(invoke("verify", "--json").stdout)["plan"]["findings"] == []


def test_a_pull_installs_the_blob_while_it_arrives(
    private: dict[str, Any], node: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The download and the install overlap: with the blob's last bytes held back, the install
    has staged files already, and none is visible; killed there, it leaves only staging."""
    url = private["url"]
    pushed = _push_private(monkeypatch, node, url)
    manifest, _ = _get_json(url, f"lm/cache/manifests/{pushed['digest']}", MANIFEST_TYPE)
    layer = manifest["layers"][0]
    # All but about the last 2 KiB of the blob (its response headers count too): the end of the
    # tar stream, compressed, stays held back.
    proxy = _StallingProxy(url, layer["digest"], limit=layer["size"] - 2048)
    staging = Path(os.environ["XDG_CACHE_HOME"]) / "cachectl/default" / temps.STAGING_DIR
    try:
        proc = _cachectl(
            "bundle", "pull", f"oci://127.0.0.1:{proxy.port}/lm/cache:v1", "--insecure"
        )
        assert proxy.stalled.wait(120), proc.communicate()
        deadline = time.monotonic() + 30
        while not [p for p in staging.glob("*/*") if p.name.endswith("-cache")]:
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        assert (
            environments() == []
            and [p for p in _namespace_files() if staging not in p.parents] == []
        )
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    finally:
        proxy.close()
    assert not list(staging.glob("*/bundle.tar.zst"))  # the blob itself is never written
    done = json.loads(
        invoke("bundle", "pull", f"oci://{url}/lm/cache:v1", "--insecure", "--json").stdout
    )
    assert done["install"]["installed"] == 5 and not staging.exists()


class _RecordingProxy(_StallingProxy):
    """A TCP proxy in front of a registry that passes everything on and records each request's
    method and path, in the order the client sent them."""

    def __init__(self, upstream: str) -> None:
        self.requests: list[str] = []
        super().__init__(upstream, "none", limit=1 << 40)

    def _up(self, client: socket.socket, up: socket.socket, state: dict[str, Any]) -> None:
        with client, up:
            try:
                while data := client.recv(65536):
                    if data[:4] in (b"GET ", b"HEAD", b"POST", b"PUT "):
                        self.requests.append(b" ".join(data.split(b" ", 2)[:2]).decode())
                    up.sendall(data)
            except OSError:
                return


def _recorded_pull(url: str, tag: str) -> tuple[dict[str, Any], list[str]]:
    """A pull of ``tag`` through a proxy recording its requests: (its JSON, the requests)."""
    proxy = _RecordingProxy(url)
    try:
        done = json.loads(
            invoke(
                "bundle",
                "pull",
                f"oci://127.0.0.1:{proxy.port}/lm/cache:{tag}",
                "--insecure",
                "--json",
            ).stdout
        )
    finally:
        proxy.close()
    return done, proxy.requests


def test_a_pull_asks_the_registry_only_for_the_manifest_and_blob(
    private: dict[str, Any], node: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No /v2/ probe before the manifest: a registry that asks for no login answers the
    manifest request itself (one round trip fewer per pull); no config request where the
    manifest's annotations name this machine's environment (another: below, and
    test_a_wrong_environment_is_refused_before_download_naming_the_field), while a manifest
    without them (an older push) is read with its config; a server that is no registry is
    still named so, from its /v2/ answer."""
    url = private["url"]
    pushed = _push_private(monkeypatch, node, url)
    manifest, _ = _get_json(url, f"lm/cache/manifests/{pushed['digest']}", MANIFEST_TYPE)
    done, asked = _recorded_pull(url, "v1")
    assert done["install"]["installed"] == 5
    assert asked == [
        "GET /v2/lm/cache/manifests/v1",
        f"GET /v2/lm/cache/blobs/{manifest['layers'][0]['digest']}",
    ], asked

    older = {**manifest, "annotations": {"org.opencontainers.image.created": "2026-01-01"}}
    requests.put(
        f"http://{url}/v2/lm/cache/manifests/older",
        data=json.dumps(older).encode(),
        headers={"Content-Type": MANIFEST_TYPE},
        timeout=10,
    ).raise_for_status()
    done, asked = _recorded_pull(url, "older")  # into the same cache: nothing new to install
    assert done["install"]["already_present"] == 5, done
    assert asked == [
        "GET /v2/lm/cache/manifests/older",
        f"GET /v2/lm/cache/blobs/{manifest['config']['digest']}",
        f"GET /v2/lm/cache/blobs/{manifest['layers'][0]['digest']}",
    ], asked

    import http.server

    class NotARegistry(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(404 if self.path != "/v2/" else 302)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotARegistry)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        other = invoke(
            "bundle", "pull", f"oci://127.0.0.1:{port}/lm/cache:v1", "--insecure", code=2
        )
    finally:
        server.shutdown()
        server.server_close()
    assert "answered /v2/ with HTTP 302: is it an OCI registry?" in other.stderr, other.stderr
    _one_line(other.stderr)


def test_two_pulls_at_once_leave_one_good_copy(node: dict[str, Any]) -> None:
    src = f"oci://{node['url']}/{node['repo']}:v1"
    procs = [_cachectl("bundle", "pull", src, "--json") for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    installs = [json.loads(out)["install"] for out, _ in outs]
    assert sum(i["installed"] for i in installs) >= 5
    (env,) = environments()
    assert env["entries"] == 5 and env["executables"] == 5
    # verify reads every file against its index row: one intact copy, no debris.
    assert json.loads(invoke("verify", "--json").stdout)["plan"]["findings"] == []


# --------------------------------------------------------------------------- registries down, auth


def test_an_unreachable_or_silent_registry_is_one_line_within_the_timeout(
    node: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    port = _free_port()
    started = time.monotonic()
    down = invoke("bundle", "pull", f"oci://127.0.0.1:{port}/lm/cache:v1", code=2)
    assert "is unreachable" in down.stderr and time.monotonic() - started < 10, down.stderr
    _one_line(down.stderr)

    silent = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    monkeypatch.setenv("CACHECTL_OCI_TIMEOUT", "2")
    try:
        started = time.monotonic()
        hung = invoke("bundle", "pull", f"oci://127.0.0.1:{silent.getsockname()[1]}/x:v1", code=2)
        took = time.monotonic() - started
    finally:
        silent.close()
    assert "did not answer within 2 s" in hung.stderr and took < 15, (took, hung.stderr)
    _one_line(hung.stderr)

    missing = invoke("bundle", "pull", f"oci://{node['url']}/cachectl/none:v1", code=2)
    assert "not found" in missing.stderr, missing.stderr
    _one_line(missing.stderr)
    absent = invoke(
        "bundle", "pull", f"oci://{node['url']}/cachectl/none", "--for-this-machine", code=2
    )
    assert "holds no cachectl bundle" in absent.stderr, absent.stderr
    _assert_nothing_installed()


def test_registry_auth_tls_and_insecure_as_users_have_them(
    tmp_path: Path, node: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, src = node["url"], f"oci://{node['url']}/{node['repo']}:v1"
    # No CA: TLS to a private CA fails with what to do.
    monkeypatch.delenv("CACHECTL_OCI_CA_FILE")
    no_ca = invoke("bundle", "pull", src, code=2)
    assert "TLS failed" in no_ca.stderr and "--ca-file" in no_ca.stderr, no_ca.stderr
    _one_line(no_ca.stderr)
    # Plain HTTP only to loopback, and only when asked.
    far = invoke("bundle", "pull", "oci://registry.example.com/lm/cache:v1", "--insecure", code=2)
    assert "only for a loopback registry" in far.stderr, far.stderr
    # A wrong password, and no credentials at all.
    monkeypatch.setenv(
        "DOCKER_CONFIG",
        str(
            _docker_config(
                tmp_path / "wrong", {"auths": {url: {"auth": _basic(OCI_USER, "wrong")}}}
            )
        ),
    )
    wrong = invoke("bundle", "pull", src, "--ca-file", OCI_CA, code=2)
    assert "check the credentials" in wrong.stderr, wrong.stderr
    _one_line(wrong.stderr)
    monkeypatch.setenv("DOCKER_CONFIG", str(_docker_config(tmp_path / "none", {"auths": {}})))
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.docker/config.json either
    none = invoke("bundle", "pull", src, "--ca-file", OCI_CA, code=2)
    assert "asks for a login and no credentials" in none.stderr, none.stderr


def _helper(bindir: Path, name: str, body: str) -> Path:
    """An executable ``docker-credential-<name>`` in ``bindir`` running ``body`` (sh)."""
    bindir.mkdir(exist_ok=True)
    helper = bindir / f"docker-credential-{name}"
    helper.write_text("#!/bin/sh\n" + body)
    helper.chmod(0o755)
    return helper


def test_docker_credential_helpers_log_in_and_a_failing_one_is_one_line_exit_2(
    tmp_path: Path, node: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """credsStore and credHelpers as `docker login` leaves them: a real helper executable on PATH
    speaking docker's get protocol (the server on stdin, Username/Secret JSON on stdout)."""
    url, src = node["url"], f"oci://{node['url']}/{node['repo']}:v1"
    bindir, asked = tmp_path / "bin", tmp_path / "asked"
    login = json.dumps({"ServerURL": url, "Username": OCI_USER, "Secret": OCI_PASSWORD})
    _helper(
        bindir,
        "store",
        f'test "$1" = get || exit 9\nread host\necho "$host" >> {asked}\necho \'{login}\'\n',
    )
    _helper(bindir, "locked", "echo 'error: the keychain is locked' >&2\nexit 1\n")
    _helper(bindir, "unknown", "echo 'credentials not found in native keychain'\nexit 1\n")
    _helper(bindir, "garbled", "echo 'Username: me'\n")
    _helper(bindir, "stuck", "exec sleep 30\n")
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.docker/config.json

    def config(name: str, cfg: dict[str, Any]) -> None:
        monkeypatch.setenv("DOCKER_CONFIG", str(_docker_config(tmp_path / name, cfg)))

    # `docker login` with a credsStore: an empty auths entry, the login in the store.
    config("store", {"auths": {url: {}}, "credsStore": "store"})
    done = json.loads(invoke("bundle", "pull", src, "--ca-file", OCI_CA, "--json").stdout)
    assert done["install"]["installed"] == 5
    assert asked.read_text().split() == [url]
    # A per-registry credHelpers entry wins over the store.
    config("helpers", {"credsStore": "locked", "credHelpers": {url: "store"}})
    invoke("bundle", "pull", src, "--ca-file", OCI_CA)
    assert asked.read_text().split() == [url, url]
    # Failures: one line naming the helper, exit 2, nothing pulled (a fresh home each time).
    for name, cfg, says in (
        ("locked", {"credsStore": "locked"}, "docker-credential-locked failed for"),
        ("garbled", {"credHelpers": {url: "garbled"}}, "gave no login for"),
        ("absent", {"credHelpers": {url: "absent"}}, "which is not on PATH"),
        ("unknown", {"credsStore": "unknown"}, "asks for a login and no credentials"),
    ):
        config(name, cfg)
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / name / "cache"))
        monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / name / "data"))
        failed = invoke("bundle", "pull", src, "--ca-file", OCI_CA, code=2)
        assert says in failed.stderr, (name, failed.stderr)
        _one_line(failed.stderr)
        _assert_nothing_installed()
    # A helper that hangs is bounded by CACHECTL_OCI_TIMEOUT.
    config("stuck", {"credsStore": "stuck"})
    monkeypatch.setenv("CACHECTL_OCI_TIMEOUT", "2")
    t0 = time.monotonic()
    stuck = invoke("bundle", "pull", src, "--ca-file", OCI_CA, code=2)
    assert time.monotonic() - t0 < 10
    assert "did not answer" in stuck.stderr, stuck.stderr
    _one_line(stuck.stderr)


def test_bad_references_are_one_line_exit_2(node: dict[str, Any]) -> None:
    for ref, says in (
        ("127.0.0.1/lm/cache:v1", "is not an OCI reference"),
        ("oci://127.0.0.1", "no registry host, or no repository"),
        ("oci://127.0.0.1/LM/Cache:v1", "is not valid"),
        ("oci://127.0.0.1/lm/cache:bad!tag", "is not a valid tag"),
        ("oci://127.0.0.1/lm/cache", "give a tag"),
    ):
        result = invoke("bundle", "pull", ref, code=2)
        assert says in result.stderr, (ref, result.stderr)
        _one_line(result.stderr)
    tagged = invoke(
        "bundle", "pull", f"oci://{node['url']}/lm/cache:v1", "--for-this-machine", code=2
    )
    assert "picks the tag itself" in tagged.stderr


# --------------------------------------------------------------------------- examples/k8s


def test_the_k8s_init_container_recipe_pulls_a_signed_bundle_the_service_hits(
    tmp_path: Path, node: dict[str, Any]
) -> None:
    """examples/k8s/pull-bundle.yaml's init container, its shell command run as written (the
    registry, paths and key moved here), then its service's environment: warm-check 100%."""
    import yaml

    recipe = Path(__file__).resolve().parent.parent / "examples/k8s/pull-bundle.yaml"
    pod = yaml.safe_load(recipe.read_text())["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    (serve,) = pod["containers"]
    mounts = {  # the longer paths first: /etc/cachectl-trust holds "/cache"
        "/etc/cachectl-trust": tmp_path / "trust",
        "/etc/docker-config": node["docker"],
        "/cache": tmp_path / "cache",
    }
    (tmp_path / "trust").mkdir()
    shutil.copy(node["pub"], tmp_path / "trust" / "ci.key.pub")

    def here(value: str) -> str:
        value = value.replace(
            "registry.example.com/lm/cache", f"{node['url']}/{node['repo']}-signed"
        )
        for inside, outside in mounts.items():
            value = value.replace(inside + "/", f"{outside}/").replace(inside + " ", f"{outside} ")
            value = str(outside) if value == inside else value
        return value

    def env_of(container: dict[str, Any]) -> dict[str, str]:
        return {e["name"]: here(e["value"]) for e in container["env"]}

    script = here(init["args"][0])
    bindir = Path(sys.executable).parent  # `cachectl` on PATH, as in the image
    env = {
        **os.environ,
        **env_of(init),
        "CACHECTL_OCI_CA_FILE": OCI_CA,
        "PATH": f"{bindir}:{os.environ['PATH']}",
    }
    done = subprocess.run(
        [*init["command"], script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and "signature verified" in done.stdout, (done.stdout, done.stderr)
    assert serve["volumeMounts"][0]["readOnly"] is True
    env = {**os.environ, **env_of(serve), "PATH": env["PATH"]}
    env.pop("CACHECTL_TRUST")  # a path in the image; the index here holds the trusted key
    check = subprocess.run(
        [str(bindir / "cachectl"), "warm-check", str(node["manifest"]), "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert check.returncode == 0, check.stderr
    assert json.loads(check.stdout)["summary"]["coverage"] == 100.0


# --------------------------------------------------------------------------- a bearer-token registry


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class _TokenServer:
    """The token service of a registry's bearer-token auth (docker's token spec): Basic
    credentials in, a short-lived ES256 JWT out, with the access the scope asks for; its
    certificate (x5c) is the registry's root of trust."""

    def __init__(self, tmp: Path, user: str, password: str) -> None:
        import datetime
        import http.server

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        self.key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "cachectl-test-token")])
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        self.cert_path = tmp / "token.pem"
        self.cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        self.x5c = base64.b64encode(cert.public_bytes(serialization.Encoding.DER)).decode()
        self.issued = 0
        expected = "Basic " + _basic(user, password)
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                from urllib.parse import parse_qs, urlparse

                if self.headers.get("Authorization") != expected:
                    self.send_response(401)
                    self.end_headers()
                    return
                query = parse_qs(urlparse(self.path).query)
                body = json.dumps({"token": outer.token(query.get("scope", []))}).encode()
                outer.issued += 1
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/token"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def token(self, scopes: list[str]) -> str:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

        access = []
        for scope in scopes:
            kind, name, actions = scope.split(":")
            access.append({"type": kind, "name": name, "actions": actions.split(",")})
        now = int(time.time())
        header = {"alg": "ES256", "typ": "JWT", "x5c": [self.x5c]}
        claims = {
            "iss": "cachectl-test-issuer",
            "sub": "tok",
            "aud": "cachectl-test",
            "exp": now + 300,
            "nbf": now - 10,
            "iat": now,
            "jti": str(time.monotonic_ns()),
            "access": access,
        }
        signing_input = (
            f"{_b64url(json.dumps(header).encode())}.{_b64url(json.dumps(claims).encode())}"
        )
        r, s = decode_dss_signature(
            self.key.sign(signing_input.encode(), ec.ECDSA(hashes.SHA256()))
        )
        return f"{signing_input}.{_b64url(r.to_bytes(32, 'big') + s.to_bytes(32, 'big'))}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_bearer_token_registry_pushes_and_pulls_with_docker_config_credentials(
    tmp_path: Path, node: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """docker-registry with token auth: its challenge is a Bearer realm; cachectl gets a token
    there with the config.json's credentials (oras's token flow), for the push and the pull."""
    _need_registry()
    assert REGISTRY_BIN is not None
    tokens = _TokenServer(tmp_path, "tok", "tokpw")
    port = _free_port()
    config = tmp_path / "registry.yml"
    config.write_text(
        "version: 0.1\nlog: {level: error}\n"
        f"storage: {{filesystem: {{rootdirectory: {tmp_path / 'data'}}}}}\n"
        f"http: {{addr: 127.0.0.1:{port}}}\n"
        f"auth: {{token: {{realm: {tokens.url}, service: cachectl-test, "
        f"issuer: cachectl-test-issuer, rootcertbundle: {tokens.cert_path}}}}}\n"
    )
    proc = subprocess.Popen(
        [REGISTRY_BIN, "serve", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                r = requests.get(f"http://{url}/v2/", timeout=1)
                if r.status_code == 401:
                    break
            except requests.RequestException:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "registry did not start"
            time.sleep(0.1)
        assert r.headers["Www-Authenticate"].startswith("Bearer realm=")
        docker = _docker_config(
            tmp_path / "docker", {"auths": {url: {"auth": _basic("tok", "tokpw")}}}
        )
        monkeypatch.setenv("DOCKER_CONFIG", str(docker))
        saved = {k: os.environ[k] for k in XDG}
        _as_source(monkeypatch, node)
        monkeypatch.setenv("DOCKER_CONFIG", str(docker))
        invoke(
            "bundle",
            "push",
            f"oci://{url}/lm/cache:v1",
            "--manifest",
            str(node["manifest"]),
            "--insecure",
        )
        for k, v in saved.items():
            monkeypatch.setenv(k, v)
        done = json.loads(
            invoke("bundle", "pull", f"oci://{url}/lm/cache:v1", "--insecure", "--json").stdout
        )
        assert done["install"]["installed"] == 5 and tokens.issued >= 2
        monkeypatch.setenv(
            "DOCKER_CONFIG",
            str(
                _docker_config(
                    tmp_path / "wrong", {"auths": {url: {"auth": _basic("tok", "nope")}}}
                )
            ),
        )
        refused = invoke("bundle", "pull", f"oci://{url}/lm/cache:v1", "--insecure", code=2)
        assert "check the credentials" in refused.stderr, refused.stderr
        _one_line(refused.stderr)
    finally:
        proc.kill()
        proc.wait()
        tokens.close()
