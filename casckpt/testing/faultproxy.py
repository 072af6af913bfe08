"""A fault-injecting HTTP/1.1 forwarding proxy for tests and benchmarks of network
blob stores (tests/ and benchmarks/chaos.py).

``FaultProxy`` listens on ``127.0.0.1`` (a free port) and relays every request
to one upstream HTTP server (the moto S3 server of the tests): method, path,
query, headers (``Host`` unchanged, so SigV4 signatures stay valid) and the raw
request body, chunked framing included. Tests point a client at
``proxy.endpoint_url`` and program faults:

``fail_next``, ``cut_next_upload``, ``cut_next_download``, ``corrupt_next_download``,
``drop_next_response``, ``stall_next`` and ``blackhole_next`` (each method says what the
client and the upstream see).

Faults count requests, not time: a window of outage is ``n=2**62`` of a kind,
then :meth:`FaultProxy.clear_faults` when the window ends.

Each fault applies to the next ``n`` requests it matches (by method, and by a
substring of the path and query), in the order faults were added. ``records``,
``requests_by_method`` and the byte counters say what went through.

The proxy is bounded: handler sockets time out, at most ``max_records`` request
records are kept, and ``stop()`` (or leaving the ``with`` block) shuts the
listener and every open client connection.
"""

from __future__ import annotations

import http.client
import socket
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from casckpt.errors import InvalidArgumentError

_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-connection", "proxy-authorization", "te",
     "trailer", "upgrade", "expect"}
)
_BODYLESS_STATUS = frozenset({204, 304})
_MESSAGES = {
    "SlowDown": "Please reduce your request rate.",
    "InternalError": "We encountered an internal error. Please try again.",
    "ServiceUnavailable": "Service is unable to handle request.",
    "AccessDenied": "Access Denied",
}


@dataclass
class _Fault:
    kind: str
    remaining: int
    methods: frozenset[str] | None
    path_contains: str | None
    status: int = 503
    code: str = "SlowDown"
    fraction: float = 0.5
    seconds: float = 0.0

    def matches(self, method: str, path: str) -> bool:
        if self.remaining <= 0:
            return False
        if self.methods is not None and method not in self.methods:
            return False
        return self.path_contains is None or self.path_contains in path


@dataclass(frozen=True)
class SeenRequest:
    """One request the proxy saw. ``headers`` has lower-cased names."""

    method: str
    path: str
    headers: dict[str, str]
    request_bytes: int
    status: int | None
    response_bytes: int
    fault: str | None


class FaultProxy:
    """Forwarding proxy with a programmable fault plan. Thread-safe."""

    def __init__(self, upstream_url: str, *, timeout: float = 30.0,
                 max_records: int = 100_000) -> None:
        parts = urlsplit(upstream_url)
        if parts.scheme != "http" or parts.hostname is None or parts.port is None:
            raise ValueError(f"upstream must be http://host:port, not {upstream_url!r}")
        self.upstream = (parts.hostname, parts.port)
        self.timeout = timeout
        self._lock = threading.Lock()
        self._faults: list[_Fault] = []
        self._records: deque[SeenRequest] = deque(maxlen=max_records)
        self._open: set[socket.socket] = set()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # lifecycle -------------------------------------------------------------

    def start(self) -> FaultProxy:
        proxy = self

        class Handler(_Handler):
            owner = proxy
            timeout = proxy.timeout

        server = _Server(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name="faultproxy",
                                        kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            sockets, self._open = list(self._open), set()
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def endpoint_url(self) -> str:
        if self._server is None:
            raise InvalidArgumentError("the proxy is not running: start() it, or use it in a with block")
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    # fault plan ------------------------------------------------------------

    def _add(self, fault: _Fault) -> None:
        with self._lock:
            self._faults.append(fault)

    @staticmethod
    def _methods(methods: Iterable[str] | None) -> frozenset[str] | None:
        return None if methods is None else frozenset(m.upper() for m in methods)

    def fail_next(self, n: int = 1, *, status: int = 503, code: str = "SlowDown",
                  methods: Iterable[str] | None = None, path_contains: str | None = None) -> None:
        """Answer the next ``n`` matching requests with ``status`` and an S3-style XML error
        ``code`` instead of forwarding them (the upstream never sees them)."""
        self._add(_Fault("status", n, self._methods(methods), path_contains,
                         status=status, code=code))

    def refuse_writes(self) -> None:
        """From now on (until :meth:`clear_faults`) answer every PUT, POST and DELETE with 403
        AccessDenied, as S3 does for credentials with only GetObject/ListBucket."""
        self.fail_next(2**62, status=403, code="AccessDenied", methods=("PUT", "POST", "DELETE"))

    def cut_next_upload(self, n: int = 1, *, fraction: float = 0.5,
                        methods: Iterable[str] | None = ("PUT", "POST"),
                        path_contains: str | None = None) -> None:
        """Read ``fraction`` of the next ``n`` matching request bodies, then hang up without
        answering (the upstream never sees them)."""
        self._add(_Fault("cut_upload", n, self._methods(methods), path_contains,
                         fraction=fraction))

    def cut_next_download(self, n: int = 1, *, fraction: float = 0.5,
                          methods: Iterable[str] | None = ("GET",),
                          path_contains: str | None = None) -> None:
        """Forward the next ``n`` matching requests, send the status and headers with the full
        ``Content-Length`` and ``fraction`` of the body, then hang up."""
        self._add(_Fault("cut_download", n, self._methods(methods), path_contains,
                         fraction=fraction))

    def corrupt_next_download(self, n: int = 1, *, methods: Iterable[str] | None = ("GET",),
                              path_contains: str | None = None) -> None:
        """Flip one byte in the middle of the next ``n`` matching response bodies (damage in
        transit that only checksums catch)."""
        self._add(_Fault("corrupt_download", n, self._methods(methods), path_contains))

    def drop_next_response(self, n: int = 1, *, methods: Iterable[str] | None = None,
                           path_contains: str | None = None) -> None:
        """Forward the next ``n`` matching requests (the upstream acts on them), then hang up
        instead of answering: a response lost on the way back."""
        self._add(_Fault("drop_response", n, self._methods(methods), path_contains))

    def stall_next(self, n: int = 1, *, seconds: float,
                   methods: Iterable[str] | None = None,
                   path_contains: str | None = None) -> None:
        """Wait ``seconds`` before forwarding the next ``n`` matching requests (client read
        timeouts)."""
        self._add(_Fault("stall", n, self._methods(methods), path_contains, seconds=seconds))

    def blackhole_next(self, n: int = 1, *, seconds: float,
                       methods: Iterable[str] | None = None,
                       path_contains: str | None = None) -> None:
        """Swallow the next ``n`` matching requests: no answer for ``seconds``, then hang up
        (an endpoint gone dark: the client sees nothing until its own read timeout)."""
        self._add(_Fault("blackhole", n, self._methods(methods), path_contains, seconds=seconds))

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    def pending_faults(self) -> int:
        """How many programmed faults have not fired yet."""
        with self._lock:
            return sum(max(f.remaining, 0) for f in self._faults)

    def _take_fault(self, method: str, path: str) -> _Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault.matches(method, path):
                    fault.remaining -= 1
                    return fault
            return None

    # counters --------------------------------------------------------------

    @property
    def records(self) -> list[SeenRequest]:
        with self._lock:
            return list(self._records)

    def reset_counters(self) -> None:
        with self._lock:
            self._records.clear()

    def requests_by_method(self) -> Counter[str]:
        return Counter(r.method for r in self.records)

    def response_bytes_by_method(self) -> Counter[str]:
        """Response body bytes sent to clients, by method."""
        out: Counter[str] = Counter()
        for r in self.records:
            out[r.method] += r.response_bytes
        return out

    def faults_fired(self) -> Counter[str]:
        return Counter(r.fault for r in self.records if r.fault is not None)

    def _record(self, record: SeenRequest) -> None:
        with self._lock:
            self._records.append(record)

    def _track(self, sock: socket.socket, add: bool) -> None:
        with self._lock:
            if add:
                self._open.add(sock)
            else:
                self._open.discard(sock)


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        # a client that hangs up (its own timeout, or a process killed mid-request, as the
        # chaos soak does hundreds of times) is expected here, not a traceback on stderr
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)  # type: ignore[arg-type]


class _Handler(BaseHTTPRequestHandler):
    owner: FaultProxy
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        self.owner._track(self.connection, True)

    def finish(self) -> None:
        self.owner._track(self.connection, False)
        try:
            super().finish()
        except OSError:
            pass

    def log_message(self, format: str, *args: object) -> None:
        return None

    def do_GET(self) -> None:
        self._relay()

    do_PUT = do_POST = do_DELETE = do_HEAD = do_GET

    # request side ----------------------------------------------------------

    def _read_body(self, limit: int | None = None) -> tuple[bytes, int]:
        """Return (raw body bytes as framed on the wire, payload length).

        With ``limit``, stop after about that many payload bytes (for a cut).
        """
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            return self._read_chunked(limit)
        length = int(self.headers.get("Content-Length") or 0)
        if limit is not None:
            length = min(length, limit)
        raw = self.rfile.read(length) if length else b""
        return raw, len(raw)

    def _read_chunked(self, limit: int | None) -> tuple[bytes, int]:
        raw = bytearray()
        payload = 0
        while True:
            line = self.rfile.readline(65537)
            if not line:
                raise ConnectionError("client closed inside a chunked body")
            raw += line
            size = int(line.split(b";", 1)[0].strip(), 16)
            if size == 0:
                while True:
                    trailer = self.rfile.readline(65537)
                    raw += trailer
                    if trailer in (b"\r\n", b"\n", b""):
                        return bytes(raw), payload
            if limit is not None and payload + size > limit:
                raw += self.rfile.read(max(limit - payload, 0))
                return bytes(raw), limit
            raw += self.rfile.read(size + 2)
            payload += size

    # relay -----------------------------------------------------------------

    def _relay(self) -> None:
        method, path = self.command, self.path
        headers = {k.lower(): v for k, v in self.headers.items()}
        fault = self.owner._take_fault(method, path)
        kind = fault.kind if fault is not None else None

        if fault is not None and fault.kind == "cut_upload":
            declared = int(self.headers.get("Content-Length") or 0)
            raw, n = self._read_body(limit=int(declared * fault.fraction) if declared else 1)
            self.owner._record(SeenRequest(method, path, headers, n, None, 0, kind))
            self.close_connection = True
            return

        raw, n = self._read_body()
        if fault is not None and fault.kind == "status":
            self._answer_error(fault, method, path, headers, n)
            return
        if fault is not None and fault.kind == "stall":
            time.sleep(fault.seconds)
        if fault is not None and fault.kind == "blackhole":
            self.owner._record(SeenRequest(method, path, headers, n, None, 0, kind))
            time.sleep(fault.seconds)
            self.close_connection = True
            return

        status, reason, resp_headers, body = self._forward(method, path, raw)
        if fault is not None and fault.kind == "drop_response":
            self.owner._record(SeenRequest(method, path, headers, n, status, 0, kind))
            self.close_connection = True
            return

        sent = body
        if fault is not None and fault.kind == "cut_download":
            sent = body[: int(len(body) * fault.fraction)]
            self.close_connection = True
        if fault is not None and fault.kind == "corrupt_download" and body:
            middle = len(body) // 2
            sent = body[:middle] + bytes([body[middle] ^ 0xFF]) + body[middle + 1:]
        # Record before answering, so a client that has its answer sees the record.
        self.owner._record(SeenRequest(method, path, headers, n, status, len(sent), kind))
        self.send_response_only(status, reason)
        for name, value in resp_headers:
            if name.lower() in _HOP_BY_HOP or name.lower() == "transfer-encoding":
                continue
            if name.lower() == "content-length" and method != "HEAD":
                continue
            self.send_header(name, value)
        if method != "HEAD" and status not in _BODYLESS_STATUS:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self._send_body(sent)

    def _forward(self, method: str, path: str,
                 raw: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
        host, port = self.owner.upstream
        conn = http.client.HTTPConnection(host, port, timeout=self.owner.timeout)
        try:
            conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
            for name, value in self.headers.items():
                if name.lower() not in _HOP_BY_HOP:
                    conn.putheader(name, value)
            conn.endheaders()
            if raw:
                conn.send(raw)
            resp = conn.getresponse()
            body = resp.read()
            return resp.status, resp.reason, resp.getheaders(), body
        finally:
            conn.close()

    def _answer_error(self, fault: _Fault, method: str, path: str,
                      headers: dict[str, str], n: int) -> None:
        message = _MESSAGES.get(fault.code, "Injected fault.")
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{fault.code}</Code><Message>{message}</Message>"
            "<RequestId>faultproxy</RequestId></Error>"
        ).encode()
        self.send_response_only(fault.status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("x-amz-request-id", "faultproxy")
        if method == "HEAD":
            self.send_header("Content-Length", "0")
            body = b""
        else:
            self.send_header("Content-Length", str(len(body)))
        self.owner._record(SeenRequest(method, path, headers, n, fault.status, len(body),
                                         "status"))
        self.end_headers()
        self._send_body(body)

    def _send_body(self, body: bytes) -> None:
        try:
            self.wfile.write(body)
            self.wfile.flush()
        except OSError:
            self.close_connection = True
