"""OpenAI's chat completions on `groundtune serve` (``POST /v1/chat/completions``; the ``openai``
client works unchanged): the last user message's text is the phrase, its ``image_url`` (a data:
URI) the image (``chat_inputs``); a parameter the server cannot honour is a 422 naming it, another
model OpenAI's 404 (``chat_settings``); the answer is OpenAI's chat.completion with the boxes in
``groundtune`` (``chat_completion``), or with ``"stream": true`` the same as OpenAI's server-sent
events (``chat_events``).

Streaming departs from OpenAI's in one way: the model's process answers a phrase whole (a batch's
answers come out together), so the events are sent once the answer is ready, not as it is
generated: a chunk with the role, one with the whole text, one with ``finish_reason`` (and the
boxes, ``groundtune``), then OpenAI's usage chunk when ``stream_options.include_usage`` asks for
it, and ``data: [DONE]``. A client reading a stream works unchanged; it sees no text earlier than
without streaming. A mistake found before the answer (a bad image, a bad parameter) is an ordinary
4xx JSON error, not a stream."""

from __future__ import annotations

import json
import time
import uuid
from typing import NamedTuple

from groundtune.deploy.batching import Answer
from groundtune.deploy.limits import Limits
from groundtune.deploy.reading import RequestError, check_phrases, image_bytes, shown


def chat_inputs(body: dict, limits: Limits) -> tuple[bytes, str]:
    """The last user message: its text is the phrase, its image_url (a data: URI) the image.
    Earlier messages (a system prompt, earlier turns) are read for their shape only: the model
    asks with its own prompt."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(422, "missing 'messages' (a list of messages)", "messages")
    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in _ROLES:
            raise RequestError(422, f"every message must be an object with a 'role' of {', '.join(_ROLES)}; got "
                                    f"{shown(message)}", "messages")
    user = next((m for m in reversed(messages) if m["role"] == "user"), None)
    if user is None:
        raise RequestError(422, "no user message: its text is the phrase, its image_url the image", "messages")
    content = user.get("content")
    if isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise RequestError(422, "the user message needs 'content': a list of an image_url part and text parts",
                           "messages")
    texts, image_urls = [], []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "image_url":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str) or not url.startswith("data:"):
                raise RequestError(422, "image_url must be a data: URI: the server does not fetch URLs or read "
                                        "files on a caller's behalf", "messages")
            image_urls.append(url)
        else:
            raise RequestError(422, "a content part must be {'type': 'text', 'text': '...'} or {'type': 'image_url', "
                                    f"'image_url': {{'url': 'data:...'}}}}; got {shown(part)}", "messages")
    if len(image_urls) != 1:
        raise RequestError(422, f"the user message needs exactly one image_url, got {len(image_urls)}", "messages")
    phrase = check_phrases(" ".join(t.strip() for t in texts if t.strip()), limits, "messages")[0]
    return image_bytes(image_urls[0], "messages"), phrase


_ROLES = ("system", "developer", "user", "assistant", "tool", "function")

# OpenAI's chat parameters that change nothing in the answer: taken as they are, when of their type
_CHAT_NO_EFFECT = {"seed": int, "user": str, "metadata": dict, "store": bool, "service_tier": str,
                   "parallel_tool_calls": bool, "prompt_cache_key": str, "safety_identifier": str}
# Those the server cannot honour: refused unless left out, null, or their "off" value
_CHAT_UNSUPPORTED = {
    "n": ((1,), "must be 1: decoding is greedy, so every answer would be the same one"),
    "logprobs": ((False,), "is not supported: no log probabilities are returned"),
    "top_logprobs": ((), "is not supported: no log probabilities are returned"),
    "stop": (([],), "is not supported: the model's answer ends by itself"),
    "frequency_penalty": ((0, 0.0), "is not supported: decoding is greedy, without penalties"),
    "presence_penalty": ((0, 0.0), "is not supported: decoding is greedy, without penalties"),
    "logit_bias": (({},), "is not supported: decoding is greedy, without biases"),
    "tools": (([],), "are not supported: the answer is the model's text, its boxes in 'groundtune'"),
    "tool_choice": (("none",), "is not supported: there are no tools"),
    "functions": (([],), "are not supported: the answer is the model's text, its boxes in 'groundtune'"),
    "function_call": (("none",), "is not supported: there are no functions"),
    "response_format": (({"type": "text"},), "is not supported: the answer is the model's text, its boxes in "
                                              "'groundtune'"),
    "modalities": ((["text"],), "is not supported: the answer is text"),
    "audio": ((), "is not supported: the answer is text"),
    "prediction": ((), "is not supported"),
    "reasoning_effort": ((), "is not supported: the model answers without reasoning"),
    "verbosity": ((), "is not supported"),
    "web_search_options": ((), "is not supported: the server searches nothing"),
}


class ChatSettings(NamedTuple):
    max_tokens: int  # the answer's token limit
    stream: bool  # answered as server-sent events (chat_events)
    include_usage: bool  # stream_options.include_usage: a last event with the usage


def chat_settings(body: dict, model_name: str, max_new_tokens: int) -> ChatSettings:
    """OpenAI's chat parameters -> the answer's token limit (``max_completion_tokens`` or its older
    name ``max_tokens``, at most the server's --max-new-tokens) and whether it streams (``stream``,
    ``stream_options``: ``_stream_settings``). A parameter the server cannot
    honour is a 422 naming it, never ignored: there is one greedy answer (no n > 1, sampling,
    penalties, biases, stop sequences, log probabilities) in plain text (no tools, functions,
    response formats, audio). top_p is taken as it is: greedy decoding's token is always inside
    it. A model other than the served one is OpenAI's 404, ``model_not_found``."""
    def refuse(name: str, why: str):
        raise RequestError(422, f"'{name}' {why}; got {shown(body[name])}", name)

    def number(name: str, low: float, high: float, integer: bool = False):
        value = body.get(name)
        if value is None:
            return None
        kinds = (int,) if integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds) or not low <= value <= high:
            refuse(name, f"must be {'an integer' if integer else 'a number'} from {low:g} to {high:g}")
        return value

    for name, value in body.items():
        if name in ("model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stream",
                    "stream_options"):
            continue
        if name in _CHAT_NO_EFFECT:
            if value is not None and (isinstance(value, bool) != (_CHAT_NO_EFFECT[name] is bool)
                                      or not isinstance(value, _CHAT_NO_EFFECT[name])):
                refuse(name, f"must be of type {_CHAT_NO_EFFECT[name].__name__}")
        elif name in _CHAT_UNSUPPORTED:
            allowed, why = _CHAT_UNSUPPORTED[name]
            if value is not None and not any(type(value) is type(a) and value == a for a in allowed):
                refuse(name, why)
        else:
            raise RequestError(422, f"unknown parameter {shown(name)}", name[:100])
    model = body.get("model")
    if not isinstance(model, str):
        raise RequestError(422, f"'model' must be the served model's id, {model_name!r} (GET /v1/models)", "model")
    if model != model_name:
        raise RequestError(404, f"the model {shown(model, 80)} does not exist: this server serves {model_name!r}",
                           "model", code="model_not_found")
    if number("temperature", 0, 2):
        refuse("temperature", "must be 0 or left out: the server decodes greedily (a box is not sampled)")
    number("top_p", 0, 1)
    limits = [number(name, 1, 2**31 - 1, integer=True) for name in ("max_completion_tokens", "max_tokens")]
    return ChatSettings(min([max_new_tokens] + [limit for limit in limits if limit is not None]),
                        *_stream_settings(body))


def _stream_settings(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage) from ``stream`` (a boolean) and ``stream_options`` (an object of
    booleans, given with ``"stream": true`` only, as OpenAI takes it). ``include_obfuscation``
    changes nothing: there is no token-by-token stream whose sizes it would hide."""
    stream, options = body.get("stream"), body.get("stream_options")
    if stream is not None and not isinstance(stream, bool):
        raise RequestError(422, f"'stream' must be true or false; got {shown(stream)}", "stream")
    if options is None:
        return bool(stream), False
    if not stream:
        raise RequestError(422, "'stream_options' is only taken with \"stream\": true", "stream_options")
    if not isinstance(options, dict):
        raise RequestError(422, f"'stream_options' must be an object; got {shown(options)}", "stream_options")
    for name, value in options.items():
        if name not in ("include_usage", "include_obfuscation"):
            raise RequestError(422, f"unknown stream option {shown(name)}: 'include_usage' or 'include_obfuscation'",
                               "stream_options")
        if not isinstance(value, bool):
            raise RequestError(422, f"'stream_options.{name}' must be true or false; got {shown(value)}",
                               "stream_options")
    return True, options.get("include_usage", False)


def chat_completion(answered: Answer, model_name: str) -> dict:
    """OpenAI's chat.completion of ``answered``, one phrase's answer: the model's text, its usage,
    and its boxes in the caller's pixels under ``groundtune``."""
    (one,) = answered.answers
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": one.prediction.raw},
                     "finish_reason": "stop" if one.stopped else "length", "logprobs": None}],
        "usage": {"prompt_tokens": answered.prompt_tokens[0], "completion_tokens": one.tokens,
                  "total_tokens": answered.prompt_tokens[0] + one.tokens},
        # the answer's boxes in the caller's pixels (its raw text is the message above)
        "groundtune": {**{k: v for k, v in one.prediction.to_json().items() if k != "raw"},
                       "width": answered.width, "height": answered.height},
    }


def chat_events(answered: Answer, model_name: str, include_usage: bool) -> list[bytes]:
    """``chat_completion`` as OpenAI's server-sent events: chat.completion.chunk objects, the first
    with the role, the next with the whole text (none for an empty answer), then one with the
    ``finish_reason`` and, beside its choices, ``groundtune`` (the boxes); then, with
    ``include_usage``, one with empty choices and the usage (every chunk before it saying
    ``"usage": null``, as OpenAI's do); then ``data: [DONE]``. Sent after the answer is ready
    (the module's docstring)."""
    whole = chat_completion(answered, model_name)
    head = {"id": whole["id"], "object": "chat.completion.chunk", "created": whole["created"], "model": model_name}
    usage = {"usage": None} if include_usage else {}

    def chunk(delta: dict, finish_reason: str | None = None, **extra) -> dict:
        return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
                **usage, **extra}

    text = whole["choices"][0]["message"]["content"]
    chunks = [chunk({"role": "assistant", "content": ""})]
    if text:
        chunks.append(chunk({"content": text}))
    chunks.append(chunk({}, whole["choices"][0]["finish_reason"], groundtune=whole["groundtune"]))
    if include_usage:
        chunks.append({**head, "choices": [], "usage": whole["usage"]})
    # json.dumps escapes every line break: one event is one "data:" line
    return [f"data: {json.dumps(c)}\n\n".encode() for c in chunks] + [b"data: [DONE]\n\n"]
