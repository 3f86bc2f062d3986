"""Request bodies of the HTTP endpoints as pydantic models (OpenAI's and SGLang's field names).

The models check types only, strictly: `"temperature": "0.5"` or `"top_k": true` is a client bug
and becomes a 400 naming the field, not a silent conversion. Value ranges stay with the engine
(`jspec.runtime.sampling_params` names the field), so there is one place that knows them. Fields
these models do not list are ignored, as OpenAI-compatible servers do (clients send `user`,
`metadata`, ...); fields that would change the output and are not implemented are listed and
refused when set (`UNSUPPORTED`), so a request never silently gets something other than it asked.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingFields(_Body):
    """Sampling fields shared by both OpenAI endpoints: OpenAI's, then SGLang's extras."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    # SGLang's extras, read from the body as SGLang reads them
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int | None = None  # the engine's min_new_tokens
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    stop_regex: str | list[str] | None = None
    # SGLang's structured-output extras (the engine needs grammar_backend)
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    logit_bias: dict[str, float] | None = None  # OpenAI's: {token id as a string: bias in [-100, 100]}
    # Known but not implemented: refused when set (see `unsupported_field`).
    lora_path: str | None = None


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. prompt: text, token ids, or a batch of either."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None  # how many top alternatives per token (0: the chosen token's only)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message. Fields beyond role / content (name, tool_calls, ...) are kept for the template."""

    model_config = ConfigDict(strict=True, extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None


class JsonSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's response_format: "text", "json_object" (any JSON object) or "json_schema"."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_tokens: int | None = None  # None: what the context has room for
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    response_format: ResponseFormat | None = None


class GenerateRequest(_Body):
    """POST /generate (SGLang's native endpoint): the `Engine.generate` arguments as JSON.
    sampling_params stays a dict: the engine validates its keys and values and names the field."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict | list[dict] | None = None
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    rid: str | list[str] | None = None


# Field -> value that means "not asked for"; anything else is refused with a 400 naming the field.
UNSUPPORTED = {
    "lora_path": (None,),
    "best_of": (None, 1), "suffix": (None, ""), "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
}


def unsupported_field(body: BaseModel) -> str | None:
    """The first field of body that asks for something this server does not implement."""
    for field, neutral in UNSUPPORTED.items():
        if field in type(body).model_fields and getattr(body, field) not in neutral:
            return field
    return None
