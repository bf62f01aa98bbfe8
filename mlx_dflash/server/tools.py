"""Reasoning and tool-call extraction from the Qwen3.5 family's output text.

The model writes ``<think> ... </think>`` around its reasoning (the chat
template often opens it in the prompt) and each tool call as
``<tool_call> ... </tool_call>`` whose body is either the Qwen3.5 /
Qwen3-Coder XML style::

    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>

or the Qwen3 JSON style ``{"name": "get_weather", "arguments": {"city": "Paris"}}``.
:class:`OutputParser` splits streamed text into reasoning, content and parsed
tool calls; a body that does not parse comes back as content, markers included.
"""

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

THINK_START, THINK_END = "<think>", "</think>"
TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: Dict[str, Any]
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


def _param_schema(tools: Optional[Sequence[dict]], name: str) -> dict:
    """The ``properties`` of function ``name`` in OpenAI-style ``tools``."""
    for t in tools or ():
        fn = t.get("function", t) if isinstance(t, dict) else {}
        if isinstance(fn, dict) and fn.get("name") == name:
            params = fn.get("parameters") or {}
            props = params.get("properties") if isinstance(params, dict) else None
            return props if isinstance(props, dict) else {}
    return {}


def _convert(value: str, schema: Any) -> Any:
    """An XML parameter's text as the type its JSON schema names (text if it does not fit)."""
    typ = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(typ, list):  # ["string", "null"]: the first non-null type
        typ = next((t for t in typ if t != "null"), None)
    if typ == "string":
        return value
    if value.strip() == "null":
        return None
    try:
        parsed = json.loads(value)
    except ValueError:
        return value
    if typ is None:  # untyped: JSON containers and scalars as such, else text
        return parsed
    kinds = {"integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list}
    want = kinds.get(typ)
    if want is None:
        return parsed
    if typ in ("integer", "number") and isinstance(parsed, bool):
        return value
    if typ == "integer" and isinstance(parsed, float) and parsed.is_integer():
        return int(parsed)
    return parsed if isinstance(parsed, want) else value


def parse_tool_call(body: str, tools: Optional[Sequence[dict]] = None) -> List[ToolCall]:
    """The calls in one ``<tool_call>`` body (XML or JSON style); ValueError if none parse."""
    s = body.strip()
    if s.startswith("<function="):
        calls = []
        for name, inner in _FUNCTION.findall(s):
            name = name.strip()
            if not name:
                raise ValueError("tool call without a function name")
            schema = _param_schema(tools, name)
            args = {}
            for pname, raw in _PARAMETER.findall(inner):
                # The format puts the value on its own lines: drop one newline each side.
                if raw.startswith("\n"):
                    raw = raw[1:]
                if raw.endswith("\n"):
                    raw = raw[:-1]
                args[pname.strip()] = _convert(raw, schema.get(pname.strip()))
            calls.append(ToolCall(name, args))
        if not calls:
            raise ValueError("no <function=...> in tool call")
        return calls
    obj = json.loads(s)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise ValueError("a JSON tool call needs a string 'name'")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = json.loads(args) if args.strip() else {}
    if not isinstance(args, dict):
        raise ValueError("tool call arguments must be a JSON object")
    return [ToolCall(obj["name"], args)]


def prompt_opens_thinking(prompt_text: str) -> bool:
    """True when the rendered prompt leaves a ``<think>`` open (the template started the reasoning)."""
    return prompt_text.rfind(THINK_START) > prompt_text.rfind(THINK_END)


def _held_suffix(text: str, markers: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that could begin one of ``markers``."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


Event = Tuple[str, Any]  # ("reasoning", str) | ("text", str) | ("tool", ToolCall)


class OutputParser:
    """Incremental split of generated text into reasoning, content and tool calls.

    ``feed(piece)`` returns the events that are certain so far (text that could
    still be the start of a marker is held back); ``finish()`` flushes the rest.
    With neither reasoning nor tools in play the text passes through unchanged.
    """

    def __init__(self, *, reasoning: bool = False, tools: Optional[Sequence[dict]] = None, joined: bool = False):
        self.tools = tools
        self.parse_tools = bool(tools)
        self.state = "reasoning" if reasoning else "start"
        self.buf = ""
        self.held_ws = ""  # content whitespace held back in case a tool call follows
        self.tool_ws = ""  # that whitespace, given back if the call turns out to be text
        self.strip_lead = False  # drop the blank lines after </think> or </tool_call>
        self.made_tool_call = False
        # Qwen's templates write "<think>\n" + reasoning + "\n</think>": the newlines are layout.
        self.think_lead = True
        # ``joined``: the dialect makes one string of all the text (Chat
        # Completions' content), so text on either side of a call keeps the
        # whitespace the model wrote between them; block dialects (Anthropic,
        # Responses) keep the pieces apart and drop it.
        self.joined = joined
        self.wrote_text = False
        self.after_call = False  # a call parsed since the last text
        self.lead_ws = ""  # whitespace dropped after the last call so far

    def _markers(self) -> List[str]:
        if self.state == "reasoning":
            return [THINK_END]
        if self.state == "tool":
            return [TOOL_END]
        out = [TOOL_START] if self.parse_tools else []
        if self.state == "start":
            out.append(THINK_START)
        return out

    def _text(self, s: str, events: List[Event], final: bool = False) -> None:
        if self.strip_lead:
            body = s.lstrip()
            self.lead_ws += s[: len(s) - len(body)]
            if not body:
                return
            s, self.strip_lead = body, False
            if self.joined and self.after_call and self.wrote_text:
                s = (self.lead_ws or self.tool_ws) + s
            self.lead_ws = ""
        if not self.parse_tools:
            if s:
                events.append(("text", s))
                self.wrote_text, self.after_call = True, False
            return
        s = self.held_ws + s
        keep = len(s) - len(s.rstrip())
        self.held_ws = "" if final else s[len(s) - keep :]
        out = s if final else s[: len(s) - keep]
        if out:
            events.append(("text", out))
            self.wrote_text, self.after_call = True, False

    def feed(self, piece: str) -> List[Event]:
        events: List[Event] = []
        self.buf += piece
        while True:
            if self.state == "start":
                # Only a <think> at the very beginning opens reasoning.
                stripped = self.buf.lstrip()
                if stripped.startswith(THINK_START):
                    self.buf = stripped[len(THINK_START) :]
                    self.state = "reasoning"
                    continue
                if THINK_START.startswith(stripped) and stripped:
                    return events  # still could be <think>
                if not stripped and self.buf:
                    return events
                self.state = "text"
                continue
            if self.state == "reasoning":
                if self.think_lead:
                    body = self.buf.lstrip("\n")
                    self.buf = body
                    if not body:
                        return events
                    self.think_lead = False
                i = self.buf.find(THINK_END)
                if i >= 0:
                    r = self.buf[:i].rstrip()
                    if r:
                        events.append(("reasoning", r))
                    self.buf = self.buf[i + len(THINK_END) :]
                    self.state, self.strip_lead = "text", True
                    continue
                hold = _held_suffix(self.buf, [THINK_END])
                # Trailing whitespace before </think> is not part of the reasoning.
                body = self.buf[: len(self.buf) - hold]
                keep = len(body) - len(body.rstrip())
                emit = body[: len(body) - keep]
                if emit:
                    events.append(("reasoning", emit))
                self.buf = self.buf[len(emit) :]
                return events
            if self.state == "text":
                i = self.buf.find(TOOL_START) if self.parse_tools else -1
                if i >= 0:
                    self._text(self.buf[:i], events)
                    self.tool_ws, self.held_ws = self.held_ws, ""  # between content and a call: layout
                    self.lead_ws = ""
                    self.buf = self.buf[i + len(TOOL_START) :]
                    self.state = "tool"
                    continue
                hold = _held_suffix(self.buf, self._markers())
                self._text(self.buf[: len(self.buf) - hold], events)
                self.buf = self.buf[len(self.buf) - hold :]
                return events
            if self.state == "tool":
                i = self.buf.find(TOOL_END)
                if i < 0:
                    return events
                body = self.buf[:i]
                self.buf = self.buf[i + len(TOOL_END) :]
                self.state, self.strip_lead = "text", True
                self._tool(body, TOOL_START + body + TOOL_END, events)
                continue

    def _tool(self, body: str, raw: str, events: List[Event]) -> None:
        try:
            calls = parse_tool_call(body, self.tools)
        except (ValueError, TypeError):
            self.strip_lead = False
            self._text(self.tool_ws + raw, events)
            return
        self.made_tool_call = self.after_call = True
        events.extend(("tool", c) for c in calls)

    def finish(self, cut: bool = False) -> List[Event]:
        """Flush the rest; ``cut``: the output was stopped by the token limit or a stop string."""
        events: List[Event] = []
        rest, self.buf = self.buf, ""
        if self.state == "reasoning":
            if rest.rstrip():
                events.append(("reasoning", rest.rstrip()))
        elif self.state == "tool" and cut:
            # Cut off by max_tokens or a stop string: its arguments may be partial, so it is no call.
            self._text(self.tool_ws + TOOL_START + rest, events)
        elif self.state == "tool":
            # Ended without </tool_call> at EOS: a call if the body parses.
            self._tool(rest, TOOL_START + rest, events)
        elif rest:
            self._text(rest, events)
        if self.held_ws:
            self._text("", events, final=True)
        return events


def split_output(
    text: str, *, reasoning: bool = False, tools: Optional[Sequence[dict]] = None, cut: bool = False
) -> Tuple[str, str, List[ToolCall]]:
    """(reasoning, content, tool calls) of a whole output (``cut``: stopped by the token limit or a stop string)."""
    p = OutputParser(reasoning=reasoning, tools=tools)
    events = p.feed(text) + p.finish(cut)
    r = "".join(v for k, v in events if k == "reasoning")
    c = "".join(v for k, v in events if k == "text")
    return r, c, [v for k, v in events if k == "tool"]
