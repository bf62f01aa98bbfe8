"""`serve --keepalive`: a streamed reply that waits for its first event (queued,
or prefilling a long prompt) sends an SSE comment line every so often, so that
clients and proxies with read timeouts keep the connection; every SSE parser
skips it, so the events a client sees are the ones it gets without keep-alive.

The wait: the tiny tool-calling pair of ``test_server`` (whose LOOP prompt
never ends) served one request at a time, one request holding the engine while
the one under test waits behind it. Two servers: ``--keepalive 0.2`` and
``--keepalive 0`` (off), both without the prefix cache so that a request's
usage does not depend on what ran before it.
"""

import json
import threading
import time
from contextlib import contextmanager

import anthropic
import httpx
import openai
import pytest
from anthropic._streaming import SSEDecoder as AnthropicSSEDecoder
from openai._streaming import SSEDecoder as OpenAISSEDecoder
from test_server import KEY, LOOP, QUESTION, WEATHER_TOOL, ServerProcess, _rig_tool_model

HEADERS = {"x-api-key": KEY}
COMMENT = b": keep-alive"
EVERY = 0.2  # --keepalive of the keep-alive server, seconds
HOLD = 1.0  # seconds the engine is held while the request under test waits


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return _rig_tool_model(tmp_path_factory.mktemp("kapair"))


def _start(pair, tmp_path_factory, keepalive):
    return ServerProcess(
        "--model",
        str(pair / "target"),
        "--draft",
        str(pair / "draft"),
        "--model-name",
        "tiny-tools",
        "--api-key",
        KEY,
        "--max-batch",  # one at a time: a request waits while another holds the engine
        "1",
        "--no-prompt-cache",
        "--keepalive",
        keepalive,
        log=tmp_path_factory.mktemp("kasrv") / "log.txt",
    )


@pytest.fixture(scope="module")
def ka_server(pair, tmp_path_factory):
    s = _start(pair, tmp_path_factory, str(EVERY))
    yield s
    s.close()


@pytest.fixture(scope="module")
def plain_server(pair, tmp_path_factory):
    s = _start(pair, tmp_path_factory, "0")
    yield s
    s.close()


@contextmanager
def engine_held(server, seconds):
    """The engine busy for ``seconds`` from now with a reply that never ends
    (its client then leaves, which frees the engine for the next request)."""
    generating = threading.Event()
    failed = []

    def hold():
        body = {"model": "tiny-tools", "prompt": "push pop " + LOOP, "max_tokens": 4000, "stream": True}
        try:
            with httpx.Client(timeout=30) as c:
                with c.stream("POST", server.url + "/v1/completions", json=body, headers=HEADERS) as r:
                    lines = r.iter_lines()
                    next(lines)  # its first token: it has the engine
                    generating.set()
                    end = time.monotonic() + seconds
                    for _ in lines:
                        if time.monotonic() > end:
                            break
        except Exception as e:  # said by the test's thread
            failed.append(e)
            generating.set()

    t = threading.Thread(target=hold)
    t.start()
    try:
        assert generating.wait(30) and not failed, failed
        yield
    finally:
        t.join()
    assert not failed, failed


TOOL = {
    "name": "get_weather",
    "description": WEATHER_TOOL["function"]["description"],
    "input_schema": WEATHER_TOOL["function"]["parameters"],
}
RESPONSES_TOOL = {"type": "function", **{k: WEATHER_TOOL["function"][k] for k in ("name", "description", "parameters")}}
# (path, body, data events each dialect sends before the prompt runs: the chat stream's
# role chunk, the Responses API's response.created and response.in_progress)
CASES = {
    "completions": ("/v1/completions", {"prompt": "push pop " + LOOP, "max_tokens": 3}, 0),
    "chat": ("/v1/chat/completions", {"messages": QUESTION, "tools": [WEATHER_TOOL], "max_tokens": 100}, 1),
    "messages": ("/v1/messages", {"messages": QUESTION, "tools": [TOOL], "max_tokens": 100}, 0),
    "responses": ("/v1/responses", {"input": QUESTION, "tools": [RESPONSES_TOOL], "max_output_tokens": 100}, 2),
}


def queued_stream(server, path, body) -> bytes:
    """The raw bytes of a streamed request sent while another holds the engine for HOLD s."""
    body = {"model": "tiny-tools", "stream": True, **body}
    with engine_held(server, HOLD), httpx.Client(timeout=30) as c:
        with c.stream("POST", server.url + path, json=body, headers=HEADERS) as r:
            assert r.status_code == 200, r.read()
            assert r.headers["content-type"].startswith("text/event-stream")
            return b"".join(r.iter_raw())


def strict_blocks(raw: bytes):
    """The stream cut into its blocks, read strictly: UTF-8, LF line ends, each block
    either comment lines only or an event (an optional ``event:`` line, then ``data:``)."""
    text = raw.decode("utf-8")
    assert "\r" not in text and text.endswith("\n\n"), text[-200:]
    blocks = []
    for block in text[:-2].split("\n\n"):
        lines = block.split("\n")
        assert all(lines), block  # no stray blank lines
        if all(line.startswith(":") for line in lines):
            assert lines == [COMMENT.decode()], block
            blocks.append("comment")
            continue
        assert not any(line.startswith(":") for line in lines), block  # comments come alone
        event = None
        if lines[0].startswith("event: "):
            event = lines.pop(0)[len("event: ") :]
        assert len(lines) == 1 and lines[0].startswith("data: "), block
        data = lines[0][len("data: ") :]
        if data != "[DONE]":
            json.loads(data)
        blocks.append((event, data))
    return blocks


def decoded(decoder, raw: bytes):
    """The events an official client's SSE decoder reads from ``raw`` (fed in small pieces)."""
    pieces = [raw[i : i + 7] for i in range(0, len(raw), 7)]
    return [(e.event, e.data) for e in decoder().iter_bytes(iter(pieces))]


VARYING = ("created", "created_at", "completed_at")


def comparable(events):
    """``events`` with what differs between two runs of one request (ids, times) blanked."""

    def blank(v):
        if isinstance(v, dict):
            return {k: None if k == "id" or k.endswith("_id") or k in VARYING else blank(x) for k, x in v.items()}
        if isinstance(v, list):
            return [blank(x) for x in v]
        return v

    return [(e, d if d == "[DONE]" else blank(json.loads(d))) for e, d in events]


@pytest.mark.parametrize("case", list(CASES))
def test_a_waiting_stream_gets_keep_alive_comments_and_the_same_events(ka_server, plain_server, case):
    path, body, at_once = CASES[case]
    raw = queued_stream(ka_server, path, body)
    blocks = strict_blocks(raw)
    events = [b for b in blocks if b != "comment"]
    # The dialect's immediate events (none for completions and messages: a comment is the
    # first thing sent), then comments while the request waits, before any other event.
    assert blocks[:at_once] == events[:at_once]
    waited = 0
    while blocks[at_once + waited] == "comment":
        waited += 1
    # Waited about HOLD s, a comment every EVERY s: several, at least (the machine may be slow).
    assert waited >= 2, blocks[: at_once + 3]
    assert len(events) > at_once + 2  # the reply itself followed

    # The official clients' decoders skip the comments: they read the strict parse's events,
    # which are what the same stream with its comments cut out reads as.
    without = raw.replace(COMMENT + b"\n\n", b"")
    assert COMMENT not in without
    for decoder in (OpenAISSEDecoder, AnthropicSSEDecoder):
        assert decoded(decoder, raw) == events == decoded(decoder, without)

    # ... and they are the events of the same request on a server without keep-alive,
    # which sent nothing while the request waited.
    plain = queued_stream(plain_server, path, body)
    assert COMMENT not in plain
    plain_events = decoded(OpenAISSEDecoder, plain)
    assert comparable(plain_events) == comparable(events)


def test_clients_with_a_short_read_timeout_wait_out_a_queue(ka_server, plain_server):
    """The official clients, their read timeout (0.8 s) shorter than the wait (1.6 s), read
    whole replies with keep-alive; without it the same client times out."""
    timeout = 0.8  # seconds, for each read (and the connect, on loopback)
    oa = openai.OpenAI(base_url=ka_server.url + "/v1", api_key=KEY, max_retries=0, timeout=timeout)
    with engine_held(ka_server, 1.6):
        chunks = list(
            oa.chat.completions.create(
                model="tiny-tools", messages=QUESTION, tools=[WEATHER_TOOL], max_tokens=100, stream=True
            )
        )
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [
        ("get_weather", {"city": "Paris", "days": 3})
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    with engine_held(ka_server, 1.6):
        text = "".join(
            c.choices[0].text
            for c in oa.completions.create(model="tiny-tools", prompt=LOOP, max_tokens=3, stream=True)
            if c.choices
        )
    assert text == LOOP * 3

    with engine_held(ka_server, 1.6):
        with oa.responses.stream(
            model="tiny-tools", input=QUESTION, tools=[RESPONSES_TOOL], max_output_tokens=100
        ) as s:
            final = s.get_final_response()
    assert final.status == "completed"
    (call,) = [item for item in final.output if item.type == "function_call"]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris", "days": 3})

    an = anthropic.Anthropic(base_url=ka_server.url, api_key=KEY, max_retries=0, timeout=timeout)
    with engine_held(ka_server, 1.6):
        with an.messages.stream(model="tiny-tools", max_tokens=100, messages=QUESTION, tools=[TOOL]) as s:
            message = s.get_final_message()
    assert message.stop_reason == "tool_use"
    assert [b.type for b in message.content] == ["thinking", "tool_use"]
    assert message.content[1].input == {"city": "Paris", "days": 3}

    # The premise: without keep-alive nothing comes while the request waits.
    plain = anthropic.Anthropic(base_url=plain_server.url, api_key=KEY, max_retries=0, timeout=timeout)
    with engine_held(plain_server, 1.6):
        with pytest.raises(anthropic.APITimeoutError):
            with plain.messages.stream(model="tiny-tools", max_tokens=5, messages=QUESTION) as s:
                s.get_final_message()


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_keepalive_flag_refuses_what_is_not_a_number_of_seconds(value, capsys):
    from mlx_dflash.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--keepalive", value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --keepalive must be a number of seconds") and "0: off" in err, err
