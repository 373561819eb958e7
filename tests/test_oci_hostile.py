"""A hostile OCI registry: credentials stay on the registry, every request ends on time, and no
manifest or referrers listing it serves is more than one line.

The registry is a small HTTP server on 127.0.0.1 (a thread in the test) that answers what each
test needs; a second server on 127.0.0.2, another loopback address, stands in for another host
(a token service, an upload location) and records what reaches it. The pulls are real
``cachectl bundle pull`` runs (in this process, as tests/test_oci.py runs them); the push goes
through the registry client the push uses.
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.bundles import assert_nothing_installed
from support.warming import invoke

from cachectl.bundle.oci import Registry, parse_reference
from cachectl.core.fingerprint import current_environment

MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
ARTIFACT_TYPE = "application/vnd.cachectl.bundle.v1"
LAYER_TYPE = "application/vnd.cachectl.bundle.v1+zstd"
CONFIG_TYPE = "application/vnd.cachectl.bundle.config.v1+json"
SIGNATURE_TYPE = "application/vnd.cachectl.bundle.signature.v1+json"
A = "io.cachectl."
TIMEOUT_S = 2  # CACHECTL_OCI_TIMEOUT in the slow-body test
LOGIN = base64.b64encode(b"user:password").decode()

Route = Callable[["_Handler"], None]


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        path = self.path.split("?", 1)[0]
        self.server.seen.append((self.command, path, self.headers.get("Authorization")))
        route = self.server.routes.get(f"{self.command} {path}") or self.server.routes.get(path)
        try:
            if route is None:
                self.send(404, b'{"errors": []}')
            else:
                route(self)
        except OSError:  # the client went away (what a cut-off request does)
            pass

    do_GET = do_HEAD = do_POST = do_PUT = _answer  # noqa: N815 - http.server's names

    def send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, host: str, routes: dict[str, Route]) -> None:
        super().__init__((host, 0), _Handler)
        self.routes = {"/v2/": lambda h: h.send(200, b"{}"), **routes}
        self.seen: list[tuple[str, str, str | None]] = []
        self.stop = threading.Event()
        self.netloc = f"{host}:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.stop.set()
        self.shutdown()
        self.server_close()


@pytest.fixture
def servers() -> Iterator[Callable[[str, dict[str, Route]], _Server]]:
    started: list[_Server] = []

    def start(host: str, routes: dict[str, Route]) -> _Server:
        started.append(_Server(host, routes))
        return started[-1]

    yield start
    for server in started:
        server.close()


def _digest(body: bytes) -> str:
    return "sha256:" + hashlib.sha256(body).hexdigest()


def _one_line(result: Any) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert isinstance(result.exception, SystemExit), result.exception
    return lines[0]


def _manifest(layer_size: int, annotations: dict[str, str] | None = None, **over: Any) -> bytes:
    config = b"{}"
    m = {
        "schemaVersion": 2,
        "mediaType": MANIFEST_TYPE,
        "artifactType": ARTIFACT_TYPE,
        "config": {"mediaType": CONFIG_TYPE, "digest": _digest(config), "size": len(config)},
        "layers": [{"mediaType": LAYER_TYPE, "digest": _digest(b"blob"), "size": layer_size}],
        "annotations": annotations or {},
        **over,
    }
    return json.dumps(m).encode()


def _serve(body: bytes, media_type: str = MANIFEST_TYPE) -> Route:
    return lambda h: h.send(200, body, {"Content-Type": media_type})


@pytest.fixture(scope="module")
def here() -> dict[str, Any]:
    """This machine's environment, as a pull computes it: a manifest annotated with it is taken
    without its config (push writes these annotations)."""
    env = current_environment()
    notes = {A + "environment": env.digest, A + "namespace": env.namespace, A + "bytes": "10"}
    return {"notes": notes, "env": env.to_dict(), "digest": env.digest}


# --------------------------------------------------------------------------- credentials


def test_a_challenge_or_location_on_another_host_gets_no_credentials(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, servers: Any
) -> None:
    """Pull: the registry's 401 names a token service on 127.0.0.2 over plain HTTP; the login in
    the docker config goes nowhere and the pull is refused in one line. Push: an upload Location
    on 127.0.0.2 gets the blob without the login."""
    elsewhere = servers(
        "127.0.0.2",
        {
            "/token": _serve(b'{"token": "t"}', "application/json"),
            "PUT /upload/1": lambda h: h.send(201),
        },
    )

    def challenge(h: _Handler) -> None:
        realm = f'Bearer realm="http://{elsewhere.netloc}/token",service="reg"'
        h.send(401, b"{}", {"Www-Authenticate": realm + ',scope="repository:lm/cache:pull"'})

    bearer = servers("127.0.0.1", {})
    bearer.routes.update({"/v2/": challenge, "/v2/lm/cache/manifests/v1": challenge})

    def basic_only(route: Route) -> Route:
        def check(h: _Handler) -> None:
            if h.headers.get("Authorization") != f"Basic {LOGIN}":
                h.send(401, b"{}", {"Www-Authenticate": 'Basic realm="reg"'})
            else:
                route(h)

        return check

    location = {"Location": f"http://{elsewhere.netloc}/upload/1"}
    basic = servers(
        "127.0.0.1",
        {
            "/v2/": basic_only(lambda h: h.send(200, b"{}")),
            "POST /v2/lm/cache/blobs/uploads/": basic_only(lambda h: h.send(202, b"", location)),
        },
    )
    docker = tmp_path / "docker"
    docker.mkdir()
    auths = {server.netloc: {"auth": LOGIN} for server in (bearer, basic)}
    (docker / "config.json").write_text(json.dumps({"auths": auths}))
    monkeypatch.setenv("DOCKER_CONFIG", str(docker))

    refused = invoke("bundle", "pull", f"oci://{bearer.netloc}/lm/cache:v1", "--insecure", code=2)
    line = _one_line(refused)
    assert "token service" in line and "over plain HTTP" in line, line

    registry = Registry(parse_reference(f"oci://{basic.netloc}/lm/cache:v1"), insecure=True)
    try:
        assert registry.put_blob(_digest(b"blob"), 4, b"blob") == 4
    finally:
        registry.session.close()
    assert ("PUT", "/upload/1", None) in elsewhere.seen, elsewhere.seen
    assert [auth for _, _, auth in elsewhere.seen] == [None], elsewhere.seen


# --------------------------------------------------------------------------- deadlines


def _drip(body: bytes, every_s: float, declared: int | None = None) -> Route:
    def send(h: _Handler) -> None:
        h.send_response(200)
        h.send_header("Content-Type", MANIFEST_TYPE)
        h.send_header("Content-Length", str(declared if declared is not None else len(body)))
        h.end_headers()
        for i in range(0, len(body), 1 if every_s < 1 else 64):
            if h.server.stop.wait(every_s):
                return
            h.wfile.write(body[i : i + (1 if every_s < 1 else 64)])
            h.wfile.flush()

    return send


def _zeros(declared: int) -> Route:
    def send(h: _Handler) -> None:
        h.send_response(200)
        h.send_header("Content-Length", str(declared))
        h.end_headers()
        chunk = bytes(1 << 20)
        while not h.server.stop.is_set():
            h.wfile.write(chunk)

    return send


@pytest.mark.timeout(120)
def test_slow_or_endless_bodies_end_within_the_timeout(
    monkeypatch: pytest.MonkeyPatch, servers: Any, here: dict[str, Any]
) -> None:
    """CACHECTL_OCI_TIMEOUT bounds each request whole: a manifest sent a byte at a time, a
    terabyte blob of zeros, a blob sent 64 bytes a second (each within the read timeout) all end
    within the timeout and a little, one line, exit 2. A blob longer than its manifest says is
    cut off there."""
    blob = f"/v2/lm/cache/blobs/{_digest(b'blob')}"
    manifest = _manifest(10, here["notes"])
    monkeypatch.setenv("CACHECTL_OCI_TIMEOUT", str(TIMEOUT_S))
    cases = {
        "manifest, a byte every 0.5 s": {"/v2/lm/cache/manifests/v1": _drip(manifest, 0.5)},
        "a 1 TB blob of zeros": {
            "/v2/lm/cache/manifests/v1": _serve(_manifest(1 << 40, here["notes"])),
            blob: _zeros(1 << 40),
        },
        "a blob, 64 bytes a second": {
            "/v2/lm/cache/manifests/v1": _serve(_manifest(1 << 20, here["notes"])),
            blob: _drip(bytes(1 << 20), 1.0),
        },
    }
    for case, routes in cases.items():
        registry = servers("127.0.0.1", routes)
        started = time.monotonic()
        result = invoke(
            "bundle", "pull", f"oci://{registry.netloc}/lm/cache:v1", "--insecure", code=2
        )
        took = time.monotonic() - started
        line = _one_line(result)
        assert f"did not answer within {TIMEOUT_S} s" in line, (case, line)
        assert took < TIMEOUT_S + 5, (case, took)
        registry.close()

    longer = servers(
        "127.0.0.1",
        {"/v2/lm/cache/manifests/v1": _serve(_manifest(10, here["notes"])), blob: _zeros(1 << 30)},
    )
    result = invoke("bundle", "pull", f"oci://{longer.netloc}/lm/cache:v1", "--insecure", code=2)
    assert "longer than its manifest says" in _one_line(result)


# --------------------------------------------------------------------------- hostile JSON


def test_hostile_manifests_and_referrer_listings_are_one_line_exit_2(
    tmp_path: Path, servers: Any, here: dict[str, Any]
) -> None:
    """Wrong JSON types, nesting deeper than the parser goes, numbers too large, missing fields,
    a non-list ``manifests``: each pull is refused in one line, exit 2, nothing installed."""
    layer = {"mediaType": LAYER_TYPE, "digest": _digest(b"blob"), "size": 10}
    huge_env = {**here["env"], "device_count": "1e999"}
    config = json.dumps({"format": "cachectl-oci-bundle/1", "environment": huge_env, "bytes": 1})
    config_bytes = config.replace('"1e999"', "1e999").encode()
    config_descriptor = {
        "mediaType": CONFIG_TYPE,
        "digest": _digest(config_bytes),
        "size": len(config_bytes),
    }
    deep = b'{"layers": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    shapes: dict[str, tuple[bytes, str]] = {
        "config-a-string": (
            _manifest(10, config="x"),
            "its config descriptor is not a JSON object",
        ),
        "layer-a-string": (_manifest(10, layers=["x"]), "its layer is not a JSON object"),
        "deep": (deep, "nested too deep"),
        "huge-number": (_manifest(10, config=config_descriptor), "its config is not JSON"),
        "no-layer-digest": (
            _manifest(10, layers=[{"mediaType": LAYER_TYPE, "size": 10}]),
            "its digest is not sha256",
        ),
    }
    many_digits = {**here["notes"], A + "bytes": "9" * 5000}
    shapes["bytes-5000-digits"] = (_manifest(10, many_digits), "its config's environment")
    routes: dict[str, Route] = {
        f"/v2/lm/cache/blobs/{_digest(b'{}')}": _serve(b"{}"),
        f"/v2/lm/cache/blobs/{config_descriptor['digest']}": _serve(config_bytes),
    }
    for tag, (body, _) in shapes.items():
        routes[f"/v2/lm/cache/manifests/{tag}"] = _serve(body)
    routes["/v2/lm/cache/tags/list"] = _serve(b"[]", "application/json")  # no object
    registry = servers("127.0.0.1", routes)
    for tag, (_, says) in shapes.items():
        result = invoke(
            "bundle", "pull", f"oci://{registry.netloc}/lm/cache:{tag}", "--insecure", code=2
        )
        assert says in _one_line(result), (tag, result.stderr)
    # No env- tag for this machine: the tag list is read for the closest, and is no object.
    result = invoke(
        "bundle",
        "pull",
        f"oci://{registry.netloc}/lm/cache",
        "--for-this-machine",
        "--insecure",
        code=2,
    )
    assert "the tag list is not a JSON object" in _one_line(result), result.stderr

    # A signature's referrers: a listing whose manifests is no list, a signature whose layers are
    # an object. The cache trusts a key, so the pull looks for a signature first.
    key = tmp_path / "signer.key"
    invoke("key", "generate", str(key))
    invoke("cache", "set", "default", "--trust", str(key) + ".pub")
    bundle = _manifest(10, here["notes"])
    bundle_digest = _digest(bundle)
    signature = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": MANIFEST_TYPE,
            "artifactType": SIGNATURE_TYPE,
            "subject": {"mediaType": MANIFEST_TYPE, "digest": bundle_digest, "size": len(bundle)},
            "layers": {"0": layer},
        }
    ).encode()
    listing = {"mediaType": MANIFEST_TYPE, "digest": _digest(signature), "size": len(signature)}
    referrers = f"/v2/lm/cache/referrers/{bundle_digest}"
    for listed, says in (
        ({"manifests": {"0": listing}}, "has no signature by a key"),
        ({"manifests": [{**listing, "artifactType": SIGNATURE_TYPE}]}, "signature's layers"),
    ):
        signed = servers(
            "127.0.0.1",
            {
                "/v2/lm/cache/manifests/v1": _serve(bundle),
                f"/v2/lm/cache/manifests/{_digest(signature)}": _serve(signature),
                referrers: _serve(json.dumps(listed).encode(), "application/json"),
            },
        )
        result = invoke(
            "bundle", "pull", f"oci://{signed.netloc}/lm/cache:v1", "--insecure", code=2
        )
        assert says in _one_line(result), (listed, result.stderr)
    assert_nothing_installed()
