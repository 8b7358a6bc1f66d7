"""A reward service on loopback (stdlib http.server in a thread), for the remote-reward tests."""

from __future__ import annotations

import http.server
import json
import threading
import time


class Service:
    """Scores each response with ``score(response, record)`` (default: its number of tokens, token id lists in
    the runs here, times the record's "weight"); the first ``slow`` requests sleep ``delay`` s first, the first
    ``fail`` answer ``status``; it counts requests, their sizes and how many were in flight at once.

    ``overlap``: no request is answered before ``overlap`` requests have been in flight at once (or 30 s have
    passed, so a client that sends one at a time is seen as one, slowly). A client that keeps that many in flight
    is then seen to, however late its second thread starts (a fixed pause in each request made that a race).
    A request is out of flight once its answer is ready to be sent (not once this thread has finished sending it:
    on a loaded machine the client's next request arrived before that, and max_active was 3 in 8 of 150 runs)."""

    def __init__(self, slow: int = 0, delay: float = 0.0, fail: int = 0, status: int = 503, score=None,
                 overlap: int = 0) -> None:
        self.score = score or (lambda r, rec: len(r) * rec.get("weight", 1.0))
        self.slow, self.delay, self.fail, self.status = slow, delay, fail, status
        self.requests = 0
        self.sizes: list[int] = []
        self.active = self.max_active = 0
        self.lock = threading.Lock()
        self.overlapped = threading.Event()
        if overlap <= 1:
            self.overlapped.set()
        service = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with service.lock:
                    service.requests += 1
                    n = service.requests
                    service.active += 1
                    service.max_active = max(service.max_active, service.active)
                    if service.active >= overlap:
                        service.overlapped.set()
                in_flight = True

                def answered() -> None:  # before the answer leaves: the client may send its next request at once
                    nonlocal in_flight
                    with service.lock:
                        service.active -= in_flight
                        in_flight = False

                try:
                    service.overlapped.wait(30.0)
                    if n <= service.slow:
                        time.sleep(service.delay)
                    if n <= service.fail:
                        answered()
                        self.send_error(service.status, "busy")
                        return
                    time.sleep(0.05)  # a request takes a moment, as a real service's does
                    with service.lock:
                        service.sizes.append(len(body["responses"]))
                    scores = [service.score(r, rec) for r, rec in zip(body["responses"], body["records"])]
                    out = json.dumps({"scores": scores}).encode()
                    answered()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(out)))
                    self.end_headers()
                    self.wfile.write(out)
                except (BrokenPipeError, ConnectionResetError):  # the client timed out and left
                    pass
                finally:
                    answered()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/score"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "Service":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


class RawService:
    """A loopback HTTP service written on raw sockets, for answers http.server cannot give: after reading a
    request it sends ``head`` (status line and headers), then ``body`` ``drip`` bytes at a time with ``pause`` s
    between them, then closes. It counts the requests it accepted."""

    def __init__(self, head: bytes, body: bytes, drip: int = 1 << 20, pause: float = 0.0) -> None:
        import socket

        self.head, self.body, self.drip, self.pause = head, body, drip, pause
        self.requests = 0
        self.stop = threading.Event()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/score"
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.requests += 1
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn) -> None:
        with conn:
            try:
                conn.settimeout(5)
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                head, _, rest = data.partition(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                while len(rest) < length:
                    rest += conn.recv(65536)
                conn.sendall(self.head)
                for i in range(0, len(self.body), self.drip):
                    if self.stop.wait(self.pause if i else 0):
                        return
                    conn.sendall(self.body[i:i + self.drip])
            except OSError:  # the client gave up and closed
                pass

    def __enter__(self) -> "RawService":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.sock.close()
