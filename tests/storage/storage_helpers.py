"""A fault-injecting HTTP proxy on loopback, between packer and the local S3 server.

Each client connection carries one request (forwarded with ``Connection: close``). GET
requests with a ``Range`` header (data reads) take the next fault from ``faults``: ``reset``
(the connection dropped with a TCP RST, no reply), ``503`` (S3's SlowDown reply), ``truncate``
(half the body, then the connection closed) or ``slow`` (the reply held ``slow_seconds``).
``delay`` holds every reply (a slow store); ``hook(method, path)`` runs before forwarding.
"""
from __future__ import annotations

import socket
import struct
import threading
import time
from collections import Counter
from typing import Callable, List, Optional, Tuple

SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
            b'<Message>Please reduce your request rate.</Message></Error>')


class FaultProxy:
    def __init__(self, upstream: Tuple[str, int]):
        self.upstream = upstream
        self.faults: List[str] = []
        self.delay = 0.0
        self.slow_seconds = 3.0
        self.hook: Optional[Callable[[str, str], None]] = None
        self.requests: Counter = Counter()
        self.lock = threading.Lock()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.closed = True
        self.server.close()

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            head, body = _read_request(conn)
            if head is None:
                return
            line = head.split(b"\r\n", 1)[0].decode("latin-1")
            method, path = line.split(" ")[:2]
            with self.lock:
                self.requests[method] += 1
                data_read = method == "GET" and b"\r\nrange:" in head.lower()
                fault = self.faults.pop(0) if data_read and self.faults else None
            if self.hook is not None:
                self.hook(method, path)
            if fault == "reset":
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                return
            if fault == "503":
                conn.sendall(b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
                             b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(SLOWDOWN) + SLOWDOWN)
                return
            time.sleep(self.delay + (self.slow_seconds if fault == "slow" else 0))
            reply = self._forward(head, body)
            if fault == "truncate":
                end = reply.index(b"\r\n\r\n") + 4
                reply = reply[:end + (len(reply) - end) // 2]
            conn.sendall(reply)
        except OSError:
            pass
        finally:
            conn.close()

    def _forward(self, head: bytes, body: bytes) -> bytes:
        lines = [h for h in head.split(b"\r\n") if not h.lower().startswith(b"connection:")]
        with socket.create_connection(self.upstream) as up:
            up.sendall(b"\r\n".join(lines[:-2] + [b"Connection: close", b"", b""]) + body)
            chunks = []
            while True:
                chunk = up.recv(1 << 20)
                if not chunk:
                    return b"".join(chunks)
                chunks.append(chunk)


def _read_request(conn: socket.socket):
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = conn.recv(65536)
        if not chunk:
            return None, b""
        buf += chunk
    head, body = buf.split(b"\r\n\r\n", 1)
    lines = head.split(b"\r\n")
    if any(h.lower().startswith(b"expect: 100-continue") for h in lines):
        conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")  # the client sends the body after this
        lines = [h for h in lines if not h.lower().startswith(b"expect:")]
    head = b"\r\n".join(lines) + b"\r\n\r\n"
    length = 0
    for h in lines:
        if h.lower().startswith(b"content-length:"):
            length = int(h.split(b":", 1)[1])
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            break
        body += chunk
    return head, body
