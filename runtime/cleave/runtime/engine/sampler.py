"""Token selection: greedy, temperature, top-k, top-p, per-request seeds, logprobs.

Randomness is keyed on (request seed, output index) rather than carried in a generator's state,
so a request that is preempted and recomputed, or split across a prefill and a decode process,
draws exactly the same tokens as one that ran straight through.
"""

from __future__ import annotations

import torch

from cleave.runtime.engine.sequence import Sequence, TokenLogprob

_MIX = 6364136223846793005
_MASK63 = (1 << 63) - 1


def draw_seed(seed: int, output_index: int) -> int:
    return (seed * _MIX + output_index + 1) & _MASK63


def _filtered(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token once the mass before it already reaches top_p; the top token stays,
        # even for a top_p so small (5e-324 is valid) that it rounds to 0 in fp32: dropping
        # every token would make the softmax NaN and stop the engine for every request.
        drop = (cumulative - sorted_logits.softmax(-1)) >= top_p
        drop[0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, order, sorted_logits)
    return logits


def sample(logits: torch.Tensor,
           seqs: list[Sequence]) -> tuple[list[int], list[TokenLogprob | None]]:
    """One token per row of fp32 ``logits`` ``[len(seqs), vocab]``."""
    tokens = logits.argmax(dim=-1).tolist()
    for row, seq in enumerate(seqs):
        p = seq.params
        if p.greedy:
            continue
        probs = _filtered(logits[row], p.temperature, p.top_k, p.top_p).softmax(-1)
        gen = torch.Generator(device=logits.device)
        gen.manual_seed(draw_seed(seq.sampling_seed, seq.num_output_tokens))
        tokens[row] = int(torch.multinomial(probs, 1, generator=gen).item())
    logprobs: list[TokenLogprob | None] = []
    for row, seq in enumerate(seqs):
        n = seq.params.logprobs
        if n is None:
            logprobs.append(None)
            continue
        lp = torch.log_softmax(logits[row], dim=-1)
        top = torch.topk(lp, n) if n else None
        logprobs.append(TokenLogprob(
            token_id=tokens[row],
            logprob=float(lp[tokens[row]]),
            top=tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top else (),
        ))
    return tokens, logprobs
