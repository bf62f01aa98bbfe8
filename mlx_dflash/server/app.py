"""What the API dialects share: settings, errors in each dialect's shape,
prompt rendering, job submission and the event stream of a running job
(the app itself is assembled in ``routes.py``)."""

import asyncio
import json
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Annotated, Any, AsyncIterator, Dict, List, Optional, Sequence, Tuple

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from ..config import SAMPLING, GenerationConfig
from ..errors import DFlashError, check_text
from .metrics import Metrics
from .tools import prompt_opens_thinking
from .worker import SHUTDOWN, Job, QueueFull, Worker

# The temperature range OpenAI's chat, completions and Responses APIs accept (Anthropic's is 0-1).
OpenAITemperature = Annotated[Optional[float], Field(ge=0, le=2)]


class EngineSampling(BaseModel):
    """The engine's sampling fields that the dialects' own APIs lack, by
    GenerationConfig's names (``config.SAMPLING``): every dialect takes all
    of them, so a request may set whatever the command line sets (a field
    left out of here would be dropped as unknown, and its reply would quietly
    ignore it). Each dialect adds temperature and top_p, its own ranges."""

    top_k: Optional[int] = None
    min_p: Optional[float] = None
    min_tokens_to_keep: Optional[int] = None
    repetition_penalty: Optional[float] = None
    repetition_context_size: Optional[int] = None
    xtc_probability: Optional[float] = None
    xtc_threshold: Optional[float] = None
    seed: Optional[int] = None
    accept_rule: Optional[str] = None


log = logging.getLogger("mlx_dflash.server")
MAX_STOPS, MAX_STOP_CHARS = 64, 1000
KEEPALIVE = ": keep-alive\n\n"  # an SSE comment line: a parser ignores it
FLAGS = re.compile(r" \(--[a-z-]+(?:, --[a-z-]+)*\)")  # "top_p (--top-p) must ..." -> "top_p must ..."


@dataclass
class Settings:
    """What ``mlx-dflash serve`` was started with (generation defaults and limits)."""

    model_id: str = "mlx-dflash"
    aliases: Sequence[str] = ()
    api_key: Optional[str] = None
    max_body_bytes: int = 32 * 1024 * 1024
    max_queue: int = 64
    timeout: float = 600.0
    # Every request's options unless it sets its own sampling fields and max_tokens.
    generation: GenerationConfig = field(default_factory=lambda: GenerationConfig(max_tokens=512))
    chat_template_args: Dict[str, Any] = field(default_factory=dict)
    prompt_cache: bool = True
    prompt_cache_bytes: Optional[int] = None  # None: the prefix cache's default budget
    max_batch: Optional[int] = None  # requests decoded together; None: batch.DEFAULT_MAX_BATCH as memory allows
    allowed_origins: Sequence[str] = ("*",)  # origins browsers may call from (CORS); () sends no CORS headers
    # Seconds a stream may go without a byte before an SSE comment is sent (0: never): a
    # long prefill or queue wait sends nothing else, and clients and proxies with read
    # timeouts would drop the connection before the first event.
    keepalive: float = 10.0


class APIError(Exception):
    """A client error; rendered in the shape of the API the request used."""

    def __init__(self, status: int, message: str, *, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


_OPENAI_TYPES = {
    401: "authentication_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
    504: "timeout",
}
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_body(path: str, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None) -> dict:
    if is_anthropic(path):
        return {
            "type": "error",
            "error": {"type": _ANTHROPIC_TYPES.get(status, "invalid_request_error"), "message": message},
        }
    return {
        "error": {
            "message": message,
            "type": _OPENAI_TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(path: str, status: int, message: str, **kw) -> JSONResponse:
    return JSONResponse(error_body(path, status, message, **kw), status_code=status)


def cut_short(done: tuple) -> bool:
    """Whether a "done" event's output was stopped before the model ended it
    (the token limit, or a stop string): a tool call open at that point may
    have partial arguments, so it is text, not a call."""
    return done[1] == "length" or bool(done[2].get("stop_sequence"))


class Server:
    """The state behind the routes: settings, the engine worker and metrics."""

    def __init__(self, settings: Settings, worker: Worker, metrics: Metrics):
        self.settings = settings
        self.worker = worker
        self.metrics = metrics
        self.created = int(time.time())

    @property
    def engine(self):
        return self.worker.engine

    @property
    def tokenizer(self):
        return self.worker.engine.tokenizer

    @property
    def max_context(self) -> int:
        return self.engine.target.max_context

    # --- request checks ----------------------------------------------------------
    def check_model(self, name: Optional[str]) -> None:
        if name is None:
            raise APIError(400, "missing required field 'model'", param="model")
        if name != self.settings.model_id and name not in self.settings.aliases:
            raise APIError(
                404,
                f"model '{name}' is not served here; this server serves '{self.settings.model_id}' (GET /v1/models)",
                param="model",
                code="model_not_found",
            )

    def check_max_tokens(self, n: Optional[int], param: str) -> int:
        n = self.settings.generation.max_tokens if n is None else n
        if not 1 <= n <= self.max_context:
            raise APIError(400, f"'{param}' must be in 1..{self.max_context}, got {n}", param=param)
        return n

    def check_prompt(self, ids: List[int]) -> None:
        if not ids:
            raise APIError(400, "empty prompt: the request renders to no tokens")
        if len(ids) >= self.max_context:
            raise APIError(
                400,
                f"prompt has {len(ids)} tokens; the context limit is {self.max_context}",
                code="context_length_exceeded",
            )

    def config(self, request, max_tokens: int) -> GenerationConfig:
        """The server's generation options with a request's on top (by field name), checked."""
        if getattr(request, "top_p", None) == 0:
            # OpenAI's API reads 0 as the top token only, mlx-lm (and --top-p) as off: ambiguous.
            raise APIError(
                400, "top_p must be above 0 (1 for off; a small value keeps only the top tokens)", param="top_p"
            )
        try:
            gen = self.engine.config(self.settings.generation.with_request(request, max_tokens))
            gen.validate()
        except (DFlashError, TypeError, ValueError) as e:
            message = FLAGS.sub("", str(e))  # a client sent fields, not command-line flags
            # The field it names first is the error's param (its words: "repetition penalty ...").
            named = sorted(
                (i, f)
                for f in SAMPLING + ("max_tokens",)
                for i in (message.find(f), message.find(f.replace("_", " ")))
                if i >= 0
            )
            raise APIError(400, message, param=named[0][1] if named else None) from None
        return gen

    # --- prompts -------------------------------------------------------------------
    def render_chat(
        self,
        messages: List[dict],
        tools: Optional[List[dict]],
        template_kwargs: Optional[Dict[str, Any]],
        prefill: str = "",
        check: bool = True,
    ) -> Tuple[List[int], bool]:
        """Token ids of the chat prompt, and whether the template left a reasoning block open.
        ``prefill``: the start of the assistant's reply, which the model continues (the
        template's generation prompt, then this text). ``check``: refuse a prompt that is
        empty or fills the context (a count of its tokens takes any)."""
        tok = self.tokenizer
        if getattr(tok, "chat_template", None) is None:
            raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions")
        kwargs = self.template_args(template_kwargs)

        def render(generation_prompt: bool) -> str:
            return tok.apply_chat_template(
                messages, tools=tools or None, add_generation_prompt=generation_prompt, tokenize=False, **kwargs
            )

        try:
            text = render(True)
            before = render(False)
        except Exception as e:  # a template that rejects these messages (raise_exception)
            raise APIError(400, f"the chat template rejected the messages: {e}") from None
        text += prefill
        ids = list(tok.encode(text, add_special_tokens=False))
        if check:
            self.check_prompt(ids)
        # Only what the template adds for the reply (and the prefill) can open a
        # reasoning block: a "<think>" in a message's own text does not.
        added = text[len(before) :] if text.startswith(before) else text
        return ids, prompt_opens_thinking(added)

    def template_args(self, template_kwargs: Optional[Dict[str, Any]]) -> Dict[str, Any]:
        """The server's chat-template arguments with a request's on top."""
        kwargs = dict(self.settings.chat_template_args)
        kwargs.update(template_kwargs or {})
        return kwargs

    def encode_text(self, prompt) -> List[int]:
        if isinstance(prompt, list):
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.engine.target.vocab_size]
            if bad:
                raise APIError(400, f"token id {bad[0]} is outside the vocabulary", param="prompt")
        else:
            ids = list(self.tokenizer.encode(prompt))  # as the engine encodes a raw prompt (a BOS if taken)
        self.check_prompt(ids)
        return ids

    # --- running ---------------------------------------------------------------------
    def submit(
        self,
        ids: List[int],
        config: GenerationConfig,
        stops: Sequence[str],
        template_kwargs: Optional[Dict[str, Any]] = None,
    ) -> Job:
        """Queue a generation; ``template_kwargs`` (a chat request's) let the prefix cache find
        the prompt's stable boundary as this request's template renders it."""
        s = self.settings
        if len(stops) > MAX_STOPS or any(len(x) > MAX_STOP_CHARS for x in stops):
            # Every stop string is matched against every token, on the thread all requests share.
            raise APIError(
                400, f"at most {MAX_STOPS} stop strings of at most {MAX_STOP_CHARS} characters each", param="stop"
            )
        gen = dict(config=config)
        if template_kwargs is not None:
            gen["chat_template_config"] = self.template_args(template_kwargs)
        if not self.worker.alive:
            raise APIError(503, "the generation thread has stopped; restart the server")
        job = Job(ids, gen, list(stops), s.timeout, asyncio.get_running_loop())
        try:
            self.worker.submit(job)
        except QueueFull:
            raise APIError(429, f"the server is busy: {s.max_queue} requests are already queued; retry later") from None
        return job

    def _cut_as_error(self, ev: tuple) -> tuple:
        """A reply cut short is an error event, in each API's error shape, after
        the text streamed so far: a timeout a 504, a server shutdown a 503."""
        if ev[0] != "done" or ev[1] not in ("timeout", "shutdown"):
            return ev
        n = ev[2]["generated_tokens"]
        if ev[1] == "timeout":
            return ("error", 504, f"generation timed out after {self.settings.timeout:g} s ({n} tokens)")
        return ("error", 503, f"{SHUTDOWN}: the reply was cut after {n} tokens")

    async def events(self, job: Job, request: Request) -> AsyncIterator[tuple]:
        """The job's events until it ends; cancels it if the client disconnects or we stop early."""
        getter = None
        done = False
        loop = asyncio.get_running_loop()
        looked = loop.time()
        try:
            while True:
                if getter is None:
                    getter = asyncio.ensure_future(job.out.get())
                finished, _ = await asyncio.wait({getter}, timeout=0.25)
                # Looked for at least every 0.25 s, events or not: a client
                # waiting for a whole reply sends nothing while tokens flow.
                if not finished or loop.time() - looked >= 0.25:
                    looked = loop.time()
                    if await request.is_disconnected():
                        return
                if not finished:
                    continue
                ev, getter = getter.result(), None
                if ev[0] in ("done", "error"):
                    done = job.delivered = True
                    ev = self._cut_as_error(ev)
                yield ev
                if done:
                    return
        finally:
            if getter is not None:
                getter.cancel()
            self.drop(job)

    def drop(self, job: Job) -> None:
        """The route is done with ``job``: cancelled, and counted as cancelled
        once, unless its last event reached the route."""
        if not job.delivered and not job.cancelled.is_set():
            self.metrics.record_cancel()
        job.cancel()

    def event_stream(self, chunks: AsyncIterator[str], job: Job) -> StreamingResponse:
        """Server-sent events from ``chunks``, with a keep-alive comment whenever
        none comes for ``settings.keepalive`` seconds; ``job`` is cancelled however
        the stream ends: a client gone before ``chunks`` reached the engine's events
        (whose own cleanup then never runs) included. A finished job ignores it."""
        every = self.settings.keepalive
        every = every if every > 0 else None  # 0: no keep-alive

        async def next_chunk():
            return await chunks.__anext__()

        async def body():
            # The next chunk is awaited in a task of its own, so that a keep-alive
            # timeout leaves it running (asyncio.wait_for would cancel the generator).
            pending = None
            try:
                while True:
                    if pending is None:
                        pending = asyncio.ensure_future(next_chunk())
                    finished, _ = await asyncio.wait({pending}, timeout=every)
                    if not finished:
                        # An SSE comment: every client's parser skips it, so no
                        # dialect's event order changes; it keeps the connection
                        # alive through a queue wait, a prefill or a pause.
                        yield KEEPALIVE
                        continue
                    step, pending = pending, None
                    try:
                        chunk = step.result()
                    except StopAsyncIteration:
                        return
                    yield chunk
            finally:
                if pending is not None:
                    pending.cancel()  # ends ``chunks`` where it waits (its cleanup runs)
                # Now, not when ``chunks`` is collected: a client gone while a chunk was
                # sent leaves ``chunks`` (and the events it reads) suspended for good.
                self.drop(job)

        return StreamingResponse(
            body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )


async def read_json(request: Request, limit: int) -> Any:
    """The request body as JSON, refusing bodies over ``limit`` bytes before reading them all."""
    n = request.headers.get("content-length")
    if n is not None and n.isdigit() and int(n) > limit:
        raise APIError(413, f"request body is {n} bytes; the limit is {limit}")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"request body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect:  # gone before its body arrived: nobody to answer, not a server fault
        raise APIError(499, "client closed the request") from None
    return await off_loop(_decode_json, b"".join(chunks))


async def off_loop(fn, *args):
    """``fn(*args)`` on a worker thread: parsing, rendering and tokenizing a
    large request take seconds, which the event loop, serving every other
    client and stream, must not wait for."""
    return await run_in_threadpool(fn, *args)


async def read_request(request: Request, model: type, limit: int) -> BaseModel:
    """The request body, read, decoded and validated into ``model`` (off the event loop)."""
    return await off_loop(parse_body, model, await read_json(request, limit))


def _decode_json(data: bytes) -> Any:
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON body: {e}") from None
    except RecursionError:
        raise APIError(400, "malformed JSON body: nested too deeply") from None


# Arguments of apply_chat_template itself (and the template's source), which
# the server sets: from a request they would replace the model's prompt format
# or break rendering (a client's template can also run for minutes).
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "chat_template",
        "conversation",
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)

# The effort values OpenAI's API takes; any but "none" turns a template's thinking on.
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def check_template_kwargs(kwargs: Optional[Dict[str, Any]], param: str = "chat_template_kwargs") -> Dict[str, Any]:
    """A request's extra chat-template variables, or a 400 naming one the server sets itself."""
    kwargs = dict(kwargs or {})
    for k in kwargs:
        if k in RESERVED_TEMPLATE_KWARGS or k.startswith("_"):
            raise APIError(
                400,
                f"'{param}.{k}' is set by the server, not by a request (template variables only, such as enable_thinking)",
                param=f"{param}.{k}",
            )
    return kwargs


# Tool types a client runs itself but only as OpenAI's or Anthropic's models are trained to
# call them (a free-form grammar, a shell, an editor, a screen): not function tools, so the
# model here would never be offered them. (A trailing "_": a family of dated versions.)
OPENAI_CLIENT_TOOLS = ("custom", "local_shell", "shell", "apply_patch", "computer_use_preview")
ANTHROPIC_CLIENT_TOOLS = ("bash_", "text_editor_", "computer_")


def check_client_tool(kind: Any, where: str, kinds: Sequence[str]) -> None:
    """A 400 for a tool of ``kinds`` (the client would run it, and it is not a
    function tool): it was dropped silently, so the model was never offered it."""
    if isinstance(kind, str) and any(kind == c or (c.endswith("_") and kind.startswith(c)) for c in kinds):
        raise APIError(
            400, f"{where}: tools of type '{kind}' are not supported here; give it as a function tool", param="tools"
        )


def check_tool_choice(choice: Any, names: Sequence[str], name_of) -> None:
    """tool_choice as the OpenAI APIs take it: "none", "auto", "required"
    (with tools), or an object naming one of ``names`` (``name_of(choice)``:
    its name, or None for an object of another kind, accepted as a hint)."""
    if choice is None:
        return
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise APIError(
                400, f"tool_choice must be 'none', 'auto', 'required' or an object, got {choice!r}", param="tool_choice"
            )
        if choice == "required" and not names:
            raise APIError(400, "tool_choice 'required' needs tools", param="tool_choice")
        return
    if not isinstance(choice, dict):
        raise APIError(400, "tool_choice must be a string or an object", param="tool_choice")
    name = name_of(choice)
    if name is not None and name not in names:
        raise APIError(
            400, f"tool_choice names the function {name!r}, which 'tools' does not define", param="tool_choice"
        )


def check_effort(effort: Optional[str], param: str) -> Optional[str]:
    if effort is not None and effort not in REASONING_EFFORTS:
        raise APIError(400, f"'{param}' must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}", param=param)
    return effort


def parse_body(model: type, body: Any) -> BaseModel:
    """Validate a JSON body into ``model``; one clear 400 naming the first bad field."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        _check_strings(body, [])
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    # Another API's name for a field that changes the reply (max_tokens sent to
    # /v1/responses) would otherwise be ignored as unknown, and the reply differ.
    for k, use in getattr(model, "FOREIGN", {}).items():
        if k in body:
            raise APIError(400, f"'{k}' is not a field of this API; {use}", param=k)
    try:
        return model.model_validate(body, strict=True)  # no coercion: "8" or true is not a number
    except ValidationError as e:
        # Of a union's errors (one per member), the one that got furthest names the field.
        err = max(e.errors(), key=lambda x: len(x["loc"]))
        loc = ".".join(str(x) for x in err["loc"] if not _union_member(x))
        raise APIError(400, f"invalid field '{loc}': {err['msg']}", param=loc or None) from None


def _union_member(part) -> bool:
    """Whether a pydantic error location part names a union member (``str``,
    ``list[Block]``), not a field."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "dict", "list", "none"))


def _check_strings(value: Any, path: List[str]) -> None:
    """A 400 naming the field of the first string that is not valid Unicode
    (a lone surrogate escape such as \\ud800, which no tokenizer takes)."""
    if isinstance(value, str):
        try:
            check_text(value, "text")
        except DFlashError as e:
            loc = ".".join(path)
            raise APIError(400, f"invalid field '{loc}': {e}", param=loc or None) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_strings(k, path)
            _check_strings(v, path + [str(k)])
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_strings(v, path + [str(i)])


def sse(data: Any, event: Optional[str] = None) -> str:
    payload = json.dumps(data, ensure_ascii=False)
    return (f"event: {event}\n" if event else "") + f"data: {payload}\n\n"
