"""Which request fields the router knows, and which values of them it honours (issue 16).

A field nobody defined is a 400 naming it: a typo (``max_token``) or a feature of another
server would otherwise be ignored and the client get something other than it asked for. vLLM's
extensions, which clients written for vLLM send, are accepted only at the values that change
nothing here (``repetition_penalty: 1``) or as JSON null ("not given"), and refused with a 400
naming them otherwise: the protocol module's rule for OpenAI's own unsupported fields.

``protocol.py`` validates the fields it honours; ``openapi.py`` states this table as schema.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

# Accepted with any value and ignored: they change nothing in the output (an end-user id, a
# caching hint, request metadata).
IGNORED: Final = frozenset({"user", "metadata", "prompt_cache_key", "safety_identifier"})
# Tool calling, validated by tools.py: chat only (with CHAT_FIELDS).
TOOL_FIELDS: Final = frozenset({"tools", "tool_choice", "parallel_tool_calls"})
# OpenAI's fields the router validates itself (protocol.py), by endpoint.
_COMMON: Final = IGNORED | frozenset({
    "model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop",
    "presence_penalty", "frequency_penalty", "logit_bias", "seed", "logprobs",
    # vLLM's, honoured:
    "top_k", "ignore_eos", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids",
    "cache_salt",
    # Structured outputs (structured_fields.py): OpenAI's, on both endpoints as vLLM takes
    # it, and vLLM's.
    "response_format", "guided_json", "guided_regex", "guided_choice", "structured_outputs"})
COMPLETION_FIELDS: Final = _COMMON | {"prompt", "echo", "best_of", "suffix"}
CHAT_FIELDS: Final = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools"}

# Fields accepted at the listed values only (besides null), because at those values they ask
# for nothing Cleave does not do. Anything else: 400 naming the field.
_NO_OP_COMMON: Final[dict[str, tuple[object, ...]]] = {
    # OpenAI's: storing completions, and a choice of service tier, are not offered.
    "store": (False,), "service_tier": ("auto", "default"),
    # vLLM's other sampling extensions. prompt_logprobs: the forward computes logits only
    # where a token is sampled (and cached prefix tokens have none), so they are not offered.
    "length_penalty": (1, 1.0), "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,),
    "use_beam_search": (False,), "truncate_prompt_tokens": (), "prompt_logprobs": (),
    "allowed_token_ids": (), "bad_words": ([],), "priority": (0,), "request_id": (),
    "logits_processors": (), "return_tokens_as_token_ids": (False,),
    "return_token_ids": (False,), "kv_transfer_params": (),
    "vllm_xargs": (),
    # vLLM's other structured outputs: grammars in its EBNF dialects, structural tags, a choice
    # of backend and of the whitespace JSON may hold.
    "guided_grammar": (), "structural_tag": (), "guided_decoding_backend": (),
    "guided_whitespace_pattern": ()}
COMPLETION_NO_OPS: Final[dict[str, tuple[object, ...]]] = {
    **_NO_OP_COMMON, "add_special_tokens": (True,)}
CHAT_NO_OPS: Final[dict[str, tuple[object, ...]]] = {
    **_NO_OP_COMMON,
    # OpenAI's deprecated form of tools: refused unless empty, 'tools' replaces it.
    "functions": ([],), "function_call": ("none", "auto"),
    "echo": (False,), "add_generation_prompt": (True,), "continue_final_message": (False,),
    "add_special_tokens": (False,), "documents": (), "chat_template": (),
    "chat_template_kwargs": (), "mm_processor_kwargs": (), "reasoning_effort": (),
    "modalities": (["text"],), "audio": (), "prediction": (), "web_search_options": ()}


def _same(value: object, allowed: object) -> bool:
    """JSON equality: ``true`` is not ``1`` (Python's ``True == 1`` is)."""
    if isinstance(value, bool) or isinstance(allowed, bool):
        return value is allowed
    return value == allowed


def refused_field(body: Mapping[str, object], known: frozenset[str],
                  no_ops: Mapping[str, tuple[object, ...]]) -> tuple[str, str] | None:
    """The first field of ``body`` the router must refuse, with why; None when there is none."""
    for name, value in body.items():
        if name in known:
            continue
        if name not in no_ops:  # even as null: a misspelt name is an error whatever its value
            return name, f"unknown field '{name}'"
        if value is not None and not any(_same(value, ok) for ok in no_ops[name]):
            shown = ", ".join(repr(ok) for ok in no_ops[name])
            return name, (f"'{name}' is not supported" +
                          (f"; only {shown} is accepted" if shown else ""))
    return None
