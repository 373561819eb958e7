"""Server mode's operations: cachectl.operations' calls over the server's HTTP API.

prune, gc and verify run there as jobs; telemetry stats and tokens are read and changed there.
Apart from cachectl/operations.py because the client and the results it decodes are imported
only when CACHECTL_SERVER is set.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from cachectl.client import API, ServerClient, decode, seg
from cachectl.context import Context
from cachectl.core.config import DELETE_BATCH
from cachectl.core.errors import BadInput
from cachectl.core.records import CreatedToken, TokenInfo
from cachectl.core.units import parse_duration, parse_min_age
from cachectl.index.usage import TelemetryStats
from cachectl.lifecycle.gc import GcResult
from cachectl.lifecycle.plan import LifecycleResult
from cachectl.lifecycle.requests import GcRequest, PruneRequest, VerifyRequest, job_params
from cachectl.lifecycle.verify_records import VerifyResult


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

    def _job(self, kind: str, result_type: type, request: Any, dry_run: bool) -> Any:
        """A job on ctx's cache, with the request's fields as its parameters."""
        return self.client.run_job(
            self.ctx.settings.cache, kind, job_params(request, dry_run), result_type
        )

    def prune(
        self, request: PruneRequest, *, dry_run: bool = False, batch_size: int = DELETE_BATCH
    ) -> LifecycleResult:
        # Bad selectors are bad input here, before the server is asked.
        self._check_batch_size(batch_size)
        request.criteria()
        return self._job("prune", LifecycleResult, request, dry_run)

    def gc(
        self, request: GcRequest, *, dry_run: bool = False, batch_size: int = DELETE_BATCH
    ) -> GcResult:
        self._check_batch_size(batch_size)
        return self._job("gc", GcResult, request, dry_run)

    def verify(self, request: VerifyRequest, *, dry_run: bool = False) -> VerifyResult:
        if request.deep:
            raise self._direct_only(
                "verify --deep",
                "it loads each entry on this machine's own devices; the server's job cannot",
            )
        parse_min_age(request.min_age)
        return self._job("verify", VerifyResult, dataclasses.replace(request, deep=False), dry_run)

    def telemetry_stats(self, cache: str, since: str) -> TelemetryStats:
        parse_duration(since)
        return decode(
            TelemetryStats, self.client.get(f"{API}/caches/{seg(cache)}/telemetry", since=since)
        )

    def create_token(
        self, name: str, role: str, caches: list[str] | None, expires: str | None
    ) -> CreatedToken:
        return self.client.create_token(name, role, caches, expires)

    def list_tokens(self) -> list[TokenInfo]:
        return self.client.list_tokens()

    def revoke_token(self, name: str) -> TokenInfo:
        return self.client.revoke_token(name)
