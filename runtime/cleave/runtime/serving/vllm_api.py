"""What vLLM's server offers beyond OpenAI's API (issue 16): ``POST /tokenize``,
``POST /detokenize`` and ``GET /version``, in vLLM's request and response shapes, and the one
place a prompt becomes token ids, so that ``/tokenize`` counts what generation will use.

As vLLM does: a completion's text prompt gets the tokenizer's special tokens (the BOS a Llama
expects); a chat prompt gets only what its template writes (templates write their own BOS, and
a second one would change the output). A template that refuses the messages (``raise_exception``
in Jinja, e.g. roles that do not alternate) is the client's error: a 400, not a 500.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from aiohttp import web
from jinja2.exceptions import TemplateError

from cleave.runtime.serving import protocol as api
from cleave.runtime.serving.admission import Admission
from cleave.runtime.serving.response_models import (
    DetokenizeResponse,
    TokenizeResponse,
    VersionResponse,
)
from cleave.runtime.serving.responses import json_reply
from cleave.runtime.serving.vllm_models import DetokenizeRequest, TokenizePrompt, tokenize_model

# The router's body reader (its bounds, its 400): every endpoint reads bodies alike.
ReadJSON = Callable[[web.Request], Awaitable[Any]]


def _version() -> str:
    try:
        return importlib.metadata.version("cleave")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "unknown"


class Prompts:
    """Text and chat messages to token ids, and back, with the served model's tokenizer."""

    def __init__(self, tokenizer: Any, max_model_len: Callable[[], int], vocab_size: int
                 ) -> None:
        self.tokenizer = tokenizer
        self._max_model_len = max_model_len  # a call: the router learns it from its workers
        self.vocab_size = vocab_size

    @property
    def max_model_len(self) -> int:
        return self._max_model_len()

    def text_ids(self, prompt: str | Sequence[int], add_special_tokens: bool = True,
                 param: str = "prompt") -> list[int]:
        if not isinstance(prompt, str):
            ids = list(prompt)
            if any(not 0 <= t < self.vocab_size for t in ids):
                raise api.APIError(400, f"token ids must be in [0, {self.vocab_size})",
                                   param=param)
            return ids
        return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))

    def chat_ids(self, messages: list[dict[str, Any]], add_special_tokens: bool = False,
                 tools: list[dict[str, Any]] | None = None, suffix: str = "") -> list[int]:
        """``tools`` go to the template; ``suffix`` is written after its generation prompt (a
        named tool call's opening, tools.generation_suffix)."""
        try:
            text = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                      add_generation_prompt=True) + suffix
        except TemplateError as e:
            raise api.APIError(400, f"the model's chat template refused the messages: {e}",
                               param="messages") from None
        return list(self.tokenizer.encode(str(text), add_special_tokens=add_special_tokens))


class VllmEndpoints:
    def __init__(self, prompts: Prompts, served: Sequence[str], read_json: ReadJSON,
                 admission: Admission) -> None:
        self.prompts = prompts
        # The router's: these endpoints use its tokenizer too, so they take a slot and its one
        # tokenizer thread (a fast tokenizer must not run on two threads at once).
        self.admission = admission
        self.served = list(served)
        self.read_json = read_json

    def register(self, app: web.Application) -> None:
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/version", self.version)

    async def tokenize(self, request: web.Request) -> web.Response:
        """``{model?, prompt | messages, add_special_tokens?}`` -> ``{count, max_model_len,
        tokens}``; ``add_special_tokens`` defaults as for generation (true for a prompt, false
        for messages)."""
        body = await self.read_json(request)
        asked = api.validate(tokenize_model(body), body, self.served)
        with self.admission.slot():
            if isinstance(asked, TokenizePrompt):
                ids = await self.admission.off_loop(self.prompts.text_ids, asked.prompt,
                                                    asked.add_special_tokens)
            else:
                ids = await self.admission.off_loop(
                    self.prompts.chat_ids, [m.template() for m in asked.messages],
                    asked.add_special_tokens)
        return json_reply(TokenizeResponse(count=len(ids), tokens=ids,
                                           max_model_len=self.prompts.max_model_len))

    async def detokenize(self, request: web.Request) -> web.Response:
        """``{model?, tokens}`` -> ``{prompt}``."""
        asked = api.validate(DetokenizeRequest, await self.read_json(request), self.served)
        ids = self.prompts.text_ids(asked.tokens, param="tokens")  # checks the vocabulary
        with self.admission.slot():
            text = await self.admission.off_loop(self.prompts.tokenizer.decode, ids)
        return json_reply(DetokenizeResponse(prompt=str(text)))

    async def version(self, _: web.Request) -> web.Response:
        return json_reply(VersionResponse(version=_version()))
