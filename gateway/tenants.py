"""API keys mapped to tenants (`--api-keys-file`: one `KEY TENANT` a line, `#` comments; reloaded on SIGHUP),
and the cache salt that keeps each tenant's prefix cache its own.

Keys are kept only as SHA-256 digests, looked up by the digest of the presented token: the lookup's time
says nothing about how much of a key a guess got right. A tenant's requests carry
`cache_salt = HMAC(server secret, tenant)` (or HMAC over the tenant and the client's own `cache_salt`), so
two tenants never share a prefix-cache block, whatever they send. Without tenants a client's `cache_salt`
passes as it is (vLLM's behaviour).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import threading

logger = logging.getLogger(__name__)

SALT_SECRET_ENV = "PDSERVE_CACHE_SALT_SECRET"
DEFAULT_TENANT = "default"  # the tenant of --api-key when a keys file is given too


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


def parse_keys(text: str) -> dict[bytes, str]:
    """Key digest -> tenant; ValueError names the line (never its text: it holds a key)."""
    keys: dict[bytes, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"line {number}: expected `KEY TENANT`, {len(parts)} fields found")
        digest = _digest(parts[0].encode())
        if keys.get(digest, parts[1]) != parts[1]:
            raise ValueError(f"line {number}: a key given twice, for two tenants")
        keys[digest] = parts[1]
    return keys


class TenantKeys:
    """The keys the /v1 endpoints accept and their tenants: `--api-key` alone (one key, no tenants), a keys
    file (its key is tenant `default` then), or both. `reload()` rereads the file (SIGHUP)."""

    def __init__(self, path: str | None = None, single_key: str | None = None) -> None:
        self.path, self._single = path, single_key
        self._keys: dict[bytes, str | None] = {}
        self._lock = threading.Lock()
        self.reload()

    @property
    def has_tenants(self) -> bool:
        return self.path is not None

    def reload(self) -> None:
        """Read the keys file again; raises OSError or ValueError and keeps the keys it had."""
        keys: dict[bytes, str | None] = {}
        if self.path is not None:
            with open(self.path, encoding="utf-8") as f:
                keys.update(parse_keys(f.read()))
        if self._single:
            keys[_digest(self._single.encode())] = DEFAULT_TENANT if self.path else None
        with self._lock:
            self._keys = keys
        tenants = len({t for t in keys.values() if t is not None})
        logger.info("API keys loaded: %d keys, %d tenants", len(keys), tenants)

    def reload_or_keep(self) -> None:
        try:
            self.reload()
        except (OSError, ValueError) as exc:
            logger.error("the API keys file was not reloaded (%s); the keys loaded before stay in force", exc)

    def lookup(self, token: bytes) -> tuple[bool, str | None]:
        """(whether the token is a key, its tenant)."""
        digest = _digest(token)
        with self._lock:
            if digest not in self._keys:
                return False, None
            return True, self._keys[digest]


class CacheSalts:
    """Each tenant's cache salt, an HMAC of its id with the server's secret (`--cache-salt-secret`, or
    $PDSERVE_CACHE_SALT_SECRET; default: random per process, so gateways that share a cluster should
    share one)."""

    def __init__(self, secret: str | None = None) -> None:
        value = secret or os.environ.get(SALT_SECRET_ENV)
        self._secret = value.encode() if value else secrets.token_bytes(32)

    def salt(self, tenant: str | None, client_salt: str | None) -> str:
        """The salt a request carries: the client's as is without a tenant; with one, the tenant's own
        (scoped by the client's salt when it set one)."""
        if tenant is None:
            return client_salt or ""
        text = json.dumps([tenant, client_salt]) if client_salt else json.dumps([tenant])
        return "tenant-" + hmac.new(self._secret, text.encode(), hashlib.sha256).hexdigest()
