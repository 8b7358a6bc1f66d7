"""The response-length distribution of an experiment's workload (issue 31, item 1).

Real RL on reasoning tasks has long-tailed response lengths: RLHFuse (rlhfuse.txt, Fig. 2) reports a p99
many times the median. An experiment declares the distribution its generation produces, and the estimator
prices generation as decode steps over the rows still running and the later calls on the tokens that exist
(``estimator/call_time.py``):

    @auto("com01", batch_size=64, gen_len=512, response_lengths=ResponseLengths.lognormal(median=40, p99=480))

Four kinds, all over integer lengths 1 .. gen_len (generation cuts a row at ``gen_len``, so the mass a
distribution puts above it counts at ``gen_len``):

- ``fixed()``: every response is ``gen_len`` tokens, the default; the estimator prices exactly what it did
  before lengths existed;
- ``uniform(low, high)``: every length from ``low`` to ``high`` equally likely;
- ``lognormal(median, p99)``: ln(length) is normal with mean ln(median) and standard deviation
  (ln p99 - ln median) / z_0.99, rounded to the nearest integer;
- ``empirical(lengths)``: the histogram of observed lengths (``realloc search --lengths-from RUN_DIR``).

Everything here is deterministic (no sampling): the probability of each length, its mean, and the expected
order statistics of a micro-batch (``order_statistics``), which say when each of its rows finishes.
"""

from __future__ import annotations

import dataclasses
import json
import math
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Mapping

import numpy as np

KINDS = ("fixed", "uniform", "lognormal", "empirical")
# What `realloc run` writes the logged samples to (runtime/records/text_io.SAMPLES_FILE; not imported: the
# runtime sits above the planner, tests/test_lengths.py checks they agree).
SAMPLES_FILE = "samples.jsonl"
# The standard normal's 0.99 quantile: a lognormal's p99 is median * exp(Z99 * sigma).
Z99 = 2.3263478740408408


@dataclasses.dataclass(frozen=True)
class ResponseLengths:
    """How long generated responses are; build one with ``fixed``, ``uniform``, ``lognormal`` or ``empirical``."""

    kind: str = "fixed"
    low: int = 0  # uniform: the shortest length
    high: int = 0  # uniform: the longest length
    median: float = 0.0  # lognormal
    p99: float = 0.0  # lognormal
    counts: tuple[tuple[int, int], ...] = ()  # empirical: (length, how many times it was seen), by length

    def __post_init__(self) -> None:
        where = "response_lengths"
        if self.kind not in KINDS:
            raise ValueError(f"{where}: unknown kind {self.kind!r}; use one of {', '.join(KINDS)}")
        if self.kind == "uniform":
            for f in ("low", "high"):
                v = getattr(self, f)
                if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                    raise ValueError(f"{where}: uniform {f} must be a positive integer, got {v!r}")
            if self.low > self.high:
                raise ValueError(f"{where}: uniform low ({self.low}) must not exceed high ({self.high})")
        if self.kind == "lognormal":
            for f in ("median", "p99"):
                v = getattr(self, f)
                if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 1:
                    raise ValueError(f"{where}: lognormal {f} must be a finite number >= 1 (tokens), got {v!r}")
            if self.p99 <= self.median:
                raise ValueError(f"{where}: lognormal p99 ({self.p99}) must exceed the median ({self.median}); "
                                 f"for one length use ResponseLengths.fixed() or uniform(n, n)")
        if self.kind == "empirical":
            if not self.counts:
                raise ValueError(f"{where}: an empirical distribution needs at least one observed length")
            for n, c in self.counts:
                if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                    raise ValueError(f"{where}: empirical lengths must be positive integers, got {n!r}")
                if not isinstance(c, int) or isinstance(c, bool) or c < 1:
                    raise ValueError(f"{where}: empirical count of length {n} must be a positive integer, got {c!r}")
            # by length, however given (``describe`` reads the shortest and longest at the ends)
            object.__setattr__(self, "counts", tuple(sorted((n, c) for n, c in self.counts)))

    # -- constructors --------------------------------------------------------------------------------
    @classmethod
    def fixed(cls) -> "ResponseLengths":
        return cls()

    @classmethod
    def uniform(cls, low: int, high: int) -> "ResponseLengths":
        return cls("uniform", low=low, high=high)

    @classmethod
    def lognormal(cls, median: float, p99: float) -> "ResponseLengths":
        return cls("lognormal", median=median, p99=p99)

    @classmethod
    def empirical(cls, lengths: Iterable[int] | Mapping[int, int]) -> "ResponseLengths":
        """From observed lengths, or a histogram {length: count}."""
        hist: dict[int, int] = {}
        if isinstance(lengths, Mapping):
            hist = dict(lengths)
        else:
            for n in lengths:
                hist[n] = hist.get(n, 0) + 1
        bad = next((n for n in hist if not isinstance(n, int) or isinstance(n, bool) or n < 1), None)
        if bad is not None:
            raise ValueError(f"response_lengths: empirical lengths must be positive integers, got {bad!r}")
        return cls("empirical", counts=tuple(sorted(hist.items())))

    # -- what the estimator reads ------------------------------------------------------------------------
    @property
    def is_fixed(self) -> bool:
        return self.kind == "fixed"

    def check(self, gen_len: int) -> None:
        """A ValueError when the distribution cannot come from a generation of at most ``gen_len`` tokens."""
        if self.kind == "uniform" and self.high > gen_len:
            raise ValueError(f"response_lengths: uniform high ({self.high}) exceeds gen_len ({gen_len}); "
                             f"generation stops at gen_len tokens")
        if self.kind == "lognormal" and self.median > gen_len:
            raise ValueError(f"response_lengths: lognormal median ({self.median}) exceeds gen_len ({gen_len})")

    def pmf(self, gen_len: int) -> np.ndarray:
        """P(length = k) for k = 0 .. gen_len (float64; entry 0 is 0), mass above gen_len at gen_len."""
        return np.asarray(_pmf(self, gen_len), np.float64)

    def mean(self, gen_len: int) -> float:
        p = self.pmf(gen_len)
        return float(np.dot(np.arange(len(p)), p))

    def quantile(self, u: float, gen_len: int) -> int:
        """The smallest length whose CDF exceeds ``u`` in [0, 1): inverse-CDF sampling of one length."""
        cdf = np.cumsum(self.pmf(gen_len))
        return int(min(gen_len, max(1, int(np.searchsorted(cdf, u, side="right")))))

    def order_statistics(self, gen_len: int, b: int) -> tuple[int, ...]:
        """Expected lengths of the shortest, second shortest, ..., longest of ``b`` independent responses,
        rounded to whole tokens (ascending). The last one ends the micro-batch's generation."""
        if self.is_fixed:
            return (gen_len,) * b
        return _order_statistics(_pmf(self, gen_len), b)

    def slowest_ends(self, gen_len: int, b: int, n: int) -> tuple[int, ...]:
        """The expected lengths of the micro-batch of ``b`` rows that ends a call of ``n`` rows (issue 31: per
        micro-batch, per dp rank, the longest row ends it, and the call ends with the rank that holds its longest
        row): ``b`` rows' order statistics, the longest one that of all ``n`` rows."""
        ends = self.order_statistics(gen_len, b)
        if self.is_fixed or n <= b:
            return ends
        return ends[:-1] + (max(ends[-1], self.order_statistics(gen_len, n)[-1]),)

    def describe(self, gen_len: int | None = None) -> str:
        if self.kind == "fixed":
            return "fixed" + (f" ({gen_len} tokens)" if gen_len else "")
        if self.kind == "uniform":
            text = f"uniform {self.low}-{self.high}"
        elif self.kind == "lognormal":
            text = f"lognormal median {self.median:g} p99 {self.p99:g}"
        else:
            n = sum(c for _, c in self.counts)
            text = f"empirical ({n} responses, {self.counts[0][0]}-{self.counts[-1][0]} tokens)"
        return text + (f", mean {self.mean(gen_len):.1f} of at most {gen_len}" if gen_len else "")


@lru_cache(maxsize=256)
def _pmf(dist: ResponseLengths, gen_len: int) -> tuple[float, ...]:
    p = [0.0] * (gen_len + 1)
    if dist.kind == "fixed":
        p[gen_len] = 1.0
    elif dist.kind == "uniform":
        hi = min(dist.high, gen_len)
        lo = min(dist.low, hi)
        for k in range(lo, hi + 1):
            p[k] = 1.0 / (hi - lo + 1)
    elif dist.kind == "lognormal":
        mu, sigma = math.log(dist.median), (math.log(dist.p99) - math.log(dist.median)) / Z99

        def cdf(x: float) -> float:  # P(continuous length < x)
            return 0.5 * (1.0 + math.erf((math.log(x) - mu) / (sigma * math.sqrt(2.0))))

        prev = 0.0  # lengths below 1.5 round to 1
        for k in range(1, gen_len):
            c = cdf(k + 0.5)
            p[k] = c - prev
            prev = c
        p[gen_len] = 1.0 - prev
    else:
        total = sum(c for _, c in dist.counts)
        for n, c in dist.counts:
            p[min(n, gen_len)] += c / total
    return tuple(p)


@lru_cache(maxsize=1024)
def _order_statistics(pmf: tuple[float, ...], b: int) -> tuple[int, ...]:
    """E[L_(i)] = sum_{k >= 0} P(L_(i) > k), and L_(i) > k exactly when fewer than i of the b lengths are <= k:
    a binomial CDF at F(k), evaluated in log space for every k at once."""
    p = np.asarray(pmf, np.float64)
    g = len(p) - 1
    f = np.clip(np.cumsum(p)[:g], 0.0, 1.0)[:, None]  # F(k), k = 0 .. g - 1
    r = np.arange(b, dtype=np.float64)[None, :]  # binomial outcomes 0 .. b - 1
    log_choose = np.array([math.lgamma(b + 1) - math.lgamma(k + 1) - math.lgamma(b - k + 1) for k in range(b)])
    with np.errstate(divide="ignore", invalid="ignore"):
        below = np.where(r == 0, 0.0, r * np.log(f))
        above = (b - r) * np.log1p(-f)
        terms = np.exp(log_choose[None, :] + below + above)
    expected = np.nan_to_num(np.cumsum(terms, axis=1), nan=0.0).sum(axis=0)
    return tuple(int(min(g, max(1, math.floor(e + 0.5)))) for e in expected)


def run_records(path: Path) -> list[dict]:
    """The JSON objects of a run's ``*.jsonl`` file, one per line (blank lines and non-objects skipped); a line that
    is not JSON (or not UTF-8) is one ValueError naming the file and line (``--lengths-from`` reads samples and
    metrics). A last line without its newline that is not JSON is what a run killed mid-write leaves: skipped. Read
    line by line, so a large file is not held whole."""
    out = []
    with path.open("rb") as f:
        for i, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                raise ValueError(f"--lengths-from: {path} line {i} is not UTF-8 text") from None
            except json.JSONDecodeError as e:
                if not raw.endswith(b"\n"):  # the last line, cut off: a killed run's last record
                    break
                raise ValueError(f"--lengths-from: {path} line {i} is not JSON ({e.msg})") from None
            if isinstance(rec, dict):
                out.append(rec)
    return out


def lengths_from_run(run_dir: str | Path, gen_len: int | None = None) -> ResponseLengths:
    """The empirical distribution of the response lengths an earlier run logged (``samples.jsonl``: each
    logged sequence's ``response_ids``, else its generation's ``logp``, one per response token; a partial rollout's
    response of a pending group is skipped: it is logged again, whole, when trained). The run logs
    ``log_samples`` sequences every ``sample_every`` iterations (runtime/inputs/run_config.py); for a full
    histogram give the experiment ``sample_every = 1`` and ``log_samples = <sequences per batch>``. With ``gen_len``
    (the experiment's), a response longer than it is one ValueError: no generation of this experiment wrote it (a
    run of another experiment, or gen_len lowered since), and the search would price it cut at gen_len unsaid."""
    root = Path(run_dir)
    if not root.is_dir():
        raise ValueError(f"--lengths-from {run_dir}: no such run directory")
    path = root / SAMPLES_FILE
    if not path.is_file():
        raise ValueError(f"--lengths-from {run_dir}: no {SAMPLES_FILE} in it; a run logs its samples there unless "
                         f"sample_every=0")
    seen: dict[tuple, int] = {}
    pending = 0
    for rec in run_records(path):
        if rec.get("pending") is True:  # partial rollouts: a response cut short, or logged again once trained
            pending += 1
            continue
        tokens = rec.get("response_ids", rec.get("logp"))
        if isinstance(tokens, list) and tokens:
            # one entry per logged sequence (a resumed run logs some again); as text, so a hand-edited field's
            # list or object is a key too, not a TypeError
            seen[tuple(json.dumps(rec.get(k, "seq" if k == "key" else None)) for k in ("iteration", "key", "seq"))] \
                = len(tokens)
    if not seen:
        why = (f"only {pending} responses of partial-rollout groups still pending (logged again once trained: run "
               f"it further)" if pending else "no response_ids or logp")
        raise ValueError(f"--lengths-from {run_dir}: {path} records no response ({why})")
    longest = max(seen.values())
    if gen_len is not None and longest > gen_len:
        raise ValueError(f"--lengths-from {run_dir}: {path} records responses of up to {longest} tokens, but this "
                         f"experiment generates at most gen_len={gen_len}; take the lengths from a run of this "
                         f"experiment, or --set gen_len={longest} if the run was this experiment's with a larger gen_len")
    return ResponseLengths.empirical(seen.values())
