"""The on-disk format of JAX cache entries, and what else lives in a namespace.

A JAX entry is ``<module>-<64 hex>-cache`` holding compress(4-byte big-endian
compile seconds + serialized executable), zstd or zlib (docs/jax-facts.md, fact 10). JAX also
leaves ``-atime`` sidecars and a ``.lockfile`` when its own size limit is on,
and XLA sub-cache directories when XLA caches are enabled.
"""

from __future__ import annotations

import enum
import hashlib
import io
import re
import sys
import threading
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import BinaryIO

ENV_FILE = "env.json"
# The namespace's signed content list (cachectl/trust/signing.py), verifiable without the index.
SIGNATURE_FILE = "signature.json"
CACHE_SUFFIX = "-cache"
# cachectl's stored executable for the entry of the same key (cachectl/storage/executables.py).
EXECUTABLE_SUFFIX = "-aot"
ATIME_SUFFIX = "-atime"
LOCKFILE = ".lockfile"
XLA_SUBCACHE_DIRS = ("xla_gpu_per_fusion_autotune_cache_dir", "xla_gpu_kernel_cache_file")
# A file name holds at most 255 bytes on the file systems a cache lives on (ext4, XFS, btrfs, APFS,
# NTFS), and a key is stored under each of its suffixes: keys are ASCII, so a key that every one of
# its files can be named after is at most 249 characters (its module part at most 184).
NAME_MAX = 255
MAX_KEY_LENGTH = NAME_MAX - max(len(CACHE_SUFFIX), len(EXECUTABLE_SUFFIX), len(ATIME_SUFFIX))

_KEY_RE = re.compile(r"^(?P<module>.+)-(?P<hash>[0-9a-f]{64})$")
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_TIME_BYTES = 4
# A compile time above a week in a 4-byte header means the bytes are not a JAX entry.
_MAX_SANE_COMPILE_SECONDS = 7 * 24 * 3600


_local = threading.local()


def _zstd_decompressor():
    """This thread's ZstdDecompressor: making one allocates a decompression context, which cost
    more than decompressing a small entry; a context is reusable but not shareable across threads."""
    dctx = getattr(_local, "dctx", None)
    if dctx is None:
        import zstandard

        dctx = _local.dctx = zstandard.ZstdDecompressor()
    return dctx


class Kind(enum.Enum):
    ENTRY = "entry"
    AOT = "aot"
    ATIME = "atime"
    LOCKFILE = "lockfile"
    ENV = "env"
    SIGNATURE = "signature"
    XLA_SUBCACHE = "xla-subcache"
    TEMP = "temp"
    OTHER = "other"


@dataclass(frozen=True)
class EntryName:
    """A parsed entry file name: ``key`` is what JAX logs and hashes files by."""

    key: str
    module: str

    @property
    def filename(self) -> str:
        return self.key + CACHE_SUFFIX


@dataclass(frozen=True)
class Header:
    compression: str
    compile_seconds: int
    payload_size: int


class CorruptEntry(ValueError):
    """Bytes that do not decompress into a JAX entry."""


# A key as JAX makes one: its module name as JAX sanitizes it (word characters, '.', '-': never a
# path, a NUL or a newline), then '-' and 64 hex digits.
_JAX_KEY_RE = re.compile(r"\w[\w.\-]*-[0-9a-f]{64}")


def is_key(key: object) -> bool:
    """Whether ``key`` is a key JAX could have written, under a name each of its files can have
    (MAX_KEY_LENGTH bytes): what a bundle or any other claim from outside must hold."""
    return (
        isinstance(key, str)
        and _JAX_KEY_RE.fullmatch(key) is not None
        and len(key.encode("utf-8", "surrogatepass")) <= MAX_KEY_LENGTH
    )


# ``is_key``'s pattern for keys joined by newlines (no key holds one: counted apart).
_JAX_KEYS_RE = re.compile(rf"(?:{_JAX_KEY_RE.pattern}\n)*")


def all_keys(keys: list[object]) -> bool:
    """Whether ``is_key`` holds for every one of ``keys``, in one regex pass over them joined
    instead of a call per key: a bundle lists thousands (BENCHMARKS.md, "OCI")."""
    if not keys:
        return True
    try:
        joined = "\n".join(keys) + "\n"  # type: ignore[arg-type]  # TypeError: not all str
    except TypeError:
        return False
    if joined.count("\n") != len(keys) or _JAX_KEYS_RE.fullmatch(joined) is None:
        return False
    if joined.isascii():
        return max(map(len, keys), default=0) <= MAX_KEY_LENGTH  # type: ignore[arg-type]
    return all(is_key(k) for k in keys)


def parse_key(key: str) -> EntryName | None:
    match = _KEY_RE.match(key)
    return EntryName(key, match["module"]) if match else None


def _is_key(name: str, suffix_len: int) -> bool:
    """Whether ``name`` less its last ``suffix_len`` characters is a key (no slice, no EntryName)."""
    return _KEY_RE.match(name, 0, len(name) - suffix_len) is not None


# A namespace's entry file, the name classify() calls Kind.ENTRY: no ".tmp-" start, no "/" (nor a
# NUL, which no file name holds), a key (its "$" lets a final newline precede the suffix), the suffix.
_ENTRY_KEY_PART = r"(?!\.tmp-)[^/\n\0]+-[0-9a-f]{64}\n?"
_ENTRY_FILE_RE = re.compile(_ENTRY_KEY_PART + re.escape(CACHE_SUFFIX))


def entry_file_matcher() -> Callable[[str], re.Match[str] | None]:
    """A test that is true exactly where ``classify(name) is Kind.ENTRY``: one C call per name, for
    the loops over every file of a listing (most files of a namespace are entries)."""
    return _ENTRY_FILE_RE.fullmatch


# The same names in a NUL-joined listing (no file name holds a NUL), each match's key as its group.
_ENTRY_KEYS_RE = re.compile(rf"(?:^|\0)({_ENTRY_KEY_PART})" + re.escape(CACHE_SUFFIX) + r"(?=\0|$)")


def entry_keys(names: Iterable[str]) -> list[str]:
    """The keys of the names ``classify`` calls Kind.ENTRY, in their order: one regex pass over the
    joined names, for a listing whose entries need nothing but their keys (sync's local walk)."""
    return _ENTRY_KEYS_RE.findall("\0".join(names))


def classify(relpath: str) -> Kind:
    """What a file inside a namespace is (``relpath`` relative to the namespace).

    Runs once per file of every listing sync and verify read: a name is tested against the key
    pattern in place."""
    if "/" in relpath:
        return Kind.XLA_SUBCACHE if relpath.split("/", 1)[0] in XLA_SUBCACHE_DIRS else Kind.OTHER
    name = relpath
    if name.startswith(".tmp-"):
        return Kind.TEMP
    if name.endswith(CACHE_SUFFIX):
        if _is_key(name, len(CACHE_SUFFIX)):
            return Kind.ENTRY
    elif name == ENV_FILE:
        return Kind.ENV
    elif name == SIGNATURE_FILE:
        return Kind.SIGNATURE
    elif name == LOCKFILE:
        return Kind.LOCKFILE
    elif name.endswith(EXECUTABLE_SUFFIX):
        if _is_key(name, len(EXECUTABLE_SUFFIX)):
            return Kind.AOT
    elif name.endswith(ATIME_SUFFIX) and _is_key(name, len(ATIME_SUFFIX)):
        return Kind.ATIME
    return Kind.OTHER


def parse_entry_filename(name: str) -> EntryName | None:
    """The entry a ``-cache`` file name holds, or None for anything else."""
    if not name.endswith(CACHE_SUFFIX):
        return None
    return parse_key(name[: -len(CACHE_SUFFIX)])


def parse_aot_filename(name: str) -> EntryName | None:
    """The entry a ``-aot`` file belongs to, or None for anything else."""
    if not name.endswith(EXECUTABLE_SUFFIX):
        return None
    return parse_key(name[: -len(EXECUTABLE_SUFFIX)])


def keys_lacking_atime(kinds: Mapping[str, Kind]) -> list[str] | None:
    """Where JAX's own eviction runs (a ``.lockfile`` in the namespace), every ``-cache`` entry
    needs its ``-atime``: JAX's next write there fails on one without (jax-ml/jax#39880).

    ``kinds``: each file of one namespace (relative path) and what ``classify`` calls it.
    The keys of the entries without an ``-atime``, sorted; None when no ``.lockfile`` is there
    (no entry needs one)."""
    if not any(kind is Kind.LOCKFILE for kind in kinds.values()):
        return None
    entries = {n[: -len(CACHE_SUFFIX)] for n, kind in kinds.items() if kind is Kind.ENTRY}
    atimes = {n[: -len(ATIME_SUFFIX)] for n, kind in kinds.items() if kind is Kind.ATIME}
    return sorted(entries - atimes)


def entry_payload(data: bytes) -> bytes:
    """The serialized executable inside JAX entry bytes (what JAX's own cache hit deserializes)."""
    _, raw = decompress(data)
    if len(raw) <= _TIME_BYTES:
        raise CorruptEntry("entry too short to hold a header and an executable")
    return raw[_TIME_BYTES:]


def decompress_zstd(data: bytes) -> bytes:
    """zstd bytes decompressed through this thread's context (CorruptEntry if they do not).

    Called once per file by sync and verify: the context is this thread's attribute, looked up
    without a call, and zstandard is imported only where a thread has none yet."""
    dctx = getattr(_local, "dctx", None)
    if dctx is None:
        try:
            dctx = _zstd_decompressor()
        except ImportError as exc:  # pragma: no cover - zstandard is a dependency
            raise CorruptEntry("zstd entry but the zstandard module is not installed") from exc
    try:
        return dctx.decompress(data, max_output_size=1 << 34)
    except sys.modules["zstandard"].ZstdError as exc:  # looked up only when something is raised
        raise CorruptEntry(f"zstd data is corrupt: {exc}") from exc


def decompress(data: bytes) -> tuple[str, bytes]:
    """Decompress by magic bytes, so a reader need not know the writer's library."""
    if data[:4] == ZSTD_MAGIC:
        return "zstandard", decompress_zstd(data)
    try:
        return "zlib", zlib.decompress(data)
    except zlib.error as exc:
        raise CorruptEntry(f"not zstd or zlib data: {exc}") from exc


def header_seconds(raw: bytes) -> int:
    """The compile seconds at the head of decompressed entry bytes (CorruptEntry if implausible)."""
    if len(raw) <= _TIME_BYTES:
        raise CorruptEntry("entry too short to hold a header and an executable")
    seconds = int.from_bytes(raw[:_TIME_BYTES], "big")
    if seconds > _MAX_SANE_COMPILE_SECONDS:
        raise CorruptEntry(f"implausible compile time in header: {seconds} s")
    return seconds


def read_header(data: bytes) -> Header:
    """Decompress an entry and check its header is plausible."""
    compression, raw = decompress(data)
    return Header(compression, header_seconds(raw), len(raw) - _TIME_BYTES)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_entry(
    executable: bytes, compile_seconds: int = 1, compression: str = "zstandard"
) -> bytes:
    """Build entry bytes in JAX's format (for imports, tests and benchmarks)."""
    raw = int(compile_seconds).to_bytes(_TIME_BYTES, "big") + executable
    if compression == "zstandard":
        import zstandard

        return zstandard.ZstdCompressor().compress(raw)
    return zlib.compress(raw)


class EntryTooLarge(CorruptEntry):
    """An entry that decompresses past the bound it was checked against (a decompression bomb)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"entry expands to more than {limit} bytes")
        self.limit = limit


def scan_entry(fh: BinaryIO, limit: int, *, chunk: int = 1 << 20) -> Header:
    """Check an entry read from ``fh`` in one streaming pass: its header, and that it expands to at
    most ``limit`` bytes. Memory stays at about one ``chunk`` of output whatever the input expands
    to; EntryTooLarge the moment output passes ``limit``, CorruptEntry for anything not an entry."""
    head = fh.read(18)  # the longest zstd frame header
    fh.seek(-len(head), io.SEEK_CUR)
    magic = head[:4]
    first = b""
    total = 0

    def take(block: bytes) -> None:
        nonlocal first, total
        if len(first) < _TIME_BYTES:
            first += block[: _TIME_BYTES - len(first)]
        total += len(block)
        if total > limit:
            raise EntryTooLarge(limit)

    if magic == ZSTD_MAGIC:
        compression = "zstandard"
        try:
            import zstandard
        except ImportError as exc:  # pragma: no cover - zstandard is a dependency
            raise CorruptEntry("zstd entry but the zstandard module is not installed") from exc
        try:
            declared = zstandard.frame_content_size(head)
            reader = _zstd_decompressor().stream_reader(fh, read_size=chunk, closefd=False)
            with reader:
                while block := reader.read(chunk):
                    take(block)
        except zstandard.ZstdError as exc:
            raise CorruptEntry(f"zstd data is corrupt: {exc}") from exc
        if declared >= 0 and declared != total:
            raise CorruptEntry(
                f"zstd frame declares {declared} bytes but holds {total}: truncated?"
            )
    else:
        compression = "zlib"
        inflater = zlib.decompressobj()
        try:
            while data := fh.read(chunk):
                while data and not inflater.eof:
                    take(inflater.decompress(data, chunk))
                    data = inflater.unconsumed_tail
                if inflater.eof:
                    break
        except zlib.error as exc:
            raise CorruptEntry(f"not zstd or zlib data: {exc}") from exc
        if not inflater.eof:
            raise CorruptEntry("not zstd or zlib data: truncated or empty stream")
    if total <= _TIME_BYTES:
        raise CorruptEntry("entry too short to hold a header and an executable")
    seconds = int.from_bytes(first, "big")
    if seconds > _MAX_SANE_COMPILE_SECONDS:
        raise CorruptEntry(f"implausible compile time in header: {seconds} s")
    return Header(compression, seconds, total - _TIME_BYTES)


# What decompress() allows: sync and verify check any stored entry, however it got there.
MAX_EXPANDED_BYTES = 1 << 34
# Decompression output per step: big enough that a real entry (MBs) takes few steps, small
# enough that the buffer is not a fresh mmap for each of 100,000 small entries.
SCAN_CHUNK = 1 << 16


# A zstd frame declaring at most this many bytes is decompressed in one call: zstandard sizes
# its output from the declaration and fails if the frame holds more, so memory stays bounded.
ONE_SHOT_BYTES = 1 << 20


def check_entry_bytes(data: bytes) -> None:
    """An entry's header, checked with a bound (CorruptEntry otherwise): an entry that expands
    enormously (a decompression bomb) costs time here, never memory. Small zstd entries, most of
    a cache, take one decompress call and no Header (sync and verify need only the verdict, once
    per file); the rest one streaming pass."""
    if data[:4] == ZSTD_MAGIC:
        import zstandard  # a module already loaded: a lookup (decompress_zstd imports it too)

        try:
            declared = zstandard.frame_content_size(data[:18])
        except zstandard.ZstdError:
            declared = -1
        if 0 <= declared <= ONE_SHOT_BYTES:
            header_seconds(decompress_zstd(data))
            return
    scan_entry(io.BytesIO(data), MAX_EXPANDED_BYTES, chunk=SCAN_CHUNK)
