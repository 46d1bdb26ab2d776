"""Build a tiny, random, fully offline Llama checkpoint for tests.

Model hubs are unreachable in CI, so tests cannot download a real model. This
module trains a small byte-level BPE tokenizer on a corpus generated in code
and pairs it with a randomly initialised ``LlamaForCausalLM``. The result is a
regular Hugging Face model directory that ``AutoTokenizer`` and
``AutoModelForCausalLM`` load like any hub checkpoint, built in well under a
second and bit-for-bit reproducible for a given seed.

Shapes (see ``TINY_MODEL_CONFIG``): hidden 64, MLP 128, 4 query heads and 2
key/value heads (GQA) of head_dim 16, tied embeddings, RoPE theta 10000,
float32 safetensors. The vocabulary is ``TINY_VOCAB_SIZE`` tokens.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Final

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

ENDOFTEXT: Final = "<|endoftext|>"
IM_START: Final = "<|im_start|>"
IM_END: Final = "<|im_end|>"
SPECIAL_TOKENS: Final = (ENDOFTEXT, IM_START, IM_END)

TINY_VOCAB_SIZE: Final = 512

# ChatML, as used by SmolLM2 (without its default system prompt).
CHAT_TEMPLATE: Final = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Everything except vocab_size, num_hidden_layers, max_position_embeddings and
# the special-token ids, which build_tiny_llama fills in.
TINY_MODEL_CONFIG: Final[dict[str, Any]] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "tie_word_embeddings": True,
    # Much larger than the usual 0.02 so that random logits are peaky and greedy
    # decoding wanders over many tokens instead of repeating one.
    "initializer_range": 0.2,
    "attention_bias": False,
    "mlp_bias": False,
}

_SUBJECTS: Final = (
    "the cat",
    "a dog",
    "my friend",
    "the old man",
    "our teacher",
    "a small bird",
    "the engineer",
    "her brother",
    "the river",
    "this model",
    "the server",
    "a child",
    "the city",
    "your computer",
    "the farmer",
    "every student",
    "the doctor",
    "a robot",
)
_VERBS: Final = (
    "walks",
    "reads",
    "watches",
    "builds",
    "finds",
    "carries",
    "writes",
    "likes",
    "remembers",
    "opens",
    "follows",
    "answers",
    "explains",
    "paints",
    "counts",
    "measures",
    "serves",
    "learns",
)
_OBJECTS: Final = (
    "a long letter",
    "the red door",
    "many books",
    "the morning news",
    "a quiet song",
    "the mountain road",
    "some fresh bread",
    "the green garden",
    "a simple question",
    "the next request",
    "three apples",
    "the blue sky",
    "a strange machine",
    "the evening train",
    "two hundred tokens",
    "the warm kitchen",
    "a heavy box",
)
_ENDINGS: Final = (
    "in the morning",
    "before dinner",
    "with great care",
    "every day",
    "after the rain",
    "near the station",
    "without a word",
    "for the first time",
    "at night",
    "during the summer",
    "because it is important",
    "while the sun sets",
    "and then goes home",
    "on Monday",
    "in 2024",
    "quickly",
    "slowly",
)
_EXTRA_LINES: Final = (
    "Hello! How are you today? I am fine, thank you.",
    "What is the capital of France? The capital of France is Paris.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 1000.",
    "def add(a, b):\n    return a + b",
    "User: please summarize the text. Assistant: Sure, here is a short summary.",
    "Once upon a time, there was a little town by the sea.",
)


def _corpus(num_lines: int = 400) -> list[str]:
    """Generate English-like lines from a fixed RNG so the tokenizer is stable."""
    rng = random.Random(1234)
    lines = list(_EXTRA_LINES)
    for _ in range(num_lines):
        sentence = (
            f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} "
            f"{rng.choice(_ENDINGS)}"
        )
        lines.append(sentence[0].upper() + sentence[1:] + rng.choice((".", "!", "?", ".")))
    return lines


def _train_tokenizer(vocab_size: int = TINY_VOCAB_SIZE) -> Tokenizer:
    """Train a GPT-2 style byte-level BPE so any UTF-8 text round-trips."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    return tokenizer


def build_tiny_tokenizer(model_max_length: int = 2048) -> PreTrainedTokenizerFast:
    """Wrap the trained BPE as a transformers tokenizer with SmolLM2-style specials.

    No BOS is prepended on encode (as in SmolLM2); batches pad on the left, as
    decoder-only generation needs.
    """
    # PreTrainedTokenizerFast is an alias of TokenizersBackend in transformers 5.
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=_train_tokenizer(),
        bos_token=ENDOFTEXT,
        eos_token=IM_END,
        unk_token=ENDOFTEXT,
        pad_token=ENDOFTEXT,
        extra_special_tokens=[IM_START, IM_END],  # v5 name of additional_special_tokens
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )


def build_tiny_llama(
    directory: Path,
    *,
    seed: int = 0,
    num_layers: int = 2,
    max_position_embeddings: int = 512,
) -> Path:
    """Write a tiny random Llama model plus tokenizer to ``directory`` and return it.

    The directory loads with ``AutoModelForCausalLM.from_pretrained`` and
    ``AutoTokenizer.from_pretrained``. Same arguments give identical files.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tiny_tokenizer(model_max_length=max_position_embeddings)
    tokenizer.save_pretrained(directory)

    config = LlamaConfig(
        **TINY_MODEL_CONFIG,
        vocab_size=len(tokenizer),
        num_hidden_layers=num_layers,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    # Fork the RNG so building a model does not reseed the caller's tests.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).float()  # type: ignore[no-untyped-call]
    # transformers 5 always writes model.safetensors (safe_serialization is gone).
    model.save_pretrained(directory)
    return directory
