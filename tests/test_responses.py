"""POST /v1/responses through the official `openai` client (``client.responses``), and the
server's sampling defaults in every dialect.

Served model: test_server's tiny target rigged to answer the weather question with
reasoning and a Qwen3.5 tool call (other prompts get the random model's text), with a
random draft. Every response and stream event is also validated strictly against the
client's own pydantic types (the client itself parses leniently).
"""

import asyncio
import json
import re

import httpx
import openai
import pytest
from openai.types.responses import Response
from test_server import KEY, QUESTION, WEATHER_TOOL, ServerProcess, _rig_tool_model

import mlx_dflash
from mlx_dflash.server.tools import split_output

FN_TOOL = {"type": "function", **WEATHER_TOOL["function"]}  # the Responses API's flat function tool
FACTS = "Reply in one short line."
ASK = "Name three rivers in Europe."


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return _rig_tool_model(tmp_path_factory.mktemp("rpair"))


@pytest.fixture(scope="module")
def eng(pair):
    return mlx_dflash.load(pair / "target", pair / "draft")


@pytest.fixture(scope="module")
def srv(pair, tmp_path_factory):
    s = ServerProcess(
        "--model",
        str(pair / "target"),
        "--draft",
        str(pair / "draft"),
        "--model-name",
        "tiny",
        "--api-key",
        KEY,
        log=tmp_path_factory.mktemp("rsrv") / "log.txt",
    )
    yield s
    s.close()


def _client(s) -> openai.OpenAI:
    return s.openai()


def _ids(eng, messages, **template_args):
    return list(
        eng.tokenizer.apply_chat_template(
            messages, tools=template_args.pop("tools", None), add_generation_prompt=True, **template_args
        )
    )


def _strict(r) -> None:
    """The wire JSON of a response validates against openai's Response type."""
    Response.model_validate(r.to_dict())


def _strict_events(events) -> None:
    for i, e in enumerate(events):
        type(e).model_validate(e.to_dict())
        assert e.sequence_number == i


def test_text_reply_equals_generate_and_stops_at_max_output_tokens(srv, eng):
    """Message items (developer + user parts), reasoning off: the text equals generate()
    on the same chat prompt; at the length limit the response is incomplete."""
    messages = [{"role": "system", "content": FACTS}, {"role": "user", "content": ASK}]
    ids = _ids(eng, messages, enable_thinking=False)
    want = mlx_dflash.generate(eng, ids, max_tokens=6)
    assert want.stats.finish_reason == "length"
    items = [
        {"type": "message", "role": "developer", "content": FACTS},
        {"role": "user", "content": [{"type": "input_text", "text": ASK}]},
    ]
    client = _client(srv)
    r = client.responses.create(model="tiny", input=items, max_output_tokens=6, reasoning={"effort": "none"})
    _strict(r)
    assert r.output_text == want.text
    assert [o.type for o in r.output] == ["message"] and r.output[0].role == "assistant"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (len(ids), 6)
    assert r.usage.total_tokens == len(ids) + 6 and r.usage.input_tokens_details.cached_tokens >= 0

    events = list(
        client.responses.create(
            model="tiny", input=items, max_output_tokens=6, reasoning={"effort": "none"}, stream=True
        )
    )
    _strict_events(events)
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[4 : 4 + len(deltas)] == ["response.output_text.delta"] * len(deltas) and len(deltas) > 1
    assert kinds[4 + len(deltas) :] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert "".join(deltas) == events[-4].text == want.text
    final = events[-1].response
    assert final.output_text == want.text and final.incomplete_details.reason == "max_output_tokens"
    assert final.usage.output_tokens == 6


def test_instructions_string_input_and_the_string_of_parts_render_alike(srv, eng):
    """``instructions`` + a string input is the same prompt as a system and a user message."""
    ids = _ids(eng, [{"role": "system", "content": FACTS}, {"role": "user", "content": ASK}], enable_thinking=False)
    r = _client(srv).responses.create(
        model="tiny", instructions=FACTS, input=ASK, max_output_tokens=2, reasoning={"effort": "none"}
    )
    assert r.usage.input_tokens == len(ids) and r.instructions == FACTS


def test_items_and_reasoning_switch_render_as_chat_messages(srv, eng):
    """An assistant item with output_text parts between user items is that chat history;
    reasoning effort "none" renders the template with thinking off, another effort with it on."""
    history = [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": "Rhine, Danube, Loire."},
        {"role": "user", "content": "And in Asia?"},
    ]
    items = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": ASK}]},
        {
            "type": "message",
            "role": "assistant",
            "id": "msg_1",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Rhine, Danube, Loire.", "annotations": []}],
        },
        {"role": "user", "content": "And in Asia?"},
    ]
    client = _client(srv)
    for effort, on in (("none", False), ("high", True)):
        r = client.responses.create(model="tiny", input=items, max_output_tokens=1, reasoning={"effort": effort})
        assert r.usage.input_tokens == len(_ids(eng, history, enable_thinking=on)), effort
    assert len(_ids(eng, history, enable_thinking=False)) != len(_ids(eng, history, enable_thinking=True))


def test_tool_call_cut_by_max_output_tokens_is_text(srv):
    """Four tokens stop the rigged reply inside its <tool_call>: no function_call item."""
    from test_server import PIECES

    client = _client(srv)
    r = client.responses.create(model="tiny", input=QUESTION, tools=[FN_TOOL], max_output_tokens=4)
    _strict(r)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [o.type for o in r.output] == ["reasoning", "message"] and r.output_text == "".join(PIECES[2:4])
    events = list(
        client.responses.create(model="tiny", input=QUESTION, tools=[FN_TOOL], max_output_tokens=4, stream=True)
    )
    _strict_events(events)
    assert not [e for e in events if e.type.startswith("response.function_call")]
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == "".join(PIECES[2:4])


def test_reasoning_and_function_call(srv):
    """The rigged reply: a reasoning item, then a function_call item; streamed through the
    client's accumulating helper, whose final response equals the non-streamed one."""
    client = _client(srv)
    r = client.responses.create(model="tiny", input=QUESTION, tools=[FN_TOOL], max_output_tokens=100)
    _strict(r)
    assert r.status == "completed" and r.incomplete_details is None
    assert [o.type for o in r.output] == ["reasoning", "function_call"]
    assert r.output[0].content[0].text == "Let me check the weather."
    # a part of the output: re-encoding the reasoning text counted 15 of 7 generated tokens here
    assert 0 < r.usage.output_tokens_details.reasoning_tokens <= r.usage.output_tokens
    call = r.output[1]
    assert (call.name, json.loads(call.arguments), call.status) == (
        "get_weather",
        {"city": "Paris", "days": 3},
        "completed",
    )
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")

    with client.responses.stream(model="tiny", input=QUESTION, tools=[FN_TOOL], max_output_tokens=100) as s:
        events = list(s)
        final = s.get_final_response()
    _strict_events(events)
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "Let me check the weather."
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert json.loads(done.arguments) == {"city": "Paris", "days": 3}
    assert (
        kinds.index("response.function_call_arguments.delta")
        < kinds.index("response.function_call_arguments.done")
        < len(kinds) - 1
    )
    assert [o.type for o in final.output] == ["reasoning", "function_call"]
    assert json.loads(final.output[1].arguments) == {"city": "Paris", "days": 3}


def test_tool_round_trip_equals_chat_and_hits_the_cache(srv, eng):
    """function_call + function_call_output items: the prompt the chat template gets for
    that conversation (as /v1/chat/completions sends it), the reply generate() gives it,
    and the first turn's prefix served from the cache."""
    convo = QUESTION + [
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Let me check the weather.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    ids = _ids(eng, convo, tools=[WEATHER_TOOL])
    want = mlx_dflash.generate(eng, ids, max_tokens=12)
    items = QUESTION + [
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "Let me check the weather."}],
        },
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": json.dumps({"city": "Paris", "days": 3}),
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"},
    ]
    client = _client(srv)
    client.responses.create(model="tiny", input=QUESTION, tools=[FN_TOOL], max_output_tokens=100)  # turn 1
    r = client.responses.create(model="tiny", input=items, tools=[FN_TOOL], max_output_tokens=12, store=False)
    _strict(r)
    assert r.usage.input_tokens == len(ids)
    assert 0 < r.usage.input_tokens_details.cached_tokens < len(ids)
    reasoning, content, _ = split_output(
        want.text, reasoning=True, tools=[WEATHER_TOOL], cut=want.stats.finish_reason == "length"
    )
    got_reasoning = "".join(c.text for o in r.output if o.type == "reasoning" for c in o.content)
    assert (got_reasoning, r.output_text) == (reasoning, content)
    assert r.usage.output_tokens == len(want.tokens)


BAD = [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation is not supported"),
    ({"input": "hi", "prompt": {"id": "pmpt_1"}}, "stored prompt template"),
    ({"input": "hi", "background": True}, "background responses"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "item references"),
    ({"input": [{"type": "computer_call", "id": "x"}]}, "computer_call"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]}, "input_image"),
    ({"input": [{"role": "robot", "content": "x"}]}, "role"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{oops"}]}, "JSON"),
    ({"input": []}, "no items"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "temperature": -2}, "temperature"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, "json_schema"),
    ({"input": 5}, "input"),
    ({"model": "gpt-9", "input": "hi"}, "gpt-9"),
    ({"input": "hi", "text": {"format": "json"}}, "text.format must be an object"),
    ({"input": "hi", "top_logprobs": 3}, "log-probabilities"),
    ({"input": "hi", "include": ["message.output_text.logprobs"]}, "log-probabilities"),
    ({"input": "hi", "top_p": 0}, "top_p must be above 0"),
]


@pytest.mark.parametrize("body,words", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input_gets_400_in_openais_shape(srv, body, words):
    r = httpx.post(srv.url + "/v1/responses", json={"model": "tiny", **body}, headers={"x-api-key": KEY}, timeout=60)
    assert r.status_code == (404 if words == "gpt-9" else 400), r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and words in err["message"]
    assert httpx.get(srv.url + "/health", timeout=10).json()["status"] == "ok"


def test_sdk_error_and_next_request(srv):
    client = _client(srv)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input="hi", previous_response_id="resp_x")
    assert e.value.body["param"] == "previous_response_id"
    r = client.responses.create(model="tiny", input="hi", max_output_tokens=2)
    assert r.usage.output_tokens == 2


# --- the server's sampling defaults apply when a request gives none --------------------


@pytest.fixture(scope="module")
def sampled_srv(tmp_path_factory):
    # The embedded pair (the rigged one is too peaked for sampling to show); --block-size
    # pins the verify width, so the sampled text is one function of the seed.
    s = ServerProcess(
        "--api-key",
        KEY,
        "--temp",
        "0.8",
        "--top-p",
        "0.7",
        "--block-size",
        "4",
        "--max-batch",  # one at a time: a batch verifies full blocks, so the speculative rule's text may differ
        "1",
        log=tmp_path_factory.mktemp("ssrv") / "log.txt",
    )
    yield s
    s.close()


def test_requests_without_temperature_use_the_servers_defaults(sampled_srv):
    """Served with --temp 0.8 --top-p 0.7: a request that names no temperature or top_p
    (as the Anthropic SDK 2.x and Codex send them) samples with those, in every dialect."""
    eng = mlx_dflash.load()
    prompt = "def quicksort(xs):"
    msgs = [{"role": "user", "content": prompt}]
    ids = _ids(eng, msgs)

    def gen(**kw):
        return mlx_dflash.generate(eng, ids, max_tokens=8, block_size=4, seed=3, **kw).text

    want = gen(temperature=0.8, top_p=0.7)
    # the check tells the defaults apart from greedy and from either setting alone
    assert want not in (gen(), gen(temperature=1.0, top_p=0.7), gen(temperature=0.8, top_p=1.0))
    r = sampled_srv.openai().chat.completions.create(model="mlx-dflash", messages=msgs, max_tokens=8, seed=3)
    assert r.choices[0].message.content == want
    m = sampled_srv.anthropic().messages.create(model="mlx-dflash", max_tokens=8, messages=msgs, extra_body={"seed": 3})
    assert m.content[0].text == want
    resp = sampled_srv.openai().responses.create(
        model="mlx-dflash", input=prompt, max_output_tokens=8, extra_body={"seed": 3}
    )
    assert resp.output_text == want and (resp.temperature, resp.top_p) == (0.8, 0.7)
    # and a request's own setting still wins
    r = sampled_srv.openai().chat.completions.create(
        model="mlx-dflash", messages=msgs, max_tokens=8, seed=3, temperature=0
    )
    assert r.choices[0].message.content == gen()
    resp = sampled_srv.openai().responses.create(
        model="mlx-dflash", input=prompt, max_output_tokens=8, temperature=1.0, extra_body={"seed": 3}
    )
    assert resp.output_text == gen(temperature=1.0, top_p=0.7) and resp.temperature == 1.0


def _scripted_app(script):
    """The server's app in process, its engine events scripted: ("text", text, n)
    and ("done", reason, stats) as the worker sends them."""
    from types import SimpleNamespace

    from mlx_dflash.server.app import Server, Settings
    from mlx_dflash.server.metrics import Metrics
    from mlx_dflash.server.routes import create_app

    class Scripted(Server):
        def submit(self, ids, config, stops, template_kwargs=None):
            out = asyncio.Queue()
            for ev in script:
                out.put_nowait(ev)
            return SimpleNamespace(out=out, cancel=lambda: None, cached_tokens=0)

    return create_app(Scripted(Settings(), SimpleNamespace(engine=mlx_dflash.load(), alive=True), Metrics()))


def test_a_reply_whose_text_is_timeout_is_not_a_timeout():
    """Stream events carry ("text", text, n) and ("done", reason, stats): a
    reply chunk that reads "timeout" (one token in Qwen's vocabulary, as in
    ``self.timeout``) is text, not the generation timing out. The handler
    runs in process on a server whose engine events are scripted."""
    from fastapi.testclient import TestClient

    stats = {"prompt_tokens": 3, "generated_tokens": 3, "cached_tokens": 0, "cycles": 2, "tau": 1.5, "decode_tps": 9.0}
    script = [("text", "self.", 1), ("text", "timeout", 1), ("text", " = 5", 1), ("done", "stop", stats)]
    body = {"model": "mlx-dflash", "input": "Set the timeout."}
    with TestClient(_scripted_app(script)) as client:
        r = client.post("/v1/responses", json={**body, "stream": True})
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
        kinds = [e["type"] for e in events]
        assert "response.failed" not in kinds and kinds[-1] == "response.completed", kinds
        text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        assert text == "self.timeout = 5"
        whole = client.post("/v1/responses", json=body).json()
        assert whole["status"] == "completed"
        (message,) = [o for o in whole["output"] if o["type"] == "message"]
        assert message["content"][0]["text"] == "self.timeout = 5"


def test_a_stream_that_times_out_keeps_its_text_in_the_failed_response():
    """A generation that times out after some text: the message item is
    closed (done events, status incomplete) with the text streamed so far,
    and response.failed carries it; the events validate as openai's types."""
    from fastapi.testclient import TestClient
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    stats = {"prompt_tokens": 3, "generated_tokens": 2, "cached_tokens": 0, "cycles": 2, "tau": 1.0, "decode_tps": 9.0}
    script = [("text", "Rhine, ", 1), ("text", "Danube", 1), ("done", "timeout", stats)]
    with TestClient(_scripted_app(script)) as client:
        r = client.post("/v1/responses", json={"model": "mlx-dflash", "input": ASK, "stream": True})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    for e in events:
        TypeAdapter(ResponseStreamEvent).validate_python(e)
    kinds = [e["type"] for e in events]
    assert kinds[-1] == "response.failed" and "response.output_text.done" in kinds, kinds
    (item,) = [o for o in events[-1]["response"]["output"] if o["type"] == "message"]
    assert item["status"] == "incomplete" and item["content"][0]["text"] == "Rhine, Danube"
    assert events[-1]["response"]["error"]["message"] == "generation timed out after 600 s (2 tokens)"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"])
def test_a_reply_cut_by_shutdown_is_an_error_in_each_api_not_a_finish(path):
    """A reply the server's Ctrl-C cut short ends, after its text so far, with
    a 503 in its API's own error shape (streamed: the last event; whole: the
    response), never with a finish reason that says it ended by itself."""
    from fastapi.testclient import TestClient

    stats = {"prompt_tokens": 3, "generated_tokens": 2, "cached_tokens": 0, "cycles": 2, "tau": 1.0, "decode_tps": 9.0}
    script = [("text", "Rhine, ", 1), ("text", "Danube", 1), ("done", "shutdown", stats)]
    ask = {"messages": [{"role": "user", "content": ASK}]}
    body = {
        "/v1/chat/completions": ask,
        "/v1/completions": {"prompt": ASK},
        "/v1/messages": {**ask, "max_tokens": 16},
        "/v1/responses": {"input": ASK},
    }[path]
    want = "the server is shutting down: the reply was cut after 2 tokens"
    with TestClient(_scripted_app(script)) as client:
        r = client.post(path, json={"model": "mlx-dflash", **body, "stream": True})
        data = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        last = data[-1]
        if path == "/v1/messages":
            assert last == {"type": "error", "error": {"type": "overloaded_error", "message": want}}
        elif path == "/v1/responses":
            assert last["type"] == "response.failed" and last["response"]["error"]["message"] == want
        else:
            assert last["error"]["type"] == "server_error" and last["error"]["message"] == want
            assert "[DONE]" not in r.text  # the openai client raises on the error, not after a finish
        assert "Danube" in r.text  # the text so far was sent
        assert not re.search(r'"(finish_reason|stop_reason)": "|response\.completed', r.text), r.text
        whole = client.post(path, json={"model": "mlx-dflash", **body})
        assert whole.status_code == 503 and want in whole.text


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/responses"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_by_a_stop_string_is_text_not_a_call(path, stream):
    """A stop string that ends the output inside ``<tool_call>`` leaves the
    call's arguments partial (here a command cut before its second half): it
    comes back as text, as a call cut by the token limit does, never as a call
    a client would run."""
    from fastapi.testclient import TestClient

    cut = "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"
    stats = {"prompt_tokens": 3, "generated_tokens": 5, "cached_tokens": 0, "cycles": 2, "tau": 1.0, "decode_tps": 9.0}
    script = [("text", cut, 5), ("done", "stop", {**stats, "stop_sequence": "is"})]
    fn = WEATHER_TOOL["function"]
    body = {
        "/v1/chat/completions": {"messages": QUESTION, "tools": [WEATHER_TOOL], "stop": ["is"]},
        "/v1/messages": {
            "messages": QUESTION,
            "max_tokens": 16,
            "stop_sequences": ["is"],
            "tools": [{"name": fn["name"], "input_schema": fn["parameters"]}],
        },
        "/v1/responses": {"input": QUESTION, "tools": [{"type": "function", **fn}]},
    }[path]
    with TestClient(_scripted_app(script)) as client:
        r = client.post(path, json={"model": "mlx-dflash", **body, "stream": stream})
    assert r.status_code == 200, r.text
    called = r'"tool_calls": \[|"finish_reason": "tool_calls"|"tool_use"|"type": "function_call"'
    assert not re.search(called, r.text), r.text
    if not stream:
        j = r.json()
        text = {
            "/v1/chat/completions": lambda: j["choices"][0]["message"]["content"],
            "/v1/messages": lambda: j["content"][0]["text"],
            "/v1/responses": lambda: j["output"][0]["content"][0]["text"],
        }[path]()
        assert text == cut
