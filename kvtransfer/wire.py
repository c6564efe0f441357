"""Framed messages over TCP: the control channel of every transport, and tcp's data path.

    frame: | magic "PDKV" | version u8 | kind u8 | meta_len u32 | payload_len u64 | meta (JSON) | payload |

A payload of payload_len bytes follows the frame's meta; the reader reads it with `recv_into`, so
bytes land where the caller points them (a pool block, a staging buffer), never in a Python object.
"""

from __future__ import annotations

import base64
import contextlib
import enum
import json
import select
import socket
import ssl
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtransfer.auth import NO_AUTH, PeerAuth, new_nonce
from kvtransfer.base import KVTransferError

MAGIC = b"PDKV"
VERSION = 1
_FRAME = struct.Struct("!4sBBIQ")
MAX_META = 1 << 24
HANDSHAKE_S = 10.0  # a connection that has not completed TLS and HELLO by then is dropped


def pack_ids(ids: Sequence[int] | np.ndarray) -> str:
    """Block ids as base64 of little-endian int32: a 256-id list costs ~2 us to encode, JSON's ints ~15."""
    return base64.b64encode(np.asarray(ids, dtype="<i4").tobytes()).decode()


def unpack_ids(text: object) -> list[int] | None:
    """pack_ids' inverse; None when `text` is not such a string (the caller refuses the request)."""
    if not isinstance(text, str):
        return None
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError:
        return None
    if len(raw) % 4:
        return None
    return np.frombuffer(raw, dtype="<i4").tolist()


class Kind(enum.IntEnum):
    HELLO = 1  # sender -> receiver: {layout, ...}
    WELCOME = 2  # receiver -> sender: {} or {error}
    BEGIN = 3  # sender -> receiver: {request_id, dst, nbytes}, tcp: payload follows
    READY = 4  # receiver -> sender (cuda_ipc): {request_id} or {request_id, error}
    DONE = 5  # sender -> receiver (cuda_ipc): {request_id, nbytes} or {request_id, error}
    ACK = 6  # receiver -> sender: {request_id} or {request_id, error}
    RELEASE = 7  # sender -> receiver (cuda_ipc): {request_id, reason}: a granted request it will not write
    REVOKE = 8  # receiver -> sender (cuda_ipc): {request_id}: the request was cancelled, do not write it
    CHALLENGE = 9  # receiver -> sender, first: {nonce} the HELLO's HMAC covers (kvtransfer/auth.py)


@dataclass
class Message:
    kind: Kind
    meta: dict[str, Any]
    payload_len: int


class Channel:
    """One TCP connection. One thread reads; any number may send (a frame goes out whole)."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self.welcome: dict[str, Any] = {}  # a sender's: what the receiver's WELCOME said
        self._send_lock = threading.Lock()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    @classmethod
    def connect(cls, host: str, port: int, timeout: float) -> Channel:
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as e:
            raise KVTransferError(f"cannot connect to kv receiver at {host}:{port}: {e}") from e
        return cls(sock, f"{host}:{port}")

    @classmethod
    def greet(
        cls,
        host: str,
        port: int,
        timeout: float,
        io_timeout: float,
        hello: dict[str, Any],
        auth: PeerAuth = NO_AUTH,
    ) -> Channel:
        """A sender's connection, past the handshake (kvtransfer/auth.py): TLS when `auth` has it,
        CHALLENGE -> HELLO `hello` (signed) -> WELCOME (checked, kept as `welcome`), or KVTransferError with
        the reason it failed (the connection closed)."""
        ch = cls.connect(host, port, timeout)
        try:
            ch.settimeout(max(timeout, io_timeout))
            if auth.tls:
                ch.start_tls(auth.client_context(), server_side=False, hostname=host)
            nonce_r = ch.expect(Kind.CHALLENGE).get("nonce")
            nonce_s = new_nonce()
            ch.send(Kind.HELLO, auth.signed("hello", nonce_r, {**hello, "nonce": nonce_s}))
            welcome = ch.expect(Kind.WELCOME)
            if "error" in welcome:
                raise KVTransferError(f"kv receiver at {ch.peer} refused the connection: {welcome['error']}")
            auth.check_mac("welcome", nonce_s, welcome)
        except BaseException:
            ch.close()
            raise
        ch.welcome = welcome
        return ch

    def start_tls(self, context: ssl.SSLContext, server_side: bool, hostname: str | None = None) -> None:
        """Wrap the connection in TLS (the handshake runs now, within the socket's timeout); KVTransferError
        if it fails: no certificate, one signed by another CA, a wrong name."""
        try:
            self.sock = context.wrap_socket(self.sock, server_side=server_side, server_hostname=hostname)
        except (ssl.SSLError, OSError) as e:
            raise KVTransferError(f"TLS handshake with {self.peer} failed: {e}") from e

    def settimeout(self, timeout: float | None) -> None:
        self.sock.settimeout(timeout)

    def send(self, kind: Kind, meta: dict[str, Any], payload: memoryview | None = None) -> None:
        body = json.dumps(meta, separators=(",", ":")).encode()
        n = payload.nbytes if payload is not None else 0
        try:
            with self._send_lock:
                self.sock.sendall(_FRAME.pack(MAGIC, VERSION, kind, len(body), n) + body)
                if payload is not None:
                    self.sock.sendall(payload)
        except OSError as e:
            raise KVTransferError(f"kv connection to {self.peer} broke while sending: {e}") from e

    def recv(self) -> Message:
        """The next frame's header and meta; its payload, if any, is left for `recv_into`."""
        head = self._exact(_FRAME.size)
        magic, version, kind, meta_len, payload_len = _FRAME.unpack(head)
        if magic != MAGIC or version != VERSION or meta_len > MAX_META or kind not in Kind._value2member_map_:
            raise KVTransferError(
                f"kv peer {self.peer} sent a bad frame (magic {magic!r}, version {version})"
            )
        try:
            meta = json.loads(self._exact(meta_len)) if meta_len else {}
        except ValueError as e:
            raise KVTransferError(f"kv peer {self.peer} sent bad JSON: {e}") from e
        return Message(Kind(kind), meta, payload_len)

    def expect(self, kind: Kind) -> dict[str, Any]:
        msg = self.recv()
        if msg.kind != kind or msg.payload_len:
            raise KVTransferError(f"kv peer {self.peer} sent {msg.kind.name}, expected {kind.name}")
        return msg.meta  # may hold "error": the peer's refusal, for the caller to raise

    def recv_into(self, view: memoryview) -> None:
        """Fill `view` completely or raise KVTransferError (closed early, timeout)."""
        got, total = 0, view.nbytes
        try:
            while got < total:
                n = self.sock.recv_into(view[got:], total - got)
                if n == 0:
                    raise KVTransferError(
                        f"kv peer {self.peer} closed the connection after {got} of {total} bytes"
                    )
                got += n
        except OSError as e:
            raise KVTransferError(
                f"kv connection to {self.peer} broke after {got} of {total} bytes: {e}"
            ) from e

    def _exact(self, n: int) -> bytes:
        buf = bytearray(n)
        self.recv_into(memoryview(buf))
        return bytes(buf)

    def peer_closed(self) -> bool:
        """Whether the peer has closed the connection (EOF next, with no message before it); for a reader
        thread that waits on something else meanwhile. Never blocks, never consumes a byte."""
        if isinstance(self.sock, ssl.SSLSocket) and self.sock.pending():
            return False  # a decrypted record waits to be read
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
            if not readable:
                return False  # nothing to read: open
            # the raw socket's bytes (an SSLSocket refuses flags): EOF there is EOF of the connection
            return socket.socket.recv(self.sock, 1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except (BlockingIOError, InterruptedError):
            return False
        except (OSError, ValueError):  # closed here meanwhile
            return True

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


class ControlServer:
    """Accepts connections on host:port; runs `handler(channel)` on a daemon thread per connection."""

    def __init__(self, host: str, port: int, handler: Callable[[Channel], None], name: str) -> None:
        self._handler = handler
        self._name = name
        self._listener = socket.create_server((host, port), reuse_port=False)
        self.port: int = self._listener.getsockname()[1]
        self._channels: set[Channel] = set()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept_loop, name=f"{name}-accept", daemon=True).start()

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, addr = self._listener.accept()
            except OSError:
                return  # listener closed
            ch = Channel(sock, f"{addr[0]}:{addr[1]}")
            with self._lock:
                if self._closed:
                    ch.close()
                    return
                self._channels.add(ch)
                thread = threading.Thread(
                    target=self._serve, args=(ch,), name=f"{self._name}-{ch.peer}", daemon=True
                )
                self._threads = [t for t in self._threads if t.is_alive()] + [thread]
            thread.start()

    def _serve(self, ch: Channel) -> None:
        try:
            self._handler(ch)
        except (KVTransferError, OSError):
            pass  # the handler failed its request already; the peer is gone or misbehaved, or close() shut the socket
        finally:
            with self._lock:
                self._channels.discard(ch)
            ch.close()

    def close(self, join_timeout: float = 5.0) -> None:
        """Stop accepting, close every connection, and wait (bounded) for the handler threads to end."""
        with self._lock:
            self._closed = True
            channels, threads = list(self._channels), list(self._threads)
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
        self._listener.close()
        for ch in channels:
            ch.close()
        for t in threads:
            if t is not threading.current_thread():  # close() may come from an on_done callback
                t.join(join_timeout)
