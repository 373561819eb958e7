"""The cachectl server's HTTP client, used when CACHECTL_SERVER (and CACHECTL_TOKEN) are set.

The server answers with the library's own dataclasses as JSON; ``from_jsonable``
rebuilds them, so the CLI prints exactly what it prints in direct mode, and
server errors come back as the same CachectlError (same message, same exit
code). ``RemoteIndex`` stands in for :class:`cachectl.index.Index` for the
calls that listing, stats and warm registration make, so those commands run
unchanged; prune, gc and verify run as server jobs (``run_job``).
"""

from __future__ import annotations

import getpass
import logging
import socket
import time
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar
from urllib.parse import quote

from cachectl.entries import sha256
from cachectl.errors import (
    BadInput,
    CachectlError,
    NotFound,
    OperationFailed,
    PermissionDenied,
    Unreachable,
    error_for_status,
    error_named,
)
from cachectl.index.records import (
    CacheInfo,
    CreatedToken,
    EntryInfo,
    EnvironmentInfo,
    TokenInfo,
    WarmRunInfo,
    actor,
    pick_environment,
)
from cachectl.jsonable import REDACTED, from_jsonable, to_jsonable

log = logging.getLogger(__name__)

T = TypeVar("T")
API = "/api/v1"
DEFAULT_TIMEOUT_S = 30.0
PAGE = 1000


# -- the HTTP client -------------------------------------------------------------------


def _message(response: Any) -> tuple[str, str | None]:
    try:
        body = response.json()
    except ValueError:
        return (response.text or response.reason_phrase or f"HTTP {response.status_code}").strip()[:500], None
    detail = body.get("detail") if isinstance(body, dict) else None
    if isinstance(detail, list):  # pydantic validation errors
        parts = []
        for err in detail[:5]:
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
        detail = "; ".join(parts)
    return str(detail or f"HTTP {response.status_code}"), body.get("error") if isinstance(body, dict) else None


class ServerClient:
    """One server, one token; connections are pooled for the client's lifetime."""

    def __init__(self, url: str, token: str | None, *, timeout: Any = DEFAULT_TIMEOUT_S,
                 transport: Any = None) -> None:
        import httpx

        if not url.startswith(("http://", "https://")):
            raise BadInput(f"bad CACHECTL_SERVER {url!r}: use http://HOST:PORT or https://HOST")
        self.url = url.rstrip("/")
        headers = {"user-agent": "cachectl-client"}
        if token:
            headers["authorization"] = f"Bearer {token}"
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout, transport=transport,
                                  trust_env=False)

    def close(self) -> None:
        self._http.close()

    def request(self, method: str, path: str, *, json: Any = None, params: dict[str, Any] | None = None,
                content: bytes | None = None, headers: dict[str, str] | None = None) -> Any:
        """Send; raise the CachectlError the server's status and error name stand for."""
        import httpx

        if params:
            params = {k: v for k, v in params.items() if v is not None}
        for attempt in (1, 2):
            try:
                response = self._http.request(method, path, json=json, params=params, content=content,
                                              headers=headers)
                break
            except httpx.RemoteProtocolError as exc:
                # A pooled connection the server closed as we sent: safe to resend a read once.
                if attempt == 2 or method not in ("GET", "HEAD"):
                    raise Unreachable(f"server {self.url} dropped the connection: {exc}") from exc
            except httpx.HTTPError as exc:
                raise Unreachable(f"server {self.url} is unreachable: {type(exc).__name__}: {exc}") from exc
        if response.status_code < 400:
            return response
        message, name = _message(response)
        status = response.status_code
        if status == 401:
            raise PermissionDenied(f"server {self.url} refused the token ({message}): check CACHECTL_TOKEN")
        error = error_named(name)
        if error is not None:
            raise error(message)
        error = error_for_status(status)
        if error is Unreachable:
            raise Unreachable(f"server {self.url}: {message}")
        if error is not None:
            raise error(message)
        raise OperationFailed(f"server {self.url} failed: {message}")

    def get(self, path: str, **params: Any) -> Any:
        return self.request("GET", path, params=params).json()

    # -- caches, environments, entries ---------------------------------------------

    def list_caches(self) -> list[Any]:
        return from_jsonable(list[CacheInfo], _without_redacted(self.get(f"{API}/caches")))

    def get_cache(self, name: str) -> Any:
        return from_jsonable(CacheInfo, _without_redacted(self.get(f"{API}/caches/{_seg(name)}")))

    def environments(self, cache: str, *, include_deleted: bool = False) -> list[Any]:
        data = self.get(f"{API}/caches/{_seg(cache)}/environments", include_deleted=include_deleted or None)
        return from_jsonable(list[EnvironmentInfo], data)

    def environment(self, cache: str, prefix: str) -> Any:
        return from_jsonable(EnvironmentInfo, self.get(f"{API}/caches/{_seg(cache)}/environments/{_seg(prefix)}"))

    def iter_entries(self, cache: str, digest: str, **filters: Any) -> Iterator[Any]:
        """Every entry of an environment, page by page."""
        offset = 0
        while True:
            page = self.get(f"{API}/caches/{_seg(cache)}/environments/{digest}/entries",
                            limit=PAGE, offset=offset, **filters)
            for item in page["items"]:
                yield from_jsonable(EntryInfo, item)
            if page.get("next_offset") is None:
                return
            offset = page["next_offset"]

    def resolve(self, cache: str, env: Any, *, create: bool = True) -> dict[str, Any]:
        body = {**env.to_dict(), "create": create}
        return self.request("POST", f"{API}/caches/{_seg(cache)}/resolve", json=body).json()

    def register_entries(self, cache: str, digest: str, entries: Iterable[Any],
                         warm_run_id: int | None = None) -> tuple[int, int]:
        items = []
        for e in entries:
            item = {"key": e.key, "size": e.size, "sha256": e.sha256, "origin": e.origin,
                    "compile_time_ms": e.compile_time_ms, "function": e.function, "bucket": e.bucket}
            if getattr(e, "aot_sha256", None) is not None:  # its stored executable, checked by the server
                item.update(aot_size=e.aot_size, aot_sha256=e.aot_sha256)
            items.append(item)
            warm_run_id = warm_run_id or e.warm_run_id
        if not items:
            return 0, 0
        body: dict[str, Any] = {"entries": items}
        if warm_run_id is not None:
            body["warm_run_id"] = warm_run_id
        data = self.request("POST", f"{API}/caches/{_seg(cache)}/environments/{digest}/entries", json=body).json()
        return int(data["inserted"]), int(data["updated"])

    def upload_entry(self, cache: str, digest: str, key: str, data: bytes) -> Any:
        response = self.request("PUT", f"{API}/caches/{_seg(cache)}/environments/{digest}/entries/{_seg(key)}",
                                content=data, headers={"content-type": "application/octet-stream",
                                                       "x-cachectl-sha256": sha256(data)})
        return from_jsonable(EntryInfo, response.json())

    def download_entry(self, cache: str, digest: str, key: str) -> bytes:
        return self.request("GET", f"{API}/caches/{_seg(cache)}/environments/{digest}/entries/{_seg(key)}").content

    def upload_executable(self, cache: str, digest: str, key: str, data: bytes) -> Any:
        """PUT an entry's stored executable (``<key>-aot``); the entry must be indexed already."""
        response = self.request(
            "PUT", f"{API}/caches/{_seg(cache)}/environments/{digest}/entries/{_seg(key)}/aot", content=data,
            headers={"content-type": "application/octet-stream", "x-cachectl-sha256": sha256(data)})
        return from_jsonable(EntryInfo, response.json())

    def download_executable(self, cache: str, digest: str, key: str) -> bytes:
        return self.request("GET", f"{API}/caches/{_seg(cache)}/environments/{digest}/entries/{_seg(key)}/aot").content

    def audit(self, cache: str, operation: str, *, entries: int = 0, nbytes: int = 0,
              duration_ms: int | None = None, details: dict[str, Any] | None = None, who: str | None = None) -> None:
        body = {"operation": operation, "actor": who, "entries": entries, "bytes": nbytes,
                "duration_ms": duration_ms, "details": to_jsonable(details or {})}
        self.request("POST", f"{API}/caches/{_seg(cache)}/audit", json=body)

    # -- warm runs --------------------------------------------------------------------

    def start_warm_run(self, cache: str, digest: str, *, manifest_digest: str, manifest_path: str | None,
                       buckets: int) -> Any:
        try:
            user = getpass.getuser()
        except Exception:  # noqa: BLE001 - no passwd entry in some containers
            user = "unknown"
        body = {"manifest_digest": manifest_digest, "manifest_path": manifest_path, "buckets": buckets,
                "host": socket.gethostname(), "user": user}
        data = self.request("POST", f"{API}/caches/{_seg(cache)}/environments/{digest}/warm-runs", json=body).json()
        return from_jsonable(WarmRunInfo, data)

    def update_warm_run(self, cache: str, run_id: int, **body: Any) -> Any:
        data = self.request("PATCH", f"{API}/caches/{_seg(cache)}/warm-runs/{int(run_id)}",
                            json={k: v for k, v in body.items() if v is not None}).json()
        return from_jsonable(WarmRunInfo, data)

    # -- telemetry ----------------------------------------------------------------------

    def send_telemetry(self, batches: Iterable[Any]) -> dict[str, Any]:
        wire = [telemetry_wire(b) for b in batches]
        return self.request("POST", f"{API}/telemetry", json={"batches": wire}).json()

    # -- jobs ---------------------------------------------------------------------------

    def start_job(self, cache: str, kind: str, params: dict[str, Any]) -> dict[str, Any]:
        return self.request("POST", f"{API}/caches/{_seg(cache)}/{kind}", json=params).json()

    def job(self, job_id: str) -> dict[str, Any]:
        return self.get(f"{API}/jobs/{_seg(job_id)}")

    def wait_job(self, job_id: str, *, poll_s: float = 0.2, timeout_s: float | None = None) -> dict[str, Any]:
        """Poll until the job finishes (backing off to 2 s between polls)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            job = self.job(job_id)
            if job["status"] in ("succeeded", "failed"):
                return job
            if deadline is not None and time.monotonic() > deadline:
                raise OperationFailed(f"job {job_id} still {job['status']} after {timeout_s:.0f}s: "
                                      f"see GET {API}/jobs/{job_id}")
            time.sleep(poll_s)
            poll_s = min(poll_s * 1.5, 2.0)

    def run_job(self, cache: str, kind: str, params: dict[str, Any], result_type: type[T]) -> T:
        """Start a job, wait for it, and return its result as the library's own type."""
        job = self.wait_job(self.start_job(cache, kind, params)["id"])
        if job["status"] == "failed":
            result = job.get("result") or {}
            error = error_named(result.get("error"))
            message = job.get("error") or "job failed"
            if error is not None:
                raise error(message)
            raise CachectlError(message, exit_code=int(result.get("exit_code") or 1))
        return from_jsonable(result_type, job["result"])

    # -- tokens -------------------------------------------------------------------------

    def create_token(self, name: str, role: str, caches: list[str] | None, expires: str | None) -> Any:
        body = {"name": name, "role": role, "caches": caches or None, "expires": expires}
        return from_jsonable(CreatedToken, self.request("POST", f"{API}/tokens", json=body).json())

    def list_tokens(self) -> list[Any]:
        return from_jsonable(list[TokenInfo], self.get(f"{API}/tokens"))

    def revoke_token(self, name: str) -> Any:
        return from_jsonable(TokenInfo, self.request("DELETE", f"{API}/tokens/{_seg(name)}").json())


def _without_redacted(value: Any) -> Any:
    """Drop the storage options the server withheld: this host uses its own credentials instead."""
    if isinstance(value, dict):
        return {k: _without_redacted(v) for k, v in value.items() if v != REDACTED}
    if isinstance(value, list):
        return [_without_redacted(v) for v in value]
    return value


def _seg(value: str) -> str:
    """One URL path segment: '/' and friends are escaped, so nothing can climb the path."""
    return quote(str(value), safe="")


def telemetry_wire(batch: Any) -> dict[str, Any]:
    """A cachectl.telemetry.TelemetryBatch as the server's /telemetry body expects it."""
    return {
        "process": batch.process, "cache": batch.cache, "environment_digest": batch.environment_digest,
        "started_at": batch.started_at.isoformat(), "ended_at": batch.ended_at.isoformat(),
        "functions": [{"function": fn, "requests": c.requests, "hits": c.hits, "writes": c.writes,
                       "saved_seconds": float(c.saved_seconds), "retrieval_seconds": float(c.retrieval_seconds)}
                      for fn, c in batch.functions.items()],
        "hit_keys": [{"key": k, "count": n, "at": at.isoformat()} for k, (n, at) in batch.hit_keys.items()],
        "dropped": batch.dropped,
        "serving": [{"function": fn, "calls": c.calls, "aot": c.aot, "fallback": c.fallback,
                     "out_of_bucket": c.out_of_bucket, "padded": c.padded,
                     "sizes": {axis: {str(size): n for size, n in sizes.items()}
                               for axis, sizes in c.sizes.items()}}
                    for fn, c in getattr(batch, "serving", {}).items()],
        "signatures": [{"function": ident[0], "key": c.key, "source": c.source,
                        "leaves": [[list(shape), dtype, bool(weak), sharding]
                                   for shape, dtype, weak, sharding in c.leaves],
                        "statics": None if c.statics is None else [[str(k), v] for k, v in c.statics],
                        "requests": c.requests, "hits": c.hits, "misses": c.misses,
                        "uncacheable": c.uncacheable, "repeats": c.repeats,
                        "first_seen": c.first_seen, "last_seen": c.last_seen}
                       for ident, c in getattr(batch, "signatures", {}).items()],
        "signatures_dropped": getattr(batch, "signatures_dropped", 0),
    }


# -- RemoteIndex -------------------------------------------------------------------------


class RemoteIndex:
    """The part of :class:`cachectl.index.Index` the CLI's reads and warm registration use, over HTTP.

    Environment ids are the server's; the (cache, digest) each id belongs to is
    remembered from the records this object returned, which is how calls that
    take only an id (list_entries, upsert_entries) find their URL.
    """

    dialect = "remote"

    def __init__(self, client: ServerClient) -> None:
        self.client = client
        self._envs: dict[int, tuple[str, str]] = {}
        self._runs: dict[int, str] = {}

    @property
    def url(self) -> str:
        return self.client.url

    def close(self) -> None:
        self.client.close()

    def _remember(self, envs: Iterable[Any]) -> None:
        for e in envs:
            self._envs[e.id] = (e.cache, e.digest)

    def _env(self, env_id: int) -> tuple[str, str]:
        try:
            return self._envs[env_id]
        except KeyError:
            raise NotFound(f"environment id {env_id} is not known to this client: look it up first") from None

    def unsupported(self, what: str) -> CachectlError:
        return BadInput(f"{what} is not available through the server ({self.url}): "
                        "unset CACHECTL_SERVER and use --db on a host with index access")

    # caches
    def list_caches(self) -> list[Any]:
        return self.client.list_caches()

    def get_cache(self, name: str) -> Any:
        return self.client.get_cache(name)

    def ensure_cache(self, name: str, root_url: str) -> Any:
        return self.client.get_cache(name)  # the server's caches are the server's to create

    def add_cache(self, *_args: Any, **_kwargs: Any) -> Any:
        raise self.unsupported("adding a cache")

    def update_cache(self, *_args: Any, **_kwargs: Any) -> Any:
        raise self.unsupported("changing a cache")

    def remove_cache(self, *_args: Any, **_kwargs: Any) -> Any:
        raise self.unsupported("removing a cache")

    # environments
    def environment_stats(self, cache: str, *, include_deleted: bool = False) -> list[Any]:
        envs = self.client.environments(cache, include_deleted=include_deleted)
        self._remember(envs)
        return envs

    def find_environment(self, cache: str, prefix: str, *, include_deleted: bool = False) -> Any:
        if include_deleted:
            return pick_environment(cache, prefix,
                                    lambda: self.environment_stats(cache, include_deleted=True))
        env = self.client.environment(cache, prefix)
        self._remember([env])
        return env

    get_environment = find_environment

    def ensure_environment(self, cache: str, env: Any) -> Any:
        data = self.client.resolve(cache, env, create=True)
        if not data.get("environment"):
            raise PermissionDenied(f"the server did not create environment {env.digest[:16]} in cache {cache!r}: "
                                   "a writer token is needed")
        info = from_jsonable(EnvironmentInfo, data["environment"])
        self._remember([info])
        return info

    def mark_environment_deleted(self, env_id: int) -> None:
        raise self.unsupported("deleting an environment")

    # entries
    def list_entries(self, env_id: int) -> list[Any]:
        cache, digest = self._env(env_id)
        return list(self.client.iter_entries(cache, digest))

    def entry_keys(self, env_id: int) -> dict[str, tuple[int, str]]:
        return {e.key: (e.size, e.sha256) for e in self.list_entries(env_id)}

    def aot_keys(self, env_id: int) -> dict[str, tuple[int, str]]:
        return {e.key: (e.aot_size, e.aot_sha256) for e in self.list_entries(env_id)
                if getattr(e, "aot_sha256", None)}

    def get_entry(self, env_id: int, key: str) -> Any:
        cache, digest = self._env(env_id)
        for e in self.client.iter_entries(cache, digest, key_prefix=key):
            if e.key == key:
                return e
        return None

    def upsert_entries(self, env_id: int, entries: Iterable[Any]) -> tuple[int, int]:
        cache, digest = self._env(env_id)
        return self.client.register_entries(cache, digest, list(entries))

    def delete_entries(self, *_args: Any, **_kwargs: Any) -> int:
        raise self.unsupported("deleting entries")

    def set_executables(self, *_args: Any, **_kwargs: Any) -> int:
        raise self.unsupported("changing executable columns directly (upload the -aot instead)")

    def record_hits(self, *_args: Any, **_kwargs: Any) -> int:
        raise self.unsupported("recording hits directly (telemetry goes to POST /api/v1/telemetry)")

    # warm runs
    def start_warm_run(self, environment_id: int, *, manifest_digest: str, manifest_path: str | None,
                       buckets: int) -> Any:
        cache, digest = self._env(environment_id)
        run = self.client.start_warm_run(cache, digest, manifest_digest=manifest_digest,
                                         manifest_path=manifest_path, buckets=buckets)
        self._runs[run.id] = cache
        return run

    def _run_cache(self, run_id: int) -> str:
        try:
            return self._runs[run_id]
        except KeyError:
            raise NotFound(f"warm run {run_id} was not started by this client") from None

    def heartbeat_warm_run(self, run_id: int, *, compiled: int | None = None, cached: int | None = None,
                           failed: int | None = None) -> None:
        self.client.update_warm_run(self._run_cache(run_id), run_id, compiled=compiled, cached=cached,
                                    failed=failed)

    def finish_warm_run(self, run_id: int, status: str, *, compiled: int, cached: int, failed: int) -> Any:
        return self.client.update_warm_run(self._run_cache(run_id), run_id, status=status, compiled=compiled,
                                           cached=cached, failed=failed)

    # audit
    def audit(self, operation: str, *, cache: str | None, entries: int = 0, nbytes: int = 0,
              duration_ms: int | None = None, details: dict[str, Any] | None = None, who: str | None = None) -> None:
        if cache is None:
            return
        self.client.audit(cache, operation, entries=entries, nbytes=nbytes, duration_ms=duration_ms,
                          details=details, who=who or actor())

    def audit_log(self, *_args: Any, **_kwargs: Any) -> list[Any]:
        raise self.unsupported("reading the audit log")


# A service's activate() must not wait long on a server that is down: it warns and
# runs as plain JAX would.
SERVICE_TIMEOUT_S = 10.0
SERVICE_CONNECT_TIMEOUT_S = 3.0


def service_client(settings: Any) -> ServerClient:
    """A client with short timeouts, for activate() and its telemetry."""
    import httpx

    return ServerClient(settings.server, settings.token,
                        timeout=httpx.Timeout(SERVICE_TIMEOUT_S, connect=SERVICE_CONNECT_TIMEOUT_S))


def remote_index_for_service(settings: Any) -> RemoteIndex:
    return RemoteIndex(service_client(settings))


def open_for_service(settings: Any) -> tuple[RemoteIndex, CacheInfo]:
    """Server mode for activate(): the server's index and this cache's policy."""
    remote = remote_index_for_service(settings)
    try:
        return remote, remote.get_cache(settings.cache)
    except Exception:
        remote.close()
        raise


def client_from_settings(settings: Any) -> ServerClient | None:
    """The client for CACHECTL_SERVER / CACHECTL_TOKEN, or None in direct mode."""
    if not getattr(settings, "server", None):
        return None
    return ServerClient(settings.server, settings.token)
