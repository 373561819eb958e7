"""RemoteIndex: the ``http`` index driver (cachectl.index.open), the IndexBackend over the
server's HTTP API."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, NoReturn

from cachectl.client.server_client import ServerClient
from cachectl.client.transport import API, seg
from cachectl.client.wire import decode
from cachectl.core.errors import BadInput, CachectlError, NotFound, PermissionDenied
from cachectl.core.records import CacheInfo, EnvironmentInfo, HeldEntry, pick_environment

if TYPE_CHECKING:
    from cachectl.core.config import Settings

# A service's activate() must not wait long on a server that is down: it warns and
# runs as plain JAX would.
SERVICE_TIMEOUT_S = 10.0
SERVICE_CONNECT_TIMEOUT_S = 3.0


def service_client(settings: Settings) -> ServerClient:
    """A client with short timeouts, for activate() and its telemetry."""
    import httpx

    assert settings.server is not None  # server mode: the callers checked settings.server
    return ServerClient(
        settings.server,
        settings.token,
        timeout=httpx.Timeout(SERVICE_TIMEOUT_S, connect=SERVICE_CONNECT_TIMEOUT_S),
    )


class RemoteIndex:
    """The part of :class:`cachectl.index.Index` the CLI's reads and warm registration use, over HTTP.

    Environment ids are the server's; the (cache, digest) each id belongs to is
    remembered from the records this object returned, which is how calls that
    take only an id (list_entries, upsert_entries) find their URL.
    """

    dialect = "remote"

    @classmethod
    def open_for(cls, settings: Settings, role: str) -> RemoteIndex:
        """The driver's opener: CACHECTL_SERVER with CACHECTL_TOKEN; a service's timeouts are short."""
        assert settings.server is not None  # open_index chose this driver for server mode
        if role == "service":
            return cls(service_client(settings))
        return cls(ServerClient(settings.server, settings.token))

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
            raise NotFound(
                f"environment id {env_id} is not known to this client: look it up first"
            ) from None

    def unsupported(self, what: str) -> CachectlError:
        return BadInput(
            f"{what} is not available through the server ({self.url}): "
            "unset CACHECTL_SERVER and use --db on a host with index access"
        )

    @property
    def reader(self) -> NoReturn:
        raise self.unsupported("reading the index's tables directly")

    @property
    def sql(self) -> NoReturn:
        raise self.unsupported("this operation on the SQL index")

    # caches
    def list_caches(self) -> list[Any]:
        return decode(list[CacheInfo], self.client.get(f"{API}/caches"))

    def get_cache(self, name: str) -> Any:
        return decode(CacheInfo, self.client.get(f"{API}/caches/{seg(name)}"))

    def ensure_cache(self, name: str, root_url: str) -> Any:
        return self.get_cache(name)  # the server's caches are the server's to create

    def add_cache(self, *_args: Any, **_kwargs: Any) -> Any:
        raise self.unsupported("adding a cache")

    def update_cache(self, *_args: Any, **_kwargs: Any) -> Any:
        raise self.unsupported("changing a cache")

    def remove_cache(self, *_args: Any, **_kwargs: Any) -> Any:
        raise self.unsupported("removing a cache")

    # environments
    def environment_stats(self, cache: str, *, include_deleted: bool = False) -> list[Any]:
        data = self.client.get(
            f"{API}/caches/{seg(cache)}/environments", include_deleted=include_deleted or None
        )
        envs = decode(list[EnvironmentInfo], data)
        self._remember(envs)
        return envs

    def misses_facts(self, cache: str, since: str) -> Any:
        """The server's MissesFacts for ``cache`` over ``since``, as JSON (usage/misses.py
        rebuilds it: this module stays free of the SQL index's imports)."""
        return self.client.get(f"{API}/caches/{seg(cache)}/misses-facts", since=since)

    def find_environment(self, cache: str, prefix: str, *, include_deleted: bool = False) -> Any:
        if include_deleted:
            return pick_environment(
                cache, prefix, lambda _: self.environment_stats(cache, include_deleted=True)
            )
        env = decode(
            EnvironmentInfo,
            self.client.get(f"{API}/caches/{seg(cache)}/environments/{seg(prefix)}"),
        )
        self._remember([env])
        return env

    get_environment = find_environment

    def ensure_environment(self, cache: str, env: Any) -> Any:
        data = self.client.resolve(cache, env, create=True)
        if not data.get("environment"):
            raise PermissionDenied(
                f"the server did not create environment {env.digest[:16]} in cache {cache!r}: "
                "a writer token is needed"
            )
        info = decode(EnvironmentInfo, data["environment"])
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
        return {
            e.key: (e.aot_size, e.aot_sha256)
            for e in self.list_entries(env_id)
            if getattr(e, "aot_sha256", None)
        }

    def held_entries(self, env_id: int, keys: Iterable[str]) -> dict[str, HeldEntry]:
        """One listing of the environment kept to ``keys`` (the server has no lookup by many
        keys): one listing where entry_keys and aot_keys made one each."""
        wanted = set(keys)
        return {
            e.key: HeldEntry(e.size, e.sha256, e.aot_size, e.aot_sha256)
            for e in self.list_entries(env_id)
            if e.key in wanted
        }

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

    def mark_executables(self, *_args: Any, **_kwargs: Any) -> int:
        raise self.unsupported("marking stored executables unusable")

    def record_proof(self, *_args: Any, **_kwargs: Any) -> None:
        raise self.unsupported("recording warm-check's proof")

    def record_hits(self, *_args: Any, **_kwargs: Any) -> int:
        raise self.unsupported("recording hits directly (telemetry goes to POST /api/v1/telemetry)")

    # warm runs
    def start_warm_run(
        self, environment_id: int, *, manifest_digest: str, manifest_path: str | None, buckets: int
    ) -> Any:
        cache, digest = self._env(environment_id)
        run = self.client.start_warm_run(
            cache,
            digest,
            manifest_digest=manifest_digest,
            manifest_path=manifest_path,
            buckets=buckets,
        )
        self._runs[run.id] = cache
        return run

    def _run_cache(self, run_id: int) -> str:
        try:
            return self._runs[run_id]
        except KeyError:
            raise NotFound(f"warm run {run_id} was not started by this client") from None

    def heartbeat_warm_run(self, run_id: int, **counts: int | None) -> None:
        """IndexBackend.heartbeat_warm_run's counts (compiled, cached, failed), sent on."""
        self.client.update_warm_run(self._run_cache(run_id), run_id, **counts)

    def finish_warm_run(
        self, run_id: int, status: str, *, compiled: int, cached: int, failed: int
    ) -> Any:
        return self.client.update_warm_run(
            self._run_cache(run_id),
            run_id,
            status=status,
            compiled=compiled,
            cached=cached,
            failed=failed,
        )

    # audit
    def audit(self, operation: str, *, cache: str | None, **fields: Any) -> None:
        """IndexBackend.audit's record, kept by the server (it audits per cache: none without)."""
        if cache is not None:
            self.client.audit(cache, operation, **fields)

    def audit_log(self, *_args: Any, **_kwargs: Any) -> list[Any]:
        raise self.unsupported("reading the audit log")
