"""mlx_lm.generate's flag names work as aliases of ours, with the same effect."""

import io
import json
import sys

import pytest
from test_cli import cli

from mlx_dflash.api import DEFAULT_DRAFT
from tools import tiny

KEYS = ("mode", "prompt tokens", "generated tokens", "finish reason", "cycles", "block size", "acceptance histogram")


def stats(err):
    """The deterministic rows of the --verbose table (no timings)."""
    out = {}
    for line in err.splitlines():
        parts = line.split("  ", 1)
        if len(parts) == 2 and parts[0].strip() in KEYS:
            out[parts[0].strip()] = parts[1].strip()
    return out


def run(capsys, *args):
    code, out, err = cli(capsys, "generate", "def f(x):", "-n", "16", "--verbose", *args)
    assert code in (0, None), err
    return out, stats(err)


def test_draft_model_num_draft_tokens_and_system_prompt(capsys):
    a = run(capsys, "--draft", str(DEFAULT_DRAFT), "--block-size", "4", "--system", "note")
    b = run(capsys, "--draft-model", str(DEFAULT_DRAFT), "--num-draft-tokens", "3", "--system-prompt", "note")
    assert a == b  # same text, same stats rows (prompt tokens, block size, ...)
    assert b[1]["block size"] == "4" and b[1]["mode"] == "dflash"
    without = run(capsys, "--block-size", "4")
    assert int(without[1]["prompt tokens"]) < int(b[1]["prompt tokens"])  # the system message went in


def test_ignore_chat_template_is_no_chat_template(capsys):
    a = run(capsys, "--no-chat-template")
    b = run(capsys, "--ignore-chat-template")
    c = run(capsys, "--system", "note")
    assert a == b and a[1]["prompt tokens"] != c[1]["prompt tokens"]
    code, _, err = cli(capsys, "generate", "x", "--chat-template", "--ignore-chat-template")
    assert code == 2 and "contradict" in err


def test_extra_eos_token_stops_generation(capsys):
    import mlx_dflash

    eng = mlx_dflash.load()
    ids = mlx_dflash.generate(eng, "def f(x):", max_tokens=16, baseline=True).tokens
    i = next(i for i in range(2, 16) if ids[i] not in ids[:i])
    as_text = eng.tokenizer._tokenizer.convert_ids_to_tokens(ids[i])
    for spelling in (str(ids[i]), as_text):
        _, st = run(capsys, "--no-chat-template", "--baseline", "--extra-eos-token", spelling)
        assert st["finish reason"] == "stop" and int(st["generated tokens"]) == i + 1, spelling
    code, _, err = cli(capsys, "generate", "x", "--extra-eos-token", "<|no-such-token|>")
    assert code == 2 and "not a token" in err
    for bad in ("99999999", "-1"):
        code, _, err = cli(capsys, "generate", "x", "--extra-eos-token", bad)
        assert code == 2 and f"--extra-eos-token {bad}: not a token id of this vocabulary" in err, err


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory, tok_dir):
    """A tiny target whose chat template has Qwen's enable_thinking switch."""
    cfg = tiny.target_config(vocab_size=400)
    path = tiny.save_mlx(
        tiny.build_target(cfg, seed=2), cfg, tmp_path_factory.mktemp("think") / "t", tokenizer_dir=tok_dir
    )
    tc = json.loads((path / "tokenizer_config.json").read_text())
    tc["chat_template"] = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
        "{% if enable_thinking %}{{ '<think>\\n' }}{% endif %}"
        "{% endif %}"
    )
    (path / "tokenizer_config.json").write_text(json.dumps(tc))
    return path


def test_chat_template_config_reaches_the_template(capsys, thinking_model):
    m = ["--model", str(thinking_model), "--chat-template"]
    plain = run(capsys, *m)[1]
    off = run(capsys, *m, "--chat-template-config", '{"enable_thinking": false}')[1]
    on = run(capsys, *m, "--chat-template-config", '{"enable_thinking": true}')[1]
    # mlx-lm's tokenizer passes enable_thinking = "has <think> tokens" (False here) by default.
    assert int(off["prompt tokens"]) == int(plain["prompt tokens"]) != int(on["prompt tokens"])
    for bad, msg in (("{nope", "not valid JSON"), ("[1, 2]", "JSON object")):
        code, _, err = cli(capsys, "generate", "x", *m, "--chat-template-config", bad)
        assert code == 2 and msg in err


def _record_loads(monkeypatch):
    """mlx_dflash.api.load replaced by a recorder of its (model, draft)
    arguments, returning no engine (so nothing checks the options against one)."""
    from types import SimpleNamespace

    import mlx_dflash.api

    seen = []

    def load(model=None, draft=None, **kw):
        seen.append((model, draft))
        return SimpleNamespace(
            draft=None, suggested_drafts=(), target=SimpleNamespace(max_context=4096, vocab_size=2048)
        )

    monkeypatch.setattr(mlx_dflash.api, "load", load)
    monkeypatch.setattr("mlx_dflash.config.GenerationConfig.validate", lambda self, draft=None: None)
    monkeypatch.setattr("mlx_dflash.config.GenerationConfig.refuse_without_draft", lambda self: None)  # no real draft
    return seen


def _serve_settings(capsys, monkeypatch, *args):
    """The Settings and loaded (model, draft) `mlx-dflash serve ARGS` starts its server with."""
    from test_server import _free_port

    import mlx_dflash.server

    seen = _record_loads(monkeypatch)
    got = {}

    def fake_serve(settings, load_engine, **kw):
        load_engine()
        got["settings"] = settings

    monkeypatch.setattr(mlx_dflash.server, "serve", fake_serve)
    code, _, err = cli(capsys, "serve", "--port", str(_free_port()), *args)
    assert code in (0, None), err
    return got["settings"], seen[-1]


def test_serve_takes_mlx_lm_server_flag_names(capsys, monkeypatch, tmp_path):
    ours, ours_loaded = _serve_settings(
        capsys, monkeypatch, "--draft", str(tmp_path), "--block-size", "5", "--prefill-chunk", "64", "--max-batch", "3"
    )
    theirs, theirs_loaded = _serve_settings(
        capsys,
        monkeypatch,
        "--draft-model",
        str(tmp_path),
        "--num-draft-tokens",
        "4",
        "--prefill-step-size",
        "64",
        "--decode-concurrency",
        "3",
    )
    assert ours_loaded == theirs_loaded == (None, str(tmp_path))  # as typed: a Path dropped a leading "./"
    assert ours == theirs
    assert theirs.generation.block_size == 5 and theirs.generation.prefill_chunk == 64 and theirs.max_batch == 3
    code, _, err = cli(capsys, "serve", "--block-size", "5", "--num-draft-tokens", "4")
    assert code == 2 and "not both" in err


def test_chat_takes_mlx_lm_flag_names(capsys, monkeypatch, tmp_path):
    import builtins

    import mlx_dflash.session
    from mlx_dflash.prefix import PrefixCache

    def chat_with(*args):
        seen = _record_loads(monkeypatch)
        got = {}

        class Session:
            def __init__(self, engine, system=None, **kw):
                got["system"] = system

            def stream(self, line, gen):  # a generator, as ChatSession.stream is
                got["gen"] = gen
                yield from ()

        lines = iter(["hello"])

        def one_line(prompt=""):
            try:
                return next(lines)
            except StopIteration:
                raise EOFError from None

        monkeypatch.setattr(mlx_dflash.session, "ChatSession", Session)
        monkeypatch.setattr(builtins, "input", one_line)  # a terminal's input
        piped = type("Stdin", (), {"buffer": io.BytesIO(b"hello\n")})()  # piped input, read as bytes
        monkeypatch.setattr(sys, "stdin", piped)
        monkeypatch.setattr("mlx_dflash.cli._prefix_cache", lambda *a: PrefixCache())
        code, _, err = cli(capsys, "chat", *args)
        assert code in (0, None), err
        return seen[-1], got

    ours = chat_with("--draft", str(tmp_path), "--block-size", "3", "--system", "be brief", "--prefill-chunk", "64")
    theirs = chat_with(
        "--draft-model",
        str(tmp_path),
        "--num-draft-tokens",
        "2",
        "--system-prompt",
        "be brief",
        "--prefill-step-size",
        "64",
    )
    assert ours == theirs
    assert theirs[0] == (None, str(tmp_path)) and theirs[1]["system"] == "be brief" and theirs[1]["gen"].block_size == 3
    assert theirs[1]["gen"].prefill_chunk == 64


def test_serve_allowed_origins_and_log_level_as_mlx_lm_takes_them(capsys, monkeypatch):
    settings, _ = _serve_settings(capsys, monkeypatch, "--allowed-origins", "http://a.example, http://b.example")
    assert settings.allowed_origins == ("http://a.example", "http://b.example")
    assert _serve_settings(capsys, monkeypatch, "--log-level", "INFO")[0].allowed_origins == ("*",)
    assert _serve_settings(capsys, monkeypatch, "--allowed-origins", "")[0].allowed_origins == ()


def test_prefill_response_continues_the_reply_as_mlx_lm_does(capsys):
    """--prefill-response: the template renders it as the assistant's message
    left open, and the model continues it; the printed text is what follows,
    token for token what mlx-lm's own generate prints (its reference run),
    but for the leading space mlx-lm drops."""
    import re
    import subprocess

    from mlx_dflash.api import DEFAULT_MODEL

    args = ["--prompt", "def f(x):", "--system-prompt", "be brief", "--prefill-response", "    return"]
    ref = subprocess.run(
        [sys.executable, "-m", "mlx_lm", "generate", "--model", str(DEFAULT_MODEL), *args, "--max-tokens", "8"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ref.returncode == 0, ref.stderr
    text = re.search(r"==========\n(.*)\n==========", ref.stdout, re.S).group(1)
    code, out, err = cli(capsys, "generate", "-n", "8", *args)
    # mlx-lm's BPE detokenizer drops the first token's leading space; this
    # prints the tokens' decoding (" codecs..."), so "    return" reads on.
    assert code in (0, None) and out in (text + "\n", " " + text + "\n"), err
    without = cli(capsys, "generate", "-n", "8", *args[:4])[1]
    assert without != out  # the prefill changed the prompt
    code, _, err = cli(capsys, "generate", "hi", "--no-chat-template", "--prefill-response", "x")
    assert code == 2 and "--prefill-response needs the chat template" in err


def _mlx_lm_server_flags() -> set:
    """mlx_lm.server builds its parser inside main(): its flags, read from its source."""
    import inspect
    import re

    import mlx_lm.server

    return set(re.findall(r'add_argument\(\s*"(--[a-z0-9-]+)"', inspect.getsource(mlx_lm.server)))


def test_every_mlx_lm_flag_is_taken_or_explained(capsys):
    """Each flag of mlx-lm's generate, chat and server parsers is one of the
    matching command's, or gets one error line saying what to do instead
    (exit 2), not "No such option"."""
    import typer
    from mlx_lm.chat import setup_arg_parser as chat_parser
    from mlx_lm.generate import setup_arg_parser as generate_parser

    from mlx_dflash.cli import _MLX_LM_FLAGS, app

    def flags(parser) -> set:
        return {o for a in parser()._actions for o in a.option_strings if o.startswith("--")} - {"--help"}

    commands = typer.main.get_command(app).commands
    gaps = {
        "generate": flags(generate_parser),
        "chat": flags(chat_parser),
        "serve": _mlx_lm_server_flags() - {"--help"},
    }
    explained = set()
    for name, theirs in gaps.items():
        params = commands[name].params
        missing = theirs - {o for p in params for o in [*getattr(p, "opts", []), *getattr(p, "secondary_opts", [])]}
        assert missing <= set(_MLX_LM_FLAGS), (name, missing - set(_MLX_LM_FLAGS))
        explained |= missing
        for flag in missing:
            code, _, err = cli(capsys, name, *(["hi"] if name == "generate" else []), flag, "1")
            assert code == 2 and f"error: {flag} is an mlx-lm flag this engine does not take: " in err, err
            assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert explained == set(_MLX_LM_FLAGS)  # no stale explanation
