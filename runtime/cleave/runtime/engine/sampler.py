"""Token selection: penalties, logit bias, min_tokens, grammars, greedy, temperature, min-p,
top-k, top-p, per-request seeds, logprobs (of sampled tokens, and of prompt tokens).

Randomness is keyed on (request seed, output index) rather than carried in a generator's state,
so a request that is preempted and recomputed, or split across a prefill and a decode process,
draws exactly the same tokens as one that ran straight through. The penalties read the
sequence's own tokens (prompt and output), which a decode worker rebuilds from the handoff and a
resumed request from the tokens already sent: they too come out the same wherever a step runs.

The order is vLLM's (v1 sampler): logit bias and min_tokens, then the penalties, then a
structured output's grammar mask (engine/grammar.py), then the choice (argmax, or temperature,
min-p, top-k, top-p and a draw). Logprobs are of the model's own
distribution, before any of that (vLLM's default, "raw" logprobs).
"""

from __future__ import annotations

import itertools
from typing import Final

import torch

from cleave.runtime.engine.grammar import mask_words
from cleave.runtime.engine.native.kernels import Kernels, kernels
from cleave.runtime.engine.sequence import Sequence, TokenLogprob

# Prompt positions scored at once (prompt_logprobs): their temporaries are this many rows of
# the vocabulary, 150 MB in fp32 for 152k tokens, whatever the chunk's length.
SCORE_ROWS: Final = 256
_MIX = 6364136223846793005
_MASK63 = (1 << 63) - 1


def draw_seed(seed: int, output_index: int) -> int:
    return (seed * _MIX + output_index + 1) & _MASK63


def _occurrences(token_lists: list[list[int]], rows: list[int], vocab: int,
                 device: torch.device) -> torch.Tensor:
    """Every (row, token) occurrence as ``row * vocab + token``, one flat tensor: the
    penalties touch only the tokens a row has seen, never the whole vocabulary."""
    tokens = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.long,
                          device=device)
    owners = torch.repeat_interleave(torch.tensor(rows, device=device),
                                     torch.tensor([len(t) for t in token_lists], device=device))
    return owners * vocab + tokens


def _per_row(values: list[float], rows: list[int], keys: torch.Tensor, vocab: int,
             like: torch.Tensor) -> torch.Tensor:
    """Each key's row's value (a row's parameter, spread over its tokens)."""
    table = torch.zeros(like.shape[0], dtype=like.dtype, device=like.device)
    table[torch.tensor(rows, device=like.device)] = torch.tensor(values, dtype=like.dtype,
                                                                   device=like.device)
    return table[keys // vocab]


def _penalize(logits: torch.Tensor, rows: list[int], seqs: list[Sequence]) -> None:
    """Repetition (over prompt and output), then frequency and presence (over the output)
    penalties on ``rows`` of ``logits``, in place, as vLLM applies them; the work grows with
    the tokens the rows hold, not with the vocabulary."""
    vocab, device = logits.shape[-1], logits.device
    flat = logits.view(-1)
    repeated = [r for r in rows if seqs[r].params.repetition_penalty != 1.0]
    if repeated:
        seen = torch.unique(_occurrences([seqs[r].token_ids for r in repeated], repeated,
                                         vocab, device))
        penalty = _per_row([seqs[r].params.repetition_penalty for r in repeated], repeated,
                           seen, vocab, logits)
        values = flat[seen]
        flat[seen] = torch.where(values > 0, values / penalty, values * penalty)
    outputs = _occurrences([seqs[r].output_token_ids for r in rows], rows, vocab, device)
    if outputs.numel():
        # Once per occurrence: count * frequency_penalty in all.
        frequency = _per_row([seqs[r].params.frequency_penalty for r in rows], rows, outputs,
                             vocab, logits)
        flat.index_put_((outputs,), -frequency, accumulate=True)
        present = torch.unique(outputs)
        presence = _per_row([seqs[r].params.presence_penalty for r in rows], rows, present,
                            vocab, logits)
        flat.index_put_((present,), -presence, accumulate=True)


def _set(logits: torch.Tensor, cells: list[tuple[int, int]], values: list[float],
         accumulate: bool) -> None:
    if cells:
        rows, cols = zip(*cells, strict=True)
        where = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
        logits.index_put_(where, torch.tensor(values, dtype=logits.dtype, device=logits.device),
                          accumulate=accumulate)


def adjust(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """``logits`` after logit bias, min_tokens, penalties and grammars; the same tensor when no
    row asks
    for any (the common case pays one attribute check per row, nothing more)."""
    rows = [r for r, s in enumerate(seqs) if s.params.adjusts_logits]
    if not rows:
        return logits
    raw, logits = logits, logits.clone()
    bias = [((r, t), b) for r in rows for t, b in seqs[r].params.logit_bias]
    _set(logits, [c for c, _ in bias], [b for _, b in bias], accumulate=True)
    vocab = logits.shape[-1]
    banned = [(r, t) for r in rows if seqs[r].num_output_tokens < seqs[r].params.min_tokens
              for t in {*seqs[r].eos_token_ids, *seqs[r].params.stop_token_ids} if t < vocab]
    _set(logits, banned, [float("-inf")] * len(banned), accumulate=False)
    penalized = [r for r in rows if seqs[r].params.penalized]
    if penalized:
        _penalize(logits, penalized, seqs)
    constrained = [r for r in rows if seqs[r].constraint is not None]
    if constrained:
        _constrain(logits, raw, constrained, seqs)
    return logits


# Byte value -> its 8 bits, as "refused" (bit clear): unpacking a bitmask is one gather. The
# int32 words are read as bytes, little-endian (x86, ARM): token t is bit t % 8 of byte t // 8.
_REFUSED = ((torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1) == 0


def _constrain(logits: torch.Tensor, raw: torch.Tensor, rows: list[int],
               seqs: list[Sequence]) -> None:
    """Tokens the rows' grammars do not allow next get -inf, in place. The grammar wins over
    the other rules: a row they leave nothing to sample from (min_tokens banning the EOS a
    complete grammar requires) takes the raw logits under the grammar alone."""
    vocab = logits.shape[-1]
    masks = torch.zeros((len(rows), mask_words(vocab)), dtype=torch.int32)
    for i, r in enumerate(rows):
        constraint = seqs[r].constraint
        assert constraint is not None
        constraint.fill(seqs[r].output_token_ids, masks[i])
    refused = _REFUSED[masks.view(torch.uint8).long()].view(len(rows), -1)[:, :vocab]
    refused = refused.to(logits.device)
    for i, r in enumerate(rows):
        row = logits[r].masked_fill_(refused[i], float("-inf"))
        # Only min_tokens sets -inf before this; bias and penalties are finite.
        if seqs[r].num_output_tokens < seqs[r].params.min_tokens and \
                bool(torch.isneginf(row).all()):
            row.copy_(raw[r].masked_fill(refused[i], float("-inf")))


def _filtered(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
              min_p: float = 0.0) -> torch.Tensor:
    logits = logits / temperature
    if min_p > 0.0:
        # p / p_max >= min_p, in log space: no softmax needed to compare.
        floor = logits.max() + torch.log(torch.tensor(min_p, device=logits.device))
        logits = logits.masked_fill(logits < floor, float("-inf"))
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
    chosen = adjust(logits, seqs)
    native = kernels() if Kernels.takes_argmax(chosen) else None
    tokens = native.argmax(chosen) if native is not None else chosen.argmax(dim=-1).tolist()
    for row, seq in enumerate(seqs):
        p = seq.params
        if p.greedy:
            continue
        probs = _filtered(chosen[row], p.temperature, p.top_k, p.top_p, p.min_p).softmax(-1)
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


def prompt_logprobs(logits: torch.Tensor, targets: list[int], top_n: int
                    ) -> list[TokenLogprob]:
    """Prompt logprobs (vLLM's): row ``i`` of fp32 ``logits`` scores token ``targets[i]``,
    with its rank (1 + the tokens likelier than it) and the row's top ``top_n``. Raw, as the
    sampled tokens' are: the model's distribution, before any sampling rule.

    ``SCORE_ROWS`` rows at a time: the log_softmax and the rank's comparison each make a
    tensor the size of their input, which for a whole chunk (2,048 rows of a 152k vocabulary:
    1.2 GB in fp32) could run the device out of memory the step needs."""
    out: list[TokenLogprob] = []
    for lo in range(0, len(targets), SCORE_ROWS):
        out += _score_rows(logits[lo:lo + SCORE_ROWS], targets[lo:lo + SCORE_ROWS], top_n)
    return out


def _score_rows(logits: torch.Tensor, targets: list[int], top_n: int) -> list[TokenLogprob]:
    lp = torch.log_softmax(logits, dim=-1)
    chosen = lp.gather(1, torch.tensor(targets, device=lp.device)[:, None])
    ranks = ((lp > chosen).sum(-1) + 1).tolist()
    values = chosen.squeeze(1).tolist()
    tops: list[tuple[tuple[int, float], ...]] = [()] * len(targets)
    if top_n:
        top = torch.topk(lp, top_n)
        tops = [tuple(zip(i, v, strict=True))
                for i, v in zip(top.indices.tolist(), top.values.tolist(), strict=True)]
    return [TokenLogprob(t, v, top, rank=r)
            for t, v, top, r in zip(targets, values, tops, ranks, strict=True)]
