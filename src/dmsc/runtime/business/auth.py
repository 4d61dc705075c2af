"""Authentication and authorization of the gateway: API keys, tenants, scopes.

Keys are random 32-byte tokens shown once; the database keeps only their SHA-256 (a key has the
entropy a password lacks, so a plain digest is enough and lookups stay exact). A request carries
``Authorization: Bearer <key>``; no key or an unknown or revoked one is 401, a key without the
scope the endpoint needs is 403.

The gateway keeps the principals of keys it has seen in a :class:`PrincipalCache` for a second,
so the hot path does not touch the database; a revocation through the control plane
(``dmsc token revoke`` while it runs) drops the key from the cache at once, and one made
directly in the database is seen within the cache's lifetime.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
from dataclasses import dataclass

from cachetools import TTLCache
from sqlalchemy import select

from dmsc.data.db import ApiKeyRecord, Database, TenantRecord

SCOPES = ("admin", "submit", "infer", "read")


@dataclass(frozen=True)
class Principal:
    """Who is calling: a tenant and what it may do."""

    tenant: str
    scopes: frozenset[str]
    key_id: int
    rate: float | None = None  # the key's own rate limit (requests/s), if it has one
    burst: float | None = None

    def may(self, scope: str) -> bool:
        return scope in self.scopes or "admin" in self.scopes


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def create_key(
    db: Database,
    tenant: str,
    scopes: list[str],
    rate: float | None = None,
    burst: float | None = None,
    weight: float | None = None,
) -> tuple[int, str]:
    """A new key for ``tenant`` with ``scopes`` (and its own rate limit: ``rate`` requests per
    second, ``burst`` saved up): (id, key). The key is not stored. ``weight`` sets the
    tenant's weight in the task queue's fair share (stored with the tenant, every key's)."""
    unknown = [s for s in scopes if s not in SCOPES]
    if unknown or not scopes:
        raise ValueError(f"scopes must be some of {', '.join(SCOPES)} (got {', '.join(scopes)})")
    if not tenant:
        raise ValueError("a tenant name is needed")
    for name, value in (("rate", rate), ("burst", burst), ("weight", weight)):
        if value is not None and not 0 < value <= 1e6:
            raise ValueError(f"{name} must be above 0 and at most 1e6 (got {value:g})")
    if weight is not None:
        with db.sessions() as s, s.begin():
            s.merge(TenantRecord(name=tenant, weight=weight))
    key = "dmsc_" + secrets.token_urlsafe(32)
    record = db.add(
        ApiKeyRecord(
            key_hash=digest(key), tenant=tenant, scopes=",".join(scopes), rate=rate, burst=burst
        )
    )
    return record.id, key


def list_keys(db: Database) -> list[ApiKeyRecord]:
    """Every key (id, tenant, scopes, created, revoked, limits), oldest first; never a hash."""
    with db.sessions() as s:
        return list(s.scalars(select(ApiKeyRecord).order_by(ApiKeyRecord.id)))


def revoke_key(db: Database, key_id: int) -> None:
    with db.sessions() as s, s.begin():
        record = s.get(ApiKeyRecord, key_id)
        if record is None:
            raise KeyError(f"no key {key_id}")
        record.revoked = True


def _bearer(authorization: str | None) -> str | None:
    if not authorization or not authorization.startswith("Bearer "):
        return None
    return authorization[len("Bearer ") :].strip() or None


def _lookup(db: Database, key_hash: str) -> Principal | None:
    with db.sessions() as s:
        record = s.scalar(select(ApiKeyRecord).where(ApiKeyRecord.key_hash == key_hash))
    if record is None or record.revoked:
        return None
    return Principal(
        record.tenant, frozenset(record.scopes.split(",")), record.id, record.rate, record.burst
    )


def authenticate(db: Database, authorization: str | None) -> Principal | None:
    """The principal behind an Authorization header, or None (-> 401)."""
    key = _bearer(authorization)
    return None if key is None else _lookup(db, digest(key))


class PrincipalCache:
    """Principals of valid keys, by key digest, for ``ttl_s`` seconds (unknown keys are not
    kept: each is looked up again). Thread-safe."""

    def __init__(self, db: Database, ttl_s: float = 1.0, maxsize: int = 10_000) -> None:
        self.db = db
        self._cache: TTLCache[str, Principal] = TTLCache(maxsize=maxsize, ttl=ttl_s)
        self._lock = threading.Lock()
        self._forgets = 0  # a lookup that raced a revocation does not store what it read

    def cached(self, authorization: str | None) -> Principal | None:
        """The principal if the key was seen valid within the cache's lifetime (no database)."""
        key = _bearer(authorization)
        if key is None:
            return None
        with self._lock:
            return self._cache.get(digest(key))

    def lookup(self, authorization: str | None) -> Principal | None:
        """:func:`authenticate`, through the cache (this may read the database)."""
        key = _bearer(authorization)
        if key is None:
            return None
        key_hash = digest(key)
        with self._lock:
            who, forgets = self._cache.get(key_hash), self._forgets
        if who is None:
            who = _lookup(self.db, key_hash)
            with self._lock:
                if who is not None and forgets == self._forgets:
                    self._cache[key_hash] = who
        return who

    def forget(self, key_id: int) -> None:
        """Drop the key ``key_id`` (revoked) at once."""
        with self._lock:
            self._forgets += 1
            for key_hash in [h for h, p in self._cache.items() if p.key_id == key_id]:
                del self._cache[key_hash]


def revoke(db: Database, key_id: int, cache: PrincipalCache | None = None) -> None:
    """Revoke ``key_id`` in the database and drop it from ``cache``."""
    revoke_key(db, key_id)
    if cache is not None:
        cache.forget(key_id)
