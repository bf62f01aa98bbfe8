"""OpenAI Responses dialect: POST /v1/responses, as Codex-style clients use it.

Nothing is stored on the server: each request carries its whole conversation
(``store`` is accepted and ignored, ``previous_response_id`` is refused), and
the shared prefix cache makes resending it cheap. Items map onto chat-template
messages: message items by role, ``function_call`` items onto the assistant's
tool calls, ``function_call_output`` items onto tool messages, ``reasoning``
items onto the next assistant turn's reasoning.
"""

import json
import time
import uuid
from typing import Any, ClassVar, Dict, List, Optional, Union

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from .app import (
    OPENAI_CLIENT_TOOLS,
    APIError,
    EngineSampling,
    OpenAITemperature,
    Server,
    check_client_tool,
    check_effort,
    check_template_kwargs,
    check_tool_choice,
    cut_short,
    off_loop,
    read_request,
    sse,
)
from .tools import OutputParser, ToolCall

router = APIRouter()


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class Reasoning(_Model):
    effort: Optional[str] = None
    summary: Optional[str] = None


class ResponsesRequest(_Model, EngineSampling):
    FOREIGN: ClassVar[Dict[str, str]] = {
        "max_tokens": "use 'max_output_tokens'",
        "max_completion_tokens": "use 'max_output_tokens'",
        "stop": "the Responses API has no stop sequences (/v1/chat/completions takes 'stop')",
        "stop_sequences": "the Responses API has no stop sequences (/v1/messages takes 'stop_sequences')",
        "messages": "use 'input'",
    }
    model: Optional[str] = None
    input: Union[str, List[Dict[str, Any]]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    temperature: OpenAITemperature = None
    top_p: Optional[float] = None
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Union[str, Dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    reasoning: Optional[Reasoning] = None
    stream: Optional[bool] = False  # null as the SDK may send it: not streamed
    store: Optional[bool] = None
    previous_response_id: Optional[str] = None
    # Read to refuse them: each would change the reply, and this server stores nothing.
    conversation: Union[str, Dict[str, Any], None] = None
    prompt: Optional[Dict[str, Any]] = None
    background: Optional[bool] = None
    text: Optional[Dict[str, Any]] = None
    metadata: Optional[Dict[str, Any]] = None
    # Read to refuse them: no log-probabilities are returned.
    top_logprobs: Optional[int] = None
    include: Optional[List[str]] = None
    chat_template_kwargs: Optional[Dict[str, Any]] = None


def _text_of(content: Any, where: str) -> str:
    """A string, or the text of a list of input_text / output_text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: content must be a string or a list of content parts", param=where)
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "reasoning_text", "summary_text") and isinstance(
            part.get("text"), str
        ):
            out.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            out.append(part["refusal"])
        else:
            raise APIError(
                400, f"{where}.content[{j}]: only text parts are supported, got '{kind}'", param=f"{where}.content"
            )
    return "".join(out)


def template_messages(req: ResponsesRequest) -> List[dict]:
    """The request's instructions and input items as chat-template messages."""
    items = [{"type": "message", "role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    if not items:
        raise APIError(400, "'input' has no items", param="input")
    system = [req.instructions] if req.instructions else []
    out: List[Dict[str, Any]] = []
    reasoning: List[str] = []  # reasoning items waiting for the assistant turn they belong to

    def assistant(new: bool) -> Dict[str, Any]:
        if new or not out or out[-1]["role"] != "assistant":
            out.append({"role": "assistant", "content": ""})
        msg = out[-1]
        if reasoning:
            msg.setdefault("reasoning_content", "\n".join(reasoning))
            reasoning.clear()
        return msg

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{where}: an input item must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(
                    400, f"{where}: role must be user, system, developer or assistant, got {role!r}", param="input"
                )
            text = _text_of(item.get("content"), where)
            if role in ("system", "developer"):
                if out:  # a later instruction stays where it was given
                    out.append({"role": "system", "content": text})
                else:
                    system.append(text)
            elif role == "assistant":
                # text after the turn's tool calls starts a new turn (templates put calls last)
                msg = assistant(new=bool(out) and "tool_calls" in out[-1])
                msg["content"] += text
            else:
                out.append({"role": "user", "content": text})
        elif kind == "function_call":
            name, call_id, args = item.get("name"), item.get("call_id"), item.get("arguments", "")
            if not isinstance(name, str) or not name or not isinstance(call_id, str):
                raise APIError(400, f"{where}: a function_call item needs a name and a call_id", param="input")
            try:
                args = json.loads(args) if isinstance(args, str) and args.strip() else (args or {})
            except ValueError:
                raise APIError(400, f"{where}: function_call arguments are not valid JSON", param="input") from None
            if not isinstance(args, dict):
                raise APIError(400, f"{where}: function_call arguments must be a JSON object", param="input")
            msg = assistant(new=False)
            msg.setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            )
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise APIError(400, f"{where}: a function_call_output item needs a call_id", param="input")
            out.append(
                {"role": "tool", "tool_call_id": item["call_id"], "content": _text_of(item.get("output", ""), where)}
            )
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            text = _text_of(parts, where)
            if text:
                reasoning.append(text)
        elif kind == "item_reference":
            raise APIError(
                400,
                f"{where}: item references need stored responses, which this server does "
                "not keep; send the items themselves",
                param="input",
            )
        else:
            raise APIError(400, f"{where}: input item type '{kind}' is not supported", param="input")
    if system:
        out.insert(0, {"role": "system", "content": "\n\n".join(system)})
    return out


def _tools(req: ResponsesRequest) -> List[dict]:
    """Function tools in chat-template form; hosted tools (web search, ...) have nothing to run them here."""
    names = [t.get("name") for t in req.tools or [] if isinstance(t, dict) and t.get("type") == "function"]
    check_tool_choice(req.tool_choice, names, lambda c: c.get("name") if c.get("type") == "function" else None)
    if req.tool_choice == "none":
        for i, t in enumerate(req.tools or []):
            check_client_tool(t.get("type") if isinstance(t, dict) else None, f"tools[{i}]", OPENAI_CLIENT_TOOLS)
        return []
    out = []
    for i, t in enumerate(req.tools or []):
        check_client_tool(t.get("type") if isinstance(t, dict) else None, f"tools[{i}]", OPENAI_CLIENT_TOOLS)
        if not isinstance(t, dict) or t.get("type") != "function":
            continue
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise APIError(400, f"tools[{i}]: a function tool needs a name", param="tools")
        out.append(
            {
                "type": "function",
                "function": {
                    "name": t["name"],
                    "description": t.get("description") or "",
                    "parameters": t.get("parameters") or {"type": "object", "properties": {}},
                },
            }
        )
    return out


def _template_kwargs(req: ResponsesRequest) -> Dict[str, Any]:
    kwargs: Dict[str, Any] = {}
    if req.reasoning is not None and check_effort(req.reasoning.effort, "reasoning.effort") is not None:
        kwargs["enable_thinking"] = req.reasoning.effort != "none"
    kwargs.update(check_template_kwargs(req.chat_template_kwargs))
    return kwargs


def _usage(d: Dict[str, Any], reasoning_tokens: int) -> dict:
    return {
        "input_tokens": d["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": d["cached_tokens"], "cache_write_tokens": 0},
        "output_tokens": d["generated_tokens"],
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": d["prompt_tokens"] + d["generated_tokens"],
    }


class _Output:
    """Builds the response's output items from the parser's events, and the stream events for them."""

    def __init__(self):
        self.items: List[Dict[str, Any]] = []
        self.open: Optional[Dict[str, Any]] = None  # the reasoning or message item being written
        self.reasoning = ""

    def _text_item(self, kind: str) -> Dict[str, Any]:
        if kind == "reasoning":
            return {
                "type": "reasoning",
                "id": "rs_" + uuid.uuid4().hex[:24],
                "summary": [],
                "content": [],
                "status": "in_progress",
            }
        return {
            "type": "message",
            "id": "msg_" + uuid.uuid4().hex[:24],
            "role": "assistant",
            "content": [],
            "status": "in_progress",
        }

    @staticmethod
    def _part(item: Dict[str, Any], text: str) -> dict:
        if item["type"] == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def feed(self, events) -> List[tuple]:
        """Stream events (type, fields) for parser events; the items accumulate in ``items``."""
        out: List[tuple] = []
        for kind, v in events:
            if kind == "tool":
                out += self.close()
                out += self._call(v)
                continue
            want = "reasoning" if kind == "reasoning" else "message"
            if self.open is not None and self.open["type"] != want:
                out += self.close()
            if self.open is None:
                self.open = self._text_item(want)
                self.open["text"] = ""
                self.items.append(self.open)
                idx = len(self.items) - 1
                out.append(("response.output_item.added", {"output_index": idx, "item": self._public(self.open)}))
                out.append(
                    (
                        "response.content_part.added",
                        {
                            "item_id": self.open["id"],
                            "output_index": idx,
                            "content_index": 0,
                            "part": self._part(self.open, ""),
                        },
                    )
                )
            self.open["text"] += v
            if want == "reasoning":
                self.reasoning += v
            idx = len(self.items) - 1
            delta = {"item_id": self.open["id"], "output_index": idx, "content_index": 0, "delta": v}
            if want == "reasoning":
                out.append(("response.reasoning_text.delta", delta))
            else:
                out.append(("response.output_text.delta", {**delta, "logprobs": []}))
        return out

    @staticmethod
    def _public(item: Dict[str, Any]) -> Dict[str, Any]:
        return {k: v for k, v in item.items() if k != "text"}

    def close(self, status: str = "completed") -> List[tuple]:
        item, self.open = self.open, None
        if item is None:
            return []
        idx, text = self.items.index(item), item.pop("text")
        item["content"] = [self._part(item, text)]
        item["status"] = status
        ref = {"item_id": item["id"], "output_index": idx, "content_index": 0}
        if item["type"] == "reasoning":
            done = ("response.reasoning_text.done", {**ref, "text": text})
        else:
            done = ("response.output_text.done", {**ref, "text": text, "logprobs": []})
        return [
            done,
            ("response.content_part.done", {**ref, "part": self._part(item, text)}),
            ("response.output_item.done", {"output_index": idx, "item": item}),
        ]

    def _call(self, c: ToolCall) -> List[tuple]:
        item = {
            "type": "function_call",
            "id": "fc_" + c.id,
            "call_id": "call_" + c.id,
            "name": c.name,
            "arguments": "",
            "status": "in_progress",
        }
        self.items.append(item)
        idx, args = len(self.items) - 1, c.arguments_json
        out = [
            ("response.output_item.added", {"output_index": idx, "item": dict(item)}),
            ("response.function_call_arguments.delta", {"item_id": item["id"], "output_index": idx, "delta": args}),
            ("response.function_call_arguments.done", {"item_id": item["id"], "output_index": idx, "arguments": args}),
        ]
        item.update(arguments=args, status="completed")
        out.append(("response.output_item.done", {"output_index": idx, "item": dict(item)}))
        return out


@router.post("/v1/responses")
async def responses(request: Request):
    server: Server = request.app.state.server
    req: ResponsesRequest = await read_request(request, ResponsesRequest, server.settings.max_body_bytes)
    server.check_model(req.model)
    if req.previous_response_id is not None:
        raise APIError(
            400,
            "previous_response_id is not supported: this server stores no responses; "
            "send the whole conversation in 'input'",
            param="previous_response_id",
        )
    if req.conversation is not None:
        raise APIError(
            400,
            "conversation is not supported: this server stores no conversations; "
            "send the whole conversation in 'input'",
            param="conversation",
        )
    if req.prompt is not None:
        raise APIError(
            400, "prompt (a stored prompt template) is not supported; send the prompt in 'input'", param="prompt"
        )
    if req.background:
        raise APIError(
            400, "background responses are not supported: this server stores no responses", param="background"
        )
    fmt = (req.text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise APIError(400, 'text.format must be an object such as {"type": "text"}', param="text.format")
    if isinstance(fmt, dict) and fmt.get("type", "text") != "text":
        raise APIError(400, f"text.format '{fmt.get('type')}' is not supported; only plain text", param="text.format")
    if req.top_logprobs or any("logprobs" in x for x in req.include or []):
        raise APIError(400, "log-probabilities are not returned by this server", param="top_logprobs")
    max_tokens = server.check_max_tokens(req.max_output_tokens, "max_output_tokens")
    tools = _tools(req)
    kwargs = _template_kwargs(req)
    ids, thinking = await off_loop(server.render_chat, template_messages(req), tools, kwargs)
    gen = server.config(req, max_tokens)
    job = server.submit(ids, gen, [], kwargs)
    parser = OutputParser(reasoning=thinking, tools=tools)
    rid, created, model = "resp_" + uuid.uuid4().hex[:24], int(time.time()), server.settings.model_id

    def response(
        status: str,
        output: List[dict],
        d: Optional[Dict[str, Any]] = None,
        reasoning: str = "",
        error: Optional[dict] = None,
    ) -> dict:
        return {
            "id": rid,
            "object": "response",
            "created_at": created,
            "model": model,
            "status": status,
            "output": output,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "temperature": gen.temperature,
            "top_p": gen.top_p,
            "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
            "tool_choice": req.tool_choice or "auto",
            "tools": req.tools or [],
            "reasoning": req.reasoning.model_dump() if req.reasoning else None,
            "text": {"format": {"type": "text"}},
            "store": False,
            "previous_response_id": None,
            "metadata": req.metadata or {},
            "completed_at": int(time.time()) if status == "completed" else None,
            "usage": None
            if d is None
            # the reasoning text's tokens, re-encoded: never more than were generated
            else _usage(
                d,
                min(len(server.tokenizer.encode(reasoning, add_special_tokens=False)), d["generated_tokens"])
                if reasoning
                else 0,
            ),
        }

    def status_of(finish: str) -> str:
        return "incomplete" if finish == "length" else "completed"

    if not req.stream:
        out = _Output()
        async for ev in server.events(job, request):
            if ev[0] == "error":
                raise APIError(ev[1], ev[2])
            if ev[0] == "text":
                out.feed(parser.feed(ev[1]))
                continue
            status = status_of(ev[1])
            out.feed(parser.finish(cut=cut_short(ev)))
            out.close("incomplete" if status == "incomplete" else "completed")
            return JSONResponse(response(status, out.items, ev[2], out.reasoning))
        raise APIError(499, "client closed the request")

    async def stream():
        seq = 0
        out = _Output()

        def event(kind: str, fields: dict) -> str:
            nonlocal seq
            seq += 1
            return sse({"type": kind, "sequence_number": seq - 1, **fields}, kind)

        yield event("response.created", {"response": response("in_progress", [])})
        yield event("response.in_progress", {"response": response("in_progress", [])})
        async for ev in server.events(job, request):
            if ev[0] == "error":
                status, message = ev[1], ev[2]
                err = {"code": "invalid_prompt" if status < 500 else "server_error", "message": message}
                for kind, fields in out.close("incomplete"):  # the text streamed so far stays in its item
                    yield event(kind, fields)
                yield event("response.failed", {"response": response("failed", out.items, error=err)})
                return
            if ev[0] == "text":
                for kind, fields in out.feed(parser.feed(ev[1])):
                    yield event(kind, fields)
                continue
            status = status_of(ev[1])
            for kind, fields in out.feed(parser.finish(cut=cut_short(ev))) + out.close(
                "incomplete" if status == "incomplete" else "completed"
            ):
                yield event(kind, fields)
            final = response(status, out.items, ev[2], out.reasoning)
            yield event("response.incomplete" if status == "incomplete" else "response.completed", {"response": final})

    return server.event_stream(stream(), job)
