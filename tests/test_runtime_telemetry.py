"""What a run records as it goes: the streamed trace and request log, and the run summary accumulated in
constant memory, checked against the batch formulas over every request (the reference)."""

import json
import random
import statistics

import pytest

from realloc.runtime.records.telemetry import LogHistogram, RequestLog, RequestRecord, RunStats, Trace, dispatch_overheads

KINDS = ("call", "realloc", "data", "offload", "release")


def synthetic_run(n_iterations: int, n_devices: int, seed: int):
    """Requests executed one after another on each device, with dispatch, start, end and reply times.

    Returns (records in reply order, (rank, record) replies in arrival order, iteration end times)."""
    rng = random.Random(seed)
    clock = {r: 100.0 for r in range(n_devices)}
    records, replies, iter_end = [], [], []
    req = 0
    for t in range(n_iterations):
        for _ in range(rng.randint(5, 12)):
            ranks = tuple(sorted(rng.sample(range(n_devices), rng.randint(1, n_devices))))
            dispatched = min(clock[r] for r in ranks) - rng.uniform(0, 0.05)
            rec = RequestRecord(req=req, kind=rng.choice(KINDS), label=f"r{req}", iteration=t, node="",
                                dispatched=dispatched, ranks=ranks)
            req += 1
            for r in ranks:
                s = max(clock[r], dispatched) + rng.uniform(0, 0.01)
                e = s + rng.uniform(0.001, 0.2)
                rec.spans[r] = (s, e)
                rec.received[r] = e + rng.uniform(0.0001, 0.003)
                clock[r] = e
                replies.append((rec.received[r], r, rec))
            rec.completed = max(rec.received.values())
            records.append(rec)
        iter_end.append(max(clock.values()) + 0.001)
    replies.sort(key=lambda x: x[0])
    return records, [(r, rec) for _, r, rec in replies], iter_end


def reference_shares(records, n_devices, begin, end):
    span = (end - begin) * n_devices
    out = {}
    for rec in records:
        for s, e in rec.spans.values():
            busy = min(e, end) - max(s, begin)
            if busy > 0:
                out[rec.kind] = out.get(rec.kind, 0.0) + busy / span
    out["idle"] = max(0.0, 1.0 - sum(out.values()))
    return out


@pytest.mark.parametrize("n_iterations", [1, 6])
def test_run_stats_match_the_batch_formulas(n_iterations):
    n_devices = 3
    records, replies, iter_end = synthetic_run(n_iterations, n_devices, seed=n_iterations)
    t_start = min(s for rec in records for s, _ in rec.spans.values())
    stats = RunStats(n_devices)
    stats.start(t_start)
    ends = iter(enumerate(iter_end))
    t, next_end = next(ends)
    for rank, rec in replies:
        while next_end is not None and rec.received[rank] > next_end:
            stats.on_iteration({"iteration": t, "iteration_time": 1.0 + t, "tokens": 10 * t,
                                "reward": 0.1 * t}, next_end)
            t, next_end = next(ends, (None, None))
        stats.on_reply(rec.kind, rank, rec.dispatched, *rec.spans[rank], rec.received[rank])
    while next_end is not None:
        stats.on_iteration({"iteration": t, "iteration_time": 1.0 + t, "tokens": 10 * t,
                            "reward": 0.1 * t}, next_end)
        t, next_end = next(ends, (None, None))
    stats.close()
    stats.on_reply("release", 0, iter_end[-1], iter_end[-1] + 1, iter_end[-1] + 2, iter_end[-1] + 3)  # ignored
    got = stats.summary()

    steady = n_iterations > 1
    begin = iter_end[0] if steady else t_start
    want = reference_shares(records, n_devices, begin, iter_end[-1])
    assert got["device_time_shares"] == pytest.approx(want, rel=1e-9, abs=1e-12)
    ov = dispatch_overheads([r for r in records if r.kind in ("call", "realloc", "data")])
    assert got["overhead"]["requests"] == len(ov)
    assert got["overhead"]["mean_overhead_s"] == pytest.approx(statistics.fmean(ov), rel=1e-9)
    assert got["overhead"]["median_overhead_s"] == pytest.approx(statistics.median(ov), rel=0.011)
    times = [1.0 + t for t in range(n_iterations)][1 if steady else 0:]
    assert got["iterations"] == n_iterations and got["steady_iterations"] == len(times)
    assert got["iteration_time"] == pytest.approx(statistics.fmean(times))
    # throughput over the window: all its tokens over all its time (not a mean of per-iteration rates)
    tokens = [10 * t for t in range(n_iterations)][1 if steady else 0:]
    assert got["tokens_per_s"] == pytest.approx(sum(tokens) / sum(times))
    assert got["first_reward"] == 0.0 and got["last_reward"] == pytest.approx(0.1 * (n_iterations - 1))


def test_log_histogram_quantiles_are_within_one_percent():
    rng = random.Random(0)
    xs = [rng.lognormvariate(-7, 1.5) for _ in range(5001)]
    h = LogHistogram()
    for x in xs:
        h.add(x)
    for q in (0.1, 0.5, 0.9):
        exact = sorted(xs)[round(q * (len(xs) - 1))]
        assert h.quantile(q) == pytest.approx(exact, rel=0.011)


def test_trace_and_request_log_are_on_disk_before_the_run_ends(tmp_path):
    trace = Trace(tmp_path / "trace.json", 2, ["n:0", "n:1"], t0=0.5)
    log = RequestLog(tmp_path / "requests.jsonl")
    rec = RequestRecord(req=7, kind="call", label="actor_gen", iteration=3, node="actor_gen", dispatched=1.0,
                        ranks=(0, 1), completed=2.0, spans={0: (1.1, 1.9), 1: (1.2, 1.8)}, received={0: 1.95, 1: 1.9})
    trace.add(rec)
    trace.add_node("actor_gen", "call", 3, 1.0, 2.0)
    log.write(rec)
    trace.flush()
    log.flush()
    text = (tmp_path / "trace.json").read_text()
    assert '"actor_gen"' in text and not text.rstrip().endswith("]}")  # streamed, not yet closed
    line = json.loads((tmp_path / "requests.jsonl").read_text())
    assert line["spans"] == {"0": [1.1, 1.9], "1": [1.2, 1.8]} and line["iteration"] == 4  # counted from 1
    trace.close()
    log.close()
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    boxes = [e for e in events if e["ph"] == "X"]
    assert [(e["pid"], e.get("tid"), e["ts"], e["dur"], e["args"]["iteration"]) for e in boxes] == [
        (0, 0, 600000.0, 800000.0, 4), (0, 1, 700000.0, 600000.0, 4), (1, 0, 500000.0, 1000000.0, 4)]


def test_sample_log_schedule_rows_and_merged_lines(tmp_path):
    """sample_every=10 logs iterations 1, 11, 21, 31 (0-based 0, 10, ...): the batch's first log_samples
    sequences, wherever their dp rank holds them. The reward call gives the ids and reward, the generation
    the response's log-probs; the master writes one line per sequence."""
    import torch

    from realloc.runtime.records.text_io import SampleLog, write_samples

    log = SampleLog(None, every=10, count=3)
    assert [t + 1 for t in range(35) if log.wanted(t, range(0, 8))] == [1, 11, 21, 31]
    assert (log.wanted(10, range(0, 2)), log.wanted(10, range(2, 4)), log.wanted(10, range(4, 8))) == ([0, 1], [0], [])
    assert SampleLog(None, every=0, count=3).wanted(0, range(0, 8)) == []
    # dp rank 1 of 4 holds sequences 2, 3 (of 8); P = 2, T = 3; only sequence 2 is among the first 3
    seq = {"tokens": torch.tensor([[5, 6, 7, 8, 0], [9, 10, 11, 0, 0]]), "prompt_lens": torch.tensor([2, 1]),
           "gen_mask": torch.tensor([[True, True, False], [True, True, False]])}
    scored = log.parts(10, range(2, 4), "seq", seq, scores=torch.tensor([0.25, 0.75]))
    generated = log.parts(10, range(2, 4), "seq", seq, logp=torch.tensor([[-0.5, -0.25, 0.0], [-1.0, -2.0, 0.0]]))
    assert [(p.key, p.seq) for p in scored + generated] == [("seq", 2), ("seq", 2)]
    assert log.parts(11, range(2, 4), "seq", seq, scores=torch.tensor([0.25, 0.75])) == []
    merged = {("seq", 2): {**generated[0].fields, **scored[0].fields}, ("greedy_seq", 0): {"reward": 1.0}}
    write_samples(tmp_path, 10, merged)
    lines = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert lines == [{"iteration": 11, "seq": 2, "reward": 0.25, "prompt_ids": [5, 6], "response_ids": [7, 8],
                      "logp": [-0.5, -0.25]},
                     {"iteration": 11, "seq": 0, "key": "greedy_seq", "reward": 1.0}]
