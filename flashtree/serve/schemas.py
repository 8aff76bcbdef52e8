"""OpenAI request bodies, validated strictly so that a wrong type or an unknown field becomes a 400 naming it.

Fields of OpenAI's API that flashtree does not implement are accepted only at their "off" values: any
other value would change the result, so it is refused rather than silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

# Result-changing fields flashtree does not implement, and the values that leave the result unchanged
# (null is always fine). Values are compared with their JSON type, so `false` is not taken for `0`.
NOT_IMPLEMENTED: dict[str, tuple] = {
    "n": (1,),
    "best_of": (1,),
    "echo": (False,),
    "suffix": ("",),
    "logprobs": (False,),
    "top_logprobs": (0,),
    "logit_bias": ({},),
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "response_format": ({"type": "text"},),
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
    "reasoning_effort": (),
    "web_search_options": (),
}

# Fields that never change the generated text: accepted and ignored.
IGNORED = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls"})


MAX_STOP = 16  # stop strings per request (OpenAI allows 4); each is matched after every step
MAX_STOP_CHARS = 1024


def _null_is(default: Any) -> BeforeValidator:
    """null means the default, as OpenAI reads it."""
    return BeforeValidator(lambda value: default if value is None else value)


def _stop_list(value: Any) -> Any:
    """`stop` may be null, one string or a list of strings; the engine takes a list."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return value


def _is_text_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)


def _text_content(value: Any) -> Any:
    """Message content: a string, or a list of text parts joined by newlines (as vLLM does)."""
    if isinstance(value, list):
        if not all(_is_text_part(p) for p in value):
            raise ValueError("only text content parts are supported: {'type': 'text', 'text': ...}")
        return "\n".join(p["text"] for p in value)
    return value


def _single_prompt(value: Any) -> Any:
    """`prompt`: a string or a list of token ids; a one-element batch of either is unwrapped."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return value
    raise ValueError("prompt must be one string or one list of token ids (batches are not supported)")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: Annotated[bool, _null_is(False)] = False


class _GenerationRequest(BaseModel):
    """Fields shared by /v1/chat/completions and /v1/completions. Defaults are OpenAI's."""

    # extra="allow" so that not-implemented and ignored fields reach `unsupported_field`.
    model_config = ConfigDict(extra="allow", strict=True)

    # null is accepted wherever OpenAI accepts it, and means the default.
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: Annotated[float, _null_is(1.0), Field(ge=0.0, le=2.0, allow_inf_nan=False)] = 1.0
    top_p: Annotated[float, _null_is(1.0), Field(gt=0.0, le=1.0, allow_inf_nan=False)] = 1.0
    # top_k is not OpenAI's: the vLLM/llama.cpp extension, where -1 also means "off"
    top_k: Annotated[int, _null_is(0), Field(ge=-1)] = 0
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 64)  # None: a fresh random seed per request
    stop: Annotated[
        list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]],
        BeforeValidator(_stop_list),
        Field(max_length=MAX_STOP),
    ] = []
    stream: Annotated[bool, _null_is(False)] = False
    stream_options: StreamOptions | None = None

    def unsupported_field(self) -> tuple[str, str] | None:
        """(field, reason) for the first extra field that is unknown or set to a value we cannot honor."""
        for name, value in (self.model_extra or {}).items():
            if name in IGNORED or value is None:
                continue
            if name not in NOT_IMPLEMENTED:
                return name, f"Unrecognized request argument supplied: {name}"
            if not any(type(value) is type(ok) and value == ok for ok in NOT_IMPLEMENTED[name]):
                return name, f"{name}={value!r} is not supported by flashtree"
        return None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[str, BeforeValidator(_text_content)]
    name: str | None = None

    def for_template(self) -> dict:
        # Chat templates know no "developer" role; OpenAI treats it as the system prompt.
        return {"role": "system" if self.role == "developer" else self.role, "content": self.content}


class ChatCompletionRequest(_GenerationRequest):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_GenerationRequest):
    prompt: Annotated[str | list[int], BeforeValidator(_single_prompt)]

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens
