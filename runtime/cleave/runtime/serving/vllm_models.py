"""The request bodies of vLLM's own endpoints (vllm_api.py): ``/tokenize``, ``/detokenize``.

As vLLM takes them: ``model`` is optional (when given it must be served), other fields are
accepted and unused, and ``/tokenize`` takes either a prompt or chat messages.
"""

from __future__ import annotations

from typing import Annotated, Any, Final

from pydantic import Field, Strict, ValidationInfo, field_validator, model_validator

from cleave.runtime.serving.chat_models import Message
from cleave.runtime.serving.json_fields import APIError
from cleave.runtime.serving.prompt_fields import Prompt
from cleave.runtime.serving.request_types import Bool, Loose, Refusal, TokenId, fail

CONTEXT_SERVED: Final = "served"  # as protocol.CONTEXT_SERVED


class _VllmRequest(Loose):
    model: Annotated[str, Strict()] | None = None

    @field_validator("model")
    @classmethod
    def _served(cls, model: str | None, info: ValidationInfo) -> str | None:
        served = (info.context or {}).get(CONTEXT_SERVED)
        if model is not None and served is not None and model not in served:
            raise APIError(404, f"The model '{model}' does not exist", param="model",
                           code="model_not_found")
        return model


class TokenizePrompt(_VllmRequest):
    prompt: Prompt
    add_special_tokens: Bool = Field(True, description="The BOS, as generation adds it.")

    @model_validator(mode="before")
    @classmethod
    def _one_of(cls, data: Any) -> Any:
        if isinstance(data, dict) and ("prompt" in data) == ("messages" in data):
            raise fail("give either 'prompt' or 'messages'", "prompt")
        return data


class TokenizeChat(_VllmRequest):
    messages: Annotated[list[Message], Field(min_length=1)]
    add_special_tokens: Bool = Field(False, description="Templates write their own BOS.")


class DetokenizeRequest(_VllmRequest):
    tokens: Annotated[list[TokenId], Refusal("'tokens' must be a list of token ids")]


TokenizeRequest = TokenizePrompt | TokenizeChat  # what the OpenAPI document states


def tokenize_model(body: object) -> type[TokenizePrompt] | type[TokenizeChat]:
    """Which of the two a body is, by its fields (a pydantic union would report the errors
    of both)."""
    if isinstance(body, dict) and "messages" in body and "prompt" not in body:
        return TokenizeChat
    return TokenizePrompt
