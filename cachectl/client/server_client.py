"""ServerClient: the server's HTTP API as typed calls that return the library's own records."""

from __future__ import annotations

import getpass
import socket
import time
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

from cachectl.client.transport import API, BodyRefused, Transport, seg
from cachectl.client.wire import decode, telemetry_wire
from cachectl.core.errors import CachectlError, NotFound, OperationFailed, error_named
from cachectl.core.jsonable import to_jsonable
from cachectl.core.records import (
    CreatedToken,
    EntryInfo,
    TokenInfo,
    WarmRunInfo,
    actor,
)
from cachectl.storage.entries import sha256

T = TypeVar("T")
PAGE = 1000

# What the index records of each entry this process listed: (server, cache, digest, key) ->
# (size, sha256, executable's size, executable's sha256). A download reads a body only up to
# its recorded size (Transport.read_body); the listing a verified record came from is usually
# already here, so knowing the size costs no request. Dropped whole past RECORDED_MAX rows.
Recorded = tuple[int, str, int | None, str | None]
_RECORDED: dict[tuple[str, str, str, str], Recorded] = {}
RECORDED_MAX = 200_000


def _remember(url: str, cache: str, digest: str, e: Any) -> None:
    if len(_RECORDED) >= RECORDED_MAX:
        _RECORDED.clear()
    _RECORDED[(url, cache, digest, e.key)] = (e.size, e.sha256, e.aot_size, e.aot_sha256)


class ServerClient(Transport):
    """One server, one token; connections are pooled for the client's lifetime."""

    # -- caches, environments, entries ---------------------------------------------

    # (a cache's and an environment's reads are RemoteIndex's: cachectl.client.remote)

    def iter_entries(self, cache: str, digest: str, **filters: Any) -> Iterator[Any]:
        """Every entry of an environment, page by page."""
        offset = 0
        while True:
            page = self.get(
                f"{API}/caches/{seg(cache)}/environments/{digest}/entries",
                limit=PAGE,
                offset=offset,
                **filters,
            )
            for item in page["items"]:
                entry = decode(EntryInfo, item)
                _remember(self.url, cache, digest, entry)
                yield entry
            if page.get("next_offset") is None:
                return
            offset = page["next_offset"]

    def resolve(self, cache: str, env: Any, *, create: bool = True) -> dict[str, Any]:
        body = {**env.to_dict(), "create": create}
        return self.request("POST", f"{API}/caches/{seg(cache)}/resolve", json=body).json()

    def register_entries(
        self, cache: str, digest: str, entries: Iterable[Any], warm_run_id: int | None = None
    ) -> tuple[int, int]:
        items = []
        for e in entries:
            item = {
                "key": e.key,
                "size": e.size,
                "sha256": e.sha256,
                "origin": e.origin,
                "compile_time_ms": e.compile_time_ms,
                "function": e.function,
                "bucket": e.bucket,
            }
            if (
                getattr(e, "aot_sha256", None) is not None
            ):  # its stored executable, checked by the server
                item.update(aot_size=e.aot_size, aot_sha256=e.aot_sha256)
            items.append(item)
            warm_run_id = warm_run_id or e.warm_run_id
        if not items:
            return 0, 0
        body: dict[str, Any] = {"entries": items}
        if warm_run_id is not None:
            body["warm_run_id"] = warm_run_id
        data = self.request(
            "POST", f"{API}/caches/{seg(cache)}/environments/{digest}/entries", json=body
        ).json()
        return int(data["inserted"]), int(data["updated"])

    def upload_entry(self, cache: str, digest: str, key: str, data: bytes) -> Any:
        response = self.request(
            "PUT",
            f"{API}/caches/{seg(cache)}/environments/{digest}/entries/{seg(key)}",
            content=data,
            headers={"content-type": "application/octet-stream", "x-cachectl-sha256": sha256(data)},
        )
        return decode(EntryInfo, response.json())

    def download_entry(self, cache: str, digest: str, key: str) -> bytes:
        """An entry's bytes, exactly as the index records them (size and sha256), else
        BodyRefused; NotFound when the index lists no such entry."""
        return self._download(cache, digest, key, executable=False)

    def _recorded(
        self, cache: str, digest: str, key: str, executable: bool, fresh: bool = False
    ) -> tuple[int, str]:
        """The index's (size, sha256) of ``key``'s entry or executable: remembered from a
        listing, else (or ``fresh``) looked up in one."""
        at = (self.url, cache, digest, key)
        row = None if fresh else _RECORDED.get(at)
        if row is None or (executable and row[3] is None):
            _RECORDED.pop(at, None)
            for _ in self.iter_entries(cache, digest, key_prefix=key):
                pass  # iter_entries remembers each row
            row = _RECORDED.get(at)
        if row is None:
            raise NotFound(f"the index lists no entry {key} in cache {cache!r}: not fetched")
        size, sha = (row[2], row[3]) if executable else (row[0], row[1])
        if size is None or sha is None:
            raise NotFound(f"the index lists no stored executable of {key} in cache {cache!r}")
        return size, sha

    def _download(self, cache: str, digest: str, key: str, *, executable: bool) -> bytes:
        path = f"{API}/caches/{seg(cache)}/environments/{digest}/entries/{seg(key)}"
        path += "/aot" if executable else ""
        recorded = self._recorded(cache, digest, key, executable)
        try:
            return self.read_body(path, *recorded)
        except BodyRefused:
            # the row remembered may be older than the entry (rewritten since): asked once more
            now = self._recorded(cache, digest, key, executable, fresh=True)
            if now == recorded:
                raise
            return self.read_body(path, *now)

    def upload_executable(self, cache: str, digest: str, key: str, data: bytes) -> Any:
        """PUT an entry's stored executable (``<key>-aot``); the entry must be indexed already."""
        response = self.request(
            "PUT",
            f"{API}/caches/{seg(cache)}/environments/{digest}/entries/{seg(key)}/aot",
            content=data,
            headers={"content-type": "application/octet-stream", "x-cachectl-sha256": sha256(data)},
        )
        return decode(EntryInfo, response.json())

    def download_executable(self, cache: str, digest: str, key: str) -> bytes:
        """An entry's stored executable, exactly as the index records it (``download_entry``)."""
        return self._download(cache, digest, key, executable=True)

    def compile_lease(self, cache: str, digest: str, action: str, body: dict[str, Any]) -> Any:
        """One compile-lease call (server/lease_routes.py): its ``result``."""
        path = f"{API}/caches/{seg(cache)}/environments/{digest}/compile-lease"
        path += "/read" if action in ("look", "recorded") else ""
        return self.request("POST", path, json={**body, "action": action}).json()["result"]

    def audit(self, cache: str, operation: str, **fields: Any) -> None:
        """POST one audit record; ``fields`` are IndexBackend.audit's (entries, nbytes,
        duration_ms, details, who: this user at this host unless given)."""
        body = {
            "operation": operation,
            "actor": fields.get("who") or actor(),
            "entries": fields.get("entries", 0),
            "bytes": fields.get("nbytes", 0),
            "duration_ms": fields.get("duration_ms"),
            "details": to_jsonable(fields.get("details") or {}),
        }
        self.request("POST", f"{API}/caches/{seg(cache)}/audit", json=body)

    # -- warm runs --------------------------------------------------------------------

    def start_warm_run(
        self,
        cache: str,
        digest: str,
        *,
        manifest_digest: str,
        manifest_path: str | None,
        buckets: int,
    ) -> Any:
        try:
            user = getpass.getuser()
        except Exception:  # noqa: BLE001 - no passwd entry in some containers
            user = "unknown"
        body = {
            "manifest_digest": manifest_digest,
            "manifest_path": manifest_path,
            "buckets": buckets,
            "host": socket.gethostname(),
            "user": user,
        }
        data = self.request(
            "POST", f"{API}/caches/{seg(cache)}/environments/{digest}/warm-runs", json=body
        ).json()
        return decode(WarmRunInfo, data)

    def update_warm_run(self, cache: str, run_id: int, **body: Any) -> Any:
        data = self.request(
            "PATCH",
            f"{API}/caches/{seg(cache)}/warm-runs/{int(run_id)}",
            json={k: v for k, v in body.items() if v is not None},
        ).json()
        return decode(WarmRunInfo, data)

    # -- telemetry ----------------------------------------------------------------------

    def send_telemetry(self, batches: Iterable[Any]) -> dict[str, Any]:
        wire = [telemetry_wire(b) for b in batches]
        return self.request("POST", f"{API}/telemetry", json={"batches": wire}).json()

    # -- jobs ---------------------------------------------------------------------------

    def start_job(self, cache: str, kind: str, params: dict[str, Any]) -> dict[str, Any]:
        return self.request("POST", f"{API}/caches/{seg(cache)}/{kind}", json=params).json()

    def job(self, job_id: str) -> dict[str, Any]:
        return self.get(f"{API}/jobs/{seg(job_id)}")

    def wait_job(
        self, job_id: str, *, poll_s: float = 0.2, timeout_s: float | None = None
    ) -> dict[str, Any]:
        """Poll until the job finishes (backing off to 2 s between polls)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            job = self.job(job_id)
            if job["status"] in ("succeeded", "failed"):
                return job
            if deadline is not None and time.monotonic() > deadline:
                raise OperationFailed(
                    f"job {job_id} still {job['status']} after {timeout_s:.0f}s: "
                    f"see GET {API}/jobs/{job_id}"
                )
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
        return decode(result_type, job["result"])

    # -- tokens -------------------------------------------------------------------------

    def create_token(
        self, name: str, role: str, caches: list[str] | None, expires: str | None
    ) -> Any:
        body = {"name": name, "role": role, "caches": caches or None, "expires": expires}
        return decode(CreatedToken, self.request("POST", f"{API}/tokens", json=body).json())

    def list_tokens(self) -> list[Any]:
        return decode(list[TokenInfo], self.get(f"{API}/tokens"))

    def revoke_token(self, name: str) -> Any:
        return decode(TokenInfo, self.request("DELETE", f"{API}/tokens/{seg(name)}").json())
