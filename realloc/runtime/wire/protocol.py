"""The wire protocol between the master worker and the model workers (realhf.txt §3, §6).

A message is two ZMQ frames: ``[payload, mac]``.

- ``payload`` is a msgpack map ``{"v", "run", "src", "dst", "seq", "type", "body"}``; ``body`` is the
  fields of one of the typed messages below. msgpack carries only plain data (no pickle, no code).
- ``mac`` is HMAC-SHA256 over the payload with the per-run secret. The secret reaches workers through a
  0600 file or the environment (``REALLOC_SECRET_FILE`` / ``REALLOC_SECRET``), never over the wire.
- Replay protection: every sender numbers its messages with a strictly increasing ``seq``; a receiver
  drops any message whose ``seq`` is not above the last one it accepted from that sender over that
  connection. The counter is per (connection, sender): a message that arrives over another connection
  (dropped by the master's ownership check) cannot move the real sender's counter and make its next
  messages look replayed. ``run`` and ``dst`` stop a message from being replayed into another run or at
  another receiver.
- Identities: a worker's sockets connect as ``<name>.<random>`` (``socket_identity``). The master binds
  each name to the socket identity of the first *signed* message from it and routes to that one only,
  so a local process cannot take a worker's name by connecting first.
- Size: every socket drops frames above ``MAX_PAYLOAD_BYTES`` before reading them (``limit_frame_size``),
  so a huge frame costs no memory. That bounds a frame, not a message (libzmq has no limit on frames per
  message): the transport's CURVE handshake (``curve.py``) keeps every frame of a process without the
  run's keys out of the master's memory.

Anything that fails these checks raises ``ProtocolError``; the receive loops log it and carry on, so a
stray or forged message never crashes a process.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import os
import secrets
import stat
from pathlib import Path
from typing import Literal

import msgpack
import zmq
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

PROTOCOL_VERSION = 1
MAC_BYTES = 32
SECRET_BYTES = 32
# Requests and replies carry metadata only; anything bigger is a bug or an attack.
MAX_PAYLOAD_BYTES = 8 << 20
# A failed request's error text is cut to this many characters (its head and tail): an exception's message
# can hold a whole tensor, and the reply must stay far below MAX_PAYLOAD_BYTES to reach the master.
MAX_ERROR_CHARS = 16_000
SECRET_FILE_ENV = "REALLOC_SECRET_FILE"
SECRET_ENV = "REALLOC_SECRET"

log = logging.getLogger("realloc.protocol")


class ProtocolError(Exception):
    """A message that must be dropped: malformed, unauthenticated, replayed or misaddressed."""


class MessageTooLarge(ValueError):
    """An outgoing message over MAX_PAYLOAD_BYTES: every receiver would drop it, so it is not sent."""


def cap_text(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """``text`` if it fits in ``limit`` characters, else its head and tail (where a traceback says the most)."""
    if len(text) <= limit:
        return text
    half = (limit - 64) // 2  # room for the marker, so the result fits in limit (capping again changes nothing)
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters cut ...]\n{text[-half:]}"


class _Msg(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


# -- shared pieces ------------------------------------------------------------------------------------------
class TensorMeta(_Msg):
    """One tensor of a data key; ``shape`` excludes the leading per-sequence dimension."""

    name: str
    dtype: str
    shape: list[int]


class Broadcast(_Msg):
    """One piece of a data transfer: ``src`` sends sequences [lo, hi) of the batch to every rank in ``dsts``."""

    src: int
    dsts: list[int]
    lo: int
    hi: int


# -- master -> worker requests. ``req`` is the global order every worker executes its requests in ------------
class Setup(_Msg):
    type: Literal["setup"] = "setup"
    req: int
    resume: str | None = None  # checkpoint directory to load after building the models
    total_iterations: int = 0  # the learning-rate schedule's horizon in iterations (the run's end unless resumed)
    verify_checkpoint: bool = True  # check the SHA-256 of every checkpoint file read (checkpoint.py)
    start_iteration: int = 0  # 0-based; trained parameters start at this version (train steps applied)


class RunCall(_Msg):
    type: Literal["call"] = "call"
    req: int
    call: str
    iteration: int
    eval_batch: int = -1  # >= 0: an evaluation pass over eval batch j (realloc/runtime/inputs/evaluation.py)
    layout_call: str = ""  # run ``call``'s interface in this call's layout (evaluation generates at home)
    # Each dp rank's [lo, hi) of the batch when the master balanced them by tokens (graph/row_balance.py);
    # empty: the even split (transfer_plan.dp_ranges)
    ranges: list[list[int]] = Field(default_factory=list)
    # Or each dp rank's rows as a list of sequence indices: one part of a call streamed around a generation's tail
    # migration (runtime/control/master_tail.py); empty: ``ranges``
    rows: list[list[int]] = Field(default_factory=list)
    # A fused train pair (plan field 'fused', docs/fused-training.md): ``call`` and ``fused_with`` run as one
    # schedule; ``fused_ranges`` are the second call's ``ranges``, ``fused_order`` the passes per stage group
    # as (model 0/1, backward 0/1, micro-batch) lists (estimator/fused_cost.FusedSchedule.order)
    fused_with: str = ""
    fused_ranges: list[list[int]] = Field(default_factory=list)
    fused_rows: list[list[int]] = Field(default_factory=list)  # the second call's ``rows`` (token-balanced)
    fused_order: list[list[list[int]]] = Field(default_factory=list)


# The reply to a fused RunCall carries the second call's stats under this prefix (worker_fused.py, master_fused.py)
FUSED_SECOND_STATS = "fused.second/"


class Reallocate(_Msg):
    type: Literal["realloc"] = "realloc"
    req: int
    model: str
    src_call: str  # the call whose layout holds the parameters now
    dst_call: str  # the call whose layout needs them next
    iteration: int
    drop_src: bool = True
    version: int = -1  # a snapshot (bounded staleness): the parameter version it copies (train steps applied)


class TransferData(_Msg):
    type: Literal["data"] = "data"
    req: int
    key: str
    iteration: int
    dst_call: str
    tensors: list[TensorMeta]
    broadcasts: list[Broadcast]


class Offload(_Msg):
    type: Literal["offload"] = "offload"
    req: int
    model: str
    call: str  # the layout, named by a call that uses it
    to_host: bool
    iteration: int


class SaveCheckpoint(_Msg):
    type: Literal["save"] = "save"
    req: int
    directory: str
    iteration: int


class ReleaseData(_Msg):
    type: Literal["release"] = "release"
    req: int
    before_iteration: int  # drop every data key of iterations below this


class EnsureGroups(_Msg):
    """Create process groups (collective over the whole world, so it goes to every worker)."""

    type: Literal["groups"] = "groups"
    req: int
    rank_sets: list[list[int]]


class Shutdown(_Msg):
    type: Literal["shutdown"] = "shutdown"
    req: int


# -- worker -> master ---------------------------------------------------------------------------------------
class Hello(_Msg):
    type: Literal["hello"] = "hello"
    rank: int
    pid: int
    host: str
    # the worker's start-up (time.time(); 0 when unknown): process start, imports done, arguments in hand
    started: float = 0.0
    imported: float = 0.0
    ready: float = 0.0


class OutputMeta(_Msg):
    key: str
    tensors: list[TensorMeta]


class SamplePart(_Msg):
    """Fields of one logged sample from one call (``text_io.SampleLog``); the master merges a sequence's
    parts from its calls (the reward call's text and reward, the generation's log-probs) into one line."""

    key: str  # the data key of the sequences: "seq" (ReMax's greedy baseline: "greedy_seq")
    seq: int  # global index of the sequence in the iteration's batch
    fields: dict[str, bool | str | float | list[int] | list[float]]  # bool: a pending partial rollout


class Reply(_Msg):
    type: Literal["reply"] = "reply"
    req: int
    rank: int
    ok: bool
    error: str = ""  # capped at MAX_ERROR_CHARS
    start: float = 0.0  # wall clock (time.time()) around the work, for the timeline
    end: float = 0.0
    stats: dict[str, float] = Field(default_factory=dict)
    outputs: list[OutputMeta] = Field(default_factory=list)
    samples: list[SamplePart] = Field(default_factory=list)
    # GPU workers: the request's peak and the allocation after it ("peak_bytes", "allocated_bytes"); empty on CPU
    memory: dict[str, int] = Field(default_factory=dict)
    # A generation's reporting rank: the tokens of each of its sequences, from sequence rows_lo on (the
    # master balances later calls' dp ranks by them, graph/row_balance.py)
    row_tokens: list[int] = Field(default_factory=list)
    rows_lo: int = 0
    # A generation with a tail migration: the rows this rank holds at its end (runtime/control/worker_tail.py)
    rows: list[int] = Field(default_factory=list)

    @field_validator("error")
    @classmethod
    def _cap_error(cls, v: str) -> str:
        return cap_text(v)


class Heartbeat(_Msg):
    """Sent by a worker's heartbeat thread every second; the master answers with its own."""

    type: Literal["heartbeat"] = "heartbeat"
    rank: int
    busy_req: int = -1  # request being executed, -1 when idle
    stop_signal: int = 0  # a stop signal the worker received (stop_signals.py); the master stops the run


class Abort(_Msg):
    """Master -> a worker's heartbeat thread: the run failed; exit now (even if stuck in a collective)."""

    type: Literal["abort"] = "abort"
    reason: str


REQUEST_TYPES: dict[str, type[_Msg]] = {m.model_fields["type"].default: m for m in (
    Setup, RunCall, Reallocate, TransferData, Offload, SaveCheckpoint, ReleaseData, EnsureGroups, Shutdown)}
MESSAGE_TYPES: dict[str, type[_Msg]] = {**REQUEST_TYPES, **{m.model_fields["type"].default: m for m in (
    Hello, Reply, Heartbeat, Abort)}}


@dataclasses.dataclass(frozen=True)
class Envelope:
    src: str
    dst: str
    seq: int
    body: _Msg


# -- secrets --------------------------------------------------------------------------------------------------
def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def write_secret_file(path: str | Path, secret: bytes) -> Path:
    """Create ``path`` readable by its owner only; refuse to overwrite an existing file."""
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(secret.hex().encode())
    except OSError as e:  # created, then not written (a full disk): no empty secret left, and the error names it
        path.unlink(missing_ok=True)
        raise OSError(e.errno, e.strerror, str(path)) from e
    return path


def read_secret(environ: dict[str, str] | None = None) -> bytes:
    """The run's secret from ``$REALLOC_SECRET_FILE`` (preferred) or ``$REALLOC_SECRET`` (hex)."""
    env = os.environ if environ is None else environ
    if env.get(SECRET_FILE_ENV):
        path = Path(env[SECRET_FILE_ENV])
        try:
            st = path.stat()
        except OSError as e:
            raise ValueError(f"{SECRET_FILE_ENV}={path}: cannot read the run secret ({e.strerror})") from None
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ValueError(f"{SECRET_FILE_ENV}={path}: the secret file must be private (chmod 600)")
        text = path.read_text().strip()
    elif env.get(SECRET_ENV):
        text = env[SECRET_ENV].strip()
    else:
        raise ValueError(f"no run secret: set {SECRET_FILE_ENV} to a 0600 file or {SECRET_ENV} to its hex value")
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        raise ValueError("the run secret must be hex-encoded") from None
    if len(secret) < 16:
        raise ValueError(f"the run secret is too short ({len(secret)} bytes); use at least 16")
    return secret


# -- the codec ------------------------------------------------------------------------------------------------
class Channel:
    """Signs outgoing and verifies incoming messages for one endpoint (``name``) of one run.

    Not thread-safe: a process that sends from two threads (the worker's heartbeat thread) uses two
    channels with distinct names, so each has its own sequence counter.
    """

    def __init__(self, secret: bytes, run_id: str, name: str) -> None:
        if len(secret) < 16:
            raise ValueError("the run secret must be at least 16 bytes")
        self._secret = secret
        self.run_id = run_id
        self.name = name
        self._next_seq = 1
        self._last_seen: dict[tuple[bytes, str], int] = {}  # (connection, sender) -> last accepted seq
        self.n_rejected = 0

    def _mac(self, payload: bytes) -> bytes:
        return hmac.new(self._secret, payload, hashlib.sha256).digest()

    def pack(self, dst: str, body: _Msg) -> list[bytes]:
        assert type(body) in MESSAGE_TYPES.values(), type(body)
        fields = body.model_dump(exclude={"type"})
        envelope = {"v": PROTOCOL_VERSION, "run": self.run_id, "src": self.name, "dst": dst,
                    "seq": self._next_seq, "type": body.type, "body": fields}
        payload = msgpack.packb(envelope, use_bin_type=True)
        if len(payload) > MAX_PAYLOAD_BYTES:
            biggest = max(fields, key=lambda k: len(msgpack.packb(fields[k], use_bin_type=True)))
            raise MessageTooLarge(f"{body.type} message to {dst} is {len(payload)} bytes, over the "
                                  f"{MAX_PAYLOAD_BYTES}-byte limit of one message (mostly its {biggest!r} field)")
        self._next_seq += 1
        return [payload, self._mac(payload)]

    def unpack(self, frames: list[bytes], expect_src: str | None = None, peer: bytes = b"") -> Envelope:
        """Verify and decode; raise ProtocolError (never anything else) for a message to drop.

        ``peer`` names the connection the frames came over (a ROUTER's socket identity; a DEALER has one
        peer): sequence numbers are checked and recorded per connection and sender.
        """
        if len(frames) != 2:
            raise ProtocolError(f"expected 2 frames (payload, mac), got {len(frames)}")
        payload, mac = bytes(frames[0]), bytes(frames[1])
        if len(payload) > MAX_PAYLOAD_BYTES:
            raise ProtocolError(f"payload of {len(payload)} bytes exceeds the {MAX_PAYLOAD_BYTES}-byte limit")
        if len(mac) != MAC_BYTES or not hmac.compare_digest(mac, self._mac(payload)):
            raise ProtocolError("bad HMAC: the message is not signed with this run's secret")
        try:
            env = msgpack.unpackb(payload, raw=False, strict_map_key=True, use_list=True)
        except Exception as e:  # noqa: BLE001 - msgpack raises many types for bad input
            raise ProtocolError(f"undecodable payload: {type(e).__name__}") from None
        if not isinstance(env, dict) or set(env) != {"v", "run", "src", "dst", "seq", "type", "body"}:
            raise ProtocolError("payload is not a protocol envelope")
        if env["v"] != PROTOCOL_VERSION:
            raise ProtocolError(f"protocol version {env['v']!r}, expected {PROTOCOL_VERSION}")
        if env["run"] != self.run_id:
            raise ProtocolError(f"message of another run ({env['run']!r})")
        if env["dst"] != self.name:
            raise ProtocolError(f"message addressed to {env['dst']!r}, not {self.name!r}")
        src, seq = env["src"], env["seq"]
        if not isinstance(src, str) or not isinstance(seq, int) or isinstance(seq, bool):
            raise ProtocolError("bad src or seq field")
        if expect_src is not None and src != expect_src:
            raise ProtocolError(f"message claims sender {src!r} but arrived from {expect_src!r}")
        last = self._last_seen.get((peer, src), 0)
        if seq <= last:
            raise ProtocolError(f"replayed or reordered message from {src!r} (seq {seq} <= {last})")
        kind = env["type"]
        cls = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
        if cls is None or not isinstance(env["body"], dict):
            raise ProtocolError(f"unknown message type {kind!r}")
        try:
            body = cls.model_validate(env["body"])
        except ValidationError as e:
            first = e.errors()[0]
            raise ProtocolError(f"{kind} message: field {'.'.join(map(str, first['loc']))!r}: {first['msg']}") \
                from None
        self._last_seen[peer, src] = seq
        return Envelope(src=src, dst=self.name, seq=seq, body=body)

    def try_unpack(self, frames: list[bytes], expect_src: str | None = None, peer: bytes = b"") -> Envelope | None:
        """``unpack`` that logs and drops a bad message instead of raising."""
        try:
            return self.unpack(frames, expect_src, peer)
        except ProtocolError as e:
            self.n_rejected += 1
            # The first few rejections are the interesting ones; after that a flood must not fill the log.
            if self.n_rejected <= 10 or self.n_rejected % 1000 == 0:
                log.warning("%s: rejected a message (%d so far): %s", self.name, self.n_rejected, e)
            return None


def worker_name(rank: int) -> str:
    return f"worker{rank}"


def heartbeat_name(rank: int) -> str:
    return f"hb{rank}"


def socket_identity(name: str) -> bytes:
    """A fresh ZMQ identity for endpoint ``name``: unguessable, so no other process can hold it first."""
    return f"{name}.{secrets.token_hex(8)}".encode()


def endpoint_name(identity: bytes) -> str:
    """The endpoint name a socket identity claims (what its signed messages must carry as ``src``)."""
    return identity.decode(errors="replace").rsplit(".", 1)[0]


def limit_frame_size(sock: zmq.Socket) -> None:
    """Drop any incoming frame above the payload limit as soon as its header arrives (libzmq never
    allocates it); ``unpack`` checks the same limit again."""
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_PAYLOAD_BYTES)


MASTER = "master"
