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
from cleave.runtime.serving.json_fields import read_bool
from cleave.runtime.serving.protocol import _messages, _prompt

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

    def _body(self, body: object) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise api.APIError(400, "the request body must be a JSON object")
        model = body.get("model")  # optional, as in vLLM; when given it must be served
        if model is not None and model not in self.served:
            raise api.APIError(404, f"The model '{model}' does not exist", param="model",
                               code="model_not_found")
        return body

    async def tokenize(self, request: web.Request) -> web.Response:
        """``{model?, prompt | messages, add_special_tokens?}`` -> ``{count, max_model_len,
        tokens}``; ``add_special_tokens`` defaults as for generation (true for a prompt, false
        for messages)."""
        body = self._body(await self.read_json(request))
        if ("prompt" in body) == ("messages" in body):
            raise api.APIError(400, "give either 'prompt' or 'messages'", param="prompt")
        special = read_bool(body, "add_special_tokens")
        with self.admission.slot():
            if "prompt" in body:
                ids = await self.admission.off_loop(self.prompts.text_ids,
                                                    _prompt(body["prompt"]),
                                                    True if special is None else special)
            else:
                messages = [m.template() for m in _messages(body["messages"])]
                ids = await self.admission.off_loop(self.prompts.chat_ids, messages,
                                                    bool(special))
        return web.json_response({"count": len(ids), "max_model_len": self.prompts.max_model_len,
                                  "tokens": ids, "token_strs": None})

    async def detokenize(self, request: web.Request) -> web.Response:
        """``{model?, tokens}`` -> ``{prompt}``."""
        body = self._body(await self.read_json(request))
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise api.APIError(400, "'tokens' must be a list of token ids", param="tokens")
        ids = self.prompts.text_ids(tokens, param="tokens")  # checks the vocabulary bounds
        with self.admission.slot():
            text = await self.admission.off_loop(self.prompts.tokenizer.decode, ids)
        return web.json_response({"prompt": str(text)})

    async def version(self, _: web.Request) -> web.Response:
        return web.json_response({"version": _version()})
