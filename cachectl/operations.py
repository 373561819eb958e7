"""Operations: the commands that differ between direct mode and server mode, behind one interface.

``LocalOperations`` calls the library on this host's index and storage;
``ServerOperations`` asks the cachectl server (CACHECTL_SERVER) over its HTTP API:
prune, gc and verify run there as jobs, telemetry stats and tokens are read and
changed there. Both return the library's own result types, so a command renders
either the same way. ``operations`` is the one place the mode is chosen.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Protocol

from cachectl import tokens
from cachectl.client import API, ServerClient, _seg, decode
from cachectl.config import DELETE_BATCH
from cachectl.context import Context
from cachectl.errors import BadInput
from cachectl.index.telemetry_queries import TelemetryStats, telemetry_stats
from cachectl.lifecycle import gc as gc_lib
from cachectl.lifecycle import prune as prune_lib
from cachectl.lifecycle import verify as verify_lib
from cachectl.lifecycle.gc import GcResult
from cachectl.lifecycle.plan import LifecycleResult
from cachectl.lifecycle.verify import VerifyResult
from cachectl.records import CreatedToken, TokenInfo
from cachectl.units import parse_duration


class Operations(Protocol):
    """What a command asks for; ``cache`` is ``ctx.settings.cache`` unless named."""

    def prune(
        self,
        *,
        older_than: str | None = None,
        unused_for: str | None = None,
        jax_version: str | None = None,
        superseded: bool = False,
        keep: int | None = None,
        env: str | None = None,
        function: str | None = None,
        dry_run: bool = False,
        batch_size: int = DELETE_BATCH,
    ) -> LifecycleResult: ...

    def gc(
        self,
        *,
        policy: str = "lru",
        max_size: str | None = None,
        protect_warm: bool = False,
        dry_run: bool = False,
        batch_size: int = DELETE_BATCH,
    ) -> GcResult: ...

    def verify(
        self,
        *,
        env: str | None = None,
        quarantine: bool = False,
        repair: bool = False,
        dry_run: bool = False,
        min_age: str = "10m",
        deep: bool = False,
    ) -> VerifyResult: ...

    def telemetry_stats(self, cache: str, since: str) -> TelemetryStats: ...

    def create_token(
        self, name: str, role: str, caches: list[str] | None, expires: str | None
    ) -> CreatedToken: ...

    def list_tokens(self) -> list[TokenInfo]: ...

    def revoke_token(self, name: str) -> TokenInfo: ...


def min_age_of(text: str) -> timedelta:
    """verify's --min-age: a duration, or 0/empty for none; bad text is BadInput before anything runs."""
    return parse_duration(text) if text.strip() not in ("0", "") else timedelta(0)


class LocalOperations:
    """Direct mode: the library on ctx's index and storage."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def prune(
        self,
        *,
        older_than: str | None = None,
        unused_for: str | None = None,
        jax_version: str | None = None,
        superseded: bool = False,
        keep: int | None = None,
        env: str | None = None,
        function: str | None = None,
        dry_run: bool = False,
        batch_size: int = DELETE_BATCH,
    ) -> LifecycleResult:
        crit = prune_lib.criteria(
            older_than=older_than,
            unused_for=unused_for,
            jax_version=jax_version,
            superseded=superseded,
            keep=keep,
            env=env,
            function=function,
        )
        return prune_lib.prune(
            self.ctx, self.ctx.cache(), crit, dry_run=dry_run, batch_size=batch_size
        )

    def gc(
        self,
        *,
        policy: str = "lru",
        max_size: str | None = None,
        protect_warm: bool = False,
        dry_run: bool = False,
        batch_size: int = DELETE_BATCH,
    ) -> GcResult:
        return gc_lib.gc(
            self.ctx,
            self.ctx.cache(),
            policy=policy,
            max_size=max_size,
            protect_warm=protect_warm,
            dry_run=dry_run,
            batch_size=batch_size,
        )

    def verify(
        self,
        *,
        env: str | None = None,
        quarantine: bool = False,
        repair: bool = False,
        dry_run: bool = False,
        min_age: str = "10m",
        deep: bool = False,
    ) -> VerifyResult:
        age = min_age_of(min_age)
        return verify_lib.verify(
            self.ctx,
            self.ctx.cache(),
            env_prefix=env,
            quarantine=quarantine,
            repair=repair,
            dry_run=dry_run,
            min_age=age,
            deep=deep,
        )

    def telemetry_stats(self, cache: str, since: str) -> TelemetryStats:
        return telemetry_stats(self.ctx.sql_index, cache, parse_duration(since))

    def create_token(
        self, name: str, role: str, caches: list[str] | None, expires: str | None
    ) -> CreatedToken:
        created = tokens.create_token(
            self.ctx.sql_index, name, role, caches, parse_duration(expires) if expires else None
        )
        self.ctx.index.audit(
            "token-create",
            cache=None,
            details={"name": name, "role": role, "caches": list(caches or ())},
        )
        return created

    def list_tokens(self) -> list[TokenInfo]:
        return tokens.list_tokens(self.ctx.sql_index)

    def revoke_token(self, name: str) -> TokenInfo:
        info = tokens.revoke_token(self.ctx.sql_index, name)
        self.ctx.index.audit("token-revoke", cache=None, details={"name": name})
        return info


class ServerOperations:
    """Server mode: the same calls over the server's HTTP API; prune/gc/verify as server jobs."""

    def __init__(self, ctx: Context, client: ServerClient) -> None:
        self.ctx = ctx
        self.client = client

    @staticmethod
    def _direct_only(option: str, why: str) -> BadInput:
        """What a flag the server's jobs do not take is: bad input, never silently dropped."""
        return BadInput(
            f"{option} works only in direct mode ({why}): unset CACHECTL_SERVER and give --db "
            "and the cache's storage, or leave it out"
        )

    def _check_batch_size(self, batch_size: int) -> None:
        if batch_size != DELETE_BATCH:
            raise self._direct_only(
                "--batch-size", f"the server deletes {DELETE_BATCH} paths per storage call"
            )

    def _job(self, kind: str, result_type: type, params: dict[str, Any]) -> Any:
        """A job on ctx's cache; unset flags are left out, so the server applies its own defaults."""
        body = {k: v for k, v in params.items() if v is not None and v is not False}
        return self.client.run_job(self.ctx.settings.cache, kind, body, result_type)

    def prune(
        self,
        *,
        older_than: str | None = None,
        unused_for: str | None = None,
        jax_version: str | None = None,
        superseded: bool = False,
        keep: int | None = None,
        env: str | None = None,
        function: str | None = None,
        dry_run: bool = False,
        batch_size: int = DELETE_BATCH,
    ) -> LifecycleResult:
        # Bad selectors are bad input here, before the server is asked.
        self._check_batch_size(batch_size)
        prune_lib.criteria(
            older_than=older_than,
            unused_for=unused_for,
            jax_version=jax_version,
            superseded=superseded,
            keep=keep,
            env=env,
            function=function,
        )
        return self._job(
            "prune",
            LifecycleResult,
            {
                "older_than": older_than,
                "unused_for": unused_for,
                "jax_version": jax_version,
                "superseded": superseded,
                "keep": keep,
                "env": env,
                "function": function,
                "dry_run": dry_run,
            },
        )

    def gc(
        self,
        *,
        policy: str = "lru",
        max_size: str | None = None,
        protect_warm: bool = False,
        dry_run: bool = False,
        batch_size: int = DELETE_BATCH,
    ) -> GcResult:
        self._check_batch_size(batch_size)
        return self._job(
            "gc",
            GcResult,
            {
                "policy": policy,
                "max_size": max_size,
                "protect_warm": protect_warm,
                "dry_run": dry_run,
            },
        )

    def verify(
        self,
        *,
        env: str | None = None,
        quarantine: bool = False,
        repair: bool = False,
        dry_run: bool = False,
        min_age: str = "10m",
        deep: bool = False,
    ) -> VerifyResult:
        if deep:
            raise self._direct_only(
                "verify --deep",
                "it loads each entry on this machine's own devices; the server's job cannot",
            )
        min_age_of(min_age)
        return self._job(
            "verify",
            VerifyResult,
            {
                "env": env,
                "quarantine": quarantine,
                "repair": repair,
                "dry_run": dry_run,
                "min_age": min_age,
            },
        )

    def telemetry_stats(self, cache: str, since: str) -> TelemetryStats:
        parse_duration(since)
        return decode(
            TelemetryStats, self.client.get(f"{API}/caches/{_seg(cache)}/telemetry", since=since)
        )

    def create_token(
        self, name: str, role: str, caches: list[str] | None, expires: str | None
    ) -> CreatedToken:
        return self.client.create_token(name, role, caches, expires)

    def list_tokens(self) -> list[TokenInfo]:
        return self.client.list_tokens()

    def revoke_token(self, name: str) -> TokenInfo:
        return self.client.revoke_token(name)


def operations(ctx: Context) -> Operations:
    """The one choice of mode: the server's when CACHECTL_SERVER is set, else this host's library."""
    if ctx.remote is not None:
        return ServerOperations(ctx, ctx.remote)
    return LocalOperations(ctx)
