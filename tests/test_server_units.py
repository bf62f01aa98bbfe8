"""Server pieces without a server: the tool-call/reasoning parser (checked against
mlx-lm's own Qwen parsers), stop strings, message conversion and the engine worker."""

import asyncio
import time
from types import SimpleNamespace

import pytest

from mlx_dflash.server import tools
from mlx_dflash.server.metrics import Metrics
from mlx_dflash.server.worker import Job, QueueFull, StopMatcher, Worker

WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "hours": {"type": "array"},
                    "opts": {"type": "object"},
                    "zip": {"type": "string"},
                },
            },
        },
    }
]

# The Qwen3.5 / Qwen3-Coder XML style, as those models write it.
XML_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n"
    '<parameter=hours>\n[1, 2]\n</parameter>\n<parameter=opts>\n{"a": {"b": null}}\n</parameter>\n'
    "<parameter=zip>\n02139\n</parameter>\n</function>\n</tool_call>"
)
JSON_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'


def _body(call: str) -> str:
    return call[len("<tool_call>") : -len("</tool_call>")]


def test_xml_call_matches_mlx_lm_parser():
    from mlx_lm.tool_parsers import qwen3_coder

    want = qwen3_coder.parse_tool_call(_body(XML_CALL), WEATHER)
    (got,) = tools.parse_tool_call(_body(XML_CALL), WEATHER)
    assert got.name == want["name"] == "get_weather"
    assert got.arguments == want["arguments"]
    assert got.arguments == {
        "city": "San Francisco",
        "days": 3,
        "metric": True,
        "hours": [1, 2],
        "opts": {"a": {"b": None}},
        "zip": "02139",
    }


def test_json_call_matches_mlx_lm_parser():
    from mlx_lm.tool_parsers import json_tools

    want = json_tools.parse_tool_call(_body(JSON_CALL))
    (got,) = tools.parse_tool_call(_body(JSON_CALL), WEATHER)
    assert (got.name, got.arguments) == (want["name"], want["arguments"])


def test_xml_values_without_schema_and_multiline():
    body = "<function=run>\n<parameter=code>\nprint(1)\n\nprint(2)\n</parameter>\n<parameter=n>\n7\n</parameter>\n</function>"
    (c,) = tools.parse_tool_call(body, None)
    assert c.arguments == {"code": "print(1)\n\nprint(2)", "n": 7}
    # a typed integer that is not one stays text rather than failing
    (c,) = tools.parse_tool_call("<function=get_weather><parameter=days>soon</parameter></function>", WEATHER)
    assert c.arguments == {"days": "soon"}


@pytest.mark.parametrize(
    "bad",
    ["{not json}", '{"arguments": {}}', '{"name": "f", "arguments": [1]}', "<function=>\n</function>", "plain words"],
)
def test_unparseable_bodies_raise(bad):
    with pytest.raises(ValueError):
        tools.parse_tool_call(bad, WEATHER)


def _stream(text, chunk, **kw):
    p = tools.OutputParser(**kw)
    events = []
    for i in range(0, len(text), chunk):
        events += p.feed(text[i : i + chunk])
    events += p.finish()
    return events, p


def _split(events):
    r = "".join(v for k, v in events if k == "reasoning")
    t = "".join(v for k, v in events if k == "text")
    return r, t, [(v.name, v.arguments) for k, v in events if k == "tool"]


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 1000])
def test_streaming_split_is_chunking_independent(chunk):
    out = "I should look this up.\n</think>\n\nChecking both.\n" + XML_CALL + "\n" + JSON_CALL
    events, p = _stream(out, chunk, reasoning=True, tools=WEATHER)
    r, t, calls = _split(events)
    assert r == "I should look this up."
    assert t == "Checking both."
    assert [n for n, _ in calls] == ["get_weather", "get_weather"]
    assert calls[1][1] == {"city": "Paris", "days": 2}
    assert p.made_tool_call


@pytest.mark.parametrize("chunk", [1, 4, 1000])
def test_plain_text_passes_through_unchanged(chunk):
    text = "  def f(x):\n    return x < 3 and x > 1  # <tool or <think?\n\n"
    events, _ = _stream(text, chunk)
    assert _split(events) == ("", text, [])
    events, _ = _stream(text, chunk, tools=WEATHER)  # tools offered but none called
    assert _split(events) == ("", text, [])


def test_model_opened_thinking_and_unterminated_call():
    # <think> written by the model itself; the call ends at EOS without </tool_call>
    out = "<think>hmm</think>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>"
    r, t, calls = _split(_stream(out, 3, tools=WEATHER)[0])
    assert (r, t, calls) == ("hmm", "", [("get_weather", {"city": "Oslo"})])


def test_call_cut_by_the_token_limit_is_text():
    # the same unterminated call as above, but stopped by max_tokens: its arguments may be partial
    out = "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
    for chunk in (1, 5, 1000):
        p = tools.OutputParser(tools=WEATHER)
        events = [e for i in range(0, len(out), chunk) for e in p.feed(out[i : i + chunk])] + p.finish(cut=True)
        assert _split(events) == ("", out, []) and not p.made_tool_call
    assert tools.split_output(out, tools=WEATHER, cut=True) == ("", out, [])


def test_unparseable_call_comes_back_as_text():
    out = "Sure.\n<tool_call>\n{oops\n</tool_call>\nDone."
    r, t, calls = _split(_stream(out, 2, tools=WEATHER)[0])
    assert calls == [] and "<tool_call>\n{oops\n</tool_call>" in t and t.startswith("Sure.") and t.endswith("Done.")


@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_a_call_that_is_text_keeps_the_whitespace_before_it(chunk):
    """Unparsed, or cut, a call comes back as the text the model wrote: the
    space before ``<tool_call>`` too (it was held as layout and then lost)."""
    for out, cut in [("See: <tool_call>not json</tool_call> done", False), ("Ok  <tool_call>\n<function=get_w", True)]:
        p = tools.OutputParser(tools=WEATHER)
        events = [e for i in range(0, len(out), chunk) for e in p.feed(out[i : i + chunk])] + p.finish(cut=cut)
        assert _split(events) == ("", out, [])
    # a call that parses still takes the layout between text and call with it
    out = "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"
    assert _split(_stream(out, chunk, tools=WEATHER)[0]) == ("", "Checking.", [("get_weather", {"city": "Oslo"})])


@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_joined_text_keeps_the_whitespace_between_text_and_a_call(chunk):
    """Chat Completions makes one string of the content: the text after a
    call keeps the layout the model wrote after it (or before it), not
    "checking.Done"; block dialects drop it, each block stripped."""
    call = "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"
    for out, joined, apart in [
        ("Sure, checking. " + call + "\nDone now.", "Sure, checking.\nDone now.", "Sure, checking.Done now."),
        ("Sure, checking. " + call + "Done now.", "Sure, checking. Done now.", "Sure, checking.Done now."),
        ("Two: " + call + "\n" + call + "\n\nDone.", "Two:\n\nDone.", "Two:Done."),
        (call + "\nDone.", "Done.", "Done."),  # no text before the call: nothing to keep apart
    ]:
        events, _ = _stream(out, chunk, tools=WEATHER, joined=True)
        r, t, calls = _split(events)
        assert t == joined and [n for n, _ in calls] == ["get_weather"] * out.count("<tool_call>")
        assert _split(_stream(out, chunk, tools=WEATHER)[0])[1] == apart


@pytest.mark.parametrize("chunk", [1, 2, 1000])
def test_reasoning_drops_the_template_newline_after_think(chunk):
    """Qwen's templates write "<think>\\n" + reasoning + "\\n</think>": neither newline is reasoning."""
    for out, kw in [("<think>\nplan\n</think>\n\nHi", {}), ("\nplan\n</think>\n\nHi", {"reasoning": True})]:
        r, t, _ = _split(_stream(out, chunk, **kw)[0])
        assert (r, t) == ("plan", "Hi")


def test_prompt_opens_thinking():
    assert tools.prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not tools.prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not tools.prompt_opens_thinking("no markers")


@pytest.mark.parametrize("chunk", [1, 2, 5, 100])
def test_stop_matcher(chunk):
    text = "abc STOP def"
    m = StopMatcher(["STOP", "xyz"])
    out = "".join(m.feed(text[i : i + chunk]) for i in range(0, len(text), chunk) if not m.hit)
    assert out == "abc " and m.hit and m.matched == "STOP"
    m = StopMatcher(["STOP"])
    out = "".join(m.feed(c) for c in "abc STO") + m.flush()
    assert out == "abc STO" and not m.hit


def test_anthropic_and_openai_messages_render_alike():
    """The same conversation in both dialects gives the same chat-template messages."""
    from mlx_dflash.server import anthropic as A
    from mlx_dflash.server import openai as O

    oa = O.ChatRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
                {
                    "role": "assistant",
                    "content": "",
                    "reasoning_content": "need a tool",
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            ],
        }
    )
    an = A.MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 5,
            "system": [{"type": "text", "text": "be brief"}],
            "messages": [
                {"role": "user", "content": "weather?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "need a tool", "signature": ""},
                        {"type": "tool_use", "id": "c1", "name": "get_weather", "input": {"city": "Paris"}},
                    ],
                },
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "sunny"}]},
            ],
        }
    )
    assert O.template_messages(oa.messages) == A.template_messages(an)


# --- the engine worker, with a scripted generator in place of the model ---------------


class _Gen:
    """A stand-in for stream_generate: one piece per cycle, records how far it ran."""

    log = []

    def __init__(self, engine, ids, *, max_tokens, step_delay=0.0, **kw):
        self.ids, self.n, self.delay = ids, max_tokens, step_delay
        self.steps, self.closed = 0, False
        _Gen.log.append(self)

    def __iter__(self):
        stats = SimpleNamespace(prompt_tokens=len(self.ids), generated_tokens=0, cycles=0, tau=1.0, decode_tps=1.0)
        try:
            for i in range(self.n):
                time.sleep(self.delay)
                self.steps += 1
                stats.generated_tokens += 1
                stats.cycles += 1
                yield SimpleNamespace(
                    text=f"{self.ids[0]}.{i} ",
                    tokens=[self.ids[0] * 1000 + i],
                    stats=stats,
                    finish_reason="length" if i == self.n - 1 else None,
                )
        finally:
            self.closed = True

    def close(self):
        self.closed = True


def _gen_fn(engine, ids, **kw):
    return iter(_Gen(engine, ids, **kw))


def _decode(ids):
    """The scripted generator's tokenizer: token r * 1000 + i reads "r.i "."""
    return "".join(f"{t // 1000}.{t % 1000} " for t in ids)


def _scripted_engine():
    return SimpleNamespace(tokenizer=SimpleNamespace(decode=_decode, eos_token_ids=[]))


def _collect(job):
    async def run():
        out = []
        while True:
            ev = await job.out.get()
            out.append(ev)
            if ev[0] in ("done", "error"):
                return out

    return run


def test_worker_order_cancel_timeout_and_queue_bound():
    _Gen.log = []
    w = Worker(_scripted_engine, prompt_cache=False, max_queue=2, metrics=Metrics(), generate_fn=_gen_fn)
    w.start()
    try:

        async def main():
            loop = asyncio.get_running_loop()
            # job a holds the engine until released, so b and c queue behind it
            a = Job([1], {"max_tokens": 1000, "step_delay": 0.01}, [], 30.0, loop)
            w.submit(a)
            for _ in range(1000):  # a worker that fails before generating must fail the test, not hang it
                if _Gen.log or a.out.qsize():
                    break
                await asyncio.sleep(0.01)
            assert _Gen.log, [a.out.get_nowait() for _ in range(a.out.qsize())]
            b = Job([2], {"max_tokens": 3}, ["2.2"], 30.0, loop)
            c = Job([3], {"max_tokens": 2}, [], 30.0, loop)
            w.submit(b)
            w.submit(c)
            with pytest.raises(QueueFull):
                w.submit(Job([4], {"max_tokens": 1}, [], 30.0, loop))
            await asyncio.sleep(0.1)
            a.cancel()  # the client went away: stopped after the current cycle
            ra, rb, rc = [await _collect(j)() for j in (a, b, c)]
            assert ra[-1][:2] == ("done", "cancelled")
            ga = _Gen.log[0]
            assert ga.closed and ga.steps < 1000
            assert [g.ids[0] for g in _Gen.log] == [1, 2, 3]  # arrival order
            assert "".join(e[1] for e in rb if e[0] == "text") == "2.0 2.1 "  # cut at the stop string
            assert rb[-1][1] == "stop" and rb[-1][2]["stop_sequence"] == "2.2"
            assert rb[-1][2]["generated_tokens"] == 3  # the tokens up to the stop string's end
            assert rc[-1][1] == "length" and rc[-1][2]["generated_tokens"] == 2
            # a per-request timeout stops a running generation too
            t = Job([5], {"max_tokens": 10_000, "step_delay": 0.01}, [], 0.2, loop)
            w.submit(t)
            rt = await _collect(t)()
            assert rt[-1][1] == "timeout" and _Gen.log[-1].closed and _Gen.log[-1].steps < 10_000

        asyncio.run(main())
    finally:
        w.stop()
    assert not w.alive


def _prefilling_gen(chunks: list):
    """A stand-in for stream_generate whose prompt prefills in 100 chunks of
    0.02 s, reporting each as stream_generate does; ``chunks`` records them."""

    def gen(engine, ids, *, prompt_progress_callback, **kw):
        for k in range(1, 101):
            time.sleep(0.02)
            chunks.append(k)
            prompt_progress_callback(k * 64, 6400)
        yield SimpleNamespace(text="x ", tokens=[1], stats=None, finish_reason="length")

    return gen


@pytest.mark.parametrize("how", ["cancel", "timeout"])
def test_a_long_prefill_stops_when_its_client_does(how):
    """A cancel or a timeout is noticed between prefill chunks, not only once
    the whole prompt is in (then the engine stayed busy for a gone client)."""
    chunks = []
    w = Worker(
        _scripted_engine, prompt_cache=False, max_queue=2, metrics=Metrics(), generate_fn=_prefilling_gen(chunks)
    )
    w.start()
    try:

        async def main():
            loop = asyncio.get_running_loop()
            job = Job([1], {}, [], 0.3 if how == "timeout" else 30.0, loop)
            w.submit(job)
            if how == "cancel":
                while len(chunks) < 3:
                    await asyncio.sleep(0.01)
                job.cancel()
            return await _collect(job)()

        events = asyncio.run(main())
    finally:
        w.stop()
    assert events[-1][:2] == ("done", "timeout" if how == "timeout" else "cancelled")
    assert len(chunks) < 50  # of 100: stopped within a chunk or so, not after the prefill


def test_a_queued_job_whose_client_left_frees_its_place():
    """A client that gives up while queued leaves the queue at once: its
    place no longer turns a live client away with a 429."""
    w = Worker(
        _scripted_engine, prompt_cache=False, max_queue=2, metrics=Metrics(), generate_fn=_gen_fn
    )  # not started: jobs stay
    loop = asyncio.new_event_loop()
    try:
        a, b, c = (Job([i], {"max_tokens": 1}, [], 30.0, loop) for i in range(3))
        w.submit(a)
        w.submit(b)
        with pytest.raises(QueueFull):
            w.submit(c)
        a.cancel()
        assert w.queue_length == 1
        w.submit(c)
        assert w.queue_length == 2
    finally:
        loop.close()


@pytest.mark.parametrize(
    "argv,words",
    [
        (["serve", "--port", "65536"], "--port"),
        (["serve", "--max-queue", "0"], "must be positive"),
        # NaN and inf compared false to "<= 0": a traceback (inf MB), or a server whose requests never time out
        (["serve", "--max-body-mb", "inf"], "--max-body-mb must be a positive number"),
        (["serve", "--max-body-mb", "nan"], "--max-body-mb must be a positive number"),
        (["serve", "--timeout", "nan"], "--timeout must be a positive number"),
        (["serve", "--pipeline", "--pipeline-timeout", "nan"], "--pipeline-timeout must be a positive number"),
        (["serve", "--chat-template-args", "[1]"], "JSON object"),
        (["serve", "--chat-template-args", "{oops"], "not valid JSON"),
        (["serve", "--temp", "-1"], "temperature"),
        (["serve", "--model", "/nonexistent/model"], "/nonexistent/model"),
        (["serve", "--api-key", ""], "--api-key is empty"),
        (["serve", "--host", "no-such-host.invalid"], "cannot resolve"),
    ],
)
def test_serve_cli_rejects_bad_flags_before_listening(argv, words, capsys):
    from mlx_dflash.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and words in err


def test_serve_on_a_port_in_use_is_one_error_before_loading(capsys):
    """A port another process listens on: exit 2 with one line, before the model loads."""
    import socket

    from mlx_dflash.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as e:
            main(["serve", "--port", str(port), "--model", "/nonexistent/model"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot listen on 127.0.0.1:") and "in use" in err


@pytest.mark.parametrize("origins", [("*",), ("http://app.example",), ()], ids=["any", "one", "none"])
def test_browser_clients_get_cors_as_allowed_origins_say(origins):
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from mlx_dflash.server.app import Server, Settings
    from mlx_dflash.server.routes import create_app

    worker = SimpleNamespace(engine=None, alive=True, queue_length=0)
    app = create_app(Server(Settings(allowed_origins=origins), worker, Metrics()))
    origin = {"Origin": "http://app.example"}
    with TestClient(app) as client:
        pre = client.options(
            "/v1/chat/completions",
            headers={
                **origin,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization",
            },
        )
        got = client.get("/health", headers=origin)
    assert got.status_code == 200
    if origins:
        assert pre.status_code == 200, pre.text
        assert pre.headers["access-control-allow-origin"] in ("*", "http://app.example")
        assert "authorization" in pre.headers["access-control-allow-headers"].lower()
        assert got.headers["access-control-allow-origin"] in ("*", "http://app.example")
    else:
        assert pre.status_code == 405 and "access-control-allow-origin" not in got.headers


def test_a_request_that_never_ran_reports_its_prompt_and_no_cache_lookup():
    from mlx_dflash.server.worker import _stats_dict

    d = _stats_dict(None, 7)  # cancelled in the queue, or at shutdown
    assert d["prompt_tokens"] == 7 and d["generated_tokens"] == 0
    m = Metrics()
    m.record_generation(d, prefix_cache=object())
    m.record_generation(dict(d, generated_tokens=3), prefix_cache=None)  # --no-prompt-cache
    assert m.cache_lookups == 0 and m.prompt_tokens == 14
    m.record_generation(dict(d, generated_tokens=3), prefix_cache=object())
    assert m.cache_lookups == 1
