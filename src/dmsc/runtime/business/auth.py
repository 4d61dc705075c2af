"""Authentication and authorization of the gateway: API keys, tenants, scopes.

Keys are random 32-byte tokens shown once; the database keeps only their SHA-256 (a key has the
entropy a password lacks, so a plain digest is enough and lookups stay exact). A request carries
``Authorization: Bearer <key>``; no key or an unknown or revoked one is 401, a key without the
scope the endpoint needs is 403.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

from sqlalchemy import select

from dmsc.data.db import ApiKeyRecord, Database

SCOPES = ("admin", "submit", "infer", "read")


@dataclass(frozen=True)
class Principal:
    """Who is calling: a tenant and what it may do."""

    tenant: str
    scopes: frozenset[str]
    key_id: int

    def may(self, scope: str) -> bool:
        return scope in self.scopes or "admin" in self.scopes


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def create_key(db: Database, tenant: str, scopes: list[str]) -> tuple[int, str]:
    """A new key for ``tenant`` with ``scopes``: (id, key). The key is not stored."""
    unknown = [s for s in scopes if s not in SCOPES]
    if unknown or not scopes:
        raise ValueError(f"scopes must be some of {', '.join(SCOPES)} (got {', '.join(scopes)})")
    if not tenant:
        raise ValueError("a tenant name is needed")
    key = "dmsc_" + secrets.token_urlsafe(32)
    record = db.add(ApiKeyRecord(key_hash=digest(key), tenant=tenant, scopes=",".join(scopes)))
    return record.id, key


def revoke_key(db: Database, key_id: int) -> None:
    with db.sessions() as s, s.begin():
        record = s.get(ApiKeyRecord, key_id)
        if record is None:
            raise KeyError(f"no key {key_id}")
        record.revoked = True


def authenticate(db: Database, authorization: str | None) -> Principal | None:
    """The principal behind an Authorization header, or None (-> 401)."""
    if not authorization or not authorization.startswith("Bearer "):
        return None
    key = authorization[len("Bearer ") :].strip()
    with db.sessions() as s:
        record = s.scalar(select(ApiKeyRecord).where(ApiKeyRecord.key_hash == digest(key)))
    if record is None or record.revoked:
        return None
    return Principal(record.tenant, frozenset(record.scopes.split(",")), record.id)
