"""Every gRPC server and channel pdserve makes, with TLS when configured; and the rule that keeps plaintext
on loopback.

- `--tls-cert` / `--tls-key`: this process's certificate and key (PEM). Servers present them; clients show
  them to servers that ask.
- `--tls-ca`: the CA that signs the cluster's certificates. Servers then require a client certificate signed
  by it (mutual TLS), and clients verify servers against it. Each certificate must name (subjectAltName) the
  host its peers dial.
- `--insecure`: listen on a non-loopback address in plaintext anyway, with a warning. Without it a role
  asked to do so refuses to start (`InsecureListen`).
- `--kv-secret` (or `PDSERVE_KV_SECRET`): the workers' shared HMAC key for the KV channel (kvtransfer/auth.py).
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import grpc

from serving.grpc_common import CHANNEL_OPTIONS

logger = logging.getLogger(__name__)

KV_SECRET_ENV = "PDSERVE_KV_SECRET"


class InsecureListen(ValueError):
    """A role was asked to serve plaintext on an address other hosts can reach."""


@dataclass(frozen=True)
class TLSConfig:
    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    insecure: bool = False  # plaintext on a non-loopback address is allowed (warned about)

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.ca is not None and self.cert is None:
            raise ValueError("--tls-ca needs --tls-cert and --tls-key: with a CA every hop is mutual TLS")
        for flag, path in (("--tls-cert", self.cert), ("--tls-key", self.key), ("--tls-ca", self.ca)):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{flag} {path}: no such file")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TLSConfig:
        return cls(args.tls_cert, args.tls_key, args.tls_ca, args.insecure)

    @property
    def enabled(self) -> bool:
        return self.cert is not None

    def describe(self) -> str:
        return "mTLS" if self.ca else "TLS" if self.enabled else "plaintext"

    def argv(self) -> list[str]:
        """The flags that give a child process this configuration."""
        out: list[str] = []
        for flag, value in (("--tls-cert", self.cert), ("--tls-key", self.key), ("--tls-ca", self.ca)):
            out += [flag, str(Path(value).resolve())] if value else []
        return out + (["--insecure"] if self.insecure else [])

    def check_listen(self, host: str, what: str, authenticated: bool | None = None) -> None:
        """Refuse (InsecureListen) to serve `what` in plaintext on a host other machines can reach, unless
        --insecure (then warn). `authenticated`: the listener authenticates its peers some other way (the
        KV channel's shared secret); by default, whether TLS is on."""
        if (self.enabled if authenticated is None else authenticated) or is_loopback(host):
            return
        if self.insecure:
            logger.warning(
                "%s listens on %s without TLS (--insecure): anyone who reaches it can use it", what, host
            )
            return
        raise InsecureListen(
            f"refusing to serve {what} on {host or '*'} without TLS: any host that reaches it could use it. "
            "Pass --tls-cert, --tls-key and --tls-ca (mutual TLS), listen on 127.0.0.1, "
            "or pass --insecure to serve plaintext anyway"
        )

    # ---- gRPC ----------------------------------------------------------------------------------------

    def aio_server(self) -> grpc.aio.Server:
        """A server with pdserve's channel options; `add_port` gives it its (secure) port."""
        return grpc.aio.server(options=CHANNEL_OPTIONS)

    def add_port(self, server: grpc.aio.Server, address: str) -> int:
        """Listen on `address` (host:port; port 0: a free one); returns the port."""
        self.check_listen(address.rpartition(":")[0], "gRPC")
        if not self.enabled:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, self._server_credentials())

    def aio_channel(self, address: str) -> grpc.aio.Channel:
        if not self.enabled:
            return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        return grpc.aio.secure_channel(address, self._channel_credentials(), options=CHANNEL_OPTIONS)

    def channel(self, address: str) -> grpc.Channel:
        """A blocking channel (tools, tests)."""
        if not self.enabled:
            return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        return grpc.secure_channel(address, self._channel_credentials(), options=CHANNEL_OPTIONS)

    def _server_credentials(self) -> grpc.ServerCredentials:
        cert, key, ca = self._read()
        assert cert is not None and key is not None
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
        )

    def _channel_credentials(self) -> grpc.ChannelCredentials:
        cert, key, ca = self._read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    def _read(self) -> tuple[bytes | None, bytes | None, bytes | None]:
        return tuple(Path(p).read_bytes() if p else None for p in (self.cert, self.key, self.ca))  # type: ignore[return-value]


PLAINTEXT = TLSConfig()


def add_tls_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-cert", default=None, help="this process's TLS certificate (PEM); with --tls-key")
    p.add_argument("--tls-key", default=None, help="the certificate's private key (PEM)")
    p.add_argument(
        "--tls-ca",
        default=None,
        help="the CA that signs the cluster's certificates: servers require client certificates signed by it "
        "(mutual TLS) and clients verify servers against it",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="allow plaintext on a non-loopback listen address (logged as a warning); refused without it",
    )


def add_kv_secret_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--kv-secret",
        default=None,
        help=f"shared secret (16+ bytes) that KV peers prove with an HMAC (default: ${KV_SECRET_ENV})",
    )


def kv_secret(args: argparse.Namespace) -> bytes | None:
    value = getattr(args, "kv_secret", None) or os.environ.get(KV_SECRET_ENV) or None
    return value.encode() if value else None


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) is only reachable from this machine."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if not host:
        return False  # every interface
    try:
        addresses = {str(info[4][0]) for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)
