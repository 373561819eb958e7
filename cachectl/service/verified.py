"""What a service may load from its namespace: every entry and stored executable is checked here.

One answer per namespace and process (:func:`namespace_verified`, one index query at the first
need): a key's JAX entry sha256 and stored executable sha256 from a verified record. With trusted
keys (``CACHECTL_TRUST``, else the keys pinned for this cache in the owner's state file,
``trust/pins.py``, else the index's, which are then pinned) only a list a trusted key signed
counts (the index's, else ``signature.json``); a cache that never had keys counts the sha256s
the index recorded. Where nothing can verify (no index and no key), nothing loads unless the
process opted in to running unverified code (``CACHECTL_RUN_UNVERIFIED_CODE=1``,
``activate(run_unverified_code=True)``).

:func:`namespace_verified` is also what JAX's own persistent cache asks in a service
(``service/namespace_verifier.py`` ``NamespaceVerifier``, through ``jax_seam.install_verifying_cache``):
``cachectl.serving`` and a plain ``activate()`` service refuse the same bytes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from cachectl.core.config import RUN_UNVERIFIED_ENV, Settings
from cachectl.core.errors import BadInput, NotFound
from cachectl.index import reads
from cachectl.storage.entries import CACHE_SUFFIX, EXECUTABLE_SUFFIX
from cachectl.trust import pins
from cachectl.trust.signing import (
    Coverage,
    Untrusted,
    pinned_keys,
    stored_signature,
    verified_files,
)

if TYPE_CHECKING:
    from cachectl.index.protocol import IndexBackend
    from cachectl.storage.node_tier import NodeFiles


class Indexed(NamedTuple):
    """A verified record of one stored executable: its entry's and its own sha256, and why
    warm-check found it unusable (None: usable, or never checked)."""

    sha256: str
    aot_sha256: str | None
    unusable: str | None = None


class Verified(dict[str, Indexed]):
    """key -> (entry sha256, executable sha256) from a verified record: the index's rows, or
    a content list a trusted key signed. ``refusal`` is a bucket's reason when its key is absent."""

    def __init__(self, shas: dict[str, Indexed], refusal: str, *, trusted: bool = False) -> None:
        super().__init__(shas)
        self.refusal = refusal
        self.trusted = trusted  # the cache trusts signing keys: only a signed list counts


UNINDEXED = "the index does not know this stored executable (run `cachectl sync`)"


def _from_signed(
    files: dict[str, tuple[int, str]], refusal: str, unusable: dict[str, str | None]
) -> Verified:
    """The keys whose entry a trusted key signed, with their executable's sha256 when that was
    signed too (with warm-check's marks from the index, which can only refuse more)."""
    shas: dict[str, Indexed] = {}
    for name, (_, sha) in files.items():
        if name.endswith(CACHE_SUFFIX):
            key = name[: -len(CACHE_SUFFIX)]
            aot = files.get(key + EXECUTABLE_SUFFIX)
            shas[key] = Indexed(sha, aot[1] if aot else None, unusable.get(key))
    return Verified(shas, refusal)


class _IndexSays(NamedTuple):
    keys: tuple[str, ...] | None  # None: the index did not answer
    signed: dict[str, Any] | None
    shas: dict[str, Indexed] | None


# How a service opens its index: service/activate.py open_service_index (passed in, so that
# activate() imports this module only at its first compile, and no import cycle forms).
OpenIndex = Callable[[Settings, list[str]], tuple[Any, Any]]


def _read_index(
    settings: Settings,
    digest: str,
    problems: list[str],
    open_index: OpenIndex,
    held: IndexBackend | None,
) -> _IndexSays:
    """The cache's trusted keys, the environment's signed list and its recorded sha256s: three
    small reads on ``held`` (the index activate() opened), else on one opened (and closed) here."""
    index = held if held is not None else open_index(settings, problems)[0]
    if index is None:
        return _IndexSays(None, None, None)
    keys: tuple[str, ...] | None = None
    signed: dict[str, Any] | None = None
    shas: dict[str, Indexed] | None = None
    try:
        keys = tuple(index.get_cache(settings.cache).trusted_keys or ())
        env = index.find_environment(settings.cache, digest)
        if index.dialect == "remote":  # the server's rows, over HTTP
            shas = {
                e.key: Indexed(e.sha256, e.aot_sha256, getattr(e, "aot_unusable", None))
                for e in index.list_entries(env.id)
            }
        else:
            signed = reads.Queries(index.reader).content_signature(env.id)
            shas = {
                k: Indexed(*row)
                for k, row in reads.executable_digests(index.reader, env.id).items()
            }
    except NotFound as exc:  # an environment the index does not know yet: nothing verified
        shas = {} if keys is not None else None
        problems.append(exc.message)
    except Exception as exc:  # noqa: BLE001 - unknown environment or index error
        problems.append(str(exc) or type(exc).__name__)
    finally:
        if held is None:
            index.close()
    return _IndexSays(keys, signed, shas)


def _trusted(
    settings: Settings, said: _IndexSays, warnings: list[str], prefix: str
) -> tuple[str, ...]:
    """The keys this service trusts for the cache: its own setting, else the pin, else the
    index's (pinned now); a pin the index contradicts stays, and the warning says so."""
    own = pinned_keys(settings)
    if own:
        return own
    problems: list[str] = []
    where = settings.server or settings.db
    remembered = pins.pinned(where, settings.cache, problems)
    index_keys = said.keys or ()
    if remembered:
        if said.keys is not None and not index_keys:
            warnings.append(
                f"{prefix}: the index lists no trusted keys for cache {settings.cache!r}, but "
                f"keys are pinned for it in {pins.pins_path()}: the pinned keys still apply"
            )
        elif said.keys is not None and set(index_keys) != set(remembered):
            warnings.append(
                f"{prefix}: the index lists other trusted keys for cache {settings.cache!r} than "
                f"those pinned in {pins.pins_path()}: only the pinned keys are trusted (set "
                "CACHECTL_TRUST, or edit that file, to trust others)"
            )
        trusted = remembered
    else:
        trusted = index_keys
        if index_keys:
            pins.pin(where, settings.cache, index_keys, problems)
    warnings.extend(f"{prefix}: trust pins: {p}" for p in problems)
    return tuple(trusted)


def _verify(
    settings: Settings,
    digest: str,
    namespace: str,
    read: Callable[[str], bytes],
    warnings: list[str],
    unverified_ok: bool,
    open_index: OpenIndex,
    held: IndexBackend | None,
    node: NodeFiles | None,
) -> Verified | None:
    prefix = "cachectl"
    problems: list[str] = []
    where = f"namespace {namespace}"
    try:
        said = _read_index(settings, digest, problems, open_index, held)
        trusted = _trusted(settings, said, warnings, prefix)
    except BadInput as exc:  # a bad pin or CACHECTL_TRUST: nothing can be trusted
        warnings.append(f"{prefix}: {exc.message}; nothing is read from cache {settings.cache!r}")
        return Verified({}, f"refused: {exc.message}", trusted=True)
    if trusted:
        reasons = []
        for doc in [d for d in (said.signed, stored_signature(read)) if d is not None]:
            try:
                files = verified_files(doc, trusted, digest, where)
            except (Untrusted, BadInput) as exc:  # BadInput: a damaged pinned key
                reasons.append(exc.message)
                continue
            marks = {k: v.unusable for k, v in (said.shas or {}).items()}
            found = _from_signed(files, Coverage(files).reason(), marks)
            found.trusted = True
            return found
        why = "; ".join(reasons) or f"{where} has no signed content list"
        warnings.append(
            f"{prefix}: nothing is read from cache {settings.cache!r} ({why}): it trusts only "
            "content a trusted key signed; every program compiles in memory (sign it with a "
            "trusted key: `cachectl warm --sign-key`)"
        )
        return Verified({}, f"refused: {why}", trusted=True)
    if said.shas is not None:
        if node is not None and said.shas:
            node.keep_record({k: list(v) for k, v in said.shas.items()})
        return Verified(said.shas, UNINDEXED)
    kept = node.record() if node is not None else None
    if node is not None and kept:
        warnings.append(
            f"{prefix}: the index cannot be reached ({'; '.join(problems)}): reading the "
            f"{len(kept)} entries this node fetched and verified before ({node.directory})"
        )
        shas = {k: Indexed(str(v[0]), v[1], v[2] if len(v) > 2 else None) for k, v in kept.items()}
        return Verified(shas, UNINDEXED)
    if unverified_ok:
        warnings.append(
            f"{prefix}: cache {settings.cache!r} is read UNVERIFIED ("
            + "; ".join(problems)
            + f"): {RUN_UNVERIFIED_ENV} is set, so this process runs code that anyone who can "
            "write the cache may have put there"
        )
        return None
    warnings.append(
        f"{prefix}: nothing is read from cache {settings.cache!r}: it cannot be verified ("
        + "; ".join(problems)
        + "): no index to check its sha256s and no trusted keys; every program compiles in "
        f"memory (start the index, set CACHECTL_TRUST, or set {RUN_UNVERIFIED_ENV}=1 to run "
        "unverified code that anyone who can write the cache may have put there)"
    )
    return None


_LOCK = threading.Lock()
_DONE: dict[tuple[str, str, str, bool], tuple[Verified | None, tuple[str, ...]]] = {}


def namespace_verified(
    settings: Settings,
    digest: str,
    namespace: str,
    read: Callable[[str], bytes],
    warnings: list[str],
    unverified_ok: bool,
    open_index: OpenIndex,
    *,
    held: IndexBackend | None = None,
    first_only: bool = False,
    node: NodeFiles | None = None,
) -> Verified | None:
    """What may load from this namespace (None: nothing can verify it); asked once per process,
    its warnings added to ``warnings`` each time (``first_only``: only by the call that asked,
    so that one warning is printed once where another caller prints it). ``held``: an index the
    caller holds open (Activation.index), asked instead of opening one. ``node``: the node tier
    (storage/node_tier.py), which keeps the index's record for a restart with the index gone."""
    ident = (settings.server or settings.db, settings.cache, digest, unverified_ok)
    with _LOCK:
        done = _DONE.get(ident)
        asked = done is None
        if done is None:
            said: list[str] = []
            found = _verify(
                settings, digest, namespace, read, said, unverified_ok, open_index, held, node
            )
            done = (found, tuple(said))
            _DONE[ident] = done
    if asked or not first_only:
        warnings.extend(done[1])
    return done[0]
