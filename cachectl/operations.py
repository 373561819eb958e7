"""Operations: the commands that differ between direct mode and server mode, behind one interface.

``LocalOperations`` calls the library on this host's index and storage;
``ServerOperations`` asks the cachectl server (CACHECTL_SERVER) over its HTTP API:
prune, gc and verify run there as jobs, telemetry stats and tokens are read and
changed there. Both return the library's own result types, so a command renders
either the same way. ``operations`` is the one place the mode is chosen.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from cachectl.context import Context
from cachectl.core.config import DELETE_BATCH
from cachectl.core.records import CreatedToken
from cachectl.core.units import parse_duration, parse_min_age
from cachectl.index.stdlib import StdlibReads
from cachectl.index.usage import TelemetryStats, telemetry_stats
from cachectl.lifecycle import prune as prune_lib
from cachectl.lifecycle.plan import LifecycleResult
from cachectl.lifecycle.requests import GcRequest, PruneRequest, VerifyRequest
from cachectl.trust import token_rules

if TYPE_CHECKING:
    from cachectl.core.records import TokenInfo
    from cachectl.lifecycle.gc import GcResult
    from cachectl.lifecycle.verify_records import VerifyResult


class Operations(Protocol):
    """What a command asks for; ``cache`` is ``ctx.settings.cache`` unless named."""

    def prune(
        self, request: PruneRequest, *, dry_run: bool = False, batch_size: int = DELETE_BATCH
    ) -> LifecycleResult: ...

    def gc(
        self, request: GcRequest, *, dry_run: bool = False, batch_size: int = DELETE_BATCH
    ) -> GcResult: ...

    def verify(self, request: VerifyRequest, *, dry_run: bool = False) -> VerifyResult: ...

    def telemetry_stats(self, cache: str, since: str) -> TelemetryStats: ...

    def create_token(
        self, name: str, role: str, caches: list[str] | None, expires: str | None
    ) -> CreatedToken: ...

    def list_tokens(self) -> list[TokenInfo]: ...

    def revoke_token(self, name: str) -> TokenInfo: ...


class LocalOperations:
    """Direct mode: the library on ctx's index and storage."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    @staticmethod
    def _tokens() -> Any:
        from cachectl.trust import tokens  # SQLAlchemy's: only the token commands need it

        return tokens

    def prune(
        self, request: PruneRequest, *, dry_run: bool = False, batch_size: int = DELETE_BATCH
    ) -> LifecycleResult:
        return prune_lib.prune(
            self.ctx, self.ctx.cache(), request.criteria(), dry_run=dry_run, batch_size=batch_size
        )

    def gc(
        self, request: GcRequest, *, dry_run: bool = False, batch_size: int = DELETE_BATCH
    ) -> GcResult:
        from cachectl.lifecycle import gc as gc_lib  # the SQL index's eviction queries

        return gc_lib.gc(
            self.ctx,
            self.ctx.cache(),
            policy=request.policy,
            max_size=request.max_size,
            protect_warm=request.protect_warm,
            dry_run=dry_run,
            batch_size=batch_size,
        )

    def verify(self, request: VerifyRequest, *, dry_run: bool = False) -> VerifyResult:
        from cachectl.lifecycle import verify as verify_lib  # the SQL index's verify queries

        options = verify_lib.VerifyOptions.from_flags(
            quarantine=request.quarantine,
            repair=request.repair,
            dry_run=dry_run,
            deep=request.deep,
            env_prefix=request.env,
            min_age=parse_min_age(request.min_age),
        )
        return verify_lib.verify(self.ctx, self.ctx.cache(), options)

    def telemetry_stats(self, cache: str, since: str) -> TelemetryStats:
        return telemetry_stats(self.ctx.index.reader, cache, parse_duration(since))

    def create_token(
        self, name: str, role: str, caches: list[str] | None, expires: str | None
    ) -> CreatedToken:
        """On a plain SQLite index the stdlib driver writes the token and its audit row (no
        SQLAlchemy import: BENCHMARKS.md, "Commands that compile nothing"); else the SQL index."""
        new = token_rules.new_token(
            name, role, caches, parse_duration(expires) if expires else None
        )
        details = token_rules.audit_details(new)
        index = self.ctx.index
        if isinstance(index, StdlibReads):
            info = index.create_token(new, details)
            if info is None:
                raise token_rules.name_taken(name)
        else:
            info = self._tokens().store_token(index.sql, new)
            index.audit("token-create", cache=None, details=details)
        return CreatedToken(info, new.secret)

    def list_tokens(self) -> list[TokenInfo]:
        return self._tokens().list_tokens(self.ctx.index.sql)

    def revoke_token(self, name: str) -> TokenInfo:
        info = self._tokens().revoke_token(self.ctx.index.sql, name)
        self.ctx.index.audit("token-revoke", cache=None, details={"name": name})
        return info


def operations(ctx: Context) -> Operations:
    """The one choice of mode: the server's when CACHECTL_SERVER is set, else this host's library."""
    index = ctx.index
    if index.dialect == "remote":  # the http driver (cachectl.index.open)
        # Imported here: the client and the lifecycle results it decodes cost direct mode ~0.5 s.
        from cachectl.client.remote import RemoteIndex
        from cachectl.server_operations import ServerOperations

        assert isinstance(index, RemoteIndex)
        return ServerOperations(ctx, index.client)
    return LocalOperations(ctx)
