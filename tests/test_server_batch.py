"""`mlx-dflash serve --max-batch N`: requests decoded together in one batch.

One server process (the embedded pair, 4 slots, the equality rule so that a
seeded sample is the same text in any mode), driven by the official
`openai` and `anthropic` clients: concurrent streams each equal their solo
``mlx_dflash.generate`` output, a dropped client frees its slot for the next
request while the others keep streaming, and the prefix cache still serves
batched requests. The server helpers are tests/test_server.py's.
"""

import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from test_server import KEY, ServerProcess, _free_port, tokens_to_stop

import mlx_dflash
from mlx_dflash.cli import main

SLOTS = 4
# Solo runs with the width pinned (no cost measurement first): greedy and the
# equality rule give the same tokens at any width.
PIN = {"block_size": 16}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServerProcess(
        "--api-key",
        KEY,
        "--max-batch",
        str(SLOTS),
        "--accept-rule",
        "equality",
        log=tmp_path_factory.mktemp("bsrv") / "log.txt",
    )
    yield s
    s.close()


@pytest.fixture(scope="module")
def engine():
    return mlx_dflash.load()


# (prompt, max_tokens, sampling): different lengths, greedy and seeded samples.
REQUESTS = [
    ("def fibonacci(n):", 10, {}),
    ("import os\n\n\ndef read_config(path):", 4, {"temperature": 0.8, "top_p": 0.9, "seed": 7}),
    ("class Stack:\n", 14, {"temperature": 0.7, "top_k": 40, "seed": 3}),
    ("# Parse command line arguments\n", 6, {}),
    ("x = [i * i for i in range(10)]\nprint(", 12, {"temperature": 1.0, "seed": 11}),
    ("SELECT name FROM users WHERE", 3, {}),
    ("The quick brown fox", 8, {"temperature": 0.6, "top_p": 0.8, "seed": 5}),
    ("fn main() {\n", 12, {"temperature": 0}),
]


def _solo(engine, prompt, n, sampling):
    ids = engine.encode(prompt, chat_template=True)
    return mlx_dflash.generate(engine, ids, max_tokens=n, accept_rule="equality", **PIN, **sampling)


def _stream(server, i):
    prompt, n, sampling = REQUESTS[i]
    messages = [{"role": "user", "content": prompt}]
    if i % 2:
        with server.anthropic().messages.stream(
            model="mlx-dflash", max_tokens=n, messages=messages, extra_body=sampling
        ) as s:
            pieces = list(s.text_stream)
            final = s.get_final_message()
        return "".join(pieces), final.usage.output_tokens
    chunks = list(
        server.openai().chat.completions.create(
            model="mlx-dflash",
            messages=messages,
            max_tokens=n,
            stream=True,
            stream_options={"include_usage": True},
            **{k: v for k, v in sampling.items() if k != "top_k"},
            extra_body={"top_k": sampling["top_k"]} if "top_k" in sampling else None,
        )
    )
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1].usage.completion_tokens


def _histogram(m, name):
    return m[f"mlx_dflash_{name}_sum"], m[f"mlx_dflash_{name}_count"]


def test_eight_concurrent_streams_equal_their_solo_output(server, engine):
    want = [_solo(engine, *r) for r in REQUESTS]
    before = server.metrics()
    with ThreadPoolExecutor(len(REQUESTS)) as ex:
        got = list(ex.map(lambda i: _stream(server, i), range(len(REQUESTS))))
    for i, ((text, n), w) in enumerate(zip(got, want)):
        assert text == w.text, (i, text, w.text)
        assert n == len(w.tokens), i
    after = server.metrics()
    assert after["mlx_dflash_batch_slots_max"] == SLOTS
    # They really shared the batch: more than one slot per step on average.
    s0, c0 = _histogram(before, "batch_slots_per_step")
    s1, c1 = _histogram(after, "batch_slots_per_step")
    assert c1 > c0 and (s1 - s0) / (c1 - c0) > 1.5
    assert after[f'mlx_dflash_batch_slots_per_step_bucket{{le="{SLOTS}"}}'] > before.get(
        f'mlx_dflash_batch_slots_per_step_bucket{{le="{SLOTS}"}}', 0
    )
    # Eight requests for four slots: each admission's wait is in the histogram.
    w0, n0 = _histogram(before, "queue_wait_seconds")
    w1, n1 = _histogram(after, "queue_wait_seconds")
    assert n1 - n0 == len(REQUESTS) and w1 > w0
    assert after["mlx_dflash_batch_slots_active"] == 0 and after["mlx_dflash_running_requests"] == 0


def _long_stream(server, client, prompt):
    body = {"model": "mlx-dflash", "messages": [{"role": "user", "content": prompt}], "max_tokens": 3000}
    body["stream"] = True
    cm = client.stream("POST", server.url + "/v1/chat/completions", json=body, headers={"x-api-key": KEY})
    r = cm.__enter__()
    assert r.status_code == 200
    lines = r.iter_lines()
    seen = 0
    for line in lines:
        if line.startswith("data: ") and '"content"' in line:
            seen += 1
            if seen == 2:
                break
    return cm, lines


def _content_events(lines, k):
    seen = 0
    for line in lines:
        if line.startswith("data: ") and '"content"' in line:
            seen += 1
            if seen == k:
                return True
    return False


def test_dropped_stream_frees_its_slot_for_the_next_request(server, engine):
    """Four long streams fill the slots and a fifth request waits; dropping one
    stream admits the waiting one, which finishes while the other three keep
    streaming. An oversized prompt meanwhile gets a 400 and changes nothing."""
    before = server.metrics()
    prompts = ["def a():", "def b():", "def c():", "def d():"]
    with httpx.Client(timeout=120) as client:
        streams = [_long_stream(server, client, p) for p in prompts]
        assert server.metrics()["mlx_dflash_batch_slots_active"] == SLOTS
        want = _solo(engine, "def e():", 6, {})
        out = {}
        waiting = threading.Thread(
            target=lambda: out.setdefault(
                "r",
                server.openai().chat.completions.create(
                    model="mlx-dflash", messages=[{"role": "user", "content": "def e():"}], max_tokens=6
                ),
            )
        )
        waiting.start()
        tic = time.monotonic()
        while server.metrics()["mlx_dflash_queue_length"] < 1 and time.monotonic() - tic < 30:
            time.sleep(0.05)
        assert server.metrics()["mlx_dflash_queue_length"] == 1  # no slot free: it waits
        # A prompt over the context: a 400 in the API's shape, the batch untouched.
        r = httpx.post(
            server.url + "/v1/completions",
            json={"model": "mlx-dflash", "prompt": [100] * 5000, "max_tokens": 3},
            headers={"x-api-key": KEY},
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        cm, _ = streams.pop(0)
        cm.__exit__(None, None, None)  # the client goes away mid-stream
        waiting.join(timeout=120)
        assert not waiting.is_alive()
        assert out["r"].choices[0].message.content == want.text
        # The other three kept their slots and still stream.
        for _, lines in streams:
            assert _content_events(lines, 2)
        m = server.metrics()
        assert m["mlx_dflash_cancelled_total"] == before["mlx_dflash_cancelled_total"] + 1
        assert m["mlx_dflash_batch_slots_active"] == SLOTS - 1
        for cm, _ in streams:
            cm.__exit__(None, None, None)
    tic = time.monotonic()
    while server.metrics()["mlx_dflash_running_requests"] > 0 and time.monotonic() - tic < 30:
        time.sleep(0.1)
    after = server.metrics()
    assert after["mlx_dflash_running_requests"] == 0
    assert after["mlx_dflash_cancelled_total"] == before["mlx_dflash_cancelled_total"] + SLOTS


def test_batched_requests_are_served_from_the_prefix_cache(server, engine):
    """A conversation's second turn, sent by several clients at once after the
    first turn ran: each batched request restores the cached prefix (usage
    reports it) and its reply equals generate() without any cache."""
    first = [{"role": "user", "content": "def parse_args(argv):\n"}]
    r1 = server.openai().chat.completions.create(model="mlx-dflash", messages=first, max_tokens=8)
    turns = ["\n\ndef main():\n", "\n\nclass Config:\n", "\n\nif __name__ == '__main__':\n", "\n\nimport sys\n"]
    convos = [
        first + [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": t}]
        for t in turns
    ]
    ids = [list(engine.tokenizer.apply_chat_template(c, add_generation_prompt=True)) for c in convos]
    want = [mlx_dflash.generate(engine, x, max_tokens=8, **PIN) for x in ids]
    before = server.metrics()

    def one(i):
        if i % 2:
            m = server.anthropic().messages.create(model="mlx-dflash", max_tokens=8, messages=convos[i])
            return (
                m.content[0].text,
                m.usage.cache_read_input_tokens,
                m.usage.input_tokens + m.usage.cache_read_input_tokens,
            )
        r = server.openai().chat.completions.create(model="mlx-dflash", messages=convos[i], max_tokens=8)
        return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens, r.usage.prompt_tokens

    with ThreadPoolExecutor(len(convos)) as ex:
        got = list(ex.map(one, range(len(convos))))
    for (text, cached, prompt), w, x in zip(got, want, ids):
        assert text == w.text
        assert prompt == len(x)
        assert 0 < cached < len(x)
    after = server.metrics()
    assert after["mlx_dflash_prefix_cache_hits_total"] >= before["mlx_dflash_prefix_cache_hits_total"] + len(convos)
    s0, c0 = _histogram(before, "batch_slots_per_step")
    s1, c1 = _histogram(after, "batch_slots_per_step")
    assert (s1 - s0) / (c1 - c0) > 1.0  # they shared the batch


def test_batch_generate_restores_and_snapshots_the_prefix_cache(engine):
    """The Python API: a batched request after a solo one with the same prefix
    restores it (stats.cached_tokens) and gives the tokens it gives without the
    cache; the batch's requests leave snapshots a later request restores."""
    cache = mlx_dflash.PrefixCache()
    first = engine.encode("def fibonacci(n):", chat_template=True)
    solo = mlx_dflash.generate(engine, first, max_tokens=8, prefix_cache=cache, **PIN)
    assert solo.stats.cached_tokens == 0
    b = cache.stable_boundary(engine.tokenizer, first)  # the prompt minus the template's reply tail
    prompts = [
        first + solo.tokens + engine.tokenizer.encode("\n# tests\n"),
        first[:b] + engine.tokenizer.encode(" hello"),
        first,
    ]
    want = [mlx_dflash.generate(engine, p, max_tokens=8, **PIN) for p in prompts]
    got = mlx_dflash.batch_generate(engine, prompts, max_tokens=8, prefix_cache=cache, **PIN)
    for g, w in zip(got, want):
        assert g.tokens == w.tokens
    assert got[0].stats.cached_tokens > len(first)  # the solo run's end snapshot
    assert got[1].stats.cached_tokens == got[2].stats.cached_tokens == b
    # The first request verified past its max_tokens (the batch verifies full
    # blocks): its cache holds rows of tokens it never handed out, so it must
    # leave no snapshot keyed by its shorter history.
    nxt = prompts[0] + got[0].tokens + engine.tokenizer.encode("\n")
    assert (
        mlx_dflash.generate(engine, nxt, max_tokens=4, prefix_cache=cache, **PIN).tokens
        == mlx_dflash.generate(engine, nxt, max_tokens=4, **PIN).tokens
    )
    # A slot leaving (here cancelled after a few tokens) leaves its snapshot:
    # the prompt and every committed token but the last, which a later request restores.
    batch = mlx_dflash.BatchDecoder(
        engine.target, engine.draft, eos_token_ids=engine.tokenizer.eos_token_ids, prefix_cache=cache
    )
    index = batch.add(prompts[1], max_tokens=40, **PIN)
    toks = []
    while len(toks) < 3:
        for ev in batch.step():
            toks += ev.tokens
    assert batch.cancel(index).finish_reason == "cancelled"
    nxt = prompts[1] + toks + engine.tokenizer.encode("\n")
    later = mlx_dflash.generate(engine, nxt, max_tokens=4, prefix_cache=cache, **PIN)
    assert later.stats.cached_tokens == len(prompts[1]) + len(toks) - 1
    assert later.tokens == mlx_dflash.generate(engine, nxt, max_tokens=4, **PIN).tokens


@pytest.mark.parametrize(
    "args, words",
    [
        (["--max-batch", "0"], "--max-batch must be at least 1"),
        (["--max-batch", "-3"], "--max-batch must be at least 1"),
        (["--max-batch", "2", "--pipeline"], "does not run with --pipeline"),
        (["--max-batch", "100000000"], "does not fit in memory"),
    ],
)
def test_bad_max_batch_is_one_error_line_and_exit_2(args, words, capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--port", str(_free_port()), *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and words in lines[0], err
    assert "Traceback" not in err


def _serve_load_error(*args) -> str:
    """The last stderr line of `mlx-dflash serve ARGS`, which must fail at load with exit 2."""
    r = subprocess.run(
        [sys.executable, "-m", "mlx_dflash", "serve", "--port", str(_free_port()), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2, r.stderr
    return r.stderr.strip().splitlines()[-1]


def test_serve_refuses_a_default_max_tokens_beyond_the_context():
    last = _serve_load_error("-n", "100000")
    assert last.startswith("error: --max-tokens 100000 is more than this model's context ("), last


def test_serve_load_error_exits_2_every_time():
    # The engine loads on its own thread; the interpreter's teardown after
    # that thread ran MLX used to abort now and then (exit 134, about 1 in 3).
    for _ in range(4):
        last = _serve_load_error("--block-size", "99")
        assert last.startswith("error: block_size (--block-size, --num-draft-tokens)"), last


# --- a batched step that fails ------------------------------------------------------------

FAULT_PROMPTS = ["def fibonacci(n):", "class Stack:\n", "import os\n\n\ndef read_config(path):", "The quick brown fox"]
FAULT_SAMPLING = [{}, {"temperature": 0.8, "seed": 7}, {}, {"temperature": 1.0, "seed": 11}]


def _in_process(
    eng,
    monkeypatch,
    *,
    fail_batch=lambda calls: False,
    fail_alone=lambda tokens: False,
    slots=SLOTS,
    gather=0,
    prompt_cache=False,
):
    """A server app of ``slots`` slots in process on ``eng``, its batched
    forward failing where ``fail_batch(slots of each call so far)`` says, its
    prefill where ``fail_alone(tokens)`` does; with ``gather``, the first
    prefill waits for that many requests to arrive."""
    from mlx_dflash.config import GenerationConfig
    from mlx_dflash.server import Settings, build

    calls, held, worker_of = [], [], {}
    forward_slots, prefill_steps = eng.target.forward_slots, eng.target.prefill_steps

    def failing_forward_slots(*a, **k):
        calls.append(a[0].shape[0])
        if fail_batch(calls):
            raise MemoryError("[metal::malloc] out of memory (injected)")
        return forward_slots(*a, **k)

    def failing_prefill_steps(tokens, *a, **k):
        # So that the requests share the batch whatever the threads' timing.
        tic = time.monotonic()
        while gather and not held and time.monotonic() - tic < 30 and worker_of.get("w") is not None:
            w = worker_of["w"]
            if w.queue_length + w.running_count >= gather:
                held.append(1)
            time.sleep(0.01)
        if fail_alone(list(tokens)):
            raise RuntimeError("injected fault of this request")
        return prefill_steps(tokens, *a, **k)

    monkeypatch.setattr(eng.target, "forward_slots", failing_forward_slots)
    monkeypatch.setattr(eng.target, "prefill_steps", failing_prefill_steps)
    settings = Settings(
        max_batch=slots,
        prompt_cache=prompt_cache,
        generation=GenerationConfig(max_tokens=64, accept_rule="equality", **PIN),
    )
    app, worker = build(settings, lambda: eng)
    worker_of["w"] = worker
    return app, worker, calls


def _complete_all(app, eng, lengths):
    from fastapi.testclient import TestClient

    def one(client, i):
        body = {"model": "mlx-dflash", "prompt": eng.encode(FAULT_PROMPTS[i]), "max_tokens": lengths[i]}
        return client.post("/v1/completions", json={**body, **FAULT_SAMPLING[i]})

    with TestClient(app) as client, ThreadPoolExecutor(len(FAULT_PROMPTS)) as ex:
        return list(ex.map(lambda i: one(client, i), range(len(FAULT_PROMPTS))))


def _solo_fault(eng, i, n):
    return mlx_dflash.generate(
        eng, eng.encode(FAULT_PROMPTS[i]), max_tokens=n, accept_rule="equality", **PIN, **FAULT_SAMPLING[i]
    )


@pytest.mark.parametrize("prompt_cache", [False, True])
def test_a_failed_batched_step_resumes_its_requests_unchanged(monkeypatch, prompt_cache):
    """The batched forward fails once, mid-generation (the first step of all
    four slots, after the first two streamed tokens): each request resumes
    alone from what it had committed and its reply and usage equal its solo
    run, greedy or seeded. With the prompt cache, the resumed run restores
    its prompt and its own output: the usage's cached tokens stay its first
    run's (they read 36 of a 7-token prompt)."""
    eng = mlx_dflash.load()
    lengths = [24, 20, 28, 16]
    want = [_solo_fault(eng, i, n) for i, n in enumerate(lengths)]
    app, worker, calls = _in_process(
        eng,
        monkeypatch,
        fail_batch=lambda calls: calls.count(4) == 1 and calls[-1] == 4,
        gather=4,
        prompt_cache=prompt_cache,
    )
    try:
        got = _complete_all(app, eng, lengths)
    finally:
        worker.stop()
    assert calls[-1] == 4 and calls.count(4) == 1  # the fault with all four in the batch; alone after it
    for r, w, i in zip(got, want, range(len(lengths))):
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["text"] == w.text, i
        assert body["usage"]["completion_tokens"] == len(w.tokens), i
        assert body["usage"]["prompt_tokens"] == len(eng.encode(FAULT_PROMPTS[i])), i
        cached = (body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        assert cached < body["usage"]["prompt_tokens"], (i, body["usage"])


def _only_the_poisoned_failed(got, want, poisoned: int) -> None:
    """Request ``poisoned`` got the 500 of its injected fault; the others their solo replies."""
    for i, (r, w) in enumerate(zip(got, want)):
        if i == poisoned:
            assert r.status_code == 500
            assert "injected fault of this request" in r.json()["error"]["message"]
        else:
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == w.text, i


def test_a_request_that_fails_alone_too_is_the_only_500(monkeypatch):
    """Every step of four slots fails; the request whose own prefill fails
    when it runs again alone gets the 500 (in the OpenAI error shape), the
    others their solo replies."""
    eng = mlx_dflash.load()
    lengths = [12, 10, 14, 8]
    poison = eng.encode(FAULT_PROMPTS[2])
    want = [_solo_fault(eng, i, n) for i, n in enumerate(lengths)]

    seen = []

    def resumed_poison(tokens):  # its second prefill: the run again alone
        seen.append(tokens[: len(poison)] == poison)
        return tokens[: len(poison)] == poison and sum(seen) > 1

    app, worker, calls = _in_process(
        eng, monkeypatch, fail_batch=lambda calls: calls[-1] == 4, fail_alone=resumed_poison, gather=4
    )
    try:
        got = _complete_all(app, eng, lengths)
    finally:
        worker.stop()
    assert calls[-1] == 4  # all four shared the batch that failed
    _only_the_poisoned_failed(got, want, 2)


def test_a_request_whose_own_prefill_fails_leaves_the_batch_running(monkeypatch):
    """One request's prefill raises (its own cache, its first sample): it alone
    gets the 500, and the others keep their batch. Before, the whole step
    counted as failed and every other request was rerun one at a time."""
    eng = mlx_dflash.load()
    lengths = [24, 20, 28, 16]
    poison = eng.encode(FAULT_PROMPTS[2])
    want = [_solo_fault(eng, i, n) for i, n in enumerate(lengths)]
    app, worker, calls = _in_process(
        eng, monkeypatch, fail_alone=lambda tokens: tokens[: len(poison)] == poison, gather=4
    )
    failed_steps = []
    monkeypatch.setattr(worker, "_failed_step", lambda batch, e: failed_steps.append(e) or batch)
    try:
        got = _complete_all(app, eng, lengths)
    finally:
        worker.stop()
    assert not failed_steps
    assert 3 in calls  # the three others stepped together
    _only_the_poisoned_failed(got, want, 2)


@pytest.mark.parametrize("max_batch", ["1", "4"])
def test_ctrl_c_ends_the_server_with_exit_0(max_batch, tmp_path):
    """The engine thread frees its MLX streams as it ends: without that the
    process aborted at exit ("terminate called without an active
    exception", exit 134) after a clean shutdown."""
    import signal
    import threading

    s = ServerProcess("--max-batch", max_batch, log=tmp_path / "log.txt")
    try:
        r = httpx.post(s.url + "/v1/completions", json={"model": "mlx-dflash", "prompt": "def f():", "max_tokens": 4})
        assert r.status_code == 200
        # A stream still running at Ctrl-C ends with an error event saying so:
        # not a cut connection, nor a reply that looks finished.
        lines, started = [], threading.Event()

        def stream():
            body = {"model": "mlx-dflash", "prompt": "def fib(n):", "max_tokens": 4000, "stream": True}
            with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    started.set()

        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(60)
        tic = time.monotonic()
        s.proc.send_signal(signal.SIGINT)
        assert s.proc.wait(timeout=30) == 0, s.log.read_text()[-2000:]
        t.join(30)
        log = s.log.read_text()
        assert time.monotonic() - tic < 4, log[-2000:]  # not the 5 s graceful-shutdown timeout
        assert "terminate called" not in log and "Traceback" not in log, log[-2000:]
        last = json.loads([x for x in lines if x][-1][len("data: ") :])
        assert last["error"]["type"] == "server_error", lines[-4:]
        assert last["error"]["message"].startswith("the server is shutting down: the reply was cut after")
        assert 'finish_reason": "' not in "".join(lines)
    finally:
        s.close()


@pytest.mark.parametrize("slots", [1, SLOTS])
def test_usage_counts_tokens_up_to_the_stop_string(monkeypatch, slots):
    """A cycle commits several tokens at once; a stop string that ends at the
    first of them ends the reply's text and its token count there, one at a
    time or batched (the count was the cycle's)."""
    from fastapi.testclient import TestClient

    eng = mlx_dflash.load()
    ids = eng.encode(FAULT_PROMPTS[0])
    chunks = [r.tokens for r in mlx_dflash.stream_generate(eng, ids, max_tokens=40, accept_rule="equality", **PIN)]
    tokens = [t for c in chunks for t in c]
    stop, used = None, 0
    for c in chunks:  # a stop string completed by the first token of a cycle that commits more
        text = eng.tokenizer.decode(tokens[: used + 1])
        for n in (4, 3, 2):
            if len(c) > 1 and text[-n:].strip() and tokens_to_stop(eng, tokens, text[-n:]) == used + 1:
                stop = text[-n:]
                break
        if stop:
            break
        used += len(c)
    assert stop is not None, chunks
    app, worker, _ = _in_process(eng, monkeypatch, slots=slots)
    try:
        with TestClient(app) as client:
            body = {"model": "mlx-dflash", "prompt": ids, "max_tokens": 40, "stop": [stop]}
            r = client.post("/v1/completions", json=body).json()
    finally:
        worker.stop()
    assert r["choices"][0]["finish_reason"] == "stop"
    assert r["choices"][0]["text"] == eng.tokenizer.decode(tokens).split(stop)[0]
    assert r["usage"]["completion_tokens"] == used + 1


def test_a_failed_admission_keeps_the_seeds_of_the_requests_it_resumes(monkeypatch):
    """After a failed step, requests resume one at a time from what they
    committed; one still queued (no sampler yet) resumed with seed None,
    so its seeded text was not its solo run's."""
    import asyncio
    import logging

    import mlx_dflash.batch as batch
    from mlx_dflash import GenerationConfig
    from mlx_dflash.server.metrics import Metrics
    from mlx_dflash.server.worker import Job, Worker

    eng = mlx_dflash.load()
    prompts = [eng.encode(p) for p in ("Once upon a time there was a", "def quicksort(arr):", "The capital of")]
    configs = [GenerationConfig(max_tokens=24, temperature=1.0, seed=s, accept_rule="equality") for s in (11, 22, 33)]
    want = [mlx_dflash.generate(eng, p, c, baseline=True).text for p, c in zip(prompts, configs)]
    real, calls = batch.open_decoder, []

    def flaky(*a, **k):  # a transient fault (an allocation, say) while the batch admits its second request
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected transient fault")
        return real(*a, **k)

    monkeypatch.setattr(batch, "open_decoder", flaky)

    async def run():
        loop = asyncio.get_running_loop()
        w = Worker(lambda: eng, max_queue=8, metrics=Metrics(), max_batch=4, generation=GenerationConfig())
        jobs = [Job(p, dict(config=c), [], 120.0, loop) for p, c in zip(prompts, configs)]
        for j in jobs:  # queued before the engine thread starts: one batch takes all three
            w.submit(j)
        await loop.run_in_executor(None, w.start)
        texts = []
        for j in jobs:
            text, ev = "", None
            while ev is None or ev[0] == "text":
                ev = await j.out.get()
                text += ev[1] if ev[0] == "text" else ""
            texts.append((text, ev[:2]))
        w.cancel_all()
        w.stop()
        return texts

    logging.disable(logging.CRITICAL)
    try:
        got = asyncio.run(run())
    finally:
        logging.disable(logging.NOTSET)
    assert len(calls) >= 2  # the fault did happen
    assert [g for g, _ in got] == want and all(ev == ("done", "length") for _, ev in got), got
