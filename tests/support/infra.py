"""Test infrastructure: real servers on loopback, and helpers for the fixtures.

Everything here talks to 127.0.0.1 only. Nothing here imports cachectl, so the
fixtures work while the library is half written.

What was found, checked by tests/test_infra.py (moto 5.2, s3fs 2026.9,
gcsfs 2026.10, gcp-storage-emulator 2026.7, jax 0.10.2, etils 1.15):

S3 on moto
  * botocore (and so s3fs, boto3 and JAX-through-etils) reads the endpoint
    from AWS_ENDPOINT_URL. ``s3fs.S3FileSystem()`` with no arguments reaches
    moto: no ``client_kwargs={"endpoint_url": ...}`` needed. Credentials come
    from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (moto accepts any), region
    from AWS_DEFAULT_REGION.
  * Bucket names must be valid S3 names (3-63 chars, lowercase): "b1" is
    refused with "The specified bucket is not valid".
  * fsspec caches filesystem instances by constructor arguments, not by the
    environment: call clear_fsspec_instance_caches() after changing env vars.

GCS on gcp-storage-emulator
  * gcsfs reads STORAGE_EMULATOR_HOST on every request (``_location()``), so
    the endpoint can be set per test.
  * GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT is read ONCE, when gcsfs is first
    imported (gcsfs/__init__.py picks ExtendedGcsFileSystem when it is
    "true", the default). With it on, every new bucket costs a 60 s gRPC
    probe against the emulator (SSL handshake failures, then "falling back to
    GCSFileSystem"). So it must be "false" in os.environ before anything
    imports gcsfs: configure_process_env() does that when conftest.py loads,
    and subprocesses inherit it.
  * token: not needed. With STORAGE_EMULATOR_HOST set and no credentials
    anywhere, gcsfs's default chain ends at "anon". token="anon" works too.
    But the default chain calls google.auth.default(), which probes the GCE
    metadata server (169.254.169.254) unless NO_GCE_CHECK=true: that is set
    process-wide here, and GCE_METADATA_HOST/GCE_METADATA_IP point at a
    closed loopback port, so no probe ever leaves the machine (checked with
    strace: only 127.0.0.1 connects).
  * gcsfs's mv() calls the JSON API's objects.move (POST .../moveTo/...),
    which the emulator lacks: 501, retried ~34 s, then copy + delete. The
    emulator started here serves moveTo (gcs_emulator_main), so a move
    takes milliseconds, as on real GCS.
  * Server logs (one request per line) are under pytest's basetemp:
    /tmp/pytest-of-$USER/pytest-current/{moto,gcs}-logs*/.

JAX through etils epath
  * JAX writes its persistent cache to s3://bucket/x on moto and to
    gs://bucket/x on the emulator with only these environment variables
    (plus JAX_COMPILATION_CACHE_DIR, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0,
    JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES=none): a
    ``jit__lambda-<64 hex>-cache`` object appears. See
    test_infra.py::test_jax_writes_cache_to_bucket.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LOOPBACK = "127.0.0.1"

# Credentials moto accepts; nothing real.
AWS_TEST_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}

# Set in os.environ when conftest.py is imported (before gcsfs or google.auth
# can be imported), inherited by every subprocess the tests start.
PROCESS_ENV = {
    # Read by gcsfs at import time; see the module docstring.
    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
    # google-auth: never probe the GCE metadata server (169.254.169.254).
    "NO_GCE_CHECK": "true",
    "GCE_METADATA_HOST": f"{LOOPBACK}:9",
    "GCE_METADATA_IP": f"{LOOPBACK}:9",
    # botocore: never probe the EC2 instance metadata service.
    "AWS_EC2_METADATA_DISABLED": "true",
}

_NO_PROXY_HOSTS = [LOOPBACK, "localhost"]


def configure_process_env() -> None:
    """Make this process (and its children) safe for the emulators.

    Call once, before gcsfs/google.auth are imported. Also keeps any HTTP
    proxy from the environment away from loopback traffic.
    """
    os.environ.update(PROCESS_ENV)
    for var in ("NO_PROXY", "no_proxy"):
        hosts = [h for h in os.environ.get(var, "").split(",") if h]
        hosts += [h for h in _NO_PROXY_HOSTS if h not in hosts]
        os.environ[var] = ",".join(hosts)
    gcsfs = sys.modules.get("gcsfs")
    if gcsfs is not None and gcsfs.GCSFileSystem.__name__ == "ExtendedGcsFileSystem":
        raise RuntimeError(
            "gcsfs was imported before tests/conftest.py could set "
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false; every GCS bucket would cost a "
            "60 s probe. Set GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false in the environment."
        )


@contextlib.contextmanager
def held(
    proc: subprocess.Popen[Any],
    ready: Callable[[], bool],
    go: Path,
    log: Path,
    timeout: float = 300,
) -> Iterator[None]:
    """A process that waits for the file ``go``: the body runs once ``ready()`` says the process
    got to its wait (while it is alive; else its ``log`` fails the test). Afterwards, whatever the
    body did, ``go`` is created and the process reaped: killed if it has not ended in ``timeout``."""
    try:
        deadline = time.monotonic() + timeout
        while not ready():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield
    finally:
        go.touch()
        try:
            proc.wait(timeout=timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def unique_name(prefix: str = "cachectl-test") -> str:
    """A fresh lowercase name, valid as an S3/GCS bucket or PostgreSQL database."""
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def port_open(port: int, host: str = LOOPBACK, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _die_with_parent() -> None:  # runs in the child, before exec
    # Linux: SIGTERM the server if pytest dies without tearing it down.
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class ServerStartError(RuntimeError):
    pass


@dataclass
class Server:
    """A server subprocess listening on 127.0.0.1:port."""

    name: str
    port: int
    process: subprocess.Popen
    log_path: Path
    host: str = LOOPBACK
    env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def log_tail(self, n: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n:])

    def stop(self, timeout: float = 10.0) -> None:
        if self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout)


def start_server(
    name: str,
    argv_for_port: Callable[[int], list[str]],
    log_dir: Path,
    *,
    timeout: float = 30.0,
    check: Callable[[Server], None] | None = None,
    attempts: int = 3,
) -> Server:
    """Start ``argv_for_port(port)`` on a free loopback port and wait until it serves.

    Retries on a fresh port when the process dies early (the port was taken
    between free_port() and bind). Raises ServerStartError with the server's
    log tail when it never comes up.
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    errors = []
    for attempt in range(1, attempts + 1):
        port = free_port()
        log_path = log_dir / f"{name}-{port}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                argv_for_port(port),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
            )
        server = Server(name=name, port=port, process=proc, log_path=log_path)
        deadline = time.monotonic() + timeout
        problem = f"no answer on {LOOPBACK}:{port} within {timeout:.0f}s"
        while time.monotonic() < deadline and proc.poll() is None:
            if port_open(port):
                if check is None:
                    return server
                try:
                    check(server)
                    return server
                except Exception as exc:  # listening, not serving yet
                    problem = f"listening on {LOOPBACK}:{port} but not healthy: {exc!r}"
            time.sleep(0.05)
        if proc.poll() is not None:
            problem = f"exited with code {proc.returncode}"
        server.stop()
        errors.append(
            f"attempt {attempt}: {problem}; log {log_path}:\n{textwrap.indent(server.log_tail(), '    ')}"
        )
    raise ServerStartError(
        f"could not start {name} on {LOOPBACK} (argv: {argv_for_port(0)!r}):\n" + "\n".join(errors)
    )


def _http(
    method: str,
    url: str,
    body: bytes | None = None,
    headers: Mapping[str, str] | None = None,
    timeout: float = 10.0,
) -> tuple[int, bytes]:
    # Loopback only, and never through a proxy.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    req = urllib.request.Request(url, data=body, method=method, headers=dict(headers or {}))
    try:
        with opener.open(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


# ---------------------------------------------------------------- S3 (moto)


def start_moto(log_dir: Path) -> Server:
    """moto's S3 API server (``python -m moto.server``) on a free loopback port."""

    def check(server: Server) -> None:
        status, body = _http("GET", server.url + "/")  # ListBuckets
        if status != 200:
            raise RuntimeError(f"GET / answered {status}: {body[:200]!r}")

    server = start_server(
        "moto",
        lambda port: [sys.executable, "-m", "moto.server", "-H", LOOPBACK, "-p", str(port)],
        log_dir,
        check=check,
    )
    server.env = s3_env_vars(server.url)
    return server


def s3_env_vars(endpoint_url: str) -> dict[str, str]:
    """The environment that points boto3, s3fs and JAX (via etils) at moto."""
    return {"AWS_ENDPOINT_URL": endpoint_url, **AWS_TEST_ENV}


def create_s3_bucket(endpoint_url: str, name: str) -> None:
    import boto3  # from moto[server]

    client = boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        aws_access_key_id=AWS_TEST_ENV["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=AWS_TEST_ENV["AWS_SECRET_ACCESS_KEY"],
        region_name=AWS_TEST_ENV["AWS_DEFAULT_REGION"],
    )
    client.create_bucket(Bucket=name)


# --------------------------------------------------------- GCS (emulator)


def start_gcs_emulator(log_dir: Path) -> Server:
    """gcp-storage-emulator, in memory, on a free loopback port (with objects.move added)."""

    def check(server: Server) -> None:
        status, body = _http("GET", server.url + "/storage/v1/b?project=test")
        if status != 200:
            raise RuntimeError(f"GET /storage/v1/b answered {status}: {body[:200]!r}")

    tests_dir = str(Path(__file__).resolve().parent)
    bootstrap = (
        f"import sys; sys.path.insert(0, {tests_dir!r}); "
        "import infra; infra.gcs_emulator_main(sys.argv[1:])"
    )
    server = start_server(
        "gcs-emulator",
        lambda port: [
            sys.executable,
            "-c",
            bootstrap,
            "start",
            f"--host={LOOPBACK}",
            f"--port={port}",
            "--in-memory",
        ],
        log_dir,
        check=check,
    )
    server.env = gcs_env_vars(server.url)
    return server


def gcs_emulator_main(argv: list[str]) -> None:
    """Run gcp-storage-emulator's CLI with the JSON API's objects.move added.

    gcsfs's mv() first calls POST b/{bucket}/o/{src}/moveTo/o/{dst} (real GCS
    has it); the emulator answers 501, which gcsfs retries six times with
    backoff (about 34 s) before falling back to rewrite + delete. So every
    move in a test would cost 34 s. Here moveTo is served as copy + delete
    inside the emulator, returning the new object's resource as GCS does.
    Everything else is the emulator as shipped.
    """
    from http import HTTPStatus

    from gcp_storage_emulator import server as gserver
    from gcp_storage_emulator import settings
    from gcp_storage_emulator.__main__ import main
    from gcp_storage_emulator.exceptions import NotFound
    from gcp_storage_emulator.handlers import objects

    def move(request, response, storage, *args, **kwargs):
        params = request.params
        bucket = params["bucket_name"]
        try:
            dest = objects._copy(
                request.base_url,
                storage,
                bucket,
                params["object_id"],
                bucket,
                params["dest_object_id"],
            )
        except NotFound:
            response.status = HTTPStatus.NOT_FOUND
            return
        objects._delete(storage, bucket, params["object_id"])
        response.json(dest)

    pattern = (
        rf"^{settings.API_ENDPOINT}/b/(?P<bucket_name>[-.\w]+)/o/(?P<object_id>.*[^/]+)"
        r"/moveTo/o/(?P<dest_object_id>.*[^/]+)$"
    )
    gserver.HANDLERS = ((pattern, {"POST": move}), *gserver.HANDLERS)
    gserver._read_data = _exact_multipart(gserver._read_data, gserver)
    sys.argv = ["gcp-storage-emulator", *argv]
    main()


def _exact_multipart(read_data, gserver):
    """The emulator's multipart upload without its off-by-one on data ending in b"\\r".

    It parses a multipart/related upload with the email package, which takes the line break
    before the closing boundary to be CRLF when the data's last byte is \\r; gcsfs writes LF,
    so such an object lost its last byte (1 in 256 random entries: a flaky `verify` "corrupt").
    Here the body is what lies between the part's blank line and the delimiter, with the line
    break style the upload itself uses.
    """
    import re

    def read(request_handler, query):
        content_type = request_handler.headers.get("Content-Type") or ""
        match = re.match(r'multipart/related;\s*boundary="?([^";]+)"?', content_type)
        if not match:
            return read_data(request_handler, query)
        raw = gserver._decode_raw_data(gserver._read_raw_data(request_handler), request_handler)
        dash = b"--" + match.group(1).encode()
        nl = b"\r\n" if raw.startswith(dash + b"\r\n") else b"\n"
        parts = raw.split(nl + dash)
        parts[0] = parts[0][len(dash) :]  # the first delimiter has no line break before it

        def split(part: bytes) -> tuple[bytes, bytes]:
            head, _, body = part[len(nl) :].partition(nl + nl)
            return head, body

        meta_head, meta = split(parts[0])
        file_head, content = split(parts[1])
        kind = "application/octet-stream"
        for line in file_head.split(nl):
            name, _, value = line.decode().partition(":")
            if name.strip().lower() == "content-type":
                kind = value.strip()
        return {"meta": json.loads(meta), "content": content, "content-type": kind}

    return read


def gcs_env_vars(endpoint_url: str) -> dict[str, str]:
    """The environment that points gcsfs and JAX (via etils) at the emulator."""
    return {"STORAGE_EMULATOR_HOST": endpoint_url, **PROCESS_ENV}


def create_gcs_bucket(endpoint_url: str, name: str) -> None:
    status, body = _http(
        "POST",
        f"{endpoint_url}/storage/v1/b?project=test",
        json.dumps({"name": name}).encode(),
        {"Content-Type": "application/json"},
    )
    if status != 200:
        raise RuntimeError(
            f"creating gs://{name} on {endpoint_url} answered {status}: {body[:300]!r}"
        )


# ------------------------------------------------------ Azure Blob (Azurite)

# Azurite's one built-in account (its documented development key; nothing real).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)


def azurite_command() -> str | None:
    """The azurite-blob executable: CACHECTL_TEST_AZURITE (scripts/test exports it after
    setup_azurite), the checkout's .test-azurite/ install, or one on PATH; None when none is."""
    import shutil

    given = os.environ.get("CACHECTL_TEST_AZURITE")
    if given:
        return given
    local = Path(__file__).resolve().parents[2] / ".test-azurite/node_modules/.bin/azurite-blob"
    if local.exists():
        return str(local)
    return shutil.which("azurite-blob")


def start_azurite(command: str, log_dir: Path, debug_log: Path | None = None) -> Server:
    """Azurite's Blob service (the Azure Storage emulator, npm package ``azurite``), in memory, on
    a free loopback port. --skipApiVersionCheck: the Python SDK may speak a newer REST version
    than this Azurite knows; --loose: it ignores headers it does not implement. ``debug_log``:
    Azurite's --debug log, one ``RequestMethod=... RequestURL=...`` line per request answered."""

    def check(server: Server) -> None:
        status, _ = _http("GET", f"{server.url}/{AZURITE_ACCOUNT}?comp=list")
        if status not in (200, 403):  # listening and answering (403: the request is unsigned)
            raise RuntimeError(f"GET ?comp=list answered {status}")

    server = start_server(
        "azurite",
        lambda port: [
            command,
            "--blobHost",
            LOOPBACK,
            "--blobPort",
            str(port),
            "--inMemoryPersistence",
            "--skipApiVersionCheck",
            "--loose",
            "--disableTelemetry",
            *(["--debug", str(debug_log)] if debug_log is not None else []),
        ],
        log_dir,
        check=check,
    )
    server.env = az_env_vars(server.url)
    return server


def az_env_vars(endpoint_url: str) -> dict[str, str]:
    """The environment that points adlfs, and JAX through etils, at Azurite: the connection string
    adlfs reads (AZURE_STORAGE_CONNECTION_STRING)."""
    return {
        "AZURE_STORAGE_CONNECTION_STRING": (
            f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};"
            f"AccountKey={AZURITE_KEY};BlobEndpoint={endpoint_url}/{AZURITE_ACCOUNT};"
        )
    }


def create_az_container(connection_string: str, name: str) -> None:
    from azure.storage.blob import BlobServiceClient  # from adlfs

    BlobServiceClient.from_connection_string(connection_string).create_container(name)


# ------------------------------------------------------------------ fsspec


def clear_fsspec_instance_caches() -> None:
    """Forget cached filesystem instances (they capture env at creation).

    Imports nothing new: only classes already loaded are cleared. The memory
    filesystem's *contents* are not touched.
    """
    classes = []
    with contextlib.suppress(Exception):
        import fsspec

        classes.extend(fsspec.registry.values())
    for mod_name, attr in (
        ("s3fs", "S3FileSystem"),
        ("gcsfs", "GCSFileSystem"),
        ("adlfs", "AzureBlobFileSystem"),
    ):
        mod = sys.modules.get(mod_name)
        if mod is not None:
            classes.append(getattr(mod, attr))
    for cls in classes:
        clear = getattr(cls, "clear_instance_cache", None)
        if clear is not None:
            with contextlib.suppress(Exception):
                clear()


# -------------------------------------------------------------- PostgreSQL


def _psycopg_conninfo(sqlalchemy_url: str) -> str:
    from sqlalchemy.engine import make_url

    return (
        make_url(sqlalchemy_url).set(drivername="postgresql").render_as_string(hide_password=False)
    )


def pg_check(admin_url: str) -> None:
    import psycopg

    with psycopg.connect(_psycopg_conninfo(admin_url), connect_timeout=10) as conn:
        conn.execute("SELECT 1")


def pg_create_database(admin_url: str, name: str) -> str:
    """CREATE DATABASE name (via admin_url's database); return its SQLAlchemy URL."""
    import psycopg
    from psycopg import sql
    from sqlalchemy.engine import make_url

    with psycopg.connect(_psycopg_conninfo(admin_url), autocommit=True, connect_timeout=10) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return make_url(admin_url).set(database=name).render_as_string(hide_password=False)


def pg_drop_database(admin_url: str, name: str) -> None:
    import psycopg
    from psycopg import sql

    # FORCE cannot end an autovacuum worker busy on the database (PostgreSQL checks the role of
    # every backend it would terminate, and a worker's is none): such a worker finishes in
    # moments, so try again for a while before failing.
    for attempt in range(40):
        with psycopg.connect(
            _psycopg_conninfo(admin_url), autocommit=True, connect_timeout=10
        ) as conn:
            try:
                conn.execute(
                    sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
                )
                return
            except psycopg.errors.InsufficientPrivilege:
                if attempt == 39:
                    raise
        time.sleep(0.25)


# ------------------------------------------------------------- subprocess


def run_cachectl(
    cwd: str | os.PathLike, *args: str, env: Mapping[str, str] | None = None, timeout: float = 600.0
) -> subprocess.CompletedProcess[str]:
    """``cachectl ARGS`` as a user runs it: a fresh process of this venv in ``cwd``, with
    os.environ plus ``env``; text stdout/stderr, never raising on its exit status."""
    return subprocess.run(
        [sys.executable, "-m", "cachectl", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        check=False,
    )


def run_py(
    code: str,
    env: Mapping[str, str | None] | None = None,
    *,
    timeout: float = 240.0,
    cwd: str | os.PathLike | None = None,
    check: bool = False,
) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh Python process (this interpreter, same venv).

    The child gets the current os.environ (so whatever fixtures set with
    monkeypatch: isolated XDG dirs, S3/GCS endpoints) plus ``env``; a value
    of None removes that variable. The code is dedented, so it can be an
    indented triple-quoted string. Returns the CompletedProcess with text
    stdout/stderr; with check=True a non-zero exit raises AssertionError
    showing both streams.
    """
    child_env = dict(os.environ)
    for key, value in (env or {}).items():
        if value is None:
            child_env.pop(key, None)
        else:
            child_env[key] = str(value)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=child_env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"subprocess exited with {proc.returncode}\n"
            f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
        )
    return proc
