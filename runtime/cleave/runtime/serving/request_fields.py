"""The request fields the router accepts without honouring them (issue 16).

A field nobody defined is a 400 naming it (the request models forbid unknown fields): a typo
(``max_token``) or a feature of another server would otherwise be ignored and the client get
something other than it asked for. vLLM's extensions that Cleave does not implement, which
clients written for vLLM send, are accepted only at the values that change nothing here
(``use_beam_search: false``) or as JSON null ("not given"), and refused with a 400 naming them
otherwise. ``protocol.py`` adds these tables to its models as fields (prompt_fields.no_op_fields),
so that the OpenAPI document generated from them states them too.
"""

from __future__ import annotations

from typing import Final

# Accepted with any value and ignored: they change nothing in the output (an end-user id, a
# caching hint, request metadata).
IGNORED: Final = frozenset({"user", "metadata", "prompt_cache_key", "safety_identifier"})
# Fields accepted at the listed values only (besides null), because at those values they ask
# for nothing Cleave does not do. Anything else: 400 naming the field.
_NO_OP_COMMON: Final[dict[str, tuple[object, ...]]] = {
    # OpenAI's: storing completions, and a choice of service tier, are not offered.
    "store": (False,), "service_tier": ("auto", "default"),
    # vLLM's other sampling extensions.
    "length_penalty": (1, 1.0), "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,),
    "use_beam_search": (False,), "truncate_prompt_tokens": (),
    "allowed_token_ids": (), "bad_words": ([],), "priority": (0,), "request_id": (),
    "logits_processors": (), "return_tokens_as_token_ids": (False,),
    "return_token_ids": (False,), "kv_transfer_params": (),
    "vllm_xargs": (),
    # vLLM's other structured outputs: structural tags, a choice of backend and of the
    # whitespace JSON may hold.
    "structural_tag": (), "guided_decoding_backend": (),
    "guided_whitespace_pattern": ()}
COMPLETION_NO_OPS: Final[dict[str, tuple[object, ...]]] = {
    **_NO_OP_COMMON, "add_special_tokens": (True,)}
CHAT_NO_OPS: Final[dict[str, tuple[object, ...]]] = {
    **_NO_OP_COMMON,
    # OpenAI's deprecated form of tools: refused unless empty, 'tools' replaces it.
    "functions": ([],), "function_call": ("none", "auto"),
    "add_generation_prompt": (True,), "continue_final_message": (False,),
    "add_special_tokens": (False,), "documents": (), "chat_template": (),
    "chat_template_kwargs": (), "mm_processor_kwargs": (), "reasoning_effort": (),
    "modalities": (["text"],), "audio": (), "prediction": (), "web_search_options": ()}

