"""OpenAI dialect: POST /v1/chat/completions and /v1/completions."""

import json
import time
import uuid
from typing import Any, ClassVar, Dict, List, Literal, Optional, Union

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from .app import (
    APIError,
    EngineSampling,
    OpenAITemperature,
    Server,
    check_effort,
    check_template_kwargs,
    check_tool_choice,
    cut_short,
    error_body,
    off_loop,
    read_request,
    sse,
)
from .tools import OutputParser, ToolCall

router = APIRouter()


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class ContentPart(_Model):
    type: str
    text: Optional[str] = None


class FunctionCall(_Model):
    name: str
    arguments: Union[str, Dict[str, Any]] = "{}"


class ToolCallIn(_Model):
    id: Optional[str] = None
    type: str = "function"
    function: FunctionCall


class Message(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, List[ContentPart], None] = None
    tool_calls: Optional[List[ToolCallIn]] = None
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None


class FunctionDef(_Model):
    name: str
    description: Optional[str] = None
    parameters: Optional[Dict[str, Any]] = None


class Tool(_Model):
    type: Literal["function"] = "function"
    function: FunctionDef


class StreamOptions(_Model):
    include_usage: bool = False


class _Sampling(_Model, EngineSampling):
    model: Optional[str] = None
    stream: Optional[bool] = False  # null as the SDK may send it: not streamed
    stream_options: Optional[StreamOptions] = None
    max_tokens: Optional[int] = None
    temperature: OpenAITemperature = None
    top_p: Optional[float] = None
    stop: Union[str, List[str], None] = None
    n: Optional[int] = Field(1, ge=1, le=1)
    # Read only to refuse them when they would change the reply (see _refuse_unsupported).
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[Dict[str, float]] = None


class ChatRequest(_Sampling):
    FOREIGN: ClassVar[Dict[str, str]] = {
        "max_output_tokens": "use 'max_completion_tokens' (or 'max_tokens')",
        "stop_sequences": "use 'stop'",
    }
    messages: List[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None
    tools: Optional[List[Tool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], Dict[str, Any], None] = None
    chat_template_kwargs: Optional[Dict[str, Any]] = None
    reasoning_effort: Optional[str] = None  # "none" turns the template's thinking off, as in /v1/responses
    response_format: Optional[Dict[str, Any]] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    # OpenAI's deprecated function calling, read to refuse it (tools replace it).
    functions: Optional[List[Dict[str, Any]]] = None
    function_call: Union[str, Dict[str, Any], None] = None


class CompletionRequest(_Sampling):
    FOREIGN: ClassVar[Dict[str, str]] = {
        "max_completion_tokens": "use 'max_tokens'",
        "max_output_tokens": "use 'max_tokens'",
        "stop_sequences": "use 'stop'",
    }
    prompt: Union[str, List[int], List[str], List[List[int]]]
    logprobs: Union[bool, int, None] = None  # false as some wrappers send it: neutral
    echo: Optional[bool] = None
    suffix: Optional[str] = None
    best_of: Optional[int] = None


def _refuse_unsupported(req: _Sampling) -> None:
    """A 400 for a field that would change the reply and is not implemented,
    rather than a reply that silently ignores it; fields at their neutral
    values (as SDKs and wrappers often send them) pass."""
    logprobs = getattr(req, "logprobs", None)
    unsupported = [
        ("presence_penalty", bool(req.presence_penalty), "use repetition_penalty"),
        ("frequency_penalty", bool(req.frequency_penalty), "use repetition_penalty"),
        ("logit_bias", bool(req.logit_bias), ""),
        # A completion's logprobs: 0 still asks for the sampled tokens' log-probabilities.
        ("logprobs", logprobs is not None and logprobs is not False, ""),
        ("top_logprobs", bool(getattr(req, "top_logprobs", None)), ""),
        ("echo", bool(getattr(req, "echo", None)), ""),
        ("suffix", bool(getattr(req, "suffix", None)), ""),
        ("best_of", (getattr(req, "best_of", None) or 1) > 1, "one completion per request"),
        ("functions", bool(getattr(req, "functions", None)), "OpenAI deprecated it: give tools"),
        ("function_call", getattr(req, "function_call", None) not in (None, "none"), "give tool_choice"),
    ]
    fmt = getattr(req, "response_format", None) or {}
    unsupported.append(("response_format", fmt.get("type", "text") != "text", "only plain text"))
    for name, given, hint in unsupported:
        if given:
            raise APIError(400, f"'{name}' is not supported by this server" + (f"; {hint}" if hint else ""), param=name)
    if req.stream_options is not None and not req.stream:
        # As OpenAI answers it: the options shape a stream, and there is none.
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")


def _one_prompt(prompt) -> Union[str, List[int]]:
    """/v1/completions' prompt: a string or token ids, or a list holding one of them."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise APIError(400, f"one prompt per request, got {len(prompt)}", param="prompt")
        return prompt[0]
    return prompt


def _text_of(content, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    out = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise APIError(400, f"{where}: only text content parts are supported, got '{part.type}'")
        out.append(part.text)
    return "".join(out)


def template_messages(messages: List[Message]) -> List[dict]:
    """OpenAI messages as the chat template expects them (tool-call arguments as objects)."""
    out = []
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        msg: Dict[str, Any] = {"role": role, "content": _text_of(m.content, f"messages[{i}]")}
        if m.reasoning_content:
            msg["reasoning_content"] = m.reasoning_content
        if m.tool_calls:
            calls = []
            for tc in m.tool_calls:
                args = tc.function.arguments
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except ValueError:
                        raise APIError(400, f"messages[{i}]: tool call arguments are not valid JSON") from None
                if not isinstance(args, dict):  # templates iterate them as name -> value
                    raise APIError(400, f"messages[{i}]: tool call arguments must be a JSON object")
                calls.append(
                    {"id": tc.id, "type": "function", "function": {"name": tc.function.name, "arguments": args}}
                )
            msg["tool_calls"] = calls
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def _stops(stop) -> List[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


def _usage(d: Dict[str, Any]) -> dict:
    return {
        "prompt_tokens": d["prompt_tokens"],
        "completion_tokens": d["generated_tokens"],
        "total_tokens": d["prompt_tokens"] + d["generated_tokens"],
        "prompt_tokens_details": {"cached_tokens": d["cached_tokens"]},
    }


def _tool_json(c: ToolCall, index: Optional[int] = None) -> dict:
    out = {"id": "call_" + c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_json}}
    if index is not None:
        out = {"index": index, **out}
    return out


def _finish(reason: str, tool_calls: bool) -> str:
    if reason == "stop" and tool_calls:
        return "tool_calls"
    return "length" if reason == "length" else "stop"


async def _collect(server: Server, request: Request, job, parser: Optional[OutputParser]):
    """Run a job to its end: (text, reasoning, tool calls, finish, stats)."""
    text, reasoning, calls = [], [], []

    def take(events):
        for kind, v in events:
            (text if kind == "text" else reasoning if kind == "reasoning" else calls).append(v)

    async for ev in server.events(job, request):
        if ev[0] == "text":
            take(parser.feed(ev[1]) if parser else [("text", ev[1])])
        elif ev[0] == "error":
            raise APIError(ev[1], ev[2])
        else:
            if parser:
                take(parser.finish(cut=cut_short(ev)))
            return "".join(text), "".join(reasoning), calls, ev[1], ev[2]
    raise APIError(499, "client closed the request")


def _start(server: Server, ids, req, max_tokens: int, template_kwargs=None):
    return server.submit(ids, server.config(req, max_tokens), _stops(req.stop), template_kwargs)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    server: Server = request.app.state.server
    req: ChatRequest = await read_request(request, ChatRequest, server.settings.max_body_bytes)
    server.check_model(req.model)
    _refuse_unsupported(req)
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        raise APIError(400, "give max_tokens or max_completion_tokens, not both", param="max_tokens")
    if req.max_completion_tokens is not None:
        max_tokens = server.check_max_tokens(req.max_completion_tokens, "max_completion_tokens")
    else:
        max_tokens = server.check_max_tokens(req.max_tokens, "max_tokens")
    # tool_choice "none" hides the tools; other choices are hints (no constrained decoding).
    check_tool_choice(
        req.tool_choice,
        [t.function.name for t in req.tools or []],
        lambda c: (c.get("function") or {}).get("name") if c.get("type") == "function" else None,
    )
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []] if req.tool_choice != "none" else []
    kwargs = check_template_kwargs(req.chat_template_kwargs)
    if check_effort(req.reasoning_effort, "reasoning_effort") is not None:
        kwargs.setdefault("enable_thinking", req.reasoning_effort != "none")
    ids, thinking = await off_loop(server.render_chat, template_messages(req.messages), tools, kwargs)
    job = _start(server, ids, req, max_tokens, kwargs)
    parser = OutputParser(reasoning=thinking, tools=tools, joined=True)
    cid, created, model = "chatcmpl-" + uuid.uuid4().hex[:24], int(time.time()), server.settings.model_id

    if not req.stream:
        text, reasoning, calls, finish, d = await _collect(server, request, job, parser)
        msg: Dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
        if reasoning:
            msg["reasoning_content"] = reasoning
        if calls:
            msg["tool_calls"] = [_tool_json(c) for c in calls]
        return JSONResponse(
            {
                "id": cid,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [
                    {"index": 0, "message": msg, "finish_reason": _finish(finish, bool(calls)), "logprobs": None}
                ],
                "usage": _usage(d),
            }
        )

    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunk(delta, finish=None):
        return sse(
            {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
                **({"usage": None} if include_usage else {}),  # OpenAI's: null but in the last chunk
            }
        )

    async def stream():
        yield chunk({"role": "assistant", "content": ""})
        n_calls = 0

        def render(events):
            nonlocal n_calls
            for kind, v in events:
                if kind == "text":
                    yield chunk({"content": v})
                elif kind == "reasoning":
                    yield chunk({"reasoning_content": v})
                else:
                    yield chunk({"tool_calls": [_tool_json(v, n_calls)]})
                    n_calls += 1

        async for ev in server.events(job, request):
            if ev[0] == "text":
                for c in render(parser.feed(ev[1])):
                    yield c
            elif ev[0] == "error":
                yield sse(error_body(request.url.path, ev[1], ev[2]))
                return
            else:
                for c in render(parser.finish(cut=cut_short(ev))):
                    yield c
                yield chunk({}, _finish(ev[1], n_calls > 0))
                if include_usage:
                    yield sse(
                        {
                            "id": cid,
                            "object": "chat.completion.chunk",
                            "created": created,
                            "model": model,
                            "choices": [],
                            "usage": _usage(ev[2]),
                        }
                    )
                yield "data: [DONE]\n\n"

    return server.event_stream(stream(), job)


@router.post("/v1/completions")
async def completions(request: Request):
    server: Server = request.app.state.server
    req: CompletionRequest = await read_request(request, CompletionRequest, server.settings.max_body_bytes)
    server.check_model(req.model)
    _refuse_unsupported(req)
    max_tokens = server.check_max_tokens(req.max_tokens, "max_tokens")
    prompt = _one_prompt(req.prompt)
    if isinstance(prompt, str) and not prompt:
        raise APIError(400, "empty prompt", param="prompt")
    ids = await off_loop(server.encode_text, prompt)
    job = _start(server, ids, req, max_tokens)
    cid, created, model = "cmpl-" + uuid.uuid4().hex[:24], int(time.time()), server.settings.model_id

    if not req.stream:
        text, _, _, finish, d = await _collect(server, request, job, None)
        return JSONResponse(
            {
                "id": cid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [{"index": 0, "text": text, "finish_reason": _finish(finish, False), "logprobs": None}],
                "usage": _usage(d),
            }
        )

    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunk(text, finish=None):
        return sse(
            {
                "id": cid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
                **({"usage": None} if include_usage else {}),  # OpenAI's: null but in the last chunk
            }
        )

    async def stream():
        async for ev in server.events(job, request):
            if ev[0] == "text":
                if ev[1]:
                    yield chunk(ev[1])
            elif ev[0] == "error":
                yield sse(error_body(request.url.path, ev[1], ev[2]))
                return
            else:
                yield chunk("", _finish(ev[1], False))
                if include_usage:
                    yield sse(
                        {
                            "id": cid,
                            "object": "text_completion",
                            "created": created,
                            "model": model,
                            "choices": [],
                            "usage": _usage(ev[2]),
                        }
                    )
                yield "data: [DONE]\n\n"

    return server.event_stream(stream(), job)
