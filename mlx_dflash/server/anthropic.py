"""Anthropic dialect: POST /v1/messages (and /v1/messages/count_tokens)."""

import uuid
from typing import Any, ClassVar, Dict, List, Literal, Optional, Union

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from .app import (
    ANTHROPIC_CLIENT_TOOLS,
    APIError,
    EngineSampling,
    Server,
    check_client_tool,
    cut_short,
    error_body,
    off_loop,
    read_request,
    sse,
)
from .tools import OutputParser

router = APIRouter()


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class Block(_Model):
    type: str
    text: Optional[str] = None
    thinking: Optional[str] = None
    id: Optional[str] = None
    name: Optional[str] = None
    input: Optional[Dict[str, Any]] = None
    tool_use_id: Optional[str] = None
    content: Union[str, List["Block"], None] = None
    is_error: Optional[bool] = None


class Message(_Model):
    role: Literal["user", "assistant"]
    content: Union[str, List[Block]]


class Tool(_Model):
    name: str
    type: Optional[str] = None
    description: Optional[str] = None
    input_schema: Dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class ToolChoice(_Model):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None


class Thinking(_Model):
    type: Literal["enabled", "disabled", "adaptive"]  # adaptive: the template's default
    budget_tokens: Optional[int] = None


class CountRequest(_Model):
    model: str
    messages: List[Message] = Field(min_length=1)
    system: Union[str, List[Block], None] = None
    tools: Optional[List[Tool]] = None
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[Thinking] = None
    output_config: Optional[Dict[str, Any]] = None  # read to refuse a structured-output format


class MessagesRequest(CountRequest, EngineSampling):
    FOREIGN: ClassVar[Dict[str, str]] = {
        "max_completion_tokens": "use 'max_tokens'",
        "max_output_tokens": "use 'max_tokens'",
        "stop": "use 'stop_sequences'",
    }
    max_tokens: int
    stop_sequences: Optional[List[str]] = None
    stream: Optional[bool] = False
    temperature: Optional[float] = Field(default=None, ge=0, le=1)  # Anthropic's range
    top_p: Optional[float] = None


def _text(blocks, where: str) -> str:
    if blocks is None:
        return ""
    if isinstance(blocks, str):
        return blocks
    out = []
    for b in blocks:
        if b.type != "text" or b.text is None:
            raise APIError(400, f"{where}: only text blocks are supported here, got '{b.type}'")
        out.append(b.text)
    return "".join(out)  # as the other dialects (and mlx-lm, and the chat template itself) join parts


def template_messages(req: CountRequest) -> List[dict]:
    """Anthropic messages as chat-template messages (OpenAI roles, tool calls with object arguments)."""
    out: List[Dict[str, Any]] = []
    system = _text(req.system, "system")
    if system:
        out.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        where = f"messages[{i}]"
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        text, reasoning, calls = [], [], []
        for b in m.content:
            if b.type == "text":
                text.append(b.text or "")
            elif b.type == "thinking" and m.role == "assistant":
                reasoning.append(b.thinking or "")
            elif b.type == "redacted_thinking":
                continue
            elif b.type == "tool_use" and m.role == "assistant":
                if not b.name:
                    raise APIError(400, f"{where}: tool_use block without a name")
                calls.append({"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input or {}}})
            elif b.type == "tool_result" and m.role == "user":
                content = _text(b.content, f"{where} tool_result")
                out.append({"role": "tool", "content": content, "tool_call_id": b.tool_use_id})
            else:
                raise APIError(400, f"{where}: content block type '{b.type}' is not supported in a {m.role} message")
        if m.role == "user" and not text and any(b.type == "tool_result" for b in m.content):
            continue  # only tool results: they are the tool messages above
        msg: Dict[str, Any] = {"role": m.role, "content": "".join(text)}
        if reasoning:
            msg["reasoning_content"] = "".join(reasoning)
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def _tools(req: CountRequest) -> List[dict]:
    for i, t in enumerate(req.tools or []):
        check_client_tool(t.type, f"tools[{i}]", ANTHROPIC_CLIENT_TOOLS)
    if req.tool_choice is not None and req.tool_choice.type == "none":
        return []
    # Server-side tools (web search, ...) have a type and no schema: nothing here can run them.
    return [
        {
            "type": "function",
            "function": {"name": t.name, "description": t.description or "", "parameters": t.input_schema},
        }
        for t in req.tools or []
        if t.type in (None, "custom")
    ]


def _template_kwargs(req: CountRequest) -> Dict[str, Any]:
    if req.thinking is not None and req.thinking.type in ("enabled", "disabled"):
        return {"enable_thinking": req.thinking.type == "enabled"}
    return {}


def _prompt(server: Server, req: CountRequest, check: bool = True):
    fmt = (req.output_config or {}).get("format")
    if fmt:
        raise APIError(400, "output_config.format is not supported by this server; only plain text")
    tools = _tools(req)
    choice = req.tool_choice
    if choice is not None and choice.type in ("any", "tool") and not req.tools:
        raise APIError(400, f"tool_choice of type '{choice.type}' needs tools")
    if choice is not None and choice.type == "tool" and not choice.name:
        raise APIError(400, "tool_choice of type 'tool' needs the tool's 'name'")
    if choice is not None and choice.type == "tool" and choice.name not in {t.name for t in req.tools}:
        raise APIError(400, f"tool_choice names the tool {choice.name!r}, which 'tools' does not define")
    messages = template_messages(req)
    prefill = ""
    last = messages[-1] if messages else {}
    if last.get("role") == "assistant" and not last.get("tool_calls") and not last.get("reasoning_content"):
        # A final assistant message is the start of the reply, which the model continues.
        prefill = messages.pop()["content"]
    ids, thinking = server.render_chat(messages, tools, _template_kwargs(req), prefill, check)
    return ids, thinking, tools


def _usage(d: Dict[str, Any]) -> dict:
    # Anthropic counts cached prompt tokens apart from input_tokens.
    return {
        "input_tokens": d["prompt_tokens"] - d["cached_tokens"],
        "output_tokens": d["generated_tokens"],
        "cache_read_input_tokens": d["cached_tokens"],
        "cache_creation_input_tokens": 0,
    }


def _stop_reason(finish: str, d: Dict[str, Any], tool_calls: bool, max_tokens: int):
    if d.get("stop_sequence"):
        return "stop_sequence", d["stop_sequence"]
    if finish == "length":
        # Cut by the context's end before max_tokens: a client that reads
        # "max_tokens" asks for more and meets the same wall.
        full = d["generated_tokens"] < max_tokens
        return ("model_context_window_exceeded" if full else "max_tokens"), None
    return ("tool_use" if tool_calls else "end_turn"), None


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request):
    server: Server = request.app.state.server
    req = await read_request(request, CountRequest, server.settings.max_body_bytes)
    server.check_model(req.model)
    # Any length: a client counts to learn whether its conversation still fits.
    ids, _, _ = await off_loop(_prompt, server, req, False)
    return {"input_tokens": len(ids)}


@router.post("/v1/messages")
async def messages(request: Request):
    server: Server = request.app.state.server
    req: MessagesRequest = await read_request(request, MessagesRequest, server.settings.max_body_bytes)
    server.check_model(req.model)
    max_tokens = server.check_max_tokens(req.max_tokens, "max_tokens")
    ids, thinking, tools = await off_loop(_prompt, server, req)
    job = server.submit(ids, server.config(req, max_tokens), req.stop_sequences or [], _template_kwargs(req))
    parser = OutputParser(reasoning=thinking, tools=tools)
    mid, model = "msg_" + uuid.uuid4().hex[:24], server.settings.model_id

    if not req.stream:
        blocks: List[Dict[str, Any]] = []
        async for ev in server.events(job, request):
            if ev[0] == "error":
                raise APIError(ev[1], ev[2])
            if ev[0] == "done":
                events = parser.finish(cut=cut_short(ev))
            else:
                events = parser.feed(ev[1])
            for kind, v in events:
                if kind == "tool":
                    blocks.append({"type": "tool_use", "id": "toolu_" + v.id, "name": v.name, "input": v.arguments})
                    continue
                key = "thinking" if kind == "reasoning" else "text"
                if blocks and blocks[-1]["type"] == key:
                    blocks[-1][key] += v
                else:
                    blocks.append({"type": key, key: v, **({"signature": ""} if key == "thinking" else {})})
            if ev[0] == "done":
                reason, seq = _stop_reason(ev[1], ev[2], parser.made_tool_call, max_tokens)
                return JSONResponse(
                    {
                        "id": mid,
                        "type": "message",
                        "role": "assistant",
                        "model": model,
                        "content": blocks,
                        "stop_reason": reason,
                        "stop_sequence": seq,
                        "usage": _usage(ev[2]),
                    }
                )
        raise APIError(499, "client closed the request")

    async def stream():
        open_kind, index = None, -1

        def start(cached: int):
            # Sent once the prompt is prefilled, so its split of cached and new input tokens
            # is the one message_delta reports.
            first = {"prompt_tokens": len(ids), "generated_tokens": 0, "cached_tokens": cached}
            msg = {
                "id": mid,
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": _usage(first),
            }
            return sse({"type": "message_start", "message": msg}, "message_start")

        def close():
            nonlocal open_kind
            if open_kind is None:
                return ""
            open_kind = None
            return sse({"type": "content_block_stop", "index": index}, "content_block_stop")

        def render(events):
            nonlocal open_kind, index
            for kind, v in events:
                if kind == "tool":
                    yield close()
                    index += 1
                    yield sse(
                        {
                            "type": "content_block_start",
                            "index": index,
                            "content_block": {"type": "tool_use", "id": "toolu_" + v.id, "name": v.name, "input": {}},
                        },
                        "content_block_start",
                    )
                    yield sse(
                        {
                            "type": "content_block_delta",
                            "index": index,
                            "delta": {"type": "input_json_delta", "partial_json": v.arguments_json},
                        },
                        "content_block_delta",
                    )
                    open_kind = "tool"
                    yield close()
                    continue
                key = "thinking" if kind == "reasoning" else "text"
                if open_kind != key:
                    yield close()
                    index += 1
                    block = {"type": key, key: ""}
                    if key == "thinking":
                        block["signature"] = ""
                    yield sse(
                        {"type": "content_block_start", "index": index, "content_block": block}, "content_block_start"
                    )
                    open_kind = key
                yield sse(
                    {"type": "content_block_delta", "index": index, "delta": {"type": f"{key}_delta", key: v}},
                    "content_block_delta",
                )

        started = False
        async for ev in server.events(job, request):
            if ev[0] == "error":
                yield sse(error_body(request.url.path, ev[1], ev[2]), "error")
                return
            if not started:
                started = True
                yield start(ev[2]["cached_tokens"] if ev[0] == "done" else job.cached_tokens or 0)
            events = parser.feed(ev[1]) if ev[0] == "text" else parser.finish(cut=cut_short(ev))
            for s in render(events):
                if s:
                    yield s
            if ev[0] == "done":
                yield close()
                reason, seq = _stop_reason(ev[1], ev[2], parser.made_tool_call, max_tokens)
                yield sse(
                    {
                        "type": "message_delta",
                        "delta": {"stop_reason": reason, "stop_sequence": seq},
                        "usage": _usage(ev[2]),
                    },
                    "message_delta",
                )
                yield sse({"type": "message_stop"}, "message_stop")

    return server.event_stream(stream(), job)
