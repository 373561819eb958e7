"""A cache's storage options reach JAX's own reads and writes, and every network wait is bounded.

Issue 50, finding 3: for a cache added with ``--storage-option endpoint_url=...`` warm and services
handed JAX the bare ``s3://bkt/...`` path, so JAX talked to the default endpoint (the public
``bkt.s3.amazonaws.com``, a same-named bucket anyone may own); an endpoint that accepted
connections and never answered held ``cache add`` and a service's first compile for minutes.

Real parts only: moto's S3 server and loopback peers (tests/support/stalling.py) that record
every request, never answer, or answer a byte every 0.2 s. botocore's default endpoint
(``AWS_ENDPOINT_URL``) points at a recording peer, so a request that misses the cache's endpoint
is seen, never sent off the machine.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.infra import AWS_TEST_ENV, create_s3_bucket, run_cachectl, run_py, unique_name
from support.stalling import Peer, peer
from support.warming import service, tiny

from cachectl.index import open_index

# Small bounds, so a test waits seconds: 1 s to connect, 1 s of silence, 2 s a request.
BOUNDS = {
    "CACHECTL_STORAGE_CONNECT_TIMEOUT": "1",
    "CACHECTL_STORAGE_READ_TIMEOUT": "1",
    "CACHECTL_STORAGE_TIMEOUT": "2",
}
# Far below what an unbounded wait took (over 200 s), far above the bounds plus a process start
# on a loaded 2-core machine.
ENDS_WITHIN_S = 45.0


@pytest.fixture
def default_endpoint(monkeypatch: pytest.MonkeyPatch) -> Iterator[Peer]:
    """botocore's default endpoint, for every process the test starts, on a peer that records
    each request and refuses it (403)."""
    with peer("record") as recorder:
        monkeypatch.setenv("AWS_ENDPOINT_URL", recorder.url)
        for name, value in AWS_TEST_ENV.items():
            monkeypatch.setenv(name, value)
        yield recorder


def _one_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    assert len(lines) == 1, text
    return lines[0]


def test_the_endpoint_option_reaches_warm_and_the_service(
    tmp_path: Path, moto_server, default_endpoint: Peer
) -> None:
    """The bucket exists only at moto: warm writes there, a service hits there, and nothing
    reaches the default endpoint."""
    bucket = unique_name()
    create_s3_bucket(moto_server.url, bucket)
    add = run_cachectl(
        tmp_path,
        "cache", "add", "s3c", f"s3://{bucket}/jax",
        "--storage-option", f"endpoint_url={moto_server.url}",
        "--storage-option", "client_kwargs.region_name=eu-west-1",  # s3fs's region: nested
    )  # fmt: skip
    assert add.returncode == 0, add.stderr
    manifest = tiny(tmp_path)
    warm = run_cachectl(tmp_path, "warm", str(manifest), "--cache", "s3c", "--json")
    assert warm.returncode == 0, warm.stderr[-2000:]
    report = json.loads(warm.stdout)
    assert report["summary"]["compiled"] == 5 and report["summary"]["failed"] == 0, report
    assert report["namespace"].startswith(f"s3://{bucket}/jax/")

    import boto3

    s3 = boto3.client("s3", endpoint_url=moto_server.url)
    listed = s3.list_objects_v2(Bucket=bucket, Prefix="jax/")
    names = {item["Key"].rsplit("/", 1)[1] for item in listed.get("Contents", [])}
    assert {b["key"] + "-cache" for b in report["buckets"]} <= names, names

    result = service(tmp_path, cache="s3c")
    assert result["warning"] is None, result  # JAX's filesystem carries both options, or refused
    assert result["requests"] == 5 and result["hits"] == 5, result

    # What `cachectl env` prints (and `exec` sets) points a child's JAX at moto: no activate().
    variables = json.loads(run_cachectl(tmp_path, "--cache", "s3c", "env", "--json").stdout)
    handed = json.loads(variables["FSSPEC_S3"])
    assert handed["endpoint_url"] == moto_server.url, handed
    assert handed["client_kwargs"] == {"region_name": "eu-west-1"}, handed
    child = run_py(CHILD.format(dir=str(tmp_path)), variables, check=True)
    assert json.loads(child.stdout.strip().splitlines()[-1]) == {"requests": 5, "hits": 5}
    assert default_endpoint.connections == 0, default_endpoint.requests


# A service started with `cachectl env`'s variables: plain JAX, no cachectl import.
CHILD = """
import json, sys
import numpy as np
import jax
sys.path.insert(0, {dir!r})
import wm_tiny
counts = {{}}
jax.monitoring.register_event_listener(lambda e, **kw: counts.__setitem__(e, counts.get(e, 0) + 1))
affine = jax.jit(wm_tiny.affine, static_argnames=["mode"])
w = np.ones((8, 8), np.float32)
for batch in (1, 2):
    for mode in ("relu", "tanh"):
        affine(np.ones((batch, 8), np.float32), w, mode=mode).block_until_ready()
p = {{"w": w, "b": np.zeros((8,), np.float32)}}
jax.jit(wm_tiny.layer)(np.ones((3, 8), np.float32), p).block_until_ready()
print(json.dumps({{"requests": counts.get("/jax/compilation_cache/compile_requests_use_cache", 0),
                  "hits": counts.get("/jax/compilation_cache/cache_hits", 0)}}))
"""


@pytest.mark.parametrize("behaviour", ["silent", "trickle"])
def test_cache_add_ends_within_the_bound(
    tmp_path: Path, behaviour: str, default_endpoint: Peer
) -> None:
    """An endpoint that never answers, or answers a byte every 0.2 s: one line, exit 2, no cache."""
    with peer(behaviour) as endpoint:
        started = time.monotonic()
        add = run_cachectl(
            tmp_path,
            "cache", "add", "dead", "s3://bkt/jax",
            "--storage-option", f"endpoint_url={endpoint.url}",
            env=BOUNDS, timeout=240,
        )  # fmt: skip
        took = time.monotonic() - started
        assert endpoint.connections >= 1  # the cache's endpoint was asked, not another
    assert add.returncode == 2, (add.returncode, add.stderr)
    line = _one_line(add.stderr)
    assert "s3://bkt/jax" in line and "Traceback" not in add.stderr, line
    assert took < ENDS_WITHIN_S, (took, line)
    listed = run_cachectl(tmp_path, "cache", "list", "--json")
    assert "dead" not in listed.stdout
    assert default_endpoint.connections == 0


@pytest.mark.parametrize("behaviour", ["silent", "trickle"])
def test_warm_ends_within_the_bound(tmp_path: Path, behaviour: str, default_endpoint: Peer) -> None:
    """warm on a dead endpoint: one line, exit 2, after a bound or two, not minutes of retries."""
    db = f"sqlite:///{tmp_path / 'index.db'}"
    manifest = tiny(tmp_path)
    with peer(behaviour) as endpoint:
        index = open_index(db)
        index.add_cache("s3c", "s3://bkt/jax", storage_options={"endpoint_url": endpoint.url})
        index.close()
        started = time.monotonic()
        warm = run_cachectl(
            tmp_path, "--db", db, "warm", str(manifest), "--cache", "s3c", env=BOUNDS, timeout=240
        )
        took = time.monotonic() - started
        assert endpoint.connections >= 1
    assert warm.returncode == 2, (warm.returncode, warm.stderr[-2000:])
    line = _one_line(warm.stderr)
    assert line.startswith("cachectl: error: storage endpoint") and "timed out" in line, line
    assert took < ENDS_WITHIN_S, (took, line)
    assert default_endpoint.connections == 0


SERVICE = """
import json, time, cachectl
import jax
started = time.monotonic()
activation = cachectl.activate(telemetry=False)
first = int(jax.jit(lambda x: x + 1)(1))
took = time.monotonic() - started
second = int(jax.jit(lambda x: x * 3)(2))
print(json.dumps({"path": activation.path, "readonly": activation.readonly, "first": first,
                  "second": second, "took": took}))
"""


@pytest.mark.parametrize(("behaviour", "readonly"), [("silent", "true"), ("trickle", "false")])
def test_a_service_compiles_as_plain_jax_within_the_bound(
    tmp_path: Path, behaviour: str, readonly: str, default_endpoint: Peer
) -> None:
    """activate() (a writer's creates its namespace first) and the first compile wait a bound or
    two on a dead endpoint, warn, and compile as plain JAX."""
    db = f"sqlite:///{tmp_path / 'index.db'}"
    with peer(behaviour) as endpoint:
        index = open_index(db)
        index.add_cache("s3c", "s3://bkt/jax", storage_options={"endpoint_url": endpoint.url})
        index.close()
        service_env = {**BOUNDS, "CACHECTL_DB": db, "CACHECTL_CACHE": "s3c"}
        proc = run_py(SERVICE, {**service_env, "CACHECTL_READONLY": readonly}, timeout=240)
        asked = endpoint.connections
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["path"].startswith("s3://bkt/jax/"), result
    assert result["readonly"] is (readonly == "true"), result
    assert (result["first"], result["second"]) == (2, 6), result
    assert result["took"] < ENDS_WITHIN_S, result
    assert asked >= 1, proc.stderr[-2000:]  # JAX asked the cache's endpoint, not the default
    assert "timed out" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert default_endpoint.connections == 0, default_endpoint.requests


def test_a_service_refuses_a_cache_whose_options_cannot_reach_jax(
    tmp_path: Path, default_endpoint: Peer
) -> None:
    """etils built JAX's s3 filesystem before activate() (user code read s3:// through it): the
    cache's endpoint cannot reach JAX, so the service runs as plain JAX, with one line."""
    db = f"sqlite:///{tmp_path / 'index.db'}"
    index = open_index(db)
    index.add_cache("s3c", "s3://bkt/jax", storage_options={"endpoint_url": "http://127.0.0.1:9"})
    index.close()
    code = """
    from etils import epath
    try:
        epath.Path("s3://elsewhere/config.json").exists()
    except Exception:
        pass
    import json, cachectl, jax
    activation = cachectl.activate(telemetry=False)
    y = int(jax.jit(lambda x: x + 1)(1))
    print(json.dumps({"path": activation.path, "warning": activation.warning, "y": y}))
    """
    proc = run_py(code, {**BOUNDS, "CACHECTL_DB": db, "CACHECTL_CACHE": "s3c"}, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["path"] == "" and result["y"] == 2, result
    assert "not activated" in result["warning"] and "endpoint_url" in result["warning"], result
    assert "\n" not in result["warning"]


def test_a_bad_bound_is_one_line_and_exit_2(tmp_path: Path, default_endpoint: Peer) -> None:
    add = run_cachectl(
        tmp_path, "cache", "add", "x", "s3://bkt/jax", env={"CACHECTL_STORAGE_TIMEOUT": "soon"}
    )
    assert add.returncode == 2, add.stderr
    assert "CACHECTL_STORAGE_TIMEOUT" in _one_line(add.stderr)
    assert default_endpoint.connections == 0


def test_a_dotted_storage_option_is_nested_and_a_clash_is_one_line(tmp_path: Path) -> None:
    add = run_cachectl(
        tmp_path,
        "cache", "add", "r", str(tmp_path / "r"), "--json",
        "--storage-option", "client_kwargs.region_name=eu-west-1",
        "--storage-option", "client_kwargs.verify=false",
    )  # fmt: skip
    assert add.returncode == 0, add.stderr
    options = json.loads(add.stdout)["storage_options"]
    assert options == {"client_kwargs": {"region_name": "eu-west-1", "verify": False}}
    for pairs in (["a=1", "a.b=2"], ["a.b=2", "a=1"], ["client_kwargs.=x"]):
        args = [arg for pair in pairs for arg in ("--storage-option", pair)]
        bad = run_cachectl(tmp_path, "cache", "add", "bad", str(tmp_path / "b"), *args)
        assert bad.returncode == 2 and "bad storage option" in _one_line(bad.stderr), bad.stderr
    secret = run_cachectl(
        tmp_path, "cache", "add", "bad", str(tmp_path / "b"),
        "--storage-option", "client_kwargs.aws_secret_access_key=hunter2",
    )  # fmt: skip
    assert secret.returncode == 2 and "credential" in _one_line(secret.stderr)


def _refusing_port() -> int:
    """A loopback port nobody listens on: connections to it are refused at once."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


AZ_GS_BOUNDS = {
    "CACHECTL_STORAGE_CONNECT_TIMEOUT": "1",
    "CACHECTL_STORAGE_READ_TIMEOUT": "1",
    "CACHECTL_STORAGE_TIMEOUT": "5",
}


def test_az_and_gs_endpoints_that_refuse_connections_end_within_the_bounds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Azure and Google Cloud Storage get the bounds and pause of s3://. With bounds of 1/1/5 s,
    ``verify`` of an az:// cache whose endpoint refuses connections took 163-167 s (azure's
    retries, 15 s and more apart) and ended in azure's ServiceRequestError traceback; gcsfs
    tried a refused request six times, up to 32 s apart, then raised aiohttp's error. Both now
    stop at the pause, one line."""
    from support.infra import az_env_vars

    from cachectl.core.errors import Unreachable
    from cachectl.storage.store import Store

    db = f"sqlite:///{tmp_path / 'index.db'}"
    index = open_index(db)
    index.add_cache("azc", "az://cont/jax", storage_options={"assume_container_exists": True})
    index.close()
    env = {**AZ_GS_BOUNDS, **az_env_vars(f"http://127.0.0.1:{_refusing_port()}")}
    started = time.monotonic()
    verify = run_cachectl(tmp_path, "--db", db, "verify", "--cache", "azc", env=env, timeout=240)
    took = time.monotonic() - started
    assert verify.returncode == 2, (verify.returncode, verify.stderr[-2000:])
    line = _one_line(verify.stderr)
    assert "storage endpoint http://127.0.0.1:" in line and "fail at once" in line, line
    assert took < 20, (took, line)

    # gs:// (in this process: a command's verify checks the bucket first, within the bound)
    for name, value in AZ_GS_BOUNDS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{_refusing_port()}")
    started = time.monotonic()
    with pytest.raises(Unreachable, match="fail at once"):
        Store("gs://bkt/jax").list("")
    assert time.monotonic() - started < 10


BARE_STORE = """
import json, fsspec.config
from cachectl.storage.store import Store
fsspec.config.conf["s3"] = {{"endpoint_url": {endpoint!r}}}  # what activate() hands JAX
print(json.dumps(sorted(i.path for i in Store({url!r}).list(""))))
"""


def test_a_store_without_options_reads_where_fsspec_was_pointed_whatever_aws_endpoint_url_says(
    tmp_path: Path, moto_server, default_endpoint: Peer
) -> None:
    """Issue 62 finding 8, in a service's process: once activate() (or `cachectl exec`, through
    FSSPEC_S3) handed fsspec the cache's endpoint, a store opened there without the cache's
    options (the exec hook's) reads through that endpoint; AWS_ENDPOINT_URL, set elsewhere, is
    not added beside it (botocore got the endpoint twice: a TypeError, nothing read)."""
    import boto3

    bucket = unique_name()
    create_s3_bucket(moto_server.url, bucket)
    s3 = boto3.client("s3", endpoint_url=moto_server.url)
    s3.put_object(Bucket=bucket, Key="jax/a-cache", Body=b"x")
    code = BARE_STORE.format(endpoint=moto_server.url, url=f"s3://{bucket}/jax")
    listed = run_py(code, check=True)
    assert json.loads(listed.stdout.strip().splitlines()[-1]) == ["a-cache"], listed.stderr
    assert default_endpoint.connections == 0
