"""Request state shared by the scheduler, block manager and engine; torch-free by contract."""

from __future__ import annotations

import enum
import itertools
import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
GREEDY_BELOW_TEMPERATURE = 1e-5  # as vLLM's sampling epsilon


class RequestError(ValueError):
    """A request the engine cannot serve as asked; the message is safe to show the user."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each token and when to stop; validated once, when the request arrives."""

    max_tokens: int = 16
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means no top-k cut
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; n: the chosen token's plus the top n

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise RequestError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0 <= self.temperature < math.inf:  # also refuses NaN, which compares False
            raise RequestError(f"temperature must be a finite number >= 0, got "
                               f"{self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0, got {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise RequestError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if any(not s for s in self.stop):
            raise RequestError("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        # Below this, sampling is argmax in all but name, and dividing fp32 logits by it
        # overflows to inf (or the temperature itself rounds to 0): the softmax turns NaN and
        # multinomial raises on the engine thread, which would stop the engine for everyone.
        return self.temperature < GREEDY_BELOW_TEMPERATURE


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"
    PREFILL_DONE = "prefill_done"  # prefill-only request: first token sampled, KV exported


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


_arrival_counter = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One request's tokens and progress through the engine.

    ``num_computed_tokens`` counts tokens whose KV sits in the pool; the next forward computes
    ``token_ids[num_computed_tokens:]`` (all of it, or a chunk under the step's token budget) and
    samples only when that reaches the end. Preemption resets it to 0: the outputs so far become
    part of what is recomputed, so a preempted request resumes exactly where it was.
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    prefill_only: bool = False
    # Leading full blocks whose KV arrives from outside (a prefill worker); loaded on admission.
    num_external_blocks: int = 0
    sampling_seed: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the local prefix cache
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chain hashes of full blocks
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    arrival: int = field(default_factory=lambda: next(_arrival_counter))

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def stop_reason_after(self, token_id: int, max_model_len: int) -> FinishReason | None:
        """Why the sequence ends now that ``token_id`` was appended, or None to go on."""
        if self.prefill_only:
            return FinishReason.PREFILL_DONE
        if token_id in self.params.stop_token_ids:
            return FinishReason.STOP
        if not self.params.ignore_eos and token_id in self.eos_token_ids:
            return FinishReason.STOP
        if self.num_output_tokens >= self.params.max_tokens or self.num_tokens >= max_model_len:
            return FinishReason.LENGTH
        return None
