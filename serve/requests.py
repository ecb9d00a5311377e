"""Checking a GenerateRequest and turning it into what the engine takes.

Every check names the field at fault: the server answers INVALID_ARGUMENT with that message and
never lets a bad request reach the engine.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
import uuid

from dspark_jax.prompts import encode_chat
from dspark_jax.sampling import SamplingParams

ROLES = ("system", "user", "assistant")
DEFAULT_MAX_NEW_TOKENS = 128
MAX_TEMPERATURE = 2.0
MAX_STOPS = 16
MAX_STOP_CHARS = 256
MAX_REQUEST_ID_CHARS = 256


class InvalidRequest(ValueError):
    """A request the server cannot take; the message starts with the field's name."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the serving engine can take."""

    vocab_size: int
    max_context: int  # prompt + new tokens + the engine's extra positions
    extra_positions: int = 0  # positions a speculative round may write past the last committed token


@dataclasses.dataclass(frozen=True)
class Prepared:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stops: tuple[str, ...]


def _prompt_ids(request, tokenizer, limits: Limits) -> list[int]:
    kind = request.WhichOneof("input")
    if kind is None:
        raise InvalidRequest("input", "set one of prompt, messages or token_ids")
    if kind == "token_ids":
        ids = list(request.token_ids.ids)
        if not ids:
            raise InvalidRequest("token_ids", "empty")
        bad = [t for t in ids if not 0 <= t < limits.vocab_size]
        if bad:
            raise InvalidRequest("token_ids", f"ids outside the vocabulary [0, {limits.vocab_size}): {bad[:5]}")
        return ids
    if tokenizer is None:
        raise InvalidRequest(kind, "this model has no tokenizer; send token_ids")
    if kind == "prompt":
        if not request.prompt:
            raise InvalidRequest("prompt", "empty")
        chat = request.chat if request.HasField("chat") else True
        if not chat:
            return list(tokenizer(request.prompt, add_special_tokens=True)["input_ids"])
        messages = [{"role": "user", "content": request.prompt}]
    else:
        if not request.messages.messages:
            raise InvalidRequest("messages", "empty")
        messages = []
        for i, m in enumerate(request.messages.messages):
            if m.role not in ROLES:
                raise InvalidRequest(f"messages[{i}].role", f"unknown role {m.role!r}; expected one of {', '.join(ROLES)}")
            messages.append({"role": m.role, "content": m.content})
    if tokenizer.chat_template is None:
        raise InvalidRequest(kind, "the model's tokenizer has no chat template; send prompt with chat=false")
    try:
        return encode_chat(tokenizer, messages)
    except Exception as err:  # the template itself may refuse a conversation (e.g. role order)
        raise InvalidRequest(kind, f"the chat template refused it: {err}") from None


def prepare(request, tokenizer, limits: Limits) -> Prepared:
    """Validate `request` (a dspark.v1.GenerateRequest) and tokenize its input."""
    request_id = request.request_id or uuid.uuid4().hex
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest("request_id", f"longer than {MAX_REQUEST_ID_CHARS} characters")
    max_new = request.max_new_tokens if request.HasField("max_new_tokens") else DEFAULT_MAX_NEW_TOKENS
    if max_new < 1:
        raise InvalidRequest("max_new_tokens", f"must be >= 1, got {max_new}")
    room = limits.max_context - limits.extra_positions - 1
    if max_new > room:
        raise InvalidRequest("max_new_tokens", f"{max_new} exceeds the context: at most {room} new tokens fit")
    temperature = request.temperature if request.HasField("temperature") else 0.0
    if not math.isfinite(temperature) or not 0.0 <= temperature <= MAX_TEMPERATURE:
        raise InvalidRequest("temperature", f"must be in [0, {MAX_TEMPERATURE}], got {temperature}")
    top_k = request.top_k if request.HasField("top_k") else 0
    if top_k < 0:
        raise InvalidRequest("top_k", f"must be >= 0 (0: no filter), got {top_k}")
    top_p = request.top_p if request.HasField("top_p") else 1.0
    if not math.isfinite(top_p) or not 0.0 < top_p <= 1.0:
        raise InvalidRequest("top_p", f"must be in (0, 1], got {top_p}")
    stops = tuple(request.stop)
    if len(stops) > MAX_STOPS:
        raise InvalidRequest("stop", f"at most {MAX_STOPS} stop strings, got {len(stops)}")
    for i, s in enumerate(stops):
        if not s or len(s) > MAX_STOP_CHARS:
            raise InvalidRequest(f"stop[{i}]", f"must be 1 to {MAX_STOP_CHARS} characters")
    ids = _prompt_ids(request, tokenizer, limits)
    need = len(ids) + max_new + limits.extra_positions
    if len(ids) + 1 + limits.extra_positions > limits.max_context:
        raise InvalidRequest(request.WhichOneof("input"),
                             f"the prompt has {len(ids)} tokens; the context holds {limits.max_context}")
    if need > limits.max_context:
        raise InvalidRequest("max_new_tokens", f"the prompt has {len(ids)} tokens, so at most "
                             f"{limits.max_context - len(ids) - limits.extra_positions} new tokens fit "
                             f"in the context of {limits.max_context}; got {max_new}")
    seed = request.seed if request.HasField("seed") else secrets.randbits(62)
    params = SamplingParams(temperature=float(temperature), top_k=int(top_k) or None,
                            top_p=None if top_p >= 1.0 else float(top_p), seed=int(seed) % (2**63),
                            max_new_tokens=int(max_new), ignore_eos=bool(request.ignore_eos))
    return Prepared(request_id=request_id, prompt_ids=[int(t) for t in ids], params=params, stops=stops)
