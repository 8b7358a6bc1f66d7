"""A reward service over HTTP (the ``remote_reward`` interface), with the standard library only.

    interface_args={"url": "http://127.0.0.1:8000/score", "timeout": 30, "retries": 3, "concurrency": 4,
                    "batch": 64}

Each request is a POST of JSON ``{"prompts": [...], "responses": [...], "records": [...]}`` (decoded texts, or
token id lists without a tokenizer; each prompt's dataset record) for up to ``batch`` sequences; the service
answers ``{"scores": [...]}`` (``{"rewards": [...]}`` as OpenRLHF's ``--remote_rm_url`` servers do is accepted
too), one number per sequence, in order. At most ``concurrency`` requests are in flight per worker.

``timeout`` is each request's deadline, from connecting to the answer's last byte: a service that sends its
headers and then drips the body a byte at a time is cut off there too (a socket timeout alone bounds only each
read). A request that misses its deadline, cannot connect, or gets a 5xx or 429 answer is tried again, up to
``retries`` more times with a doubling pause from ``backoff`` seconds, so a failing call ends within about
``timeout × (retries + 1)`` plus the pauses: once one request has failed, the queued ones are not sent. Any
other answer (another status, malformed JSON, the wrong number of scores, a score that is not a finite number
(NaN, Infinity), a body over ``max_bytes``, 16 MiB by default: scores are a few bytes each) fails at once; an
answer cut short of its Content-Length (the service closed the connection mid-reply) is tried again. Either way
the run stops with one error naming the URL. The URL is reached directly (no proxy, no redirects).

Data goes to the URL as JSON and only numbers come back: nothing received is executed. Point it at a service you
trust, on a network you trust (the request carries the prompts and responses in clear text over ``http``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import http.client
import json
import math
import socket
import threading
import time
import urllib.parse
from typing import Any, Mapping, Sequence

_RETRY_STATUS = {429, 500, 502, 503, 504}
_READ = 1 << 16  # bytes per read of the answer's body
_BIG = 2 ** 1023  # an int beyond +-2**1024 has no float (a float() of it raises OverflowError)


class _Retry(Exception):
    """A failure worth another try; its text says why."""


class _Late(_Retry):
    """A request that missed its deadline."""


class RewardServiceError(RuntimeError):
    """The reward service could not score a batch; the message names the URL and why."""


class RewardServiceTimeout(RewardServiceError):
    """Every try of a request missed its deadline (the service may be slow rather than gone)."""


@dataclasses.dataclass(frozen=True)
class RemoteReward:
    url: str
    timeout: float = 30.0
    retries: int = 3
    concurrency: int = 4
    batch: int = 64
    backoff: float = 0.5
    headers: Mapping[str, str] = dataclasses.field(default_factory=dict)
    max_bytes: int = 16 << 20

    @classmethod
    def of(cls, call: str, args: Mapping[str, Any]) -> "RemoteReward":
        """The service of call ``call``'s ``interface_args``, checked (one ValueError naming the call and field)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(args) - known)
        if unknown:
            raise ValueError(f"call {call!r}: remote_reward does not know interface_args {unknown}; it takes "
                             f"{', '.join(sorted(known))}")
        url = args.get("url")
        parsed = urllib.parse.urlparse(url) if isinstance(url, str) else None
        if parsed is None or parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"call {call!r}: remote_reward needs interface_args['url'], an http:// or https:// URL "
                             f"of the reward service (e.g. 'http://127.0.0.1:8000/score'); got {url!r}")
        for field, kind, low in (("timeout", (int, float), 0), ("backoff", (int, float), -1), ("retries", int, -1),
                                 ("concurrency", int, 0), ("batch", int, 0), ("max_bytes", int, 0)):
            v = args.get(field, getattr(cls, field))
            if isinstance(v, bool) or not isinstance(v, kind) or not v > low:
                bound = "positive" if low == 0 else "zero or more"
                raise ValueError(f"call {call!r}: remote_reward interface_args[{field!r}] must be {bound}, got {v!r}")
        headers = args.get("headers", {})
        if not isinstance(headers, Mapping) or not all(isinstance(k, str) and isinstance(v, str)
                                                       for k, v in headers.items()):
            raise ValueError(f"call {call!r}: remote_reward interface_args['headers'] must map header names to "
                             f"strings")
        return cls(**{k: v for k, v in args.items() if k in known})

    def score(self, prompts: Sequence[Any], responses: Sequence[Any], records: Sequence[Mapping[str, Any]]
              ) -> list[float]:
        """One score per sequence, in order: the batch split into requests of ``batch``, ``concurrency`` at a time."""
        chunks = [range(i, min(i + self.batch, len(prompts))) for i in range(0, len(prompts), self.batch)]
        with concurrent.futures.ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            futures = [pool.submit(self._request, {"prompts": [prompts[i] for i in c],
                                                   "responses": [responses[i] for i in c],
                                                   "records": [dict(records[i]) for i in c]}, len(c))
                       for c in chunks]
            done, _ = concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
            failed = next((f for f in futures if f in done and f.exception() is not None), None)
            if failed is not None:  # the call has failed: start none of the queued requests (each would take
                pool.shutdown(wait=False, cancel_futures=True)  # up to its own deadline and retries first)
                raise failed.exception()
            return [s for f in futures for s in f.result()]

    def _request(self, body: dict[str, Any], n: int) -> list[float]:
        data = json.dumps(body).encode()
        pause, why, late = self.backoff, "", False
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(pause)
                pause *= 2
            try:
                return self._parse(self._post(data), n)
            except _Retry as e:
                why, late = str(e), isinstance(e, _Late)
        error = RewardServiceTimeout if late else RewardServiceError
        raise error(f"reward service {self.url} failed {self.retries + 1} time(s): {why}; check that it is running "
                    f"and reachable, or raise interface_args 'timeout'/'retries'")

    def _post(self, data: bytes) -> bytes:
        """One POST and its whole answer within ``timeout`` seconds; raises ``_Retry`` or ``RewardServiceError``."""
        u = urllib.parse.urlsplit(self.url)
        kind = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
        conn = kind(u.hostname, u.port, timeout=self.timeout)
        late = threading.Event()

        def cut_off() -> None:  # the deadline: wake whatever read is waiting on the socket, at once
            late.set()
            sock = conn.sock
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

        timer = threading.Timer(self.timeout, cut_off)
        timer.daemon = True
        timer.start()
        try:
            conn.request("POST", (u.path or "/") + (f"?{u.query}" if u.query else ""), body=data,
                         headers={"Content-Type": "application/json", **self.headers})
            resp = conn.getresponse()
            if resp.status != 200:
                detail = resp.read(200).decode(errors="replace").strip()
                why = f"HTTP {resp.status} {resp.reason}" + (f": {detail}" if detail else "")
                if resp.status in _RETRY_STATUS:
                    raise _Retry(why)
                raise RewardServiceError(f"reward service {self.url} refused the request: {why}")
            size = resp.getheader("Content-Length")
            if size is not None and size.strip().isdigit() and int(size) > self.max_bytes:
                raise self._too_big(f"{int(size)} bytes")
            parts, got = [], 0
            while True:
                part = resp.read1(_READ)
                if not part:
                    break
                got += len(part)
                if got > self.max_bytes:
                    raise self._too_big(f"more than {self.max_bytes} bytes")
                parts.append(part)
            if late.is_set():  # the cut-off's end of stream, not the answer's
                raise _Late(f"no answer within timeout={self.timeout} s (a deadline for the whole request)")
            if resp.length:  # read1 ends quietly where the service closed the connection before its Content-Length
                raise _Retry(f"the connection closed after {got} of the answer's {got + resp.length} bytes")
            return b"".join(parts)
        except (http.client.HTTPException, OSError) as e:
            if late.is_set() or isinstance(e, (TimeoutError, socket.timeout)):
                raise _Late(f"no answer within timeout={self.timeout} s (a deadline for the whole request)") from None
            if isinstance(e, http.client.RemoteDisconnected):  # connected, then closed without a status line
                raise _Retry("the service closed the connection without answering") from None
            if isinstance(e, (ConnectionRefusedError, socket.gaierror)) or conn.sock is None:
                raise _Retry(f"cannot connect ({e})") from None
            raise _Retry(f"the connection failed ({e!r})") from None
        finally:
            timer.cancel()
            conn.close()

    def _too_big(self, what: str) -> RewardServiceError:
        return RewardServiceError(f"reward service {self.url} answered with {what}, over interface_args "
                                  f"max_bytes={self.max_bytes}; a score is a few bytes: check the service, or raise "
                                  f"'max_bytes'")

    def _parse(self, raw: bytes, n: int) -> list[float]:
        try:
            got = json.loads(raw)
        except (ValueError, RecursionError):  # RecursionError: arrays nested deeper than the parser goes
            raise RewardServiceError(f"reward service {self.url} answered with something other than JSON: "
                                     f"{raw[:80]!r}") from None
        scores = got.get("scores", got.get("rewards")) if isinstance(got, dict) else None
        if isinstance(scores, list) and len(scores) != n:
            raise RewardServiceError(f"reward service {self.url} answered {len(scores)} score(s) for {n} sequences "
                                     f"(a request carries up to interface_args 'batch' of them); it must answer one "
                                     f"number per sequence, in order")
        if not isinstance(scores, list) or not all(isinstance(s, (int, float)) and not isinstance(s, bool)
                                                   for s in scores):
            raise RewardServiceError(f"reward service {self.url} must answer {{\"scores\": [{n} numbers]}} for "
                                     f"{n} sequences; got {str(got)[:120]}")
        bad = next((s for s in scores if not (isinstance(s, float) or -_BIG < s < _BIG) or not math.isfinite(s)),
                   None)  # JSON's NaN, Infinity, 1e999 and integers past a float's range
        if bad is not None:
            raise RewardServiceError(f"reward service {self.url} answered the score {str(bad)[:40]} for sequence "
                                     f"{scores.index(bad)} of a request; a score must be a finite number")
        return [float(s) for s in scores]
