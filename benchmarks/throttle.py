"""A bandwidth-throttling TCP proxy on loopback, and a throttled S3 in a process of its own.

``ThrottledProxy(upstream_url, rate=...)`` listens on ``127.0.0.1`` (a free port) and
relays every accepted connection byte for byte to one upstream (a moto S3 server in the
benchmarks): it speaks TCP, not HTTP, so signatures, chunked bodies and keep-alive pass
through untouched. Each direction has **one token bucket shared by every connection**:
uploads (client to upstream) together get at most ``rate`` bytes per second, and so do
downloads, like one link of that bandwidth between a host and its object store.

``throttled_s3(rate)`` starts a moto server and a proxy in front of it in a **child
process** and yields a ``ThrottledS3``: the proxy's URL, moto's own (unthrottled) and the
proxy's byte counters. The S3 side's CPU
(moto parses, hashes and stores every byte) then does not share this process's GIL with
the client being measured, as a remote object store would not.

Usage::

    with throttled_s3(50e6) as s3:
        client = boto3.client("s3", endpoint_url=s3.endpoint)  # ~50 MB/s each way
"""

from __future__ import annotations

import multiprocessing
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from urllib.parse import urlsplit

MB = 1_000_000
DEFAULT_RATE = 50 * MB  # bytes per second, each way
_RECV = 64 * 1024


class TokenBucket:
    """``rate`` bytes per second with bursts of up to ``burst`` bytes; thread-safe, FIFO.

    ``take(n)`` reserves ``n`` bytes and sleeps until the bucket has paid for them, so
    concurrent takers share the rate in the order they asked.
    """

    def __init__(self, rate: float, burst: int) -> None:
        if rate <= 0 or burst <= 0:
            raise ValueError(f"rate and burst must be > 0, not {rate!r} and {burst!r}")
        self.rate = float(rate)
        self.burst = burst
        self._lock = threading.Lock()
        self._paid_until = time.monotonic()  # when every byte reserved so far is paid for

    def take(self, n: int) -> None:
        """Block until ``n`` more bytes may pass."""
        with self._lock:
            now = time.monotonic()
            self._paid_until = max(self._paid_until, now - self.burst / self.rate) + n / self.rate
            wait = self._paid_until - now
        if wait > 0:
            time.sleep(wait)


class ThrottledProxy:
    """A TCP relay on 127.0.0.1 to ``upstream_url``, ``rate`` bytes/s each way (all connections).

    Thread-safe; ``start``/``stop`` or a ``with`` block. ``bytes_up`` and ``bytes_down``
    count what was relayed each way.
    """

    def __init__(self, upstream_url: str, *, rate: float = DEFAULT_RATE, burst: int = 2 * MB) -> None:
        parts = urlsplit(upstream_url)
        if parts.hostname is None or parts.port is None:
            raise ValueError(f"upstream must be http://host:port, not {upstream_url!r}")
        self.upstream = (parts.hostname, parts.port)
        self.rate = rate
        self._up = TokenBucket(rate, burst)
        self._down = TokenBucket(rate, burst)
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self.bytes_up = 0
        self.bytes_down = 0

    def start(self) -> ThrottledProxy:
        listener = socket.create_server(("127.0.0.1", 0))
        self._listener = listener
        self._thread = threading.Thread(target=self._accept, name="throttle-accept", daemon=True)
        self._thread.start()
        return self

    @property
    def endpoint_url(self) -> str:
        if self._listener is None:
            raise RuntimeError("the proxy is not running")
        host, port = self._listener.getsockname()[:2]
        return f"http://{host}:{port}"

    def stop(self) -> None:
        """Close the listener and every open connection."""
        listener, self._listener = self._listener, None
        if listener is None:
            return
        _close(listener)  # shutdown wakes the accept() blocked on it (close alone does not)
        with self._lock:
            sockets, self._open = list(self._open), set()
        for sock in sockets:
            _close(sock)
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> ThrottledProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _accept(self) -> None:
        listener = self._listener
        while listener is not None:
            try:
                client, _ = listener.accept()
            except OSError:  # closed by stop()
                return
            try:
                upstream = socket.create_connection(self.upstream)
            except OSError:
                _close(client)
                continue
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._open.update((client, upstream))
            threading.Thread(target=self._relay, args=(client, upstream), name="throttle-relay",
                             daemon=True).start()

    def _relay(self, client: socket.socket, upstream: socket.socket) -> None:
        """Pump both ways (uploads on a thread of their own), then close both sockets."""
        uploads = threading.Thread(target=self._pump, args=(client, upstream, self._up, True),
                                   name="throttle-up", daemon=True)
        uploads.start()
        self._pump(upstream, client, self._down, False)
        uploads.join()
        with self._lock:
            self._open.difference_update((client, upstream))
        _close(client)
        _close(upstream)

    def _pump(self, src: socket.socket, dst: socket.socket, bucket: TokenBucket, up: bool) -> None:
        try:
            while data := src.recv(_RECV):
                bucket.take(len(data))
                with self._lock:  # counted before they are sent: a reader of the counters who
                    if up:        # has received the bytes sees them counted
                        self.bytes_up += len(data)
                    else:
                        self.bytes_down += len(data)
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)  # pass the half-close on
        except OSError:
            _close(src)
            _close(dst)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def _serve(rate: float, conn: Connection) -> None:
    """Child process: moto + a proxy in front of it; answers "counters" until told to stop."""
    from casckpt.testing.s3 import moto_server

    with moto_server() as direct, ThrottledProxy(direct, rate=rate) as proxy:
        conn.send((proxy.endpoint_url, direct))
        while conn.recv() == "counters":
            conn.send((proxy.bytes_up, proxy.bytes_down))
    conn.close()


class ThrottledS3:
    """A moto S3 server behind a proxy in a child process (made by :func:`throttled_s3`).

    ``endpoint``: the throttled URL; ``direct``: moto's own. ``counters()``: bytes the
    proxy relayed so far, ``(up, down)``. Not thread-safe (one pipe to the child).
    """

    def __init__(self, endpoint: str, direct: str, conn: Connection) -> None:
        self.endpoint = endpoint
        self.direct = direct
        self._conn = conn

    def counters(self) -> tuple[int, int]:
        """Bytes relayed so far: (client to S3, S3 to client), HTTP headers included."""
        self._conn.send("counters")
        up, down = self._conn.recv()
        return int(up), int(down)


@contextmanager
def throttled_s3(rate: float = DEFAULT_RATE) -> Iterator[ThrottledS3]:
    """A moto S3 server behind a ``rate`` bytes/s proxy, both in a child process.

    Use it inside ``casckpt.testing.s3.fake_aws_environment`` (the clients need fake
    credentials). The child is stopped (killed if it does not stop) on leaving.
    """
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_serve, args=(rate, child), name="throttled-s3", daemon=True)
    process.start()
    child.close()
    try:
        if not parent.poll(60):
            raise RuntimeError("the throttled S3 server did not start within 60 s")
        endpoint, direct = parent.recv()
        yield ThrottledS3(endpoint, direct, parent)
    finally:
        try:
            parent.send("stop")
        except OSError:
            pass
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
            process.join()
        parent.close()
