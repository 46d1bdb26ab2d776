"""When requests are sent: open-loop arrivals at a rate, or a fixed number in flight.

Open loop (``--rate``): inter-arrival gaps are drawn from a gamma distribution with mean
``1 / rate``. Shape 1 is the exponential distribution, i.e. Poisson arrivals; a shape below 1
keeps the mean rate but clusters requests into bursts separated by quiet gaps (the squared
coefficient of variation of the gaps is ``1 / shape``), the usual way serving benchmarks model
bursty traffic. Open loop keeps sending whatever the server's latency, so queueing shows up in
the measured latencies, as it would for real users.

Closed loop (``--concurrency`` alone): a fixed number of requests in flight; each finished
request is replaced at once. This measures capacity at a given load, but hides queueing: a slow
server just receives requests more slowly.

Both (``--rate`` with ``--concurrency``, vLLM's ``--request-rate`` with ``--max-concurrency``):
open-loop arrivals, but a request that arrives while ``max_concurrency`` are in flight waits at
the client until one ends, as when a gateway caps what reaches the server.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

POISSON_SHAPE = 1.0


@dataclass(frozen=True)
class OpenLoop:
    """Send at ``rate`` requests/s on average; ``shape`` is the gamma shape of the gaps;
    ``max_concurrency``: at most this many in flight (None: no cap)."""

    rate: float
    shape: float = POISSON_SHAPE
    max_concurrency: int | None = None

    def __post_init__(self) -> None:
        if not (self.rate > 0 and math.isfinite(self.rate)):
            raise ValueError(f"the request rate must be a positive number, not {self.rate}")
        if not (self.shape > 0 and math.isfinite(self.shape)):
            raise ValueError(f"the burstiness (gamma shape) must be positive, not {self.shape}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"the concurrency must be at least 1, not {self.max_concurrency}")

    @property
    def is_poisson(self) -> bool:
        return self.shape == POISSON_SHAPE


@dataclass(frozen=True)
class ClosedLoop:
    """Keep ``concurrency`` requests in flight."""

    concurrency: int

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"the concurrency must be at least 1, not {self.concurrency}")


Schedule = OpenLoop | ClosedLoop


def interarrival_gaps(schedule: OpenLoop, seed: int | None) -> Iterator[float]:
    """An endless stream of gaps in seconds, reproducible for a given seed."""
    rng = random.Random(seed)
    # Gamma(shape k, scale θ) has mean kθ: θ = 1 / (rate k) gives mean 1 / rate for every k.
    scale = 1.0 / (schedule.rate * schedule.shape)
    while True:
        yield rng.gammavariate(schedule.shape, scale)


def arrival_offsets(schedule: OpenLoop, seed: int | None) -> Iterator[float]:
    """Send times in seconds after the start: the running sum of the gaps, from the first gap
    (the first request waits one gap too, so the rate holds from t = 0)."""
    t = 0.0
    for gap in interarrival_gaps(schedule, seed):
        t += gap
        yield t


def describe(schedule: Schedule) -> str:
    if isinstance(schedule, ClosedLoop):
        return f"fixed concurrency {schedule.concurrency}"
    kind = "Poisson" if schedule.is_poisson else f"bursty (gamma shape {schedule.shape:g})"
    cap = (f", at most {schedule.max_concurrency} in flight"
           if schedule.max_concurrency is not None else "")
    return f"{schedule.rate:g} req/s, {kind} arrivals{cap}"


def max_concurrency(schedule: Schedule) -> int | None:
    """The most requests the schedule lets be in flight (None: unbounded)."""
    return schedule.concurrency if isinstance(schedule, ClosedLoop) else schedule.max_concurrency
