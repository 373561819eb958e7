"""What new bytes must be to enter a cache: the rules ingest.py checks before it writes.

Each rule is written once, here, for every writer: the sha256 computed, never a client's claim
(``check_claim``); an entry within the cache's max entry size (``check_size``); an entry that
decompresses into a JAX entry within ``expansion_bound`` (``check_entry``); a stored executable
intact and made for its key and its entry's bytes (``check_executable``). A refusal is
``Refused`` with the rule that refused it, so the server answers with its HTTP status and the
CLI with one line. Nothing here writes: a bundle install checks each staged member with these
before ingest publishes the batch.
"""

from __future__ import annotations

import io
import os
import sys

from cachectl.core.errors import BadInput
from cachectl.core.units import format_size
from cachectl.index import CacheInfo
from cachectl.storage import executables
from cachectl.storage.entries import (
    ONE_SHOT_BYTES,
    ZSTD_MAGIC,
    CorruptEntry,
    EntryTooLarge,
    decompress_zstd,
    header_seconds,
    scan_entry,
)

# Why ingest refused: the server answers 422 for these ...
SHA256 = "sha256"
CORRUPT = "corrupt"
EXECUTABLE = "executable"
MISMATCH = "mismatch"  # a registration that storage (or the warm run) contradicts
# ... and 413 for these.
TOO_LARGE = "too-large"
EXPANDS = "expands"


class Refused(BadInput):
    """Bytes that may not enter the cache; ``rule`` names the rule (SHA256, CORRUPT, ...)."""

    def __init__(self, message: str, rule: str) -> None:
        super().__init__(message)
        self.rule = rule


def size_limit(cache: CacheInfo, cap: int, cap_name: str) -> tuple[int, str]:
    """The most bytes one object may have in ``cache`` and what sets it: the cache's max entry
    size, or ``cap`` (e.g. the server's upload limit) when that is smaller."""
    if cache.max_entry_size is not None and cache.max_entry_size < cap:
        return cache.max_entry_size, f"cache {cache.name!r}'s max entry size"
    return cap, cap_name


def check_claim(sha: str, claimed: str | None, claim_name: str) -> None:
    """Refused (SHA256) when a client's claimed sha256 is not the one computed from its bytes."""
    if claimed is not None and claimed.lower() != sha:
        raise Refused(
            f"body sha256 is {sha}, not the {claim_name} sent: corrupted in transit?", SHA256
        )


def check_size(cache: CacheInfo, key: str, size: int) -> None:
    """Refused (TOO_LARGE) when an entry of ``size`` bytes is above the cache's max entry size."""
    if cache.max_entry_size is not None and size > cache.max_entry_size:
        raise Refused(
            f"entry {key} ({format_size(size)}) is above cache {cache.name!r}'s max entry size "
            f"({format_size(cache.max_entry_size)})",
            TOO_LARGE,
        )


# How far an entry may decompress: ENTRY_EXPANSION times its own size (JAX entries expand a few
# times; a decompression bomb a thousand times or more), at least EXPANSION_FLOOR, at most
# MAX_EXPANDED, whoever writes it. The server's bound for an upload may be smaller.
ENTRY_EXPANSION = 64
EXPANSION_FLOOR = 64 << 20
MAX_EXPANDED = 4 << 30


def expansion_bound(size: int, cap: int = MAX_EXPANDED) -> int:
    """The most bytes an entry of ``size`` bytes may decompress to (``cap``: a caller's own bound)."""
    return min(cap, MAX_EXPANDED, max(EXPANSION_FLOOR, size * ENTRY_EXPANSION))


def check_entry(source: bytes | str | os.PathLike[str], expand_to: int | None = None) -> int:
    """The compile time (ms) of entry bytes (in memory or a local file), checked in one streaming
    pass that stops past ``expand_to`` (default: ``expansion_bound`` of its size): memory stays at
    one read chunk whatever the entry expands to. Bytes in memory whose zstd frame declares at most
    ``ONE_SHOT_BYTES`` (within the bound) are decompressed in one call (``_declared_seconds``)."""
    try:
        if isinstance(source, bytes):
            bound = expansion_bound(len(source), expand_to or MAX_EXPANDED)
            if (seconds := _declared_seconds(source, bound)) is not None:
                return seconds * 1000
            return scan_entry(io.BytesIO(source), bound).compile_seconds * 1000
        with open(source, "rb") as fh:
            bound = expansion_bound(os.fstat(fh.fileno()).st_size, expand_to or MAX_EXPANDED)
            return scan_entry(fh, bound).compile_seconds * 1000
    except EntryTooLarge as exc:
        raise Refused(
            f"entry expands to more than {format_size(exc.limit)}: refused", EXPANDS
        ) from None
    except CorruptEntry as exc:
        raise Refused(f"not a JAX cache entry: {exc}", CORRUPT) from None


def _declared_seconds(data: bytes, bound: int) -> int | None:
    """The compile seconds of a zstd entry whose frame declares at most ``ONE_SHOT_BYTES`` (and at
    most ``bound``), decompressed in one call: zstandard sizes its output from the declaration
    and fails if the frame holds another amount, so memory stays within the bound (a frame that
    lies is corrupt). None for any other entry: ``scan_entry``'s streaming pass. A bundle of
    small entries checks thousands; the stream reader, its 1 MiB reads and its end-of-frame
    read cost more than decompressing 8 KiB (BENCHMARKS.md, "OCI")."""
    if data[:4] != ZSTD_MAGIC:
        return None
    zstandard = sys.modules.get("zstandard")
    if zstandard is None:
        return None  # the streaming pass imports it (or says it is missing)
    try:
        declared = zstandard.frame_content_size(data[:18])
    except zstandard.ZstdError:
        return None
    if not 0 <= declared <= min(bound, ONE_SHOT_BYTES):
        return None
    return header_seconds(decompress_zstd(data))


def check_executable(key: str, data: bytes, entry_sha256: str | None) -> None:
    """An intact stored executable made for ``key`` and the entry bytes with ``entry_sha256``."""
    try:
        header = executables.read_header(data)
    except CorruptEntry as exc:
        raise Refused(f"not a cachectl stored executable: {exc}", EXECUTABLE) from None
    if header.key != key:
        raise Refused("the stored executable's header names another key: refused", EXECUTABLE)
    if entry_sha256 is not None and header.entry_sha256 != entry_sha256:
        raise Refused(
            "the stored executable was made for other entry bytes than the indexed "
            "entry's (entry_sha256 differs): refused",
            EXECUTABLE,
        )
