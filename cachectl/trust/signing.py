"""Ed25519 signatures over a namespace's content list: the trust root is a key.

Whoever can write a bucket can run code in every process that loads from it
(docs/jax-facts.md, fact 7). With signatures, a cache that lists trusted public keys
(`cachectl cache set NAME --trust PUBKEY`) accepts only content whose list of
files and sha256s is signed by one of them: `mirror pull`, `bundle install` and
`cachectl.serving` refuse each file no trusted key signed, and serve the rest.

- A **key** is made by `cachectl key generate PATH`: PATH holds the private key
  (PKCS#8 PEM, mode 0600), PATH.pub the public key, one line: ``ed25519:<base64>``.
- Writers sign with ``--sign-key PATH`` or ``CACHECTL_SIGNING_KEY=PATH``: warm and
  push re-sign the namespace's content list (:func:`resign`: what this run wrote,
  plus what the previous list, signed by this key or a trusted one, still matches;
  never a file someone else put there), kept on the environment's index row and as
  ``signature.json`` in the namespace, which a reader verifies with the key alone;
  `bundle create` signs the bundle's list.
- The **content list** is canonical JSON: the environment digest and every file
  (``env.json``, ``<key>-cache``, ``<key>-aot``) with its size and sha256.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cachectl.core.config import SIGNING_KEY_ENV as KEY_ENV
from cachectl.core.errors import BadInput, CachectlError, PermissionDenied
from cachectl.storage.entries import CACHE_SUFFIX, ENV_FILE, EXECUTABLE_SUFFIX, SIGNATURE_FILE
from cachectl.trust.owned import read_trusted_file

PREFIX = "ed25519:"
CONTENT_FORMAT = "cachectl-content/1"
# A namespace's signature.json lists a few hundred bytes per file; anything larger is not ours.
MAX_SIGNATURE_BYTES = 256 * 1024 * 1024


class Untrusted(CachectlError):
    """Content that is unsigned, or signed by a key the cache does not trust, or altered since."""

    exit_code = 2


@dataclass(frozen=True)
class KeyInfo:
    """What `cachectl key generate` made."""

    path: str
    public_path: str
    public_key: str
    key_id: str


@dataclass(frozen=True)
class SigningKey:
    private: Any  # cryptography's Ed25519PrivateKey
    public_key: str
    path: str

    @property
    def key_id(self) -> str:
        return key_id(self.public_key)


def key_id(public_key: str) -> str:
    """A short name for a public key: sha256 of its raw bytes, 16 hex digits."""
    return hashlib.sha256(_raw(public_key)).hexdigest()[:16]


def _raw(public_key: str) -> bytes:
    text = public_key.strip()
    if not text.startswith(PREFIX):
        raise BadInput(
            f"not an Ed25519 public key {text[:40]!r}: expected 'ed25519:<base64>' "
            "(the .pub file `cachectl key generate` writes)"
        )
    try:
        raw = base64.b64decode(text[len(PREFIX) :], validate=True)
    except ValueError as exc:
        raise BadInput(f"public key {text[:40]!r}: bad base64") from exc
    if len(raw) != 32:
        raise BadInput(f"public key {text[:40]!r}: an Ed25519 key is 32 bytes, got {len(raw)}")
    return raw


def _public_text(private: Any) -> str:
    from cryptography.hazmat.primitives import serialization

    raw = private.public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw
    )
    return PREFIX + base64.b64encode(raw).decode()


def parse_public_key(text: str, *, files: bool = True) -> str:
    """A public key given as its ``ed25519:...`` line or (``files``) as the path of a .pub file,
    normalized; a key file others could have written is refused (BadInput: trust/owned.py)."""
    candidate = text.strip()
    if files and not candidate.startswith(PREFIX):
        path = Path(candidate).expanduser()
        if os.path.lexists(path):
            candidate = read_trusted_file(path).decode(errors="replace").strip()
    raw = _raw(candidate)
    return PREFIX + base64.b64encode(raw).decode()


def generate(
    path: str | os.PathLike[str], *, force: bool = False, dry_run: bool = False
) -> KeyInfo:
    """Write a new private key to PATH (0600) and its public key to PATH.pub."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    target = Path(path).expanduser().absolute()
    public_path = target.with_name(target.name + ".pub")
    if not force:
        for p in (target, public_path):
            if p.exists():
                raise BadInput(
                    f"{p} exists: pass --force to replace it (signatures made with it stop verifying)"
                )
    if target.parent.exists() and not target.parent.is_dir():
        raise BadInput(f"{target.parent} is not a directory")
    private = Ed25519PrivateKey.generate()
    public = _public_text(private)
    if not dry_run:
        target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # like ssh-keygen's ~/.ssh
        pem = private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(pem)
        os.chmod(target, 0o600)
        fd = os.open(public_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        with os.fdopen(fd, "w") as fh:
            os.fchmod(fh.fileno(), 0o644)  # never writable by others, whatever the umask
            fh.write(public + "\n")
    return KeyInfo(str(target), str(public_path), public, key_id(public))


def load_signing_key(path: str | os.PathLike[str]) -> SigningKey:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    p = Path(path).expanduser()
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise BadInput(f"signing key {p}: {exc.strerror or exc}") from exc
    try:
        private = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise BadInput(f"signing key {p}: not an unencrypted PEM private key ({exc})") from exc
    if not isinstance(private, Ed25519PrivateKey):
        raise BadInput(f"signing key {p}: not an Ed25519 key")
    return SigningKey(private, _public_text(private), str(p))


def signing_key(explicit: str | None = None) -> SigningKey | None:
    """``--sign-key PATH``, else ``CACHECTL_SIGNING_KEY``, else None (no signing)."""
    path = explicit or os.environ.get(KEY_ENV, "").strip() or None
    return load_signing_key(path) if path else None


def content_list(digest: str, files: Iterable[tuple[str, int, str]]) -> dict[str, Any]:
    """The signed document: environment digest and (name, size, sha256) of every file, sorted."""
    items = sorted((str(n), int(s), str(h)) for n, s, h in files)
    names = [n for n, _, _ in items]
    if len(set(names)) != len(names):
        raise BadInput("content list names a file twice")
    return {
        "format": CONTENT_FORMAT,
        "environment": digest,
        "files": [{"name": n, "size": s, "sha256": h} for n, s, h in items],
    }


def canonical(content: dict[str, Any]) -> bytes:
    return json.dumps(content, sort_keys=True, separators=(",", ":")).encode()


def sign(key: SigningKey, content: dict[str, Any]) -> dict[str, Any]:
    """``{"content", "key", "signature", "signed_at"}``: what the index and bundles keep."""
    signature = key.private.sign(canonical(content))
    return {
        "content": content,
        "key": key.public_key,
        "key_id": key.key_id,
        "signature": base64.b64encode(signature).decode(),
        "signed_at": datetime.now(UTC).isoformat(),
    }


def verify(signed: dict[str, Any] | None, trusted: Sequence[str], what: str) -> dict[str, Any]:
    """The signed content list, when a trusted key signed it; Untrusted otherwise.

    With no trusted keys nothing is required: returns the content (possibly unsigned).
    """
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    if not trusted:
        return (signed or {}).get("content") or {}
    if not signed or not signed.get("signature"):
        raise Untrusted(
            f"{what} is not signed, and the cache trusts only content signed by "
            f"{', '.join(key_id(k) for k in trusted)}: sign with --sign-key (or {KEY_ENV})"
        )
    public = str(signed.get("key", ""))
    trusted_norm = {parse_public_key(k) for k in trusted}
    try:
        public = parse_public_key(public, files=False)  # the signer's claim: never a path
    except BadInput as exc:
        raise Untrusted(f"{what}: signed with an unreadable key ({exc.message})") from exc
    if public not in trusted_norm:
        raise Untrusted(
            f"{what} is signed by key {key_id(public)}, which the cache does not trust "
            f"(trusted: {', '.join(key_id(k) for k in trusted)})"
        )
    try:
        Ed25519PublicKey.from_public_bytes(_raw(public)).verify(
            base64.b64decode(str(signed["signature"])), canonical(signed.get("content") or {})
        )
    except (InvalidSignature, ValueError) as exc:
        raise Untrusted(
            f"{what}: the signature by key {key_id(public)} does not match its content list "
            "(altered after signing)"
        ) from exc
    return signed["content"]


def files_of(content: dict[str, Any]) -> dict[str, tuple[int, str]]:
    """name -> (size, sha256) of a content list."""
    return {f["name"]: (int(f["size"]), str(f["sha256"])) for f in content.get("files", [])}


# --------------------------------------------------------------------------- namespaces


def env_json_file(env: Any) -> tuple[str, int, str]:
    """(name, size, sha256) of the env.json cachectl writes for ``env``."""
    data = env.env_json().encode()
    return ENV_FILE, len(data), hashlib.sha256(data).hexdigest()


def namespace_content(index: Any, env_info: Any) -> dict[str, Any]:
    """The content list of an environment's namespace as the index records it."""
    return content_list(env_info.digest, _indexed_files(index, env_info))


def _indexed_files(index: Any, env_info: Any) -> list[tuple[str, int, str]]:
    files = [env_json_file(env_info.environment)]
    for e in index.list_entries(env_info.id):
        files.append((e.key + CACHE_SUFFIX, e.size, e.sha256))
        if e.aot_sha256:
            files.append((e.key + EXECUTABLE_SUFFIX, int(e.aot_size or 0), e.aot_sha256))
    return files


def verified_files(
    signed: dict[str, Any] | None, trusted: Sequence[str], digest: str, what: str
) -> dict[str, tuple[int, str]]:
    """name -> (size, sha256) of a signed list that a trusted key signed for environment
    ``digest``; Untrusted otherwise (``trusted`` must not be empty)."""
    content = verify(signed, trusted, what)
    if content.get("environment") != digest:
        raise Untrusted(f"{what}: its signed content list is for another environment")
    return files_of(content)


@dataclass(frozen=True)
class Coverage:
    """What of one namespace a trusted key signed: readers use exactly these files.

    ``problem`` says why no signed list verified (then ``files`` is empty and every
    file is refused); a file the index lists with another size or sha256, or that the
    list lacks, is unsigned: refused alone, the rest is served."""

    files: dict[str, tuple[int, str]]
    problem: str | None = None
    document: dict[str, Any] | None = None  # the signed list that verified

    def covers(self, name: str, size: int | None, sha: str | None) -> bool:
        known = self.files.get(name)
        return known is not None and known[1] == sha and (size is None or known[0] == size)

    def reason(self) -> str:
        """Why a file is refused, in words that never advise signing it."""
        if self.problem:
            return f"refused: {self.problem}"
        return (
            "refused: not in the namespace's signed content list (unsigned, or changed since a "
            "trusted key signed it: whoever wrote it has no trusted key)"
        )


def coverage(index: Any, cache: Any, env_info: Any) -> Coverage | None:
    """The signed files of a namespace, from the index's signed list; None when the cache trusts no keys."""
    trusted = tuple(getattr(cache, "trusted_keys", ()) or ())
    if not trusted:
        return None
    what = f"namespace {env_info.namespace} of cache {cache.name!r}"
    if not hasattr(index, "content_signature"):
        return Coverage({}, f"{what}: signatures cannot be checked through this index")
    signed = index.content_signature(env_info.id)
    try:
        files = verified_files(signed, trusted, env_info.digest, what)
    except Untrusted as exc:
        return Coverage({}, exc.message)
    return Coverage(files, document=signed)


def trusted_files(index: Any, cache: Any, env_info: Any) -> dict[str, tuple[int, str]] | None:
    """name -> (size, sha256) a trusted key signed for this namespace; None when the cache trusts no keys.

    Raises Untrusted when the cache has trusted keys and no signed list verifies."""
    covered = coverage(index, cache, env_info)
    if covered is None:
        return None
    if covered.problem:
        raise Untrusted(covered.problem)
    return covered.files


def unsigned_files(index: Any, cache: Any, env_info: Any) -> list[str] | None:
    """The files the index lists for this namespace that no trusted key signed (None: no trusted keys)."""
    covered = coverage(index, cache, env_info)
    if covered is None:
        return None
    return [n for n, s, h in _indexed_files(index, env_info) if not covered.covers(n, s, h)]


def require_signer(cache: Any, key: SigningKey | None, operation: str) -> None:
    """Writers of a cache that trusts keys must sign with one of them (exit 4 otherwise)."""
    trusted = tuple(getattr(cache, "trusted_keys", ()) or ())
    if not trusted:
        return
    if key is None:
        raise PermissionDenied(
            f"cache {cache.name!r} accepts only signed content: {operation} needs "
            f"--sign-key (or {KEY_ENV}) with a trusted key "
            f"({', '.join(key_id(k) for k in trusted)}); nothing was written"
        )
    if key.public_key not in {parse_public_key(k) for k in trusted}:
        raise PermissionDenied(
            f"cache {cache.name!r} does not trust signing key {key.key_id} "
            f"(trusted: {', '.join(key_id(k) for k in trusted)}); nothing was written"
        )


@dataclass(frozen=True)
class Resigned:
    """What a writer's signature now covers: ``unsigned`` are the files the index lists that it
    left out, because this run did not write them and no list it trusts signed them."""

    key_id: str
    signed: int
    unsigned: tuple[str, ...] = ()

    def warning(self) -> str | None:
        if not self.unsigned:
            return None
        return (
            f"{len(self.unsigned)} indexed file(s) left unsigned (first: {self.unsigned[0]}): "
            "this run did not write them and no trusted signature lists them; readers of a cache "
            "that trusts keys refuse them (check where they came from, then remove them)"
        )


Written = Iterable[tuple[str, int, str]]


def carried_files(
    index: Any, cache: Any, env_info: Any, key: SigningKey
) -> dict[str, tuple[int, str]] | None:
    """The files of the namespace's previous signed list, when this key or a key the cache
    trusts signed it; {} otherwise (a list by any other key vouches for nothing); None where
    this index keeps no signatures (server mode: nothing is signed there)."""
    if not hasattr(index, "content_signature"):
        return None
    accepted = [key.public_key, *(getattr(cache, "trusted_keys", ()) or ())]
    try:
        return verified_files(
            index.content_signature(env_info.id), accepted, env_info.digest, "previous list"
        )
    except Untrusted:
        return {}


def resign(
    ctx: Any, cache_name: str, digest: str, key: SigningKey | None, written: Written = ()
) -> Resigned | None:
    """After a write: sign what this run wrote (``written``: name, size, sha256) and what the
    previous list (signed by this key or a key the cache trusts) still matches, never anything
    else; an executable only beside its signed entry.

    The signed list goes on the environment's index row and into the namespace as
    ``signature.json``, so a reader with the public key verifies it without the index."""
    index = ctx.index
    if key is None or not hasattr(index, "set_content_signature"):
        return None
    cache = ctx.cache(cache_name)
    env_info = index.get_environment(cache_name, digest)
    carried = carried_files(index, cache, env_info, key) or {}
    fresh = {str(n): (int(s), str(h)) for n, s, h in written}
    files = _indexed_files(index, env_info)
    chosen = {
        name: (size, sha)
        for name, size, sha in files
        if name == ENV_FILE or (size, sha) in (fresh.get(name), carried.get(name))
    }
    unsigned = [n for n, _, _ in files if n not in chosen]
    for name in [n for n in chosen if n.endswith(EXECUTABLE_SUFFIX)]:
        if name[: -len(EXECUTABLE_SUFFIX)] + CACHE_SUFFIX not in chosen:
            del chosen[name]
            unsigned.append(name)
    signed = sign(key, content_list(env_info.digest, [(n, *v) for n, v in chosen.items()]))
    index.set_content_signature(env_info.id, signed)
    _store_signature(ctx.store(cache), env_info.namespace, signed)
    return Resigned(key.key_id, len(chosen), tuple(sorted(unsigned)))


def report_resigned(resigned: Resigned | None) -> None:
    """One line on stderr when a signature left indexed files out (the CLI's writers call it)."""
    message = resigned.warning() if resigned is not None else None
    if message:
        print(f"cachectl: warning: {message}", file=sys.stderr)


def _store_signature(store: Any, namespace: str, signed: dict[str, Any]) -> None:
    """``<namespace>/signature.json``: the signed list beside the files it covers (atomic write)."""
    data = json.dumps(signed, indent=1, sort_keys=True).encode()
    store.write_bytes(f"{namespace}/{SIGNATURE_FILE}", data)


def stored_signature(read: Any) -> dict[str, Any] | None:
    """The namespace's ``signature.json`` through ``read(name) -> bytes``; None when absent or unreadable."""
    try:
        data = read(SIGNATURE_FILE)
    except (OSError, ValueError):
        return None
    if len(data) > MAX_SIGNATURE_BYTES:
        return None
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) else None


def pinned_keys(settings: Any) -> tuple[str, ...]:
    """The keys a service trusts by its own settings (``CACHECTL_TRUST``), normalized."""
    return tuple(parse_public_key(k) for k in getattr(settings, "trust", ()) or ())
