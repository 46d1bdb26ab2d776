"""What the engine hands back: per-step deltas, whole completions, and the KV handoff."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cleave.runtime.engine.sequence import FinishReason, TokenLogprob


@dataclass(frozen=True)
class KVHandoff:
    """Leading full KV blocks of a prompt, handed from one engine (or the store) to another.

    From a prefill-only request it also carries the first sampled token: the receiving
    engine continues decoding from there. From the block store it is just a cached prefix.
    Each block is ``[layers, 2, kv_heads, block_size, head_dim]``; on export the blocks are
    views into ``buffer`` (``[n, header_room + block_bytes]`` uint8, CPU), whose first
    ``header_room`` bytes of each row are free for the store's header, so writing the blocks
    to the store copies nothing more.
    """

    block_hashes: list[bytes]
    blocks: list[torch.Tensor]
    first_token: int | None = None
    first_logprob: TokenLogprob | None = None
    # Output tokens handed out before ``first_token``: a decode resumed after its worker died
    # mid-stream goes on from everything the client already has, not only the first token.
    earlier_tokens: tuple[int, ...] = ()
    buffer: torch.Tensor | None = None
    header_room: int = 0

    @property
    def output_tokens(self) -> list[int]:
        """Every output token the receiver holds as already handed out, first_token last."""
        return [] if self.first_token is None else [*self.earlier_tokens, self.first_token]


@dataclass(frozen=True)
class RequestTimes:
    """Where a finished request's time went in this engine (seconds, vLLM's intervals):
    waiting to be scheduled, scheduled to its first token here, first token to last, and
    scheduled to last. A request that finished before any step has zeros after the queue."""

    queue: float
    prefill: float
    decode: float
    inference: float


@dataclass
class RequestOutput:
    """What one step added to one request."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    handoff: KVHandoff | None = None
    # Prompt tokens 1.. scored (SamplingParams.prompt_logprobs): on the first token's output.
    prompt_logprobs: list[TokenLogprob] | None = None
    times: RequestTimes | None = None  # on the last output only


@dataclass
class Completion:
    """A whole request's result, accumulated from its outputs."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    handoff: KVHandoff | None = None
    prompt_logprobs: list[TokenLogprob] | None = None

    def absorb(self, out: RequestOutput) -> None:
        self.token_ids += out.new_token_ids
        self.text += out.new_text
        self.logprobs += out.new_logprobs
        self.num_prompt_tokens = out.num_prompt_tokens
        self.num_cached_tokens = out.num_cached_tokens
        if out.handoff is not None:
            self.handoff = out.handoff
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            self.finish_reason = out.finish_reason


