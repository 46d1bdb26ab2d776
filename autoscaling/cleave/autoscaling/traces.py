"""Request traces for the simulator: synthetic arrival processes and recorded JSONL.

Every synthetic trace is a pure function of its arguments and a seed. Prompt and output lengths
are log-normal, shaped after the conversation part of the Azure LLM inference trace (2023):
mean prompt about 1.3k tokens, mean output about 0.2k.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Request:
    arrival: float  # seconds from the start of the trace
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class LengthDist:
    """Log-normal token count with the given median and shape, clipped to [low, high]."""

    median: float
    sigma: float
    low: int
    high: int

    def sample(self, rng: random.Random) -> int:
        tokens = round(self.median * math.exp(rng.gauss(0, self.sigma)))
        return min(self.high, max(self.low, tokens))

    @property
    def mean(self) -> float:  # of the unclipped distribution: close enough for sizing
        return self.median * math.exp(self.sigma**2 / 2)


PROMPTS = LengthDist(1000, 0.7, 32, 8192)
OUTPUTS = LengthDist(160, 0.8, 8, 2048)


@dataclass(frozen=True)
class Trace:
    name: str
    duration: float
    requests: tuple[Request, ...]
    prompts: LengthDist = field(default=PROMPTS)
    outputs: LengthDist = field(default=OUTPUTS)

    def peak_rate(self, window_s: float = 60.0) -> float:
        """Highest arrival rate over any aligned window: what static provisioning sizes for."""
        bins: dict[int, int] = {}
        for r in self.requests:
            bins[int(r.arrival // window_s)] = bins.get(int(r.arrival // window_s), 0) + 1
        return max(bins.values(), default=0) / window_s


def _finish(name: str, duration: float, arrivals: Iterable[float], seed: int,
            prompts: LengthDist, outputs: LengthDist) -> Trace:
    rng = random.Random(seed * 7919 + 1)  # lengths independent of the arrival stream
    reqs = tuple(Request(t, prompts.sample(rng), outputs.sample(rng)) for t in arrivals)
    return Trace(name, duration, reqs, prompts, outputs)


def _check(duration: float, rate: float) -> None:
    if duration <= 0 or rate <= 0:
        raise ValueError("duration and rate must be > 0")


def _renewal(rng: random.Random, start: float, end: float, rate: float,
             shape: float) -> list[float]:
    """Gamma inter-arrival times of mean 1/rate: shape 1 is Poisson, below 1 bursty."""
    out: list[float] = []
    t = start
    while True:
        t += rng.gammavariate(shape, 1.0 / (shape * rate))
        if t >= end:
            return out
        out.append(t)


def poisson(duration: float, rate: float, seed: int = 0, prompts: LengthDist = PROMPTS,
            outputs: LengthDist = OUTPUTS) -> Trace:
    _check(duration, rate)
    arrivals = _renewal(random.Random(seed), 0.0, duration, rate, 1.0)
    return _finish("poisson", duration, arrivals, seed, prompts, outputs)


def bursty(duration: float, rate: float, seed: int = 0, shape: float = 0.5,
           epoch_s: float = 300.0, level_shape: float = 4.0, prompts: LengthDist = PROMPTS,
           outputs: LengthDist = OUTPUTS) -> Trace:
    """Gamma arrivals (shape 0.5: coefficient of variation 1.4, bursty within seconds) whose
    mean rate is redrawn every ``epoch_s`` from a gamma distribution of mean ``rate`` and
    shape ``level_shape`` (4: the level varies by +-50 %), clipped to [0.2, 3] x ``rate``.
    ``epoch_s`` 0 keeps the rate constant (a stationary gamma process)."""
    _check(duration, rate)
    if shape <= 0 or level_shape <= 0 or epoch_s < 0:
        raise ValueError("shape and level_shape must be > 0, epoch_s >= 0")
    rng = random.Random(seed)
    arrivals: list[float] = []
    start = 0.0
    while start < duration:
        end = duration if epoch_s == 0 else min(duration, start + epoch_s)
        level = 1.0 if epoch_s == 0 else rng.gammavariate(level_shape, 1.0 / level_shape)
        arrivals += _renewal(rng, start, end, rate * min(3.0, max(0.2, level)), shape)
        start = end
    return _finish("bursty", duration, arrivals, seed, prompts, outputs)


def _thinned(rng: random.Random, duration: float, peak: float,
             rate_at: Callable[[float], float]) -> list[float]:
    out = []
    for t in _renewal(rng, 0.0, duration, peak, 1.0):
        if rng.random() * peak < rate_at(t):
            out.append(t)
    return out


def diurnal(duration: float, rate: float, seed: int = 0, amplitude: float = 0.8,
            period_s: float | None = None, prompts: LengthDist = PROMPTS,
            outputs: LengthDist = OUTPUTS) -> Trace:
    """Poisson arrivals at rate * (1 - amplitude * cos(2 pi t / period)): a trough at the
    start, the peak half a period later; the period defaults to the whole duration."""
    _check(duration, rate)
    if not 0 <= amplitude < 1:
        raise ValueError("amplitude must be in [0, 1)")
    period = period_s or duration

    def rate_at(t: float) -> float:
        return rate * (1 - amplitude * math.cos(2 * math.pi * t / period))

    arrivals = _thinned(random.Random(seed), duration, rate * (1 + amplitude), rate_at)
    return _finish("diurnal", duration, arrivals, seed, prompts, outputs)


STEP_LEVELS = (0.2, 1.0, 0.1)  # of the peak: 2 -> 10 -> 1 requests/s at the default peak of 10


def step(duration: float, rate: float = 10.0, seed: int = 0, prompts: LengthDist = PROMPTS,
         outputs: LengthDist = OUTPUTS) -> Trace:
    """Poisson arrivals whose rate steps 0.2 -> 1 -> 0.1 x ``rate`` in three equal thirds."""
    _check(duration, rate)
    rng = random.Random(seed)
    third = duration / 3
    arrivals: list[float] = []
    for i, level in enumerate(STEP_LEVELS):
        arrivals += _renewal(rng, i * third, (i + 1) * third, rate * level, 1.0)
    return _finish("step", duration, arrivals, seed, prompts, outputs)


# llm-d's scored SLO-aware episode (guides/workload-autoscaling/slo-aware/benchmark-templates/
# scored-config.yml in llm-d/llm-d): inference-perf "constant" stages of (requests/s, seconds),
# random prompts of 4000 +- 300 tokens (3500-4500) and outputs of 1000 +- 80 (900-1100,
# ignore_eos: every output runs to its drawn length).
LLMD_STAGES = ((2.0, 330.0), (4.0, 360.0), (6.0, 360.0), (8.0, 360.0), (10.0, 360.0),
               (4.0, 360.0), (1.0, 300.0))
LLMD_PROMPTS = LengthDist(4000, 0.0, 3500, 4500)  # its mean, for sizing; drawn as below
LLMD_OUTPUTS = LengthDist(1000, 0.0, 900, 1100)


def llmd_ramp(seed: int = 0, scale: float = 1.0) -> Trace:
    """llm-d's staged ramp 2 -> 4 -> 6 -> 8 -> 10 -> 4 -> 1 requests/s (2430 s): evenly spaced
    arrivals within a stage (a constant-rate load, offset by a seeded phase) and normal
    lengths clipped as inference-perf draws them. ``scale`` multiplies every rate."""
    rng = random.Random(seed)
    arrivals: list[float] = []
    start = 0.0
    for rate, seconds in LLMD_STAGES:
        gap = 1.0 / (rate * scale)
        t = start + rng.random() * gap
        while t < start + seconds:
            arrivals.append(t)
            t += gap
        start += seconds
    lengths = random.Random(seed * 7919 + 1)

    def draw(mean: float, sd: float, lo: int, hi: int) -> int:
        return min(hi, max(lo, round(lengths.gauss(mean, sd))))

    reqs = tuple(Request(t, draw(4000, 300, 3500, 4500), draw(1000, 80, 900, 1100))
                 for t in arrivals)
    return Trace("llmd-ramp", start, reqs, LLMD_PROMPTS, LLMD_OUTPUTS)


def _field(obj: dict[str, object], keys: tuple[str, ...], where: str) -> float:
    for k in keys:
        if k in obj:
            v = obj[k]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{where}: {k} must be a number, got {v!r}")
            return float(v)
    raise ValueError(f"{where}: missing {' or '.join(keys)}")


def load_jsonl(path: str | Path, duration: float | None = None) -> Trace:
    """One request per line: {"arrival_s": 1.5, "prompt_tokens": 900, "output_tokens": 120}
    ("timestamp" is accepted for arrival_s). Arrivals are shifted so the first is at 0."""
    p = Path(path)
    try:
        lines = p.read_text().splitlines()
    except OSError as e:
        raise ValueError(f"cannot read trace {p}: {e}") from e
    rows: list[tuple[float, int, int]] = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{p}:{no}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e.msg})") from e
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: expected an object, got {type(obj).__name__}")
        t = _field(obj, ("arrival_s", "timestamp"), where)
        n_in = _field(obj, ("prompt_tokens",), where)
        n_out = _field(obj, ("output_tokens",), where)
        if t < 0 or n_in < 1 or n_out < 1 or n_in != int(n_in) or n_out != int(n_out):
            raise ValueError(f"{where}: need arrival_s >= 0 and whole token counts >= 1")
        rows.append((t, int(n_in), int(n_out)))
    if not rows:
        raise ValueError(f"{p}: no requests")
    rows.sort()
    t0 = rows[0][0]
    reqs = tuple(Request(t - t0, a, b) for t, a, b in rows)
    span = reqs[-1].arrival + 1.0
    if duration is not None and duration > 0:
        reqs = tuple(r for r in reqs if r.arrival < duration)
        span = duration
    return Trace(p.stem, span, reqs)


def write_jsonl(trace: Trace, path: str | Path) -> None:
    with open(path, "w") as f:
        for r in trace.requests:
            f.write(json.dumps({"arrival_s": round(r.arrival, 6), "prompt_tokens": r.prompt_tokens,
                                "output_tokens": r.output_tokens}) + "\n")


TRACES = ("poisson", "bursty", "diurnal", "step", "llmd-ramp")
DEFAULT_RATES = {"poisson": 5.0, "bursty": 5.0, "diurnal": 5.0, "step": 10.0,
                 "llmd-ramp": 10.0}


def make_trace(kind: str, duration: float, rate: float | None = None, seed: int = 0) -> Trace:
    """A named synthetic trace, or a JSONL file when ``kind`` is a path."""
    if kind not in TRACES:
        if kind.endswith(".jsonl") or Path(kind).exists():
            return load_jsonl(kind, duration)
        raise ValueError(f"unknown trace {kind!r}: use {', '.join(TRACES)} or a .jsonl file")
    r = rate or DEFAULT_RATES[kind]
    if kind == "poisson":
        return poisson(duration, r, seed)
    if kind == "bursty":
        return bursty(duration, r, seed)
    if kind == "diurnal":
        return diurnal(duration, r, seed)
    if kind == "llmd-ramp":  # its own stages and duration; --rate scales the peak of 10
        return llmd_ramp(seed, r / DEFAULT_RATES["llmd-ramp"])
    return step(duration, r, seed)
