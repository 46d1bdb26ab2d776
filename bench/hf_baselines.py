"""Transformers-only baselines for the engine benchmark.

The benchmark asks "what does a user get from transformers alone?", so both baselines call
public transformers entry points the way a user would, with no engine code involved:

* `run_hf_generate`: static, left-padded batches through `model.generate`.
* `run_hf_continuous_batching`: transformers' own continuous batching manager.

Both decode greedily and never stop at EOS, so every request yields exactly its own
`max_new_tokens` and the useful-token count (the benchmark's numerator) is exact and equal
for both baselines and for the engine. Only generation is timed: model loading, and for
continuous batching the cache allocation and warm-up, are excluded because the engine's
figures exclude its own start-up too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

__all__ = ["BaselineResult", "run_hf_continuous_batching", "run_hf_generate"]

# EOS id that can never be sampled. Continuous batching documents -1 as "no EOS"; for
# `generate`, leaving eos_token_id=None does not work because `generate` then fills it from
# the model's own generation config, and `min_new_tokens` would mask the EOS logit and so
# change the greedy argmax whenever EOS is the top token. -1 keeps the logits untouched.
_NO_EOS = -1

# How long to wait for one continuous-batching result before checking the worker thread is
# still alive; only bounds how quickly a crashed worker is noticed.
_RESULT_POLL_S = 1.0


class _DropNegativeEosWarning(logging.Filter):
    """Drops `generate`'s "eos_token_id should consist of positive integers" warning.

    The -1 is deliberate (see `_NO_EOS`) and the warning would be logged once per batch.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return "should consist of positive integers" not in record.getMessage()


@contextmanager
def _quiet_negative_eos() -> Iterator[None]:
    """Install `_DropNegativeEosWarning` on the generation logger for the block only."""
    gen_logger = logging.getLogger("transformers.generation.utils")
    flt = _DropNegativeEosWarning()
    gen_logger.addFilter(flt)
    try:
        yield
    finally:
        gen_logger.removeFilter(flt)


@dataclass(frozen=True)
class BaselineResult:
    """Outcome of one baseline run over a list of requests."""

    useful_tokens: int
    """Sum of the requested output lengths actually produced (padding excluded)."""
    seconds: float
    """Wall time of generation only (model loading and cache setup excluded)."""
    outputs: list[list[int]]
    """Generated token ids per request, in request order."""


def _check_requests(requests: list[tuple[list[int], int]]) -> None:
    """Reject requests that would make the useful-token count ambiguous."""
    for i, (prompt, max_new) in enumerate(requests):
        if not prompt:
            raise ValueError(f"request {i}: empty prompt")
        if max_new < 1:
            raise ValueError(f"request {i}: max_new_tokens must be >= 1, got {max_new}")


def run_hf_generate(
    model: Any,
    requests: list[tuple[list[int], int]],
    batch_size: int = 8,
    pad_token_id: int = 0,
) -> BaselineResult:
    """Run `requests` through `model.generate` in static, left-padded batches.

    This is what a user does without a serving engine: sort by prompt length (so each batch
    pads as little as possible), pad on the left (decoder-only models continue from the last
    column), and generate every batch to the longest `max_new_tokens` in it. Rows that asked
    for fewer tokens still pay for the whole batch; only their own `max_new_tokens` count
    as useful, which is exactly the waste the engine is meant to remove.

    `model` is a loaded, eval-mode causal LM (e.g. `LlamaForCausalLM`).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    _check_requests(requests)
    device = model.device
    order = sorted(range(len(requests)), key=lambda i: len(requests[i][0]))
    outputs: list[list[int]] = [[] for _ in requests]
    useful = 0
    elapsed = 0.0
    with torch.inference_mode(), _quiet_negative_eos():
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            prompts = [requests[i][0] for i in idx]
            width = max(len(p) for p in prompts)
            input_ids = torch.full((len(idx), width), pad_token_id, dtype=torch.long)
            attention_mask = torch.zeros((len(idx), width), dtype=torch.long)
            for row, prompt in enumerate(prompts):
                input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
                attention_mask[row, width - len(prompt) :] = 1
            batch_max_new = max(requests[i][1] for i in idx)
            # A fresh config rather than kwargs: nothing from the checkpoint's generation
            # config (sampling, temperature, repetition penalty) leaks into the greedy run.
            gen_config = GenerationConfig(  # type: ignore[no-untyped-call]
                do_sample=False,
                num_beams=1,
                max_new_tokens=batch_max_new,
                min_new_tokens=None,
                eos_token_id=_NO_EOS,
                pad_token_id=pad_token_id,
            )
            t0 = time.perf_counter()
            sequences = model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                generation_config=gen_config,
            )
            elapsed += time.perf_counter() - t0
            generated = sequences[:, width:].tolist()
            for row, i in enumerate(idx):
                want = requests[i][1]
                tokens = generated[row][:want]
                if len(tokens) != want:
                    raise RuntimeError(
                        f"request {i}: generate produced {len(tokens)}/{want} tokens"
                    )
                outputs[i] = tokens
                useful += want
    return BaselineResult(useful_tokens=useful, seconds=elapsed, outputs=outputs)


def run_hf_continuous_batching(
    model: Any,
    requests: list[tuple[list[int], int]],
    num_blocks: int = 512,
    block_size: int = 32,
    max_batch_tokens: int = 512,
    *,
    max_requests_per_batch: int | None = None,
    attn_implementation: str = "sdpa",
) -> BaselineResult:
    """Run `requests` through transformers' continuous batching (transformers 5.24 API).

    `generate_batch` takes a single `max_new_tokens` for all prompts, so per-request lengths
    go through `continuous_batching_context_manager` + `add_request(max_new_tokens=n,
    eos_token_id=-1)`. The cache size is fixed via `num_blocks` (blocks of `block_size`
    tokens, called `page_size` since 5.17): left unset, transformers sizes the cache from
    60 % of free host RAM on CPU (80-90 % of free GPU memory), which costs 10-25 s per
    call on CPU and distorts memory figures.

    `attn_implementation` must be one continuous batching accepts on 5.24: "sdpa",
    "paged|eager" or a flash variant. It is set for the run and the model's previous
    implementation is restored afterwards. `max_requests_per_batch=None` lets transformers
    choose (up to 1024 requests per step).
    """
    _check_requests(requests)
    if not requests:
        return BaselineResult(useful_tokens=0, seconds=0.0, outputs=[])
    gen_config = GenerationConfig(  # type: ignore[no-untyped-call]
        do_sample=False,
        num_beams=1,
        max_new_tokens=max(n for _, n in requests),
        eos_token_id=_NO_EOS,
    )
    cb_config = ContinuousBatchingConfig(
        page_size=block_size,
        num_blocks=num_blocks,
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=max_requests_per_batch,
        # No flash attention on CPU; on GPU we still want the implementation we asked for.
        auto_switch_to_flash=False,
        # Prompts are random and unrelated: prefix sharing would only add bookkeeping.
        allow_block_sharing=False,
    )
    previous_attn = model.config._attn_implementation
    if previous_attn != attn_implementation:
        model.set_attn_implementation(attn_implementation)
    ids = [f"req_{i}" for i in range(len(requests))]
    results: dict[str, list[int]] = {}
    try:
        with (
            torch.inference_mode(),
            model.continuous_batching_context_manager(
                generation_config=gen_config,
                continuous_batching_config=cb_config,
                block=True,
            ) as manager,
        ):
            # The manager is built, its cache allocated and warmed up on entry: timing starts
            # here so only generation is measured.
            t0 = time.perf_counter()
            for request_id, (prompt, max_new) in zip(ids, requests, strict=True):
                manager.add_request(
                    input_ids=list(prompt),
                    request_id=request_id,
                    max_new_tokens=max_new,
                    eos_token_id=_NO_EOS,
                )
            while len(results) < len(requests):
                out = manager.get_result(timeout=_RESULT_POLL_S)
                if out is None:
                    if not manager.is_running():
                        raise RuntimeError("continuous batching worker stopped before finishing")
                    continue
                if not out.is_finished():
                    continue
                if out.error is not None:
                    raise RuntimeError(f"{out.request_id}: {out.error}")
                results[out.request_id] = list(out.generated_tokens)
            seconds = time.perf_counter() - t0
    finally:
        if model.config._attn_implementation != previous_attn:
            model.set_attn_implementation(previous_attn)
    outputs = [results[request_id] for request_id in ids]
    for i, ((_, want), tokens) in enumerate(zip(requests, outputs, strict=True)):
        if len(tokens) != want:
            raise RuntimeError(f"request {i}: continuous batching produced {len(tokens)}/{want}")
    return BaselineResult(
        useful_tokens=sum(n for _, n in requests), seconds=seconds, outputs=outputs
    )
