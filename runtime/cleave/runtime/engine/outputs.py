"""What the engine hands back: per-step deltas, whole completions, and the KV handoff."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cleave.runtime.engine.sequence import FinishReason, TokenLogprob


@dataclass(frozen=True)
class PrefillKV:
    """A prompt's KV handed from a prefill engine to a decode engine."""

    block_hashes: list[bytes]
    kv: torch.Tensor  # [layers, 2, kv_heads, len(block_hashes), block_size, head_dim]
    first_token: int
    first_logprob: TokenLogprob | None = None


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
    prefill_kv: PrefillKV | None = None


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
    prefill_kv: PrefillKV | None = None

    def absorb(self, out: RequestOutput) -> None:
        self.token_ids += out.new_token_ids
        self.text += out.new_text
        self.logprobs += out.new_logprobs
        self.num_prompt_tokens = out.num_prompt_tokens
        self.num_cached_tokens = out.num_cached_tokens
        if out.prefill_kv is not None:
            self.prefill_kv = out.prefill_kv
        if out.finished:
            self.finish_reason = out.finish_reason


