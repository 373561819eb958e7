"""The bundle format: its names, the records `bundle ls` shows, and reading a bundle's metadata."""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import re
import tarfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Generic, Protocol, Self, TypeVar, cast

from cachectl.core import temps
from cachectl.core.errors import BadInput, path_words
from cachectl.trust import signing

FORMAT = "cachectl-bundle/1"
META = "bundle.json"
SIGNATURE = "signature.json"
FILES = "files/"
ORIGIN = "bundle"
STAGING_DIR = temps.STAGING_DIR
CHUNK = 1 << 20
T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class BadBundle(BadInput):
    """A bundle that is not one, or whose files do not match its content list."""


@dataclass(frozen=True)
class BundleEntry:
    key: str
    function: str | None
    bucket: dict[str, Any] | None
    size: int
    sha256: str
    compile_time_ms: int | None
    aot_size: int | None
    aot_sha256: str | None


@dataclass(frozen=True)
class BundleInfo:
    """What `bundle create` wrote and `bundle ls` shows."""

    path: str
    environment: dict[str, Any]
    digest: str
    namespace: str
    source_cache: str | None
    created_at: str
    entries: list[BundleEntry]
    files: int
    content_bytes: int
    bundle_bytes: int
    signed_by: str | None
    duration_s: float = 0.0
    dry_run: bool = False


@dataclass(frozen=True)
class InstallResult:
    path: str
    cache: str
    digest: str
    namespace: str
    dest: str
    entries: int
    executables: int
    installed: int
    already_present: int
    conflicts: list[str]
    bytes: int
    signed_by: str | None
    duration_s: float
    dry_run: bool
    notes: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- members


def _tarinfo(name: str, size: int, mtime: float) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = size, int(mtime), 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def _octal(value: int, width: int) -> bytes:
    return b"%0*o\0" % (width - 1, value)


_CHKSUM_AS_SPACES = 8 * ord(" ")  # the checksum field counts as spaces while it is summed


def member_header(name: str, size: int, mtime: int) -> bytes:
    """A member's tar header: a plain USTAR header (what ``tarfile`` writes for ``_tarinfo``) where
    the name is ASCII of at most 100 bytes, else tarfile's own PAX header. tarfile spends more
    building a header than reading and hashing an 8 KiB entry, and bundles of small entries hold
    thousands (bench/fleet.py)."""
    if not name.isascii() or len(name) > 100 or not 0 <= size < 8**11 or not 0 <= mtime < 8**11:
        return _tarinfo(name, size, mtime).tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
    head = b"".join(
        (
            name.encode("ascii").ljust(100, b"\0"),
            _octal(0o644, 8),
            _octal(0, 8),
            _octal(0, 8),
            _octal(size, 12),
            _octal(mtime, 12),
            b" " * 8,  # the checksum, summed as spaces
            tarfile.REGTYPE,
            b"\0" * 100,  # linkname
            tarfile.POSIX_MAGIC,
            b"\0" * 247,  # uname, gname, devmajor, devminor (not a device), prefix, padding
        )
    )
    chksum = b"%06o\0 " % sum(head)
    return head[:148] + chksum + head[156:]


def _digits(field: bytes | bytearray) -> int:
    """An octal field as ``member_header`` writes it (digits, then NUL); ValueError otherwise."""
    if field[-1] != 0 or not field[:-1].isdigit():
        raise ValueError(field)
    return int(field[:-1], 8)


class MemberInfo(tarfile.TarInfo):
    """A member header as tarfile reads it, read in a quarter of tarfile's time when it is exactly
    what ``member_header`` writes for a short ASCII name: a regular file, USTAR, no prefix, owner 0,
    its checksum right. Any other header (PAX, a link, a damaged one) is tarfile's to read, accept
    or refuse; global PAX headers still apply (tarfile does that after this). Install reads
    thousands of headers per bundle of small entries (bench/fleet.py)."""

    @classmethod
    def frombuf(cls, buf: bytes | bytearray, encoding: str, errors: str) -> Self:
        if (plain := plain_header(buf)) is not None:
            info = cls(plain[0])
            info.size = plain[1]
            info.mode = _digits(buf[100:108])
            info.mtime = _digits(buf[136:148])
            info.chksum = _digits(buf[148:155])
            return info
        return super().frombuf(buf, encoding, errors)


def plain_header(buf: bytes | bytearray) -> tuple[str, int] | None:
    """(name, size) of a header that is exactly what ``member_header`` writes for a short ASCII
    name (a regular file, USTAR, no prefix, owner 0, its checksum right); None for any other
    block, which is tarfile's to read, accept or refuse. Every field past the name is checked by
    one match of ``_PLAIN`` (its octal fields' digits, the fixed bytes): a third of the time of
    a check per field, for thousands of headers per bundle of small entries."""
    m = _PLAIN.fullmatch(buf, 100) if len(buf) == tarfile.BLOCKSIZE else None
    # The checksum: every byte past the ones summed here is fixed by ``_PLAIN``.
    if m is None or int(m[3], 8) != sum(buf[:108]) + sum(buf[124:148]) + _PLAIN_FIXED_SUM:
        return None
    try:
        return buf[:100].split(b"\0", 1)[0].decode("ascii"), int(m[1], 8)
    except UnicodeDecodeError:
        return None


_NO_OWNER = _octal(0, 8) * 2  # uid, gid
_NO_LINK = b"\0" * 100
_NO_NAMES_NOR_PREFIX = b"\0" * 247  # uname, gname, devmajor, devminor, prefix, padding
# What the fixed fields of a plain header add to its checksum (owner, the checksum as spaces,
# the type, the magic; the rest is NULs).
_PLAIN_FIXED_SUM = sum(_NO_OWNER) + _CHKSUM_AS_SPACES + sum(tarfile.REGTYPE + tarfile.POSIX_MAGIC)
# A plain header from its mode on (offset 100): octal fields as ``_octal`` writes them (digits,
# then NUL), the checksum as ``member_header`` writes it (six digits, NUL, space), fixed bytes.
# Groups: size, mtime, checksum.
_PLAIN = re.compile(
    rb"[0-7]{7}\x00"
    + re.escape(_NO_OWNER)
    + rb"([0-7]{11})\x00([0-7]{11})\x00([0-7]{6})\x00 "
    + re.escape(tarfile.REGTYPE + _NO_LINK + tarfile.POSIX_MAGIC + _NO_NAMES_NOR_PREFIX)
)


# --------------------------------------------------------------------------- reading


# Files up to this size are read, hashed and written in the thread that parses or writes the tar
# stream, on both create and install: handing a small file to a worker cost more than the work, and
# each of a worker's GIL hand-backs can wait a switch interval (5 ms) on that thread (bench/fleet.py,
# 2,000 entries of 8 KiB).
INLINE_MAX = 64 << 10


class Outcome(Protocol[T_co]):
    """A result to take in order: a pool's Future, or ``ran_here``'s settled one."""

    def result(self) -> T_co: ...

    def cancel(self) -> bool: ...


class _Settled(Generic[T]):
    """A call's result or exception, taken later like a Future's, without a Future's lock and
    condition (install settles one per small member: thousands per bundle)."""

    __slots__ = ("_value", "_error")

    def __init__(self, value: T | None, error: Exception | None) -> None:
        self._value, self._error = value, error

    def result(self) -> T:
        if self._error is not None:
            raise self._error
        return cast(T, self._value)

    def cancel(self) -> bool:
        return False  # settled already, as a finished Future's


def ran_here(fn: Callable[..., T], *args: Any) -> Outcome[T]:
    """``fn(*args)`` run now, in this thread, as a settled outcome: a result or its exception, taken
    in order with the ones a pool still runs."""
    try:
        return _Settled(fn(*args), None)
    except Exception as exc:  # noqa: BLE001 - raised where the outcome is taken, in order
        return _Settled(None, exc)


class ForwardOnly:
    """The decompressed stream as tarfile's random-access mode reads it. That mode reads a member's
    bytes where they stand; its stream mode copies each member twice more, joining its pieces and
    slicing off the rest (bench/fleet.py). Reading in order only ever seeks forward, which the zstd
    reader does by reading on; a header that asks to go back is damaged or hostile."""

    def __init__(self, reader: Any) -> None:
        self._reader = reader
        self._back = b""  # bytes put back by unread, read again first
        self.read: Callable[..., bytes] = reader.read
        self.tell: Callable[[], int] = reader.tell

    def unread(self, data: bytes) -> None:
        """Put back the bytes just read (a header install's own loop does not parse), so that
        tarfile reads them where they stand. Reads go straight to the reader again once they
        are taken."""
        self._back = data + self._back
        self.read, self.tell = self._read_back, self._tell_back

    def _tell_back(self) -> int:
        return int(self._reader.tell()) - len(self._back)

    def _read_back(self, size: int | None = -1) -> bytes:
        data, self._back = self._back, b""
        self.read, self.tell = self._reader.read, self._reader.tell
        if size is None or size < 0:
            return data + self._reader.read()
        if size < len(data):
            self.unread(data[size:])
            return data[:size]
        return data + self._reader.read(size - len(data)) if size > len(data) else data

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        here = self.tell()
        target = offset if whence == os.SEEK_SET else here + offset if whence == os.SEEK_CUR else -1
        if target < here:
            raise tarfile.ReadError("a header points back into the stream: damaged or hostile")
        if self._back and target > here:
            self._read_back(min(target - here, len(self._back)))
        return target if target == self.tell() else int(self._reader.seek(target))


@contextmanager
def open_bundle(path: Path, source: IO[bytes] | None = None) -> Iterator[tarfile.TarFile]:
    """The bundle at ``path`` as a forward-only tar stream; ``source`` reads its bytes instead
    of the file when they are still arriving (a pull's download: it has ``peek``)."""
    import zstandard

    try:
        fh: IO[bytes] = (
            open(path, "rb")  # noqa: SIM115 - closed by the with below
            if source is None
            else source
        )
    except OSError as exc:
        raise BadInput(f"bundle {path_words(path)}: {exc.strerror or exc}") from exc
    with fh if source is None else nullcontext(fh):  # a source is its owner's to close
        if source is None:
            magic = fh.read(4)
            fh.seek(0)
        else:
            magic = source.peek(4)[:4]  # type: ignore[attr-defined]
        if magic != b"\x28\xb5\x2f\xfd":
            raise BadBundle(f"{path} is not a cachectl bundle (not zstd-compressed)")
        reader = zstandard.ZstdDecompressor().stream_reader(fh, read_across_frames=True)
        try:
            stream = cast(IO[bytes], ForwardOnly(reader))  # read, tell, seek: what tarfile calls
            with tarfile.open(fileobj=stream, mode="r:", tarinfo=MemberInfo) as tar:
                yield tar
        except (tarfile.TarError, zstandard.ZstdError, EOFError) as exc:
            raise BadBundle(f"{path}: damaged bundle ({exc})") from exc


# What a bundle's stream may expand to: this many times the bundle's own size, plus the floor.
# Entries are stored raw (about 1x), executables and bundle.json compress a few times, while a
# bundle of a few KiB that expands to hundreds of MiB is a decompression bomb: refused before
# anything is read into memory or staged.
BUNDLE_EXPANSION = 16
BUNDLE_FLOOR = 16 << 20
_JSON_MAX = 256 << 20


def room(path: Path, size: int | None = None) -> int:
    """The most bytes the files (or one metadata member) of the bundle at ``path`` may hold;
    ``size`` is its size when it is still arriving (a pull's download, by its manifest)."""
    return BUNDLE_EXPANSION * (path.stat().st_size if size is None else size) + BUNDLE_FLOOR


def _read_json(
    tar: tarfile.TarFile, member: tarfile.TarInfo, path: Path, size: int | None = None
) -> dict[str, Any]:
    fh = tar.extractfile(member)
    if fh is None:
        raise BadBundle(f"{path}: {member.name} is not a regular file")
    if member.size > min(_JSON_MAX, room(path, size)):
        raise BadBundle(
            f"{path}: {member.name} is {member.size} bytes, more than a bundle of this size can "
            "hold (a decompression bomb?): nothing installed"
        )
    try:
        data = json.loads(fh.read())
    except RecursionError:
        raise BadBundle(f"{path}: {member.name} is nested too deeply: nothing installed") from None
    except ValueError as exc:
        raise BadBundle(f"{path}: {member.name} is not JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise BadBundle(f"{path}: {member.name} is not a JSON object")
    return data


def read_meta(
    path: Path, tar: tarfile.TarFile, size: int | None = None
) -> tuple[dict[str, Any], dict[str, Any] | None, tarfile.TarInfo | None]:
    """bundle.json, signature.json (or None), and the first file member (or None); ``size`` as
    for ``room``."""
    first = tar.next()
    if first is None or first.name != META:
        raise BadBundle(f"{path} is not a cachectl bundle: its first member is not {META}")
    meta = _read_json(tar, first, path, size)
    if meta.get("format") != FORMAT:
        raise BadBundle(
            f"{path}: unknown bundle format {meta.get('format')!r} (this cachectl reads {FORMAT})"
        )
    for field_name in ("environment", "digest", "namespace", "entries", "content"):
        if field_name not in meta:
            raise BadBundle(f"{path}: {META} lacks {field_name!r}")
    member = tar.next()
    signed = None
    if member is not None and member.name == SIGNATURE:
        signed = _read_json(tar, member, path, size)
        member = tar.next()
    _check_shape(path, meta, signed)
    return meta, signed, member


def _check_shape(path: Path, meta: dict[str, Any], signed: dict[str, Any] | None) -> None:
    """Every field an install reads has the JSON type it reads it as: a malformed bundle.json or
    signature.json is one line (BadBundle), never a traceback from deep in the install."""
    problem = _shape_problem(meta, signed)
    if problem is not None:
        raise BadBundle(f"{path}: malformed {problem}: nothing installed")


def _shape_problem(meta: dict[str, Any], signed: dict[str, Any] | None) -> str | None:
    if not isinstance(meta["environment"], dict):
        return f"{META}: 'environment' is not an object"
    for name in ("digest", "namespace"):
        if not isinstance(meta[name], str):
            return f"{META}: {name!r} is not a string"
    content, entries = meta["content"], meta["entries"]
    if not isinstance(content, dict) or not isinstance(content.get("files", []), list):
        return f"{META}: 'content' is not an object with a list of 'files'"
    for f in content.get("files", []):
        if not (
            isinstance(f, dict)
            and isinstance(f.get("name"), str)
            and type(f.get("size")) is int
            and isinstance(f.get("sha256"), str)
        ):
            return f"{META}: a content file is not an object of name, size (an integer), sha256"
    if not isinstance(entries, list) or not all(type(e) is dict for e in entries):
        return f"{META}: 'entries' is not a list of objects"
    if signed is not None:
        for name in ("key", "signature", ENTRIES_SIGNATURE):
            if not isinstance(signed.get(name, ""), str):
                return f"{SIGNATURE}: {name!r} is not a string"
    return None


# A signed bundle's entries (what an install writes into the index beyond the content list: function,
# bucket, compile time) are signed with the content list, by the same key, as this document.
ENTRIES_FORMAT = "cachectl-bundle-entries/1"
ENTRIES_SIGNATURE = "entries_signature"


def entries_document(meta: dict[str, Any]) -> bytes:
    """The canonical bytes an entries signature signs: the content list and every entry's fields."""
    return signing.canonical(
        {
            "format": ENTRIES_FORMAT,
            "content": meta["content"],
            "entries": [dataclasses.asdict(e) for e in bundle_entries(meta)],
        }
    )


def sign_entries(key: signing.SigningKey, meta: dict[str, Any], signed: dict[str, Any]) -> None:
    """Add the entries signature to ``signed`` (the content list's signature by ``key``)."""
    signed[ENTRIES_SIGNATURE] = base64.b64encode(key.private.sign(entries_document(meta))).decode()


def entries_signed(signed: dict[str, Any], meta: dict[str, Any], what: str) -> bool:
    """Whether the key that signed the content list signed the entries too; False when the bundle
    carries no entries signature, Untrusted when it carries one that does not verify."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    sig = signed.get(ENTRIES_SIGNATURE)
    if sig is None:
        return False
    try:
        public = signing.parse_public_key(str(signed.get("key", "")), files=False)
        raw = base64.b64decode(public[len(signing.PREFIX) :])
        Ed25519PublicKey.from_public_bytes(raw).verify(
            base64.b64decode(str(sig)), entries_document(meta)
        )
    except (InvalidSignature, ValueError, TypeError, BadInput) as exc:
        raise signing.Untrusted(
            f"{what}: the signature of its entries (function, bucket, compile time, sizes) does "
            "not match them (altered after signing): nothing installed"
        ) from exc
    return True


def content_signature(signed: dict[str, Any]) -> dict[str, Any]:
    """The content list's signature alone (what a namespace keeps), without the entries'."""
    return {k: v for k, v in signed.items() if k != ENTRIES_SIGNATURE}


def bundle_entries(meta: dict[str, Any]) -> list[BundleEntry]:
    """The entry list, each entry's fields this cachectl knows (a newer one's extra fields are
    dropped; only then is an entry's dict copied, thousands per bundle of small entries)."""
    names = BundleEntry.__dataclass_fields__.keys()
    return [
        _entry(e) if e.keys() == names else BundleEntry(**{k: e[k] for k in e if k in names})
        for e in meta["entries"]
    ]


def _entry(fields: dict[str, Any]) -> BundleEntry:
    """A BundleEntry of a dict holding exactly its fields (``frozen_from``: most of reading a
    small entry's line); any other dict takes ``__init__``, which refuses a missing field."""
    return frozen_from(BundleEntry, fields)


def frozen_from(cls: type[T], fields: dict[str, Any]) -> T:
    """An instance of the frozen dataclass ``cls`` holding ``fields``, which the caller makes
    exactly its fields, without its ``__init__`` (one ``object.__setattr__`` per field): for
    the records made per entry of a bundle of thousands of small entries."""
    obj = object.__new__(cls)
    obj.__dict__.update(fields)
    return obj


def field_defaults(cls: type) -> dict[str, Any]:
    """The dataclass ``cls``'s fields that have a default, at it: what ``frozen_from`` needs
    beside the fields a caller knows. A field made by a default factory would be left unset
    (every instance needs its own value): refused."""
    fields = dataclasses.fields(cls)
    if any(f.default_factory is not dataclasses.MISSING for f in fields):
        raise TypeError(f"{cls.__name__} has a default_factory field: build it with __init__")
    return {f.name: f.default for f in fields if f.default is not dataclasses.MISSING}


def describe(path: str | os.PathLike[str]) -> BundleInfo:
    """`bundle ls`: what a bundle holds (reads only its first members)."""
    p = Path(path).expanduser().absolute()
    with open_bundle(p) as tar:
        meta, signed, _ = read_meta(p, tar)
    files = signing.files_of(meta["content"])
    return BundleInfo(
        str(p),
        meta["environment"],
        meta["digest"],
        meta["namespace"],
        meta.get("cache"),
        meta.get("created_at", ""),
        bundle_entries(meta),
        len(files),
        sum(s for s, _ in files.values()),
        p.stat().st_size,
        signing.key_id(signed["key"]) if signed and signed.get("key") else None,
    )


def write_all(fd: int, bufs: list[bytes | memoryview]) -> None:
    """os.writev until everything is written (a write may be short)."""
    while bufs:
        n = os.writev(fd, bufs[:1024])
        while bufs and n >= len(bufs[0]):
            n -= len(bufs[0])
            bufs.pop(0)
        if n:
            bufs[0] = memoryview(bufs[0])[n:]
