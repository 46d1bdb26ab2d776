"""Prefill capacity the decode workers lend, and what it saves the prefill role (pure).

Issue 18's convertible workers: the router sends a prompt whose prefill would be late behind
the prefill workers' backlog whole to a decode worker, which prefills it in chunks inside its
decode steps, within a per-step token budget (decode tokens included, as vLLM's
``max_num_batched_tokens`` counts them) sized so that a step stays within the TPOT target. So
each decode replica can prefill about ``budget / step time`` tokens a second, less the output
tokens its own batch takes out of every step.

That capacity is reached only through a backlog (a prompt must be late at a prefill worker
first), so it is burst capacity: it stands in for the room a role keeps for rises in demand
while new replicas start, never for its base capacity. Prefill workers alone still carry the
demand at their target utilization: sized below it, they would run with standing queues of up
to the router's TTFT target, their TTFT p90 over the policy's target, and the latency rule
would add back, a cold start later, the replica the credit took away.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ConvertiblePrefill:
    """The decode workers' per-step token budget and the step time it is sized for (the
    policy's TPOT target): what one decode replica can prefill beside its batch."""

    tokens_per_step: int
    step_s: float

    def __post_init__(self) -> None:
        if self.tokens_per_step < 1 or self.step_s <= 0:
            raise ValueError("need tokens_per_step >= 1 and step_s > 0")

    def lent(self, decode_replicas: int, output_rate: float | None) -> float:
        """Prompt tok/s that ``decode_replicas`` ready decode workers can prefill while their
        batches emit ``output_rate`` tok/s in all (unknown: nothing is lent, since a full
        batch lends nothing)."""
        if output_rate is None or decode_replicas <= 0:
            return 0.0
        return max(0.0, decode_replicas * self.tokens_per_step / self.step_s - output_rate)


def prefill_replicas(demand: float, utilization: float, risen: float, per_replica: float,
                     lent: float = 0.0) -> float:
    """Prefill replicas (a fraction) for ``demand`` prompt tok/s now: the prefill workers carry
    it at the target ``utilization`` (so their queues, and TTFT, stay short), and the ``risen``
    demand that may come before a replica started now is ready is met with the ``lent`` tok/s
    of the decode workers first."""
    return max(demand / utilization, risen - lent) / per_replica


__all__ = ["ConvertiblePrefill", "prefill_replicas"]
