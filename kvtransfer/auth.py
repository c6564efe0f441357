"""Who may open a KV connection: TLS with certificates signed by the cluster's CA, an HMAC over the
handshake with a shared secret, or both. Every transport's control channel goes through it.

    sender                                            receiver
    connect; TLS handshake (with a CA: both sides     TLS handshake: a client certificate signed by the
      show a certificate signed by it)                  CA is required, else the connection is refused
                                   <-  CHALLENGE {nonce_r}            (a fresh random nonce per connection)
    HELLO {..., nonce_s, mac = HMAC(secret, "hello" nonce_r HELLO)} ->
                                                      check the mac (constant time); a HELLO captured on
                                                      another connection carries another nonce: refused
                                   <-  WELCOME {..., mac = HMAC(secret, "welcome" nonce_s WELCOME)}
    check the mac: the receiver holds the secret too

Without a secret the macs are left out and ignored. A receiver that has one refuses a HELLO without a good
mac; a sender that has one refuses a WELCOME without one. After the handshake each write still needs the
receiver's grant for that request (kvtransfer/registry.py: the request's blocks and its token).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import secrets
import ssl
from dataclasses import dataclass
from typing import Any

from kvtransfer.base import KVTransferError

NONCE_BYTES = 32


@dataclass(frozen=True)
class PeerAuth:
    """The KV channel's credentials (picklable: the engine process builds its TLS contexts from the paths).
    `secret`: the shared HMAC key; `cert`/`key`: this worker's certificate (PEM); `ca`: the CA both ends'
    certificates must be signed by (TLS needs cert, key and CA)."""

    secret: bytes | None = None
    cert: str | None = None
    key: str | None = None
    ca: str | None = None

    def __post_init__(self) -> None:
        given = [x is not None for x in (self.cert, self.key, self.ca)]
        if any(given) and not all(given):
            raise ValueError("TLS on the KV channel needs a certificate, its key and the CA together")
        if self.secret is not None and len(self.secret) < 16:
            raise ValueError("the KV secret must be at least 16 bytes")

    @property
    def tls(self) -> bool:
        return self.ca is not None

    @property
    def authenticates(self) -> bool:
        """Whether a peer must prove itself (TLS with a CA, or the shared secret)."""
        return self.tls or self.secret is not None

    def describe(self) -> str:
        parts = (["mTLS"] if self.tls else []) + (["HMAC"] if self.secret is not None else [])
        return " + ".join(parts) or "no peer authentication"

    def mac(self, label: str, nonce: object, meta: dict[str, Any]) -> str:
        """HMAC-SHA256 over (label, the other side's nonce, the message without its mac), hex."""
        assert self.secret is not None
        body = {k: v for k, v in meta.items() if k != "mac"}
        text = json.dumps([label, str(nonce), body], sort_keys=True, separators=(",", ":"))
        return hmac.new(self.secret, text.encode(), hashlib.sha256).hexdigest()

    def check_mac(self, label: str, nonce: object, meta: dict[str, Any]) -> None:
        """Raises KVTransferError unless `meta` carries the right mac (or there is no secret to check)."""
        if self.secret is None:
            return
        given = meta.get("mac")
        if not isinstance(given, str):
            raise KVTransferError(f"the {label} carries no HMAC (this end has a KV secret)")
        if not hmac.compare_digest(given, self.mac(label, nonce, meta)):
            raise KVTransferError(f"the {label}'s HMAC is wrong (another secret, or a replayed {label})")

    def signed(self, label: str, nonce: object, meta: dict[str, Any]) -> dict[str, Any]:
        return meta if self.secret is None else {**meta, "mac": self.mac(label, nonce, meta)}

    def server_context(self) -> ssl.SSLContext:
        assert self.cert and self.key and self.ca
        return _server_context(self.cert, self.key, self.ca)

    def client_context(self) -> ssl.SSLContext:
        assert self.cert and self.key and self.ca
        return _client_context(self.cert, self.key, self.ca)


NO_AUTH = PeerAuth()


def new_nonce() -> str:
    return secrets.token_hex(NONCE_BYTES)


@functools.lru_cache(maxsize=4)
def _server_context(cert: str, key: str, ca: str) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    ctx.load_verify_locations(ca)
    ctx.verify_mode = ssl.CERT_REQUIRED  # only holders of a certificate signed by the CA
    return ctx


@functools.lru_cache(maxsize=4)
def _client_context(cert: str, key: str, ca: str) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the receiver's certificate and name
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    ctx.load_verify_locations(ca)
    return ctx
