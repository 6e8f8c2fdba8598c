"""OpenAI's request bodies, as pydantic models, and the error shape every failure answers with.

Fields outside the models are ignored, as OpenAI's API ignores them. A field with a bad value
is refused by the model (``Field`` bounds) before anything reaches the engine; the 400 names
the field and the value (``validation_error``). The sampling fields are those
``SamplingParams`` covers; ``ignore_eos`` and ``return_token_ids`` are vLLM's extensions
(``return_token_ids`` adds each choice's new ``token_ids`` to every response and chunk).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from paged_jax.engine.params import SamplingParams

__all__ = ["ChatCompletionRequest", "CompletionRequest", "error_body", "validation_error"]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    model: str | None = None
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """The engine's ``SamplingParams`` (raises ``ValueError`` naming a bad value)."""
        return SamplingParams(n=self.n, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, max_tokens=max_tokens, seed=self.seed,
                              stop=self.stop, ignore_eos=self.ignore_eos)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: one prompt (text or token ids) or a list of them."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int = Field(16, ge=1)

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or not p or isinstance(p[0], int):
            return [p]
        return list(p)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: str
    content: str | list[TextPart] | None = None

    def as_dict(self) -> dict[str, str]:
        c = self.content
        text = c if isinstance(c, str) else "".join(p.text for p in c or ())
        return {"role": self.role, "content": text}


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``. Without ``max_tokens`` (or OpenAI's newer
    ``max_completion_tokens``) a reply may fill the context: ``max_model_len`` minus the
    prompt."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def validation_error(errors: list[dict]) -> dict:
    """The 400 body for pydantic's ``errors()``: the first bad field, named with its value."""
    first = errors[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    # A union's failure names the branch tried (``str``, ``list[int]``); the field is first.
    param = loc[0] if loc else None
    where = ".".join(loc) if loc else "body"
    message = f"{where}: {first.get('msg', 'invalid value')}"
    if "input" in first and loc:
        message += f" (got {first['input']!r})"
    if len(errors) > 1:
        message += f"; {len(errors) - 1} more problem(s) in the body"
    return error_body(message, param=param, code=400)
