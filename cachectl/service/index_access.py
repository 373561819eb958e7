"""The mirror pull of activate(mirror=DIR): verified entries into a local directory.

It needs the entry format and the index's entry rows, so cachectl.service.activate imports this
module only when a service asks for a mirror.
"""

from __future__ import annotations

from collections.abc import Callable

from cachectl.core.errors import CachectlError
from cachectl.core.fingerprint import Environment
from cachectl.index import CacheInfo
from cachectl.index.protocol import IndexBackend
from cachectl.service.mirror import NOT_INDEXED, PullResult, prepare_mirror_dir, pull_namespace
from cachectl.storage.store import Store


def prepare_mirror(
    index: IndexBackend | None,
    cache_info: CacheInfo | None,
    env: Environment,
    store: Callable[[], Store],
    directory: str,
    problems: list[str],
) -> PullResult | None:
    """Pull verified entries into the mirror; on any failure keep what the mirror holds."""

    def keep_local(reason: str) -> None:
        problems.append(f"mirror {directory} not refreshed ({reason})")
        try:
            prepare_mirror_dir(directory, env)
        except Exception as exc:  # noqa: BLE001
            problems.append(f"mirror {directory} unusable ({exc})")

    if index is None or cache_info is None:
        keep_local("the index is needed to verify entries")
        return None
    try:
        result = pull_namespace(
            index, cache_info, env, directory, store=store, skip_storage_if_complete=True
        )
    except CachectlError as exc:
        keep_local(exc.message)
        return None
    except Exception as exc:  # noqa: BLE001 - bucket down: serve from what is local
        keep_local(f"{type(exc).__name__}: {exc}".splitlines()[0][:300])
        return None
    unindexed = [p for p in result.refused if p.reason.startswith(NOT_INDEXED)]
    if result.indexed == 0 and unindexed:
        problems.append(
            f"mirror {directory}: the index lists no entries for this environment, so nothing "
            f"was pulled and every program compiles; {result.source} holds {len(unindexed)} "
            "it has not recorded: run `cachectl sync` (it skips entries younger than --min-age)"
        )
    elif result.refused:
        problems.append(
            f"mirror {directory}: refused {len(result.refused)} entr"
            f"{'y' if len(result.refused) == 1 else 'ies'} (unknown to the index, changed, or unsigned) "
            f"(e.g. {result.refused[0].key}: {result.refused[0].reason}); see `cachectl pull`"
        )
    if result.failed:
        problems.append(
            f"mirror {directory}: {len(result.failed)} entries failed to copy "
            f"({result.failed[0].reason})"
        )
    return result


__all__ = ["PullResult", "prepare_mirror"]
