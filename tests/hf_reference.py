"""The reference tests compare the engine with: transformers' own greedy generate."""

from __future__ import annotations

import torch


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:  # type: ignore[no-untyped-def]
    """The reference: transformers' own generate, greedy, never stopping early."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                             dtype=torch.long), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=-1, pad_token_id=0)
    return list(out[0, len(prompt):].tolist())
