"""Request state shared by the scheduler, block manager and engine; torch-free by contract."""

from __future__ import annotations

import enum
import functools
import itertools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the grammar module needs no torch either, but imports this one
    from cleave.runtime.engine.grammar import Constraint

MAX_LOGPROBS = 20
GREEDY_BELOW_TEMPERATURE = 1e-5  # as vLLM's sampling epsilon
MAX_PENALTY = 2.0  # presence and frequency penalties: OpenAI's range is [-2, 2]
MAX_REPETITION_PENALTY = 100.0  # vLLM only asks > 0; far past any useful value, and finite
MAX_LOGIT_BIAS = 100.0  # OpenAI's range is [-100, 100]
# Entries of logit_bias and stop_token_ids: each costs a little on every step it is applied.
MAX_TOKEN_ID_LIST = 1024
# A cache_salt is hashed once per request; far longer than any tenant id or random key.
MAX_CACHE_SALT_CHARS = 1024


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
    # vLLM's prompt logprobs: each prompt token's (after the first) plus the top n there.
    # Computed only by an engine that runs the prompt (not one handed its first token).
    prompt_logprobs: int | None = None
    # OpenAI's penalties, over the output so far: logit -= frequency * count + presence * seen.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's (and HF's), over prompt and output: a seen token's logit is divided by it when
    # positive, multiplied when negative. 1 is off.
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    min_p: float = 0.0  # drop tokens less likely than min_p times the likeliest
    min_tokens: int = 0  # EOS and stop_token_ids cannot be sampled before this many tokens
    # Structured output: llguidance's grammar text (JSON schema, regex or choice, compiled by
    # the router); every token is one the grammar allows, and EOS only once it is complete.
    grammar: str | None = None
    # vLLM's per-request cache_salt: not sampling, but it travels with the request to every
    # worker that computes or loads its KV. It salts the request's block hashes (block_hash.
    # salted_root): only requests with the same salt share cached blocks. Kept out of reprs.
    cache_salt: str | None = field(default=None, repr=False)

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
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise RequestError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got "
                               f"{self.prompt_logprobs}")
        if any(not s for s in self.stop):
            raise RequestError("stop strings must not be empty")
        if self.cache_salt is not None and not 0 < len(self.cache_salt) <= MAX_CACHE_SALT_CHARS:
            raise RequestError(f"cache_salt must be a non-empty string of at most "
                               f"{MAX_CACHE_SALT_CHARS} characters")
        if self.grammar is not None and self.ignore_eos:
            # A complete grammar allows only EOS: ignoring it would leave nothing to sample.
            raise RequestError("ignore_eos cannot be combined with a structured output")
        self._check_logit_rules()

    def _check_logit_rules(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise RequestError(f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got "
                                   f"{getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise RequestError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}], "
                               f"got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise RequestError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got "
                               f"{self.min_tokens}")
        if len(self.logit_bias) > MAX_TOKEN_ID_LIST or \
                len(self.stop_token_ids) > MAX_TOKEN_ID_LIST:
            raise RequestError(f"logit_bias and stop_token_ids take at most "
                               f"{MAX_TOKEN_ID_LIST} token ids each")
        if any(t < 0 for t in self.stop_token_ids):
            raise RequestError("stop_token_ids must be >= 0")
        for token, bias in self.logit_bias:
            if token < 0 or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise RequestError(f"logit_bias maps token ids >= 0 to biases in "
                                   f"[-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], got {token}: {bias}")

    # Cached: read for every row of every step (a frozen dataclass's __dict__ still takes it).
    @functools.cached_property
    def penalized(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @functools.cached_property
    def adjusts_logits(self) -> bool:
        """Whether the logits change before the choice (the sampler's per-row work): greedy
        and plain sampling skip it, which keeps the common decode step as it was."""
        return (self.penalized or bool(self.logit_bias) or self.min_tokens > 0
                or self.grammar is not None)

    @property
    def reads_cached_prefix(self) -> bool:
        """Whether the request may take its prompt's leading KV from a cache (the engine's
        prefix cache, the store). Prompt logprobs need the logits at every prompt position, and
        a cached block has none: such a request computes its whole prompt, as vLLM skips the
        prefix cache for it. (Recomputing only the logits would need the cached KV's hidden
        states, which nothing keeps; the prompt is read once, so this costs one prefill.)"""
        return self.prompt_logprobs is None

    def max_token_id(self) -> int:
        """The largest token id the parameters name (-1: none), to check against the vocab."""
        return max([*self.stop_token_ids, *(t for t, _ in self.logit_bias)], default=-1)

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
    # 1 + how many tokens were likelier (prompt logprobs, as vLLM's); None: not computed.
    rank: int | None = None


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
    # Prompt logprobs so far, for prompt tokens 1.. in order (token 0 has none: nothing comes
    # before it); None: this engine does not compute them (not asked, or handed its first token).
    prompt_logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    constraint: Constraint | None = None  # params.grammar's matcher, set by the engine
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
    def scores_prompt(self) -> bool:
        """Prompt positions remain whose logits must be kept (so no cached prefix is read)."""
        return self.prompt_logprobs is not None and \
            len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    def prompt_positions(self, start: int, end: int) -> range:
        """The positions in ``[start, end)`` whose logits score a prompt token not scored yet
        (position p scores token p + 1): a recomputed chunk does not score anything twice."""
        if self.prompt_logprobs is None:
            return range(0)
        return range(max(start, len(self.prompt_logprobs)), min(end, self.num_prompt_tokens - 1))

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
