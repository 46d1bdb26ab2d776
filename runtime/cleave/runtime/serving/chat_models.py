"""The chat request's parts as pydantic models: messages (by role), their text parts and tool
calls, the function tools and the choice of call (the structured-output fields, on both
endpoints: structured_models.py). The request models (protocol.py) are built from these; the
OpenAPI document is generated from them (openapi.py).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Annotated, Any, Final, Literal

from pydantic import (
    BeforeValidator,
    Discriminator,
    Field,
    Strict,
    Tag,
    TypeAdapter,
    ValidationError,
)

from cleave.runtime.serving.request_types import Body, Bool, Loose, Refusal, Text, fail

JSONObject = dict[str, Any]
ROLES: Final = ("system", "user", "assistant", "developer", "tool")
MAX_TOOLS: Final = 128  # OpenAI's limit on tools


# -- messages --------------------------------------------------------------------------------

class TextPart(Loose):
    type: Literal["text"]
    text: Text


_PART: Final = TypeAdapter(TextPart)


def _joined(v: object) -> object:
    """A list of text parts is their text, joined as vLLM joins them; a string stays one."""
    if not isinstance(v, list):
        return v  # the strict string check follows
    texts = []
    for j, part in enumerate(v):
        try:
            texts.append(_PART.validate_python(part).text)
        except ValidationError:
            raise fail('{param} must be {"type": "text", "text": <string>}; only text is '
                       "supported", sub=f"[{j}]") from None
    return "\n".join(texts)


Content = Annotated[Text, BeforeValidator(_joined, json_schema_input_type=str | list[TextPart])]


class FunctionCall(Loose):
    name: Text
    arguments: Text  # JSON text, as the model wrote it


class ToolCall(Loose):
    """A call an assistant made, as a request sends it back."""
    id: Text = ""
    type: Literal["function"] = "function"
    function: FunctionCall

    def template(self) -> JSONObject:
        """As templates take it: arguments as an object (they print them with ``tojson``), as
        vLLM passes them; text that is not JSON is passed on as the model wrote it."""
        try:
            args: object = json.loads(self.function.arguments)
        except ValueError:
            args = self.function.arguments
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name, "arguments": args}}


class _Message(Loose):
    content: Content

    def template(self) -> JSONObject:
        """The message as chat templates take it (``apply_chat_template``)."""
        return {"role": getattr(self, "role"), "content": self.content}  # noqa: B009


class PlainMessage(_Message):
    role: Literal["system", "user", "developer"]
    tool_calls: None = Field(None, description="Only assistant messages have tool calls.")


class ToolMessage(_Message):
    """A tool's result. ``tool_call_id`` is optional, as vLLM takes it (Llama's and Qwen's
    templates do not use it)."""
    role: Literal["tool"]
    tool_call_id: Text | None = None
    tool_calls: None = Field(None, description="Only assistant messages have tool calls.")

    def template(self) -> JSONObject:
        out = super().template()
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class AssistantMessage(_Message):
    """An assistant turn; its content may be null (OpenAI's tool-call turns)."""
    role: Literal["assistant"]
    content: Content = ""
    tool_calls: tuple[ToolCall, ...] = ()

    def template(self) -> JSONObject:
        out = super().template()
        if self.tool_calls:
            out["tool_calls"] = [c.template() for c in self.tool_calls]
        return out


def continued(messages: Sequence[_Message]) -> str:
    """What chat's ``echo`` puts in front of each choice's content (vLLM's): the last message's,
    when it is the assistant's (the answer continues it, as the same role)."""
    last = messages[-1]
    return last.content if isinstance(last, AssistantMessage) else ""


def _role_tag(v: Any) -> str | None:
    if not isinstance(v, dict):
        return "<plain>"  # refused there as not an object
    role = v.get("role")
    if not isinstance(role, str) or role not in ROLES:
        return None
    return {"assistant": "<assistant>", "tool": "<tool>"}.get(role, "<plain>")


# Tags are <...>: request_types.param_of leaves them out of the field's name.
Message = Annotated[
    Annotated[PlainMessage, Tag("<plain>")] | Annotated[AssistantMessage, Tag("<assistant>")]
    | Annotated[ToolMessage, Tag("<tool>")],
    Discriminator(_role_tag, custom_error_type="cleave", custom_error_message="{message}",
                  custom_error_context={"message": f"{{param}} must be one of {ROLES}",
                                        "param": None, "sub": ".role"})]


# -- tools -----------------------------------------------------------------------------------

FunctionName = Annotated[str, Strict(), Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class FunctionDef(Body):
    name: FunctionName
    description: Text | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object",
                                                                "properties": {}})
    strict: Bool = Field(False, description="Only with 'required' or a named tool_choice "
                         "(the grammar holds it).")


class Tool(Body):
    type: Literal["function"]
    function: FunctionDef

    def as_json(self) -> JSONObject:
        """The tool as tools.ToolRequest holds it (keys in the order templates print)."""
        fn = self.function
        out: JSONObject = {"name": fn.name, "parameters": fn.parameters, "strict": fn.strict}
        if fn.description is not None:
            out["description"] = fn.description
        return {"type": "function", "function": out}


class NamedFunction(Loose):
    name: FunctionName


class NamedChoice(Loose):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Annotated[
    Literal["none", "auto", "required"] | NamedChoice,
    Refusal("'tool_choice' must be 'none', 'auto', 'required' or "
            '{"type": "function", "function": {"name": ...}}'),
    Field(description="A named function must be in tools.")]
