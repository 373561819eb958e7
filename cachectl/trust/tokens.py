"""Bearer tokens for the cachectl server: create, list, revoke, authenticate.

Only a sha256 of each token is stored: the secret is shown once, when it is
created, and a leaked index does not leak usable tokens. Tokens are 256-bit
``secrets.token_urlsafe`` strings, so a plain (unsalted) hash is enough; the
lookup is by hash and the final comparison is constant-time. How a new token is made
(name, role, expiry, scope, secret) is cachectl.trust.token_rules', shared with the stdlib
driver's writer.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import select, update

from cachectl.core.errors import CachectlError, NotFound
from cachectl.core.records import (  # noqa: F401 - re-exported
    ROLE_RANK,
    ROLES,
    CreatedToken,
    NewToken,
    TokenInfo,
)
from cachectl.index import Index
from cachectl.index.models import Token, utcnow
from cachectl.trust.token_rules import TOKEN_PREFIX, hash_token, name_taken, new_token  # noqa: F401

# Refresh last_used_at at most this often: a write per request would make
# every read a database write.
_LAST_USED_GRANULARITY = timedelta(minutes=1)


class InvalidToken(Exception):
    """Unknown, expired or revoked: the server answers 401 without saying which."""


def _info(row: Token) -> TokenInfo:
    return TokenInfo(
        id=row.id,
        name=row.name,
        role=row.role,
        caches=tuple(row.caches) if row.caches is not None else None,
        created_at=row.created_at,
        expires_at=row.expires_at,
        revoked_at=row.revoked_at,
        last_used_at=row.last_used_at,
    )


def create_token(
    index: Index,
    name: str,
    role: str,
    caches: list[str] | tuple[str, ...] | None = None,
    expires_in: timedelta | None = None,
) -> CreatedToken:
    """Mint a token; the secret is returned here and never again."""
    new = new_token(name, role, caches, expires_in)
    return CreatedToken(store_token(index, new), new.secret)


def store_token(index: Index, new: NewToken) -> TokenInfo:
    """Write a token made by cachectl.trust.token_rules on the SQL index (the stdlib driver's
    twin: cachectl.index.stdlib ``StdlibReads.create_token``)."""
    for cache in new.caches or ():
        index.get_cache(cache)  # a typo would make a token that can do nothing
    with index.session() as s:
        held = select(Token.id).where(Token.name == new.name, Token.revoked_at.is_(None))
        if s.scalar(held) is not None:  # a revoked token's name is free again
            raise name_taken(new.name)
        row = Token(
            name=new.name,
            role=new.role,
            caches=new.caches,
            token_hash=new.token_hash,
            created_at=new.created_at,
            expires_at=new.expires_at,
        )
        s.add(row)
        s.flush()
        return _info(row)


def list_tokens(index: Index, *, include_revoked: bool = True) -> list[TokenInfo]:
    with index.session() as s:
        q = select(Token).order_by(Token.name, Token.id)
        if not include_revoked:
            q = q.where(Token.revoked_at.is_(None))
        return [_info(r) for r in s.scalars(q)]


def revoke_token(index: Index, name: str) -> TokenInfo:
    """Revoke by name (the token that holds it; else the latest revoked one, unchanged):
    revoking twice is harmless."""
    with index.session() as s:
        row = s.scalar(
            select(Token)
            .where(Token.name == name)
            .order_by(Token.revoked_at.is_(None).desc(), Token.id.desc())
            .limit(1)
        )
        if row is None:
            raise NotFound(f"no token named {name!r}: see `cachectl token list`")
        if row.revoked_at is None:
            row.revoked_at = utcnow()
        s.flush()
        return _info(row)


def authenticate(index: Index, token: str) -> TokenInfo:
    """The active token ``token`` is, or InvalidToken (never saying why)."""
    if not token or len(token) > 512:
        raise InvalidToken()
    digest = hash_token(token)
    with index.session() as s:
        row = s.scalar(select(Token).where(Token.token_hash == digest))
        # The index lookup is by hash, so timing says nothing about the secret;
        # compare again in constant time so the check never relies on the DB.
        if row is None or not hmac.compare_digest(row.token_hash, digest):
            raise InvalidToken()
        info = _info(row)
    if not info.active:
        raise InvalidToken()
    now = utcnow()
    if info.last_used_at is None or now - info.last_used_at > _LAST_USED_GRANULARITY:
        # Its own short write, best effort: a busy index must not fail the request.
        try:
            with index.session() as s:
                s.execute(update(Token).where(Token.id == info.id).values(last_used_at=now))
        except CachectlError:
            pass
    return info


# -- dashboard sessions ------------------------------------------------------------------
#
# The dashboard's cookie holds a session, never the token: "<token id>.<expiry>.<mac>",
# the mac an HMAC-SHA256 keyed by the token's stored hash. Replicas need no shared state or
# secret; a session ends when it expires or its token is revoked or expires; a stolen
# cookie is worth a read-only dashboard for at most SESSION_TTL, never an API token.

SESSION_TTL = timedelta(hours=12)
_SESSION_RE = re.compile(r"^(\d{1,18})\.(\d{1,12})\.([0-9a-f]{64})$")


def _session_mac(token_hash: str, token_id: int, expires: int) -> str:
    return hmac.new(
        bytes.fromhex(token_hash), f"cachectl-session|{token_id}|{expires}".encode(), hashlib.sha256
    ).hexdigest()


@dataclass(frozen=True)
class Session:
    value: str
    info: TokenInfo
    expires_at: datetime


def issue_session(index: Index, token: str, ttl: timedelta = SESSION_TTL) -> Session:
    """A session for an active token (InvalidToken otherwise), ending at the latest when it does."""
    info = authenticate(index, token)
    end = utcnow() + ttl
    if info.expires_at is not None and info.expires_at < end:
        end = info.expires_at
    expires = int(end.timestamp())
    value = f"{info.id}.{expires}.{_session_mac(hash_token(token), info.id, expires)}"
    return Session(value, info, end)


def authenticate_session(index: Index, value: str) -> TokenInfo:
    """The active token a session value was issued for, or InvalidToken (expired, forged, revoked)."""
    match = _SESSION_RE.match(value or "")
    if match is None:
        raise InvalidToken()
    token_id, expires, mac = int(match[1]), int(match[2]), match[3]
    if expires < utcnow().timestamp():
        raise InvalidToken()
    with index.read_session() as s:
        row = s.get(Token, token_id)
        if row is None or not hmac.compare_digest(
            _session_mac(row.token_hash, token_id, expires), mac
        ):
            raise InvalidToken()
        info = _info(row)
    if not info.active:
        raise InvalidToken()
    return info
