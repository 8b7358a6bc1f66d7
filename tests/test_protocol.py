"""The wire protocol: typed round trips, and rejection of tampered, forged, replayed or malformed messages."""

import hashlib
import hmac
import logging
import os
import time

import msgpack
import pytest
import zmq

from realloc.runtime.wire import protocol as P
from realloc.runtime.wire.curve import CurveKeys, Gatekeeper, secure_client, secure_server
from zmtp_forge import forge

SECRET = bytes(range(32))


def pair(run="run-1"):
    return P.Channel(SECRET, run, P.MASTER), P.Channel(SECRET, run, P.worker_name(0))


def sign(payload: bytes, secret: bytes = SECRET) -> list[bytes]:
    return [payload, hmac.new(secret, payload, hashlib.sha256).digest()]


def envelope(**over):
    env = {"v": P.PROTOCOL_VERSION, "run": "run-1", "src": P.MASTER, "dst": "worker0", "seq": 1,
           "type": "call", "body": {"req": 3, "call": "actor_gen", "iteration": 0}}
    env.update(over)
    return msgpack.packb(env, use_bin_type=True)


EXAMPLES = [
    P.Setup(req=0, resume="/tmp/ckpt"),
    P.RunCall(req=1, call="actor_gen", iteration=2),
    P.Reallocate(req=2, model="actor", src_call="actor_train", dst_call="actor_gen", iteration=1, drop_src=False),
    P.TransferData(req=3, key="seq", iteration=0, dst_call="critic_inf",
                   tensors=[P.TensorMeta(name="tokens", dtype="int64", shape=[16])],
                   broadcasts=[P.Broadcast(src=0, dsts=[1], lo=0, hi=16)]),
    P.Offload(req=4, model="ref", call="ref_inf", to_host=True, iteration=0),
    P.SaveCheckpoint(req=5, directory="/tmp/x", iteration=3),
    P.ReleaseData(req=6, before_iteration=2),
    P.EnsureGroups(req=8, rank_sets=[[0, 1], [1, 2, 3]]),
    P.Shutdown(req=7),
]


@pytest.mark.parametrize("body", EXAMPLES, ids=lambda b: b.type)
def test_requests_round_trip(body):
    master, worker = pair()
    env = worker.unpack(master.pack("worker0", body))
    assert env.body == body and type(env.body) is type(body)
    assert env.src == P.MASTER and env.dst == "worker0" and env.seq == 1


def test_replies_round_trip_with_stats_and_outputs():
    master, worker = pair()
    reply = P.Reply(req=9, rank=0, ok=True, start=1.5, end=2.5, stats={"reward": 0.25, "n": 4},
                    outputs=[P.OutputMeta(key="seq", tensors=[P.TensorMeta(name="t", dtype="int64", shape=[8])])])
    got = master.unpack(worker.pack(P.MASTER, reply), expect_src="worker0").body
    assert got == reply and got.stats["n"] == 4.0


@pytest.mark.parametrize("where", ["payload", "mac"])
def test_tampered_byte_is_rejected(where):
    master, worker = pair()
    frames = master.pack("worker0", P.RunCall(req=1, call="actor_gen", iteration=0))
    i = 0 if where == "payload" else 1
    b = bytearray(frames[i])
    b[len(b) // 2] ^= 0x01
    frames[i] = bytes(b)
    with pytest.raises(P.ProtocolError, match="HMAC"):
        worker.unpack(frames)
    # The untampered message still goes through afterwards: a rejection leaves no state behind.
    frames = master.pack("worker0", P.RunCall(req=2, call="actor_gen", iteration=0))
    assert worker.unpack(frames).body.req == 2


def test_tampered_field_with_recomputed_mac_of_wrong_secret_is_rejected():
    _, worker = pair()
    forged = sign(envelope(body={"req": 3, "call": "evil", "iteration": 0}), secret=b"x" * 32)
    with pytest.raises(P.ProtocolError, match="HMAC"):
        worker.unpack(forged)


def test_replay_and_reorder_are_rejected():
    master, worker = pair()
    first = master.pack("worker0", P.RunCall(req=1, call="a", iteration=0))
    second = master.pack("worker0", P.RunCall(req=2, call="a", iteration=0))
    worker.unpack(first)
    with pytest.raises(P.ProtocolError, match="replayed"):
        worker.unpack(first)
    worker.unpack(second)
    with pytest.raises(P.ProtocolError, match="replayed"):
        worker.unpack(first)


def test_replay_counters_are_per_connection():
    """Issue 22 item 21: a message over one connection moves only that connection's counter for its sender."""
    master, worker = pair()
    real = worker.pack(P.MASTER, P.Hello(rank=0, pid=1, host="h"))  # seq 1
    forger = P.Channel(SECRET, "run-1", P.worker_name(0))
    forger._next_seq = 10**9
    master.unpack(forger.pack(P.MASTER, P.Hello(rank=0, pid=2, host="h")), "worker0", peer=b"worker0.evil")
    assert master.unpack(real, "worker0", peer=b"worker0.real").body.pid == 1
    with pytest.raises(P.ProtocolError, match="replayed"):  # each connection still refuses its own replays
        master.unpack(real, "worker0", peer=b"worker0.real")


def test_message_for_another_receiver_or_run_is_rejected():
    master, _ = pair()
    other_worker = P.Channel(SECRET, "run-1", P.worker_name(1))
    with pytest.raises(P.ProtocolError, match="addressed"):
        other_worker.unpack(master.pack("worker0", P.Shutdown(req=1)))
    other_run = P.Channel(SECRET, "run-2", P.worker_name(0))
    with pytest.raises(P.ProtocolError, match="another run"):
        other_run.unpack(master.pack("worker0", P.Shutdown(req=1)))


def test_sender_identity_must_match_the_socket_identity():
    master, worker = pair()
    with pytest.raises(P.ProtocolError, match="claims sender"):
        master.unpack(worker.pack(P.MASTER, P.Hello(rank=0, pid=1, host="h")), expect_src="worker1")


@pytest.mark.parametrize("payload, match", [
    (b"\xc1\xc1\xc1", "undecodable"),
    (msgpack.packb([1, 2, 3]), "envelope"),
    (envelope(v=99), "version"),
    (envelope(type="exec"), "unknown message type"),
    (envelope(body={"req": 3, "call": "actor_gen", "iteration": "0"}), "iteration"),
    (envelope(body={"req": 3, "call": "actor_gen", "iteration": 0, "code": "rm -rf /"}), "code"),
    (envelope(body={"req": 3, "call": "actor_gen"}), "iteration"),
    (envelope(seq=True), "seq"),
    (envelope(body=[1, 2]), "unknown message type"),
])
def test_malformed_but_signed_payloads_are_rejected(payload, match):
    _, worker = pair()
    with pytest.raises(P.ProtocolError, match=match):
        worker.unpack(sign(payload))


def test_frame_count_and_size_limits():
    _, worker = pair()
    with pytest.raises(P.ProtocolError, match="2 frames"):
        worker.unpack([envelope()])
    big = b"\x00" * (P.MAX_PAYLOAD_BYTES + 1)
    with pytest.raises(P.ProtocolError, match="limit"):
        worker.unpack(sign(big))


def test_an_outgoing_message_over_the_limit_is_refused_and_the_worker_reports_it():
    """Every receiver drops a message over MAX_PAYLOAD_BYTES, so a worker that sent one would leave the master
    waiting for a reply that never comes: pack refuses it, and the worker sends a failure instead."""
    from realloc.runtime.control.worker import packed_reply

    master, worker = pair()
    huge = P.SamplePart(key="seq", seq=0, fields={"text": "x" * (P.MAX_PAYLOAD_BYTES + 10)})
    reply = P.Reply(req=7, rank=0, ok=True, start=1.0, end=2.0, samples=[huge])
    with pytest.raises(P.MessageTooLarge, match=r"reply message to master is \d+ bytes, over the 8388608-byte "
                                                r"limit of one message \(mostly its 'samples' field\)"):
        worker.pack(P.MASTER, reply)
    frames = packed_reply(worker, reply)
    assert len(frames[0]) < 2000
    got = master.unpack(frames, P.worker_name(0)).body
    assert (got.req, got.ok) == (7, False) and got.error.startswith("the reply to request 7 cannot be sent: reply "
                                                                   "message to master is")
    ok = P.Reply(req=8, rank=0, ok=True)
    assert master.unpack(packed_reply(worker, ok), P.worker_name(0)).body == ok  # small replies go as they are


def test_a_huge_error_text_keeps_its_head_and_tail():
    master, worker = pair()
    text = "Traceback (most recent call last):\n" + "  frame\n" * 2_000_000 + "RuntimeError: the cause"
    reply = P.Reply(req=1, rank=0, ok=False, error=text)
    assert len(reply.error) <= P.MAX_ERROR_CHARS
    assert reply.error.startswith("Traceback (most recent call last):\n  frame")
    assert reply.error.endswith("RuntimeError: the cause")
    head, cut, tail = reply.error.partition("\n[... ")
    assert text.startswith(head) and text.endswith(tail.partition(" characters cut ...]\n")[2])
    assert int(tail.split()[0]) == len(text) - len(head) - len(tail.partition(" characters cut ...]\n")[2])
    assert master.unpack(worker.pack(P.MASTER, reply), P.worker_name(0)).body.error == reply.error
    assert P.Reply(req=1, rank=0, ok=False, error="short").error == "short"


def test_try_unpack_logs_and_drops(caplog):
    _, worker = pair()
    with caplog.at_level(logging.WARNING, logger="realloc.protocol"):
        assert worker.try_unpack([b"junk", b"junk"]) is None
    assert worker.n_rejected == 1
    assert "rejected" in caplog.text and "HMAC" in caplog.text


def test_secret_file_must_be_private(tmp_path):
    path = P.write_secret_file(tmp_path / "secret", SECRET)
    assert (path.stat().st_mode & 0o777) == 0o600
    assert P.read_secret({P.SECRET_FILE_ENV: str(path)}) == SECRET
    os.chmod(path, 0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        P.read_secret({P.SECRET_FILE_ENV: str(path)})
    with pytest.raises(FileExistsError):
        P.write_secret_file(path, SECRET)
    assert P.read_secret({P.SECRET_ENV: SECRET.hex()}) == SECRET
    with pytest.raises(ValueError, match="no run secret"):
        P.read_secret({})
    with pytest.raises(ValueError, match="hex"):
        P.read_secret({P.SECRET_ENV: "not hex"})


def live_sockets(ctx: zmq.Context, *identities: bytes, limit: bool = False) -> list[zmq.Socket]:
    """A loopback ROUTER (with the protocol's frame limit if ``limit``) and a DEALER per identity."""
    router = ctx.socket(zmq.ROUTER)
    if limit:
        P.limit_frame_size(router)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealers = []
    for ident in identities:
        dealers.append(ctx.socket(zmq.DEALER))
        dealers[-1].setsockopt(zmq.IDENTITY, ident)
        dealers[-1].connect(f"tcp://127.0.0.1:{port}")
    return [router, *dealers]


def test_forged_message_over_a_live_socket_does_not_stop_the_receiver():
    """A ROUTER that receives junk and a forgery in between real messages serves both real ones."""
    ctx = zmq.Context()
    router, good, evil = live_sockets(ctx, b"worker0", b"worker1")
    master = P.Channel(SECRET, "run-1", P.MASTER)
    w0 = P.Channel(SECRET, "run-1", "worker0")
    forger = P.Channel(b"y" * 32, "run-1", "worker1")
    try:
        good.send_multipart(w0.pack(P.MASTER, P.Hello(rank=0, pid=1, host="h")))
        evil.send_multipart([b"garbage"])
        evil.send_multipart(forger.pack(P.MASTER, P.Hello(rank=1, pid=2, host="h")))
        good.send_multipart(w0.pack(P.MASTER, P.Heartbeat(rank=0)))
        accepted = []
        for _ in range(4):
            assert router.poll(5000)
            ident, *frames = router.recv_multipart()
            env = master.try_unpack(frames, expect_src=ident.decode())
            if env is not None:
                accepted.append(env.body.type)
        assert accepted == ["hello", "heartbeat"]
        assert master.n_rejected == 2
    finally:
        for s in (router, good, evil):
            s.close(linger=0)
        ctx.term()


def test_oversized_frame_is_dropped_before_it_is_read():
    """A frame above the payload limit is refused by libzmq from its header: the receiver never holds
    it, and the sender's next (reconnected) message and other peers still get through."""
    ctx = zmq.Context()
    router, evil, good = live_sockets(ctx, b"evil", b"good", limit=True)
    try:
        evil.send_multipart([b"\x00" * (P.MAX_PAYLOAD_BYTES + 1), b"mac"])
        evil.send_multipart([b"small", b"mac"])
        good.send_multipart([b"hello", b"mac"])
        got = []
        deadline = time.monotonic() + 10
        while len(got) < 2 and time.monotonic() < deadline:
            if router.poll(200):
                got.append(router.recv_multipart())
        assert sorted((f[0], f[1]) for f in got) == [(b"evil", b"small"), (b"good", b"hello")]
        assert not router.poll(300)  # the oversized frame never arrives
    finally:
        for s in (router, evil, good):
            s.close(linger=0)
        ctx.term()


def test_socket_identities_are_unguessable_and_name_their_endpoint():
    a, b = P.socket_identity("worker0"), P.socket_identity("worker0")
    assert a != b and P.endpoint_name(a) == P.endpoint_name(b) == "worker0"
    assert P.endpoint_name(P.socket_identity(P.heartbeat_name(3))) == "hb3"
    assert P.endpoint_name(b"worker0") == "worker0"  # an old-style fixed identity still maps to its name


# -- transport security (curve.py) ------------------------------------------------------------------------------
def test_curve_keys_come_from_the_secret():
    keys = CurveKeys.of(SECRET)
    assert keys == CurveKeys.of(SECRET) and keys != CurveKeys.of(b"y" * 32)
    assert len({keys.server_public, keys.server_secret, keys.client_public, keys.client_secret}) == 4
    assert zmq.curve_public(keys.client_secret) == keys.client_public


def _drain(router: zmq.Socket, wait_ms: int) -> list[list[bytes]]:
    got = []
    while router.poll(wait_ms):
        got.append(router.recv_multipart())
    return got


def test_a_forged_many_frame_message_reaches_a_plain_socket():
    """The attack the CURVE handshake stops: every frame is under the frame limit, so a plain socket
    queues the whole 50-frame message (libzmq has no limit on frames per message)."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.MAXMSGSIZE, 1000)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    try:
        assert forge(port, [b"x" * 900] * 50, hold=0.3)
        assert router.poll(3000) and len(router.recv_multipart()) == 1 + 50
    finally:
        router.close(linger=0)
        ctx.term()


def test_only_the_runs_workers_complete_a_handshake(caplog):
    """The master's socket setup (CURVE server + ZAP gatekeeper): a raw forger without the secret (a
    50-frame message, then a frame above the payload limit) and a CURVE client with a key of its own (it
    knows the master's public key) get no frame queued; each refusal is logged. A worker with the run's
    keys gets through, and its messages are signed as before."""
    keys = CurveKeys.of(SECRET)
    ctx = zmq.Context()
    gate = Gatekeeper(ctx, keys)
    router = ctx.socket(zmq.ROUTER)
    secure_server(router, keys)
    monitor = gate.watch(router)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    stranger = ctx.socket(zmq.DEALER)
    worker = ctx.socket(zmq.DEALER)
    try:
        forge(port, [b"x" * 900] * 50)
        forge(port, [b"\x00" * (P.MAX_PAYLOAD_BYTES + 1), b"mac"])
        public, secret = zmq.curve_keypair()
        stranger.curve_serverkey, stranger.curve_publickey, stranger.curve_secretkey = keys.server_public, public, secret
        stranger.setsockopt(zmq.LINGER, 0)
        stranger.connect(f"tcp://127.0.0.1:{port}")
        stranger.send_multipart([b"x" * 900] * 50)
        worker.setsockopt(zmq.IDENTITY, P.socket_identity("worker0"))
        worker.setsockopt(zmq.LINGER, 0)
        secure_client(worker, keys)
        worker.connect(f"tcp://127.0.0.1:{port}")
        w0 = P.Channel(SECRET, "run-1", "worker0")
        worker.send_multipart(w0.pack(P.MASTER, P.Hello(rank=0, pid=1, host="h")))
        got = _drain(router, 1000)
        assert len(got) == 1 and P.endpoint_name(got[0][0]) == "worker0"
        assert P.Channel(SECRET, "run-1", P.MASTER).unpack(got[0][1:], "worker0").body.type == "hello"
        with caplog.at_level(logging.WARNING, logger="realloc.curve"):
            while monitor.poll(500):
                gate.on_event(monitor.recv_multipart())
        assert gate.n_refused >= 3
        assert "not complete a CURVE handshake" in caplog.text and "not the run's worker key" in caplog.text
    finally:
        for s in (stranger, worker):
            s.close(linger=0)
        gate.close(router)
        router.close(linger=0)
        ctx.term()
