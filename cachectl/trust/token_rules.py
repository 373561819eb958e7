"""The rules a new token is made by, shared by both writers and importing no SQLAlchemy.

``cachectl token create`` on a plain SQLite index writes through the stdlib driver
(cachectl.index.stdlib ``StdlibReads.create_token``) and answers without SQLAlchemy's import;
elsewhere cachectl.trust.tokens writes through the SQL index. Both take the row this module
checked and made: the name, the role, the expiry, the scope, the secret and its hash.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from datetime import timedelta
from typing import Any

from cachectl.core.errors import BadInput
from cachectl.core.records import ROLES, NewToken, utcnow

TOKEN_PREFIX = "cct_"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,127}$")


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def new_token(
    name: str,
    role: str,
    caches: list[str] | tuple[str, ...] | None = None,
    expires_in: timedelta | None = None,
) -> NewToken:
    """A checked token row with a fresh secret; BadInput names what is wrong. The scoped caches'
    existence and the name's uniqueness are the writer's to check, inside its transaction."""
    if not NAME_RE.match(name or ""):
        raise BadInput(
            f"bad token name {name!r}: use letters, digits, '.', '_', '@' or '-' (at most 128)"
        )
    if role not in ROLES:
        raise BadInput(f"bad role {role!r}: use reader, writer or admin")
    if expires_in is not None and expires_in.total_seconds() <= 0:
        raise BadInput("token expiry must be in the future, e.g. --expires 90d")
    scope = None if caches is None else sorted(set(caches))
    if scope == []:  # stored as NULL it would read every cache
        raise BadInput(
            "a token scoped to no cache (caches: []) could do nothing: name its caches, or "
            "leave the scope out for every cache"
        )
    secret = TOKEN_PREFIX + secrets.token_urlsafe(32)
    now = utcnow()
    return NewToken(
        name=name,
        role=role,
        caches=scope,
        token_hash=hash_token(secret),
        created_at=now,
        expires_at=now + expires_in if expires_in else None,
        secret=secret,
    )


def name_taken(name: str) -> BadInput:
    """The error for a name a token not revoked holds (a revoked token's name is free again)."""
    return BadInput(f"a token named {name!r} exists: revoke it first or pick another name")


def audit_details(new: NewToken) -> dict[str, Any]:
    """The ``token-create`` audit row's details (never the secret nor its hash)."""
    return {"name": new.name, "role": new.role, "caches": list(new.caches or ())}
