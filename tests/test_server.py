"""`mlx-dflash serve` end to end: real server processes on free loopback ports,
driven by the official `openai` and `anthropic` clients (and httpx for raw HTTP).

Two servers per run: the embedded pair (text equals ``mlx_dflash.generate``,
concurrency, disconnects, bad input, auth) and a test-local tiny target rigged
to answer one tool-using prompt with the Qwen3.5 tool-call format
(reasoning + ``<tool_call><function=...>``), served with a random draft and a
queue of one (tool calls, dialect parity, 429).
"""

import json
import os
import re
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

import mlx_dflash
from mlx_dflash.server.tools import split_output
from tools import tiny

ROOT = Path(__file__).resolve().parents[1]
KEY = "test-key-123"
MAX_NEW = 12  # tokens per request: the embedded target runs at tens of tokens/s on a loaded CPU


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m mlx_dflash serve --port 0`` (a free loopback port, the one
    its start line names), stopped on close."""

    def __init__(self, *args, log: Path):
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.log = log
        self.url = None
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlx_dflash", "serve", "--port", "0", "--log-level", "warning", *args],
            cwd=ROOT,
            env=env,
            stdout=open(log, "w"),
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {log.read_text()[-2000:]}")
            if self.url is None:
                said = re.search(r"serving '.*' on (http://127\.0\.0\.1:(\d+)) ", log.read_text())
                if said:
                    self.url, self.port = said.group(1), int(said.group(2))
                    assert self.port != 0
            try:
                if self.url and httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.close()
        raise RuntimeError("server did not come up in 120 s")

    def close(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def metrics(self) -> dict:
        text = httpx.get(self.url + "/metrics", headers={"x-api-key": KEY}, timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def openai(self, key=KEY):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120)

    def anthropic(self, key=KEY):
        return anthropic.Anthropic(base_url=self.url, api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # One request at a time (--max-batch 1, as before batching): its seeded speculative-rule
    # text equals generate()'s; batched serving is tested in tests/test_server_batch.py.
    s = ServerProcess(
        "--api-key", KEY, "--max-body-mb", "0.5", "--max-batch", "1", log=tmp_path_factory.mktemp("srv") / "log.txt"
    )
    yield s
    s.close()
    assert s.proc.returncode is not None


@pytest.fixture(scope="module")
def engine():
    return mlx_dflash.load()


PROMPTS = [
    "def fibonacci(n):",
    "import os\n\n\ndef read_config(path):",
    "class Stack:\n",
    "# Parse command line arguments\n",
]


def _expected(engine, prompt, chat=True, n=MAX_NEW):
    ids = engine.encode(prompt, chat_template=chat)
    return ids, mlx_dflash.generate(engine, ids, max_tokens=n)


def _finish(result, n=MAX_NEW):
    return "length" if result.stats.finish_reason == "length" else "stop"


# --- text equals mlx_dflash.generate --------------------------------------------------------


def test_openai_chat_equals_generate(server, engine):
    ids, want = _expected(engine, PROMPTS[0])
    client = server.openai()
    r = client.chat.completions.create(
        model="mlx-dflash", messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=MAX_NEW, temperature=0
    )
    assert r.choices[0].message.content == want.text
    assert r.choices[0].finish_reason == _finish(want)
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == len(want.tokens)
    assert r.usage.total_tokens == len(ids) + len(want.tokens)
    assert r.usage.prompt_tokens_details.cached_tokens >= 0

    chunks = list(
        client.chat.completions.create(
            model="mlx-dflash",
            messages=[{"role": "user", "content": PROMPTS[0]}],
            max_completion_tokens=MAX_NEW,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # really streamed
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [_finish(want)]
    assert chunks[-1].usage.prompt_tokens == len(ids) and chunks[-1].usage.completion_tokens == len(want.tokens)
    # "All other chunks will also include a usage field, but with a null value" (OpenAI's stream_options)
    assert all("usage" in c.model_fields_set and c.usage is None for c in chunks[:-1])


def test_a_think_marker_in_a_message_opens_no_reasoning(server, engine):
    """Only what the template adds for the reply can open a reasoning block: a
    "<think>" in a user's text (code, a tool result) left the reply all reasoning."""
    content = "# <think>\nSTART = '<think>'\n"
    ids, want = _expected(engine, content)
    assert want.text
    r = server.openai().chat.completions.create(
        model="mlx-dflash", messages=[{"role": "user", "content": content}], max_tokens=MAX_NEW, temperature=0
    )
    msg = r.choices[0].message
    assert msg.content == want.text and not getattr(msg, "reasoning_content", None)
    m = server.anthropic().messages.create(
        model="mlx-dflash", max_tokens=MAX_NEW, messages=[{"role": "user", "content": content}]
    )
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == want.text


def test_openai_completions_equals_generate(server, engine):
    ids, want = _expected(engine, PROMPTS[1], chat=False)
    client = server.openai()
    r = client.completions.create(model="mlx-dflash", prompt=PROMPTS[1], max_tokens=MAX_NEW)
    assert r.choices[0].text == want.text
    eos = engine.tokenizer.eos_token_ids
    assert want.text == engine.tokenizer.decode([t for t in want.tokens if t not in eos])  # leading space kept
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(want.tokens))
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(model="mlx-dflash", prompt=PROMPTS[1], max_tokens=MAX_NEW, stream=True)
        if c.choices
    )
    assert streamed == want.text


def test_anthropic_messages_equal_generate(server, engine):
    ids, want = _expected(engine, PROMPTS[2])
    client = server.anthropic()
    m = client.messages.create(
        model="mlx-dflash", max_tokens=MAX_NEW, messages=[{"role": "user", "content": PROMPTS[2]}]
    )
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == want.text
    assert m.stop_reason == ("max_tokens" if want.stats.finish_reason == "length" else "end_turn")
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == len(ids)
    assert m.usage.output_tokens == len(want.tokens)
    with client.messages.stream(
        model="mlx-dflash", max_tokens=MAX_NEW, messages=[{"role": "user", "content": PROMPTS[2]}]
    ) as s:
        pieces = list(s.text_stream)
        final = s.get_final_message()
    assert "".join(pieces) == want.text and len(pieces) > 1
    assert final.content[0].text == want.text and final.usage.output_tokens == len(want.tokens)
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == len(ids)
    n = client.messages.count_tokens(model="mlx-dflash", messages=[{"role": "user", "content": PROMPTS[2]}])
    assert n.input_tokens == len(ids)


def test_sampling_settings_and_seed_equal_generate(server, engine):
    ids = engine.encode(PROMPTS[3], chat_template=True)
    want = mlx_dflash.generate(engine, ids, max_tokens=MAX_NEW, temperature=0.8, top_p=0.9, top_k=40, seed=7)
    r = server.openai().chat.completions.create(
        model="mlx-dflash",
        messages=[{"role": "user", "content": PROMPTS[3]}],
        max_tokens=MAX_NEW,
        temperature=0.8,
        top_p=0.9,
        seed=7,
        extra_body={"top_k": 40},
    )
    assert r.choices[0].message.content == want.text
    # (this SDK version has no temperature/top_p/top_k arguments; the API fields go in the body)
    m = server.anthropic().messages.create(
        model="mlx-dflash",
        max_tokens=MAX_NEW,
        messages=[{"role": "user", "content": PROMPTS[3]}],
        extra_body={"temperature": 0.8, "top_p": 0.9, "top_k": 40, "seed": 7},
    )
    assert m.content[0].text == want.text


def test_text_parts_are_joined_alike_in_every_dialect(server):
    """A system prompt given as several text parts renders one prompt in every
    dialect (Anthropic's blocks were joined with newlines, the others' parts not)."""
    parts = [{"type": "text", "text": "You are"}, {"type": "text", "text": " a coder."}]
    counts = {}
    r = httpx.post(
        server.url + "/v1/chat/completions",
        headers={"x-api-key": KEY},
        json={"model": "mlx-dflash", "max_tokens": 1, "messages": [{"role": "system", "content": parts}, MSG[0]]},
    )
    counts["chat"] = r.json()["usage"]["prompt_tokens"]
    r = httpx.post(
        server.url + "/v1/responses",
        headers={"x-api-key": KEY},
        json={
            "model": "mlx-dflash",
            "max_output_tokens": 1,
            "input": [
                {"role": "system", "content": [{"type": "input_text", "text": p["text"]} for p in parts]},
                {"role": "user", "content": MSG[0]["content"]},
            ],
        },
    )
    counts["responses"] = r.json()["usage"]["input_tokens"]
    r = httpx.post(
        server.url + "/v1/messages/count_tokens",
        headers={"x-api-key": KEY},
        json={"model": "mlx-dflash", "system": parts, "messages": MSG},
    )
    counts["messages"] = r.json()["input_tokens"]
    assert len(set(counts.values())) == 1, counts


def test_count_tokens_counts_a_conversation_past_the_context(server):
    """A client counts tokens to learn whether its conversation still fits (and
    compacts it if not): a count past the context limit is a count, not a 400."""
    long = [{"role": "user", "content": "a " * 4200}]
    r = httpx.post(
        server.url + "/v1/messages/count_tokens",
        headers={"x-api-key": KEY},
        json={"model": "mlx-dflash", "messages": long},
    )
    assert r.status_code == 200 and r.json()["input_tokens"] > 4200
    r = httpx.post(
        server.url + "/v1/messages",
        headers={"x-api-key": KEY},
        json={"model": "mlx-dflash", "max_tokens": 4, "messages": long},
    )
    assert r.status_code == 400 and "context limit" in r.json()["error"]["message"]


def test_xtc_min_p_and_repetition_penalty_in_every_dialect(server, engine):
    """mlx-lm's extra sampling fields reach the sampler from each dialect
    (/v1/messages ignored min_p and repetition_penalty before)."""
    ids = engine.encode(PROMPTS[3], chat_template=True)
    extra = {"xtc_probability": 0.7, "xtc_threshold": 0.05, "min_p": 0.02, "repetition_penalty": 1.3}
    want = mlx_dflash.generate(engine, ids, max_tokens=MAX_NEW, temperature=1.0, seed=7, **extra)
    assert want.text != mlx_dflash.generate(engine, ids, max_tokens=MAX_NEW, temperature=1.0, seed=7).text
    msgs = [{"role": "user", "content": PROMPTS[3]}]
    r = server.openai().chat.completions.create(
        model="mlx-dflash", messages=msgs, max_tokens=MAX_NEW, temperature=1.0, seed=7, extra_body=extra
    )
    assert r.choices[0].message.content == want.text
    m = server.anthropic().messages.create(
        model="mlx-dflash", max_tokens=MAX_NEW, messages=msgs, extra_body={"temperature": 1.0, "seed": 7, **extra}
    )
    assert m.content[0].text == want.text
    resp = server.openai().responses.create(
        model="mlx-dflash",
        input=PROMPTS[3],
        max_output_tokens=MAX_NEW,
        temperature=1.0,
        extra_body={"seed": 7, **extra},
    )
    assert resp.output_text == want.text


def test_sampling_integers_past_any_vocabulary_or_history_are_served(server, engine):
    """min_tokens_to_keep over the vocabulary and a repetition window over 32
    bits keep every token / the whole history. They passed validation and then
    failed in mlx-lm's filters (a 500), and the first left MLX's random state
    broken, so every later unseeded sampled request got a 500 too."""
    msgs = [{"role": "user", "content": PROMPTS[3]}]
    ids = engine.encode(PROMPTS[3], chat_template=True)
    want = mlx_dflash.generate(engine, ids, max_tokens=MAX_NEW, temperature=1.0, seed=7).text
    for extra in ({"min_p": 0.1, "min_tokens_to_keep": 3000}, {"min_p": 0.2, "min_tokens_to_keep": 2**70}):
        r = server.openai().chat.completions.create(
            model="mlx-dflash", messages=msgs, max_tokens=MAX_NEW, temperature=1.0, seed=7, extra_body=extra
        )
        assert r.choices[0].message.content == want
    r = server.openai().chat.completions.create(
        model="mlx-dflash",
        messages=msgs,
        max_tokens=MAX_NEW,
        temperature=0.0,
        extra_body={"repetition_penalty": 1.1, "repetition_context_size": 2**40},
    )
    assert r.choices[0].message.content
    r = server.openai().chat.completions.create(model="mlx-dflash", messages=msgs, max_tokens=4, temperature=0.8)
    assert 1 <= r.usage.completion_tokens <= 4  # answered, not a 500


def test_second_turn_is_served_from_the_prefix_cache(server, engine):
    """An agent resending its history: the second turn reuses the first turn's prefix, and the
    reply still equals generate() without any cache."""
    first = [{"role": "user", "content": "def parse_args(argv):\n"}]
    r1 = server.openai().chat.completions.create(model="mlx-dflash", messages=first, max_tokens=MAX_NEW)
    convo = first + [
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "\n\ndef main():\n"},
    ]
    ids = list(engine.tokenizer.apply_chat_template(convo, add_generation_prompt=True))
    want = mlx_dflash.generate(engine, ids, max_tokens=MAX_NEW)
    before = server.metrics()
    r2 = server.openai().chat.completions.create(model="mlx-dflash", messages=convo, max_tokens=MAX_NEW)
    assert r2.choices[0].message.content == want.text
    assert r2.usage.prompt_tokens == len(ids)
    assert 0 < r2.usage.prompt_tokens_details.cached_tokens < len(ids)
    m = server.anthropic().messages.create(model="mlx-dflash", max_tokens=MAX_NEW, messages=convo)
    assert m.content[0].text == want.text
    assert m.usage.cache_read_input_tokens > 0
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(ids)
    after = server.metrics()
    assert after["mlx_dflash_prefix_cache_hits_total"] >= before["mlx_dflash_prefix_cache_hits_total"] + 2
    assert after["mlx_dflash_prefix_cache_hit_tokens_total"] > before["mlx_dflash_prefix_cache_hit_tokens_total"]
    assert after["mlx_dflash_prefix_cache_bytes"] > 0


def test_kv_bits_server_serves_from_the_prefix_cache(engine, tmp_path):
    """``serve --kv-bits 8``: the prefix cache holds quantized KV; a second
    turn restores it and its reply equals generate() with 8-bit KV and no cache
    (the width pinned so that no cost measurement runs)."""
    s = ServerProcess("--kv-bits", "8", "--block-size", "16", "--api-key", KEY, log=tmp_path / "log.txt")
    try:
        first = [{"role": "user", "content": "def parse_args(argv):\n"}]
        r1 = s.openai().chat.completions.create(model="mlx-dflash", messages=first, max_tokens=MAX_NEW)
        convo = first + [
            {"role": "assistant", "content": r1.choices[0].message.content},
            {"role": "user", "content": "\n\ndef main():\n"},
        ]
        ids = list(engine.tokenizer.apply_chat_template(convo, add_generation_prompt=True))
        want = mlx_dflash.generate(engine, ids, max_tokens=MAX_NEW, kv_bits=8, block_size=16)
        r2 = s.openai().chat.completions.create(model="mlx-dflash", messages=convo, max_tokens=MAX_NEW)
        assert r2.choices[0].message.content == want.text
        assert 0 < r2.usage.prompt_tokens_details.cached_tokens < len(ids)
    finally:
        s.close()


def tokens_to_stop(engine, tokens, stop) -> int:
    """How many of ``tokens`` a reply cut at ``stop`` used: up to the one whose text completes it."""
    return next(k for k in range(1, len(tokens) + 1) if stop in engine.tokenizer.decode(tokens[:k]))


def test_stop_sequences(server, engine):
    _, want = _expected(engine, PROMPTS[0])
    stop = want.text[6:9]
    cut = want.text[: want.text.find(stop)]
    r = server.openai().chat.completions.create(
        model="mlx-dflash", messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=MAX_NEW, stop=[stop, "@@@"]
    )
    assert r.choices[0].message.content == cut and r.choices[0].finish_reason == "stop"
    # The tokens up to the one that completes the stop string, not what the cycle committed past it.
    assert r.usage.completion_tokens == tokens_to_stop(engine, want.tokens, stop) < len(want.tokens)
    m = server.anthropic().messages.create(
        model="mlx-dflash",
        max_tokens=MAX_NEW,
        stop_sequences=[stop],
        messages=[{"role": "user", "content": PROMPTS[0]}],
    )
    assert m.content[0].text == cut and m.stop_reason == "stop_sequence" and m.stop_sequence == stop


def test_eight_concurrent_clients(server, engine):
    want = {p: _expected(engine, p, n=8)[1].text for p in PROMPTS}

    def one(i):
        p = PROMPTS[i % len(PROMPTS)]
        if i % 2:
            chunks = server.openai().chat.completions.create(
                model="mlx-dflash", messages=[{"role": "user", "content": p}], max_tokens=8, stream=True
            )
            return p, "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        if i % 4 == 0:
            m = server.anthropic().messages.create(
                model="mlx-dflash", max_tokens=8, messages=[{"role": "user", "content": p}]
            )
            return p, m.content[0].text
        r = server.openai().chat.completions.create(
            model="mlx-dflash", messages=[{"role": "user", "content": p}], max_tokens=8
        )
        return p, r.choices[0].message.content

    with ThreadPoolExecutor(8) as ex:
        results = list(ex.map(one, range(8)))
    assert len(results) == 8
    for p, text in results:
        assert text == want[p]


def test_dropped_stream_frees_engine(server):
    before = server.metrics()
    body = {
        "model": "mlx-dflash",
        "messages": [{"role": "user", "content": PROMPTS[3]}],
        "max_tokens": 2000,
        "stream": True,
    }
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", server.url + "/v1/chat/completions", json=body, headers={"x-api-key": KEY}) as r:
            assert r.status_code == 200
            seen = 0
            for line in r.iter_lines():
                if line.startswith("data: ") and '"content"' in line:
                    seen += 1
                    if seen == 3:
                        break  # leave mid-stream: closing the response drops the connection
    tic = time.monotonic()
    after = before
    while time.monotonic() - tic < 30:
        after = server.metrics()
        if (
            after["mlx_dflash_cancelled_total"] > before["mlx_dflash_cancelled_total"]
            and after["mlx_dflash_running_requests"] == 0
        ):
            break
        time.sleep(0.1)
    assert after["mlx_dflash_cancelled_total"] == before["mlx_dflash_cancelled_total"] + 1
    assert after["mlx_dflash_running_requests"] == 0
    generated = after["mlx_dflash_generation_tokens_total"] - before["mlx_dflash_generation_tokens_total"]
    # It had started (the first content event may be the role's empty delta, so
    # 3 events can be 2 tokens) and stopped long before its 2000 tokens.
    assert 1 <= generated < 200
    # and the engine takes the next request at once
    r = server.openai().completions.create(model="mlx-dflash", prompt="x = 1\n", max_tokens=2)
    assert r.usage.completion_tokens == 2


def _post(server, path, body, headers=None, raw=None):
    h = {"x-api-key": KEY, **(headers or {})}
    if raw is not None:
        return httpx.post(server.url + path, content=raw, headers={**h, "content-type": "application/json"}, timeout=60)
    return httpx.post(server.url + path, json=body, headers=h, timeout=60)


ATOOL = {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
MSG = [{"role": "user", "content": "x = 1"}]
RFN = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}
BAD = [
    # (path, json body or raw bytes, status, words in the message)
    ("/v1/chat/completions", b"{not json", 400, "malformed JSON"),
    ("/v1/chat/completions", b"[1, 2]", 400, "JSON object"),
    ("/v1/chat/completions", {"model": "mlx-dflash", "messages": MSG, "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": "mlx-dflash", "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"model": "mlx-dflash", "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": "mlx-dflash", "messages": MSG, "temperature": -1}, 400, "temperature"),
    ("/v1/chat/completions", {"model": "mlx-dflash", "messages": MSG, "top_p": 1.5}, 400, "top_p"),
    ("/v1/messages", {"model": "mlx-dflash", "messages": MSG, "max_tokens": 4, "temperature": 5}, 400, "temperature"),
    ("/v1/chat/completions", {"model": "gpt-9", "messages": MSG}, 404, "gpt-9"),
    ("/v1/chat/completions", {"model": "mlx-dflash", "messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": "mlx-dflash", "messages": MSG, "max_tokens": 10**9}, 400, "max_tokens"),
    (
        "/v1/chat/completions",
        {
            "model": "mlx-dflash",
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}],
        },
        400,
        "text",
    ),
    (
        "/v1/chat/completions",
        {"model": "mlx-dflash", "messages": [{"role": "user", "content": "a " * 4200}]},
        400,
        "context limit",
    ),
    ("/v1/completions", {"model": "mlx-dflash", "prompt": ""}, 400, "empty"),
    ("/v1/completions", {"model": "mlx-dflash", "prompt": [1, 99999999]}, 400, "vocabulary"),
    (
        "/v1/chat/completions",
        {"model": "mlx-dflash", "messages": [{"role": "user", "content": "a" * 600_000}]},
        413,
        "limit",
    ),
    ("/v1/messages", b"{", 400, "malformed JSON"),
    ("/v1/chat/completions", {"model": "mlx-dflash", "messages": MSG, "functions": [{"name": "f"}]}, 400, "tools"),
    ("/v1/chat/completions", {"model": "mlx-dflash", "messages": MSG, "function_call": "auto"}, 400, "tool_choice"),
    ("/v1/completions", {"model": "mlx-dflash", "prompt": "x", "logprobs": 0}, 400, "logprobs"),
    ("/v1/chat/completions", {"model": "mlx-dflash", "messages": MSG, "top_p": 0}, 400, "top_p must be above 0"),
    ("/v1/completions", {"model": "mlx-dflash", "prompt": "x", "stop": [str(i) for i in range(65)]}, 400, "stop"),
    (
        "/v1/messages",
        {"model": "mlx-dflash", "max_tokens": 4, "messages": MSG, "stop_sequences": ["x" * 1001]},
        400,
        "stop",
    ),
    ("/v1/completions", b'{"prompt": "x", "metadata": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5001, 400, "too deeply"),
    ("/v1/messages", b'{"messages": ' + b"[" * 100000 + b"]" * 100000 + b"}", 400, "too deeply"),
    ("/v1/messages", {"model": "mlx-dflash", "messages": MSG}, 400, "max_tokens"),
    ("/v1/messages", {"model": "claude-x", "max_tokens": 5, "messages": MSG}, 404, "claude-x"),
    ("/v1/messages", {"model": "mlx-dflash", "max_tokens": -5, "messages": MSG}, 400, "max_tokens"),
    (
        "/v1/messages",
        {"model": "mlx-dflash", "max_tokens": 5, "messages": [{"role": "robot", "content": "x"}]},
        400,
        "role",
    ),
    (
        "/v1/messages",
        {
            "model": "mlx-dflash",
            "max_tokens": 5,
            "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
        },
        400,
        "image",
    ),
    (
        "/v1/messages",
        {"model": "mlx-dflash", "max_tokens": 5, "messages": [{"role": "user", "content": "a " * 4200}]},
        400,
        "context limit",
    ),
    ("/v1/messages", {"model": "mlx-dflash", "max_tokens": 5, "top_k": "x", "messages": MSG}, 400, "top_k"),
    (
        "/v1/messages",
        {"model": "mlx-dflash", "max_tokens": 5, "messages": MSG, "thinking": {"type": "weird"}},
        400,
        "thinking",
    ),
    (
        "/v1/messages",
        {"model": "mlx-dflash", "max_tokens": 5, "messages": MSG, "tool_choice": {"type": "bogus"}},
        400,
        "tool_choice",
    ),
    (  # a union's error names the field that is wrong, not the union member tried first
        "/v1/messages",
        {
            "model": "mlx-dflash",
            "max_tokens": 5,
            "messages": MSG
            + [{"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": "oops"}]}],
        },
        400,
        "'messages.1.content.0.input'",
    ),
    # No coercion: a number in a string, a boolean for a number or a string for a boolean is refused.
    ("/v1/chat/completions", {"model": "mlx-dflash", "messages": MSG, "max_tokens": "8"}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": "mlx-dflash", "messages": MSG, "max_tokens": True}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": "mlx-dflash", "messages": MSG, "stream": "yes"}, 400, "stream"),
    ("/v1/responses", {"model": "mlx-dflash", "input": "hi", "max_output_tokens": True}, 400, "max_output_tokens"),
    ("/v1/messages", {"model": "mlx-dflash", "max_tokens": "5", "messages": MSG}, 400, "max_tokens"),
    # Non-finite numbers (Python's JSON reads NaN and Infinity) and text that is not valid Unicode.
    (
        "/v1/chat/completions",
        b'{"model": "mlx-dflash", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
        400,
        "temperature",
    ),
    (
        "/v1/responses",
        b'{"model": "mlx-dflash", "input": "hi", "stream": true, "temperature": NaN}',
        400,
        "temperature",
    ),
    (
        "/v1/messages",
        b'{"model": "mlx-dflash", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], '
        b'"temperature": Infinity}',
        400,
        "temperature",
    ),
    (
        "/v1/chat/completions",
        b'{"model": "mlx-dflash", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
        400,
        "messages.0.content",
    ),
    (
        "/v1/messages/count_tokens",
        b'{"model": "mlx-dflash", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
        400,
        "not valid UTF-8",
    ),
    # Out of OpenAI's documented range (0-2), refused as OpenAI refuses it.
    ("/v1/chat/completions", {"model": "mlx-dflash", "messages": MSG, "temperature": 2.5}, 400, "temperature"),
    ("/v1/responses", {"model": "mlx-dflash", "input": "hi", "temperature": 3}, 400, "temperature"),
    # Fields that would change the reply and are not implemented: refused, not ignored.
    ("/v1/chat/completions", {"model": "mlx-dflash", "messages": MSG, "logprobs": True}, 400, "'logprobs'"),
    ("/v1/chat/completions", {"model": "mlx-dflash", "messages": MSG, "presence_penalty": 0.5}, 400, "repetition"),
    ("/v1/chat/completions", {"model": "mlx-dflash", "messages": MSG, "logit_bias": {"5": 10}}, 400, "logit_bias"),
    (
        "/v1/chat/completions",
        {"model": "mlx-dflash", "messages": MSG, "response_format": {"type": "json_object"}},
        400,
        "response_format",
    ),
    ("/v1/completions", {"model": "mlx-dflash", "prompt": "x", "echo": True}, 400, "'echo'"),
    # The engine's own fields beyond the dialect's, in every dialect: checked, never dropped.
    ("/v1/completions", {"model": "mlx-dflash", "prompt": "x", "accept_rule": "bogus"}, 400, "accept_rule"),
    (
        "/v1/chat/completions",
        {"model": "mlx-dflash", "messages": MSG, "repetition_context_size": -5},
        400,
        "repetition",
    ),
    (
        "/v1/messages",
        {"model": "mlx-dflash", "max_tokens": 4, "messages": MSG, "min_tokens_to_keep": 0},
        400,
        "min_tokens",
    ),
    ("/v1/responses", {"model": "mlx-dflash", "input": "hi", "accept_rule": "bogus"}, 400, "accept_rule"),
    ("/v1/completions", {"model": "mlx-dflash", "prompt": "x", "best_of": 3}, 400, "one completion"),
    ("/v1/completions", {"model": "mlx-dflash", "prompt": ["a", "b"]}, 400, "one prompt per request"),
    (
        "/v1/messages",
        {"model": "mlx-dflash", "max_tokens": 5, "messages": MSG, "output_config": {"format": {"type": "json_schema"}}},
        400,
        "output_config.format",
    ),
    # The template's own arguments are the server's: a client's chat_template would replace the
    # model's prompt format (and a template can run for minutes); tokenize broke rendering.
    (
        "/v1/chat/completions",
        {"model": "mlx-dflash", "messages": MSG, "chat_template_kwargs": {"chat_template": "{{ 'x' * 9 }}"}},
        400,
        "chat_template_kwargs.chat_template",
    ),
    (
        "/v1/responses",
        {"model": "mlx-dflash", "input": "hi", "chat_template_kwargs": {"tokenize": True}},
        400,
        "set by the server",
    ),
    (
        "/v1/chat/completions",
        {"model": "mlx-dflash", "messages": MSG, "reasoning_effort": "ultra"},
        400,
        "reasoning_effort",
    ),
    (
        "/v1/responses",
        {"model": "mlx-dflash", "input": "hi", "reasoning": {"effort": "ultra"}},
        400,
        "reasoning.effort",
    ),
    # Another dialect's name for a field that changes the reply: named, not ignored.
    ("/v1/responses", {"model": "mlx-dflash", "input": "hi", "max_tokens": 3}, 400, "max_output_tokens"),
    ("/v1/responses", {"model": "mlx-dflash", "input": "hi", "stop": ["x"]}, 400, "no stop sequences"),
    (
        "/v1/chat/completions",
        {"model": "mlx-dflash", "messages": MSG, "max_output_tokens": 3},
        400,
        "max_completion_tokens",
    ),
    ("/v1/completions", {"model": "mlx-dflash", "prompt": "x", "stop_sequences": ["x"]}, 400, "'stop'"),
    ("/v1/messages", {"model": "mlx-dflash", "max_tokens": 4, "messages": MSG, "stop": ["x"]}, 400, "stop_sequences"),
    (  # as /v1/responses refuses them: a template iterates arguments as name -> value
        "/v1/chat/completions",
        {
            "model": "mlx-dflash",
            "messages": MSG
            + [
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[1, 2]"}}],
                }
            ],
        },
        400,
        "JSON object",
    ),
    (
        "/v1/messages",
        {
            "model": "mlx-dflash",
            "max_tokens": 5,
            "messages": MSG,
            "tools": [ATOOL],
            "tool_choice": {"type": "tool", "name": "nope"},
        },
        400,
        "'nope'",
    ),
    # as Anthropic refuses them: a tool forced where no tools are given, or a forced tool without its name
    (
        "/v1/messages",
        {"model": "mlx-dflash", "max_tokens": 5, "messages": MSG, "tool_choice": {"type": "any"}},
        400,
        "'any' needs tools",
    ),
    (
        "/v1/messages",
        {"model": "mlx-dflash", "max_tokens": 5, "messages": MSG, "tools": [ATOOL], "tool_choice": {"type": "tool"}},
        400,
        "needs the tool's 'name'",
    ),
    # as OpenAI refuses it: stream options without a stream
    (
        "/v1/chat/completions",
        {"model": "mlx-dflash", "messages": MSG, "stream_options": {"include_usage": True}},
        400,
        "only allowed when stream is true",
    ),
    (
        "/v1/completions",
        {"model": "mlx-dflash", "prompt": "x", "stream": False, "stream_options": {"include_usage": True}},
        400,
        "only allowed when stream is true",
    ),
    # A top_p that is 0 in float32 would keep no token: refused, as a tiny temperature is.
    (
        "/v1/chat/completions",
        {"model": "mlx-dflash", "messages": MSG, "temperature": 1, "top_p": 1e-300},
        400,
        "top_p",
    ),
    # tool_choice as OpenAI checks it: /v1/responses echoed "bogus" (a reply the SDK's types refuse),
    # and a named function the tools lack, or "required" with none, passed in both OpenAI dialects
    ("/v1/responses", {"model": "mlx-dflash", "input": "hi", "tool_choice": "bogus"}, 400, "tool_choice must be"),
    (
        "/v1/responses",
        {"model": "mlx-dflash", "input": "hi", "tools": [RFN], "tool_choice": {"type": "function", "name": "nope"}},
        400,
        "names the function 'nope', which 'tools' does not define",
    ),
    ("/v1/responses", {"model": "mlx-dflash", "input": "hi", "tool_choice": "required"}, 400, "'required' needs tools"),
    (
        "/v1/chat/completions",
        {
            "model": "mlx-dflash",
            "messages": MSG,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
            "tool_choice": {"type": "function", "function": {"name": "nope"}},
        },
        400,
        "names the function 'nope'",
    ),
    ("/v1/chat/completions", {"model": "mlx-dflash", "messages": MSG, "tool_choice": "required"}, 400, "needs tools"),
    # tools the client runs that are not function tools were dropped: the model never saw them
    (
        "/v1/responses",
        {"model": "mlx-dflash", "input": "hi", "tools": [{"type": "custom", "name": "apply_patch"}]},
        400,
        "tools of type 'custom' are not supported",
    ),
    (
        "/v1/messages",
        {"model": "mlx-dflash", "max_tokens": 5, "messages": MSG, "tools": [{"type": "bash_20250124", "name": "bash"}]},
        400,
        "tools of type 'bash_20250124' are not supported",
    ),
]


@pytest.mark.parametrize("path,body,status,words", BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD)])
def test_bad_input_gets_4xx_in_the_dialects_shape(server, path, body, status, words):
    r = _post(server, path, None if isinstance(body, bytes) else body, raw=body if isinstance(body, bytes) else None)
    assert r.status_code == status, r.text
    err = r.json()
    assert " (--" not in err["error"]["message"]  # a client sent fields; the CLI's flag names are not its words
    if path.startswith("/v1/messages"):
        assert err["type"] == "error" and set(err["error"]) == {"type", "message"}
        assert words in err["error"]["message"]
    else:
        assert set(err["error"]) >= {"message", "type"} and words in err["error"]["message"]
        if words in ("temperature", "top_p", "max_tokens") and status == 400:  # the field is named
            assert err["error"]["param"] == words, err
    # the server keeps serving
    assert httpx.get(server.url + "/health", timeout=10).json()["status"] == "ok"


def test_a_client_gone_while_sending_its_body_is_no_server_error(server):
    """A client that closes its connection before its whole body arrived is
    counted as gone (499), not as a server fault (500 and a traceback)."""

    def fives():
        m = server.metrics()
        return sum(v for k, v in m.items() if k.startswith("mlx_dflash_requests_total") and 'status="500"' in k)

    before = fives()
    for path in ("/v1/messages", "/v1/chat/completions"):
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.sendall(
                f"POST {path} HTTP/1.1\r\nHost: x\r\nx-api-key: {KEY}\r\nContent-Type: application/json\r\n"
                f'Content-Length: 1000\r\n\r\n{{"model":'.encode()
            )
            time.sleep(0.3)
    time.sleep(0.5)
    assert fives() == before
    assert "Traceback" not in server.log.read_text()
    assert httpx.get(server.url + "/health", timeout=10).json()["status"] == "ok"


def test_a_wrong_method_is_a_405_that_says_which_methods_the_path_takes(server):
    r = httpx.get(server.url + "/v1/chat/completions", headers={"x-api-key": KEY}, timeout=10)
    assert r.status_code == 405 and r.headers["allow"] == "POST" and "not allowed" in r.json()["error"]["message"]
    r = httpx.delete(server.url + "/v1/messages", headers={"x-api-key": KEY}, timeout=10)
    assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["type"] == "error"


def test_a_reply_cut_by_the_context_end_says_so(server):
    """Anthropic's stop reason for a reply the context's end cut before
    max_tokens is model_context_window_exceeded: a client that reads
    max_tokens asks for more and meets the same wall."""
    c = server.anthropic()

    def room(text):  # the embedded pair's context is 4096 tokens
        return (
            4096
            - c.messages.count_tokens(model="mlx-dflash", messages=[{"role": "user", "content": text}]).input_tokens
        )

    text = "a " * 3900
    text += "a " * (room(text) - 20)  # one token each
    assert 10 < room(text) < 30
    r = c.messages.create(model="mlx-dflash", max_tokens=100, messages=[{"role": "user", "content": text}])
    assert r.stop_reason == "model_context_window_exceeded" and r.usage.output_tokens < 30
    r = c.messages.create(model="mlx-dflash", max_tokens=2, messages=[{"role": "user", "content": text}])
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 2


def test_neutral_values_of_unsupported_fields_and_nulls_pass(server, engine):
    """What SDKs and wrappers send by default (zero penalties, logprobs false,
    a text response_format, null stream and n) is served; a one-item prompt
    list is that prompt."""
    ids, want = _expected(engine, PROMPTS[1])
    body = {
        "model": "mlx-dflash",
        "messages": [{"role": "user", "content": PROMPTS[1]}],
        "max_tokens": MAX_NEW,
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "logprobs": False,
        "logit_bias": {},
        "response_format": {"type": "text"},
        "stream": None,
        "n": None,
    }
    r = _post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == want.text
    _, plain = _expected(engine, PROMPTS[2], chat=False)
    for prompt in (PROMPTS[2], [PROMPTS[2]]):
        r = _post(server, "/v1/completions", {"model": "mlx-dflash", "prompt": prompt, "max_tokens": MAX_NEW})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == plain.text


def test_anthropic_assistant_prefill_is_continued(server, engine):
    """A final assistant message is the start of the reply (Anthropic's
    prefill): the model continues it, and the reply holds what follows."""
    start = "def fibonacci(n):\n    "
    messages = [{"role": "user", "content": PROMPTS[0]}, {"role": "assistant", "content": start}]
    text = engine.tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=False)
    ids = engine.tokenizer.encode(text + start, add_special_tokens=False)
    want = mlx_dflash.generate(engine, ids, max_tokens=MAX_NEW)
    m = server.anthropic().messages.create(model="mlx-dflash", max_tokens=MAX_NEW, messages=messages)
    assert m.content[0].text == want.text
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == len(ids)


def test_reasoning_effort_none_turns_thinking_off(tool_server, tool_pair):
    """reasoning_effort "none" (Chat Completions) renders the template with
    enable_thinking off, as reasoning.effort does in /v1/responses."""
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(tool_pair / "target")
    off = len(tok.apply_chat_template(QUESTION, add_generation_prompt=True, enable_thinking=False))
    on = len(tok.apply_chat_template(QUESTION, add_generation_prompt=True, enable_thinking=True))
    assert off != on
    for effort, n in (("none", off), ("high", on)):
        r = tool_server.openai().chat.completions.create(
            model="tiny-tools", messages=QUESTION, max_tokens=1, reasoning_effort=effort
        )
        assert r.usage.prompt_tokens == n, effort


def test_sdk_errors_and_next_request(server):
    with pytest.raises(openai.NotFoundError):
        server.openai().chat.completions.create(model="nope", messages=MSG, max_tokens=2)
    with pytest.raises(anthropic.BadRequestError) as e:
        server.anthropic().messages.create(model="mlx-dflash", max_tokens=0, messages=MSG)
    assert e.value.body["error"]["type"] == "invalid_request_error"
    r = server.openai().chat.completions.create(model="mlx-dflash", messages=MSG, max_tokens=2)
    assert r.usage.completion_tokens == 2


def test_api_key(server):
    with pytest.raises(openai.AuthenticationError):
        server.openai(key="wrong").models.list()
    with pytest.raises(anthropic.AuthenticationError) as e:
        server.anthropic(key="wrong").messages.create(model="mlx-dflash", max_tokens=2, messages=MSG)
    assert e.value.body["error"]["type"] == "authentication_error"
    for path in ("/v1/models", "/metrics"):
        assert httpx.get(server.url + path, timeout=10).status_code == 401
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "mlx-dflash", "messages": MSG}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200  # /health needs no key
    ok = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "mlx-dflash"
    assert [m.id for m in server.openai().models.list()] == ["mlx-dflash"]
    # One model by id, as both SDKs ask for it; another id is a 404.
    assert server.openai().models.retrieve("mlx-dflash").id == "mlx-dflash"
    assert server.anthropic().models.retrieve("mlx-dflash").id == "mlx-dflash"
    with pytest.raises(openai.NotFoundError):
        server.openai().models.retrieve("gpt-9")
    # The Anthropic SDK, on the path both APIs share, gets its own error shape.
    with pytest.raises(anthropic.NotFoundError) as e:
        server.anthropic().models.retrieve("claude-x")
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.AuthenticationError) as e:
        server.anthropic(key="wrong").models.list()
    assert e.value.body["type"] == "error"


def test_either_key_header_may_carry_the_key(server):
    """SDKs send both headers (one a placeholder): a right key in either is accepted."""
    url = server.url + "/v1/models"
    for headers in (
        {"x-api-key": "wrong", "Authorization": f"Bearer {KEY}"},
        {"x-api-key": KEY, "Authorization": "Bearer wrong"},
    ):
        assert httpx.get(url, headers=headers, timeout=10).status_code == 200, headers
    both_wrong = {"x-api-key": "wrong", "Authorization": "Bearer wrong"}
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": "mlx-dflash", "messages": MSG},
        headers=both_wrong,
        timeout=10,
    )
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(
        server.url + "/v1/messages",
        json={"model": "mlx-dflash", "max_tokens": 2, "messages": MSG},
        headers=both_wrong,
        timeout=10,
    )
    assert r.status_code == 401 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "authentication_error"
    # the Anthropic SDK with the right auth_token (Bearer) and a stale x-api-key beside it
    client = anthropic.Anthropic(
        base_url=server.url, auth_token=KEY, default_headers={"x-api-key": "wrong"}, max_retries=0, timeout=120
    )
    m = client.messages.create(model="mlx-dflash", max_tokens=2, messages=MSG)
    assert m.usage.output_tokens == 2


def test_anthropic_stream_start_and_delta_agree_on_a_cache_hit(server):
    """message_start's usage splits the prompt into new and cached tokens as message_delta does."""
    messages = [{"role": "user", "content": "def merge_sorted(a, b):\n"}]
    client = server.anthropic()
    client.messages.create(model="mlx-dflash", max_tokens=2, messages=messages)  # fills the prefix cache
    with client.messages.stream(model="mlx-dflash", max_tokens=4, messages=messages) as s:
        events = list(s)
    (start,) = [e.message.usage for e in events if e.type == "message_start"]
    (delta,) = [e.usage for e in events if e.type == "message_delta"]
    assert delta.cache_read_input_tokens > 0  # a hit
    assert (start.input_tokens, start.cache_read_input_tokens) == (delta.input_tokens, delta.cache_read_input_tokens)


def test_metrics(server):
    m = server.metrics()
    assert m['mlx_dflash_requests_total{endpoint="/v1/chat/completions",status="200"}'] >= 1
    assert m["mlx_dflash_generation_tokens_total"] > 0 and m["mlx_dflash_decode_cycles_total"] > 0
    assert m["mlx_dflash_tau"] > 1.0  # the embedded draft does get tokens accepted
    assert m["mlx_dflash_queue_length"] == 0


# --- tool calls: a tiny target rigged to answer with a Qwen3.5 tool call -------------

# A Qwen3.5-style template: tools as JSON in the system turn, assistant tool calls in the XML
# format, tool results as <tool_response> user turns, and an open <think> for the reply.
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>\n{%- for t in tools %}{{ t | tojson }}\n{%- endfor %}</tools>\n"
    "Call a tool as <tool_call><function=NAME><parameter=ARG>VALUE</parameter></function></tool_call><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|im_start|>assistant\n"
    "{%- if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}{{ m.content }}"
    "{%- for tc in m.tool_calls or [] %}<tool_call>\n<function={{ tc.function.name }}>\n"
    "{%- for k, v in tc.function.arguments.items() %}<parameter={{ k }}>\n{{ v }}\n</parameter>\n{% endfor %}"
    "</function>\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- elif m.role != 'system' %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"
    "{%- endif %}"
)
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
QUESTION = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]
REPLY = (
    "Let me check the weather.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
    "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)


# REPLY as six pieces, each one vocabulary entry the BPE merges never produce (so no piece
# repeats and a bigram model can chain them); the model is rigged to emit them in turn.
PIECES = [
    "Let me check the weather.",
    "\n</think>\n\n",
    "<tool_call>\n<function=get_weather>\n",
    "<parameter=city>\nParis\n</parameter>\n",
    "<parameter=days>\n3\n</parameter>\n",
    "</function>\n</tool_call>",
]
assert "".join(PIECES) == REPLY
LOOP = "~"  # one byte: a single token in any byte-level BPE


def _byte_level(text: str) -> str:
    """GPT-2 byte-to-unicode spelling of ``text`` (how byte-level BPE vocabularies store tokens)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, n = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    return "".join(table[b] for b in text.encode())


def _rig_tool_model(folder: Path) -> Path:
    """A tiny Qwen3.5 target (DeltaNet + attention) whose greedy reply to any prompt ending like
    the tool template's generation prompt is REPLY + EOS, and a random draft for it.

    The layers' output projections are scaled down so the residual stream carries mainly the
    current token's embedding: chain tokens get one-hot embeddings and the lm_head row of each
    next token points at its predecessor's axis, a bigram chain over PIECES."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_tokenizer

    tok_dir = tiny.build_tokenizer(
        folder / "tok",
        vocab_size=400,
        chat_template=TOOL_TEMPLATE,
        corpus=json.dumps(WEATHER_TOOL) * 4 + TOOL_TEMPLATE + tiny._CORPUS,
    )
    from tokenizers import AddedToken, Tokenizer

    spec = json.loads((tok_dir / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    piece_ids = list(range(len(vocab), len(vocab) + len(PIECES)))
    for i, piece in zip(piece_ids, PIECES):
        vocab[_byte_level(piece)] = i
    (tok_dir / "tokenizer.json").write_text(json.dumps(spec))
    # Qwen3.5's reasoning and tool markers are added (non-special) tokens; with <think> in the
    # vocabulary mlx-lm's tokenizer turns thinking on in the template, as for the real models.
    t = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    t.add_tokens(
        [AddedToken(m, special=False, normalized=False) for m in ("<think>", "</think>", "<tool_call>", "</tool_call>")]
    )
    t.save(str(tok_dir / "tokenizer.json"))
    tok = load_tokenizer(tok_dir)
    prompt = tok.apply_chat_template(QUESTION, tools=[WEATHER_TOOL], add_generation_prompt=True, tokenize=False)
    last = tok.encode(prompt, add_special_tokens=False)[-1]
    chain = [last] + piece_ids + [tok.eos_token_id]

    cfg = tiny.target_config(vocab_size=512)
    model = tiny.build_target(cfg, seed=11)
    params = dict(tree_flatten(model.parameters()))
    updates = [
        (n, p * 0.01) for n, p in params.items() if n.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight"))
    ]
    emb = params["language_model.model.embed_tokens.weight"] * 0.1
    head = params["language_model.lm_head.weight"]
    loop = tok.encode(LOOP, add_special_tokens=False)
    assert len(loop) == 1 and loop[0] not in chain
    # ... and LOOP is followed by itself: a reply that never ends (for queue and disconnect tests)
    for k, (a, b) in enumerate([*zip(chain, chain[1:]), (loop[0], loop[0])]):
        axis = mx.zeros((emb.shape[1],)).at[k].add(1.0)
        emb[a] = axis
        head[b] = 10.0 * axis
    updates += [("language_model.model.embed_tokens.weight", emb), ("language_model.lm_head.weight", head)]
    model.load_weights(updates, strict=False)
    tiny.save_hf(model, cfg, folder / "target", tokenizer_dir=tok_dir)
    dcfg = tiny.draft_config(cfg, block_size=8)
    tiny.save_draft(tiny.build_draft(dcfg, seed=2), dcfg, folder / "draft")
    return folder


@pytest.fixture(scope="module")
def tool_pair(tmp_path_factory):
    return _rig_tool_model(tmp_path_factory.mktemp("toolpair"))


@pytest.fixture(scope="module")
def tool_server(tool_pair, tmp_path_factory):
    s = ServerProcess(
        "--model",
        str(tool_pair / "target"),
        "--draft",
        str(tool_pair / "draft"),
        "--model-name",
        "tiny-tools",
        "--api-key",
        KEY,
        "--max-queue",
        "1",
        "--max-batch",  # one at a time: the queue tests need the engine busy with one request
        "1",
        log=tmp_path_factory.mktemp("tsrv") / "log.txt",
    )
    yield s
    s.close()


def test_tool_model_really_says_the_tool_call(tool_pair):
    """The premise: generate() on this pair gives the scripted Qwen tool-call text."""
    eng = mlx_dflash.load(tool_pair / "target", tool_pair / "draft")
    prompt = eng.tokenizer.apply_chat_template(
        QUESTION, tools=[WEATHER_TOOL], add_generation_prompt=True, tokenize=False
    )
    out = mlx_dflash.generate(eng, eng.tokenizer.encode(prompt, add_special_tokens=False), max_tokens=100)
    assert out.text == REPLY and out.stats.finish_reason == "stop"


def test_openai_tool_calls(tool_server):
    client = tool_server.openai()
    r = client.chat.completions.create(model="tiny-tools", messages=QUESTION, tools=[WEATHER_TOOL], max_tokens=100)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert msg.reasoning_content == "Let me check the weather."
    assert not msg.content
    (call,) = msg.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}

    chunks = list(
        client.chat.completions.create(
            model="tiny-tools", messages=QUESTION, tools=[WEATHER_TOOL], max_tokens=100, stream=True
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert reasoning == "Let me check the weather."
    assert "".join(d.content or "" for d in deltas) == ""
    assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [
        (0, "get_weather", {"city": "Paris", "days": 3})
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_anthropic_tool_use(tool_server):
    client = tool_server.anthropic()
    tool = {
        "name": "get_weather",
        "description": WEATHER_TOOL["function"]["description"],
        "input_schema": WEATHER_TOOL["function"]["parameters"],
    }
    m = client.messages.create(model="tiny-tools", max_tokens=100, messages=QUESTION, tools=[tool])
    assert m.stop_reason == "tool_use"
    assert [b.type for b in m.content] == ["thinking", "tool_use"]
    assert m.content[0].thinking == "Let me check the weather."
    assert (m.content[1].name, m.content[1].input) == ("get_weather", {"city": "Paris", "days": 3})
    assert m.content[1].id.startswith("toolu_")
    with client.messages.stream(model="tiny-tools", max_tokens=100, messages=QUESTION, tools=[tool]) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [b.type for b in final.content] == ["thinking", "tool_use"]
    assert final.content[0].thinking == "Let me check the weather."
    assert final.content[1].input == {"city": "Paris", "days": 3}


def test_tool_result_turn_renders_alike_in_both_dialects(tool_server, tool_pair):
    """A second turn carrying the tool result: both dialects send the model the same prompt
    (same usage, same greedy reply), which is what generate() says for that conversation."""
    eng = mlx_dflash.load(tool_pair / "target", tool_pair / "draft")
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
    prompt = eng.tokenizer.apply_chat_template(convo, tools=[WEATHER_TOOL], add_generation_prompt=True, tokenize=False)
    ids = eng.tokenizer.encode(prompt, add_special_tokens=False)
    want = mlx_dflash.generate(eng, ids, max_tokens=12)

    oa_convo = json.loads(json.dumps(convo))
    oa_convo[1]["tool_calls"][0]["function"]["arguments"] = json.dumps({"city": "Paris", "days": 3})
    r = tool_server.openai().chat.completions.create(
        model="tiny-tools", messages=oa_convo, tools=[WEATHER_TOOL], max_tokens=12
    )
    tool = {
        "name": "get_weather",
        "description": WEATHER_TOOL["function"]["description"],
        "input_schema": WEATHER_TOOL["function"]["parameters"],
    }
    m = tool_server.anthropic().messages.create(
        model="tiny-tools",
        max_tokens=12,
        tools=[tool],
        messages=[
            QUESTION[0],
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Let me check the weather.", "signature": ""},
                    {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris", "days": 3}},
                ],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "sunny, 21 C"}]},
        ],
    )
    assert r.usage.prompt_tokens == len(ids)
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == len(ids)
    assert r.usage.completion_tokens == m.usage.output_tokens == len(want.tokens)
    r_text = (getattr(r.choices[0].message, "reasoning_content", None) or "") + (r.choices[0].message.content or "")
    m_text = "".join(getattr(b, "thinking", None) or getattr(b, "text", "") for b in m.content)
    reasoning, content, _ = split_output(want.text, reasoning=True, tools=[WEATHER_TOOL])
    assert r_text == m_text == reasoning + content


def test_thinking_switch_reaches_the_template(tool_server, tool_pair):
    """chat_template_kwargs (OpenAI) and thinking (Anthropic) both set the template's enable_thinking."""
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(tool_pair / "target")
    n = {
        on: len(tok.apply_chat_template(QUESTION, add_generation_prompt=True, enable_thinking=on))
        for on in (True, False)
    }
    assert n[True] != n[False]
    for on in (True, False):
        r = tool_server.openai().chat.completions.create(
            model="tiny-tools",
            messages=QUESTION,
            max_tokens=1,
            extra_body={"chat_template_kwargs": {"enable_thinking": on}},
        )
        thinking = {"type": "enabled", "budget_tokens": 1024} if on else {"type": "disabled"}
        m = tool_server.anthropic().messages.create(
            model="tiny-tools", max_tokens=1, messages=QUESTION, thinking=thinking
        )
        assert r.usage.prompt_tokens == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == n[on]


def test_second_turn_reuses_the_prefix_with_thinking_off(tool_server, tool_pair):
    """With enable_thinking off the template's generation prompt ends in an empty think block;
    the stable boundary must be found with the request's template arguments, or turn 2
    restores nothing."""
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(tool_pair / "target")
    context = " I am packing for a week of walks along the coast and need to know what to bring with me."
    for dialect, question in (("openai", "Is it raining in Oslo?"), ("anthropic", "Is it snowing in Bergen?")):
        convo = [{"role": "user", "content": question + context}]
        turn2 = convo + [
            {"role": "assistant", "content": "I cannot tell."},
            {"role": "user", "content": "Guess, then."},
        ]
        n = len(tok.apply_chat_template(turn2, add_generation_prompt=True, enable_thinking=False))
        turn1_prompt = len(tok.apply_chat_template(convo, add_generation_prompt=False, enable_thinking=False))
        if dialect == "openai":
            client, off = tool_server.openai(), {"chat_template_kwargs": {"enable_thinking": False}}
            client.chat.completions.create(model="tiny-tools", messages=convo, max_tokens=2, extra_body=off)
            r = client.chat.completions.create(model="tiny-tools", messages=turn2, max_tokens=2, extra_body=off)
            prompt, cached = r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens
        else:
            client = tool_server.anthropic()
            client.messages.create(model="tiny-tools", max_tokens=2, messages=convo, thinking={"type": "disabled"})
            m = client.messages.create(model="tiny-tools", max_tokens=2, messages=turn2, thinking={"type": "disabled"})
            prompt, cached = m.usage.input_tokens + m.usage.cache_read_input_tokens, m.usage.cache_read_input_tokens
        assert prompt == n
        # all of turn 1's prompt but its generation-prompt tail: most of turn 2's
        assert cached == turn1_prompt, (dialect, cached, turn1_prompt, n)
        assert cached > n / 2


def test_tool_call_cut_by_max_tokens_is_text(tool_server):
    """Four tokens end the reply inside its <tool_call> (after the city, before the days):
    a call with partial arguments must not reach the client as a call."""
    cut = "".join(PIECES[2:4])  # "<tool_call>...<parameter=city>...</parameter>\n", no </tool_call>
    client = tool_server.openai()
    r = client.chat.completions.create(model="tiny-tools", messages=QUESTION, tools=[WEATHER_TOOL], max_tokens=4)
    assert r.choices[0].finish_reason == "length"
    assert not r.choices[0].message.tool_calls and r.choices[0].message.content == cut
    chunks = list(
        client.chat.completions.create(
            model="tiny-tools", messages=QUESTION, tools=[WEATHER_TOOL], max_tokens=4, stream=True
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not [tc for d in deltas for tc in d.tool_calls or []]
    assert "".join(d.content or "" for d in deltas) == cut
    assert chunks[-1].choices[0].finish_reason == "length"

    tool = {
        "name": "get_weather",
        "description": WEATHER_TOOL["function"]["description"],
        "input_schema": WEATHER_TOOL["function"]["parameters"],
    }
    aclient = tool_server.anthropic()
    m = aclient.messages.create(model="tiny-tools", max_tokens=4, messages=QUESTION, tools=[tool])
    assert m.stop_reason == "max_tokens"
    assert [b.type for b in m.content] == ["thinking", "text"] and m.content[1].text == cut
    with aclient.messages.stream(model="tiny-tools", max_tokens=4, messages=QUESTION, tools=[tool]) as s:
        final = s.get_final_message()
    assert final.stop_reason == "max_tokens"
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[1].text == cut


def test_a_client_that_leaves_before_its_whole_reply_frees_the_engine(tool_server):
    """A non-streaming request whose client gives up (here: its read timeout)
    is cancelled though tokens keep flowing on the server's side of it (the
    server looks for the disconnect on a timer, not only while no event
    arrives; it used to hold the engine until max_tokens)."""
    before = tool_server.metrics()
    body = {"model": "tiny-tools", "prompt": "push pop " + LOOP, "max_tokens": 4000}
    with httpx.Client(timeout=1.0) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post(tool_server.url + "/v1/completions", json=body, headers={"x-api-key": KEY})
    tic = time.monotonic()
    after = before
    while time.monotonic() - tic < 30:
        after = tool_server.metrics()
        if after["mlx_dflash_running_requests"] == 0 and after["mlx_dflash_queue_length"] == 0:
            break
        time.sleep(0.1)
    assert after["mlx_dflash_cancelled_total"] == before["mlx_dflash_cancelled_total"] + 1
    assert after["mlx_dflash_generation_tokens_total"] - before["mlx_dflash_generation_tokens_total"] < 4000


def test_full_queue_gets_429_and_dropped_queued_requests_free_it(tool_server):
    """--max-queue 1: one request generating, one waiting, the third is refused."""
    body = {"model": "tiny-tools", "prompt": "push pop " + LOOP, "max_tokens": 4000, "stream": True}
    headers = {"x-api-key": KEY}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", tool_server.url + "/v1/completions", json=body, headers=headers) as first:
            lines = first.iter_lines()  # kept: a discarded iterator would close the response
            next(lines)  # generating
            with c.stream("POST", tool_server.url + "/v1/completions", json=body, headers=headers) as second:
                assert second.status_code == 200  # accepted, queued behind the first
                tic = time.monotonic()
                while tool_server.metrics()["mlx_dflash_queue_length"] < 1 and time.monotonic() - tic < 10:
                    time.sleep(0.05)
                r = c.post(tool_server.url + "/v1/completions", json={**body, "stream": False}, headers=headers)
                assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
                r = c.post(
                    tool_server.url + "/v1/messages",
                    json={"model": "tiny-tools", "max_tokens": 5, "messages": MSG},
                    headers=headers,
                )
                assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
    # both dropped: the engine is free again
    r = tool_server.openai().completions.create(model="tiny-tools", prompt=LOOP, max_tokens=3)
    assert r.usage.completion_tokens == 3 and r.choices[0].text == LOOP * 3
