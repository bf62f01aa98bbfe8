"""ChatSession reuses each previous turn; `mlx-dflash chat` driven through a real terminal;
`generate --prompt-cache-file`."""

import os
import pty
import re
import select
import sys
import time
from pathlib import Path

import pytest
from support.signals import interrupt
from test_prefix import engines  # noqa: F401  (the fixture)

import mlx_dflash
from mlx_dflash.cli import main
from mlx_dflash.errors import DFlashError
from mlx_dflash.prefix import PrefixCache
from tools import tiny

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("which", ["dense", "moe"])
def test_three_turn_session_reuses_each_previous_turn(engines, which):  # noqa: F811
    eng = engines[which]
    chat = mlx_dflash.ChatSession(
        eng, system="You write small Python functions. " * 4, prefix_cache=PrefixCache(rung_interval=0)
    )
    turns = ["def fibonacci(n):", "class Stack:", "import os, sys"]
    for i, text in enumerate(turns):
        r = chat.send(text, max_tokens=12)
        s = r.stats
        if i == 0:
            assert s.cached_tokens == 0
        else:
            assert s.cached_tokens > 0.8 * s.prompt_tokens, (i, s.cached_tokens, s.prompt_tokens)
        # The turn's output is exactly a cold run over the same prompt ids.
        ids = chat._ids[: s.prompt_tokens]
        assert mlx_dflash.generate(eng, ids, max_tokens=12).tokens == r.tokens
    assert [m["role"] for m in chat.messages] == ["system"] + ["user", "assistant"] * 3
    # The conversation is the template's rendering of the messages.
    rendered = eng.tokenizer.apply_chat_template(
        chat.messages + [{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=False
    )
    assert rendered.startswith(eng.tokenizer.decode(chat._ids[: chat.stats.prompt_tokens]))
    chat.reset()
    assert chat.messages == [{"role": "system", "content": chat.system}]
    with pytest.raises(DFlashError, match="set by the chat session"):
        chat.send("hi", chat_template=True)


def test_session_on_a_template_that_rewrites_history(engines):  # noqa: F811
    """When a template renders earlier replies differently, the turn is
    re-encoded and the stable boundary of the previous prompt still hits."""
    eng = engines["dense"]
    tok = eng.tokenizer
    saved = tok._tokenizer.chat_template
    # Like Qwen3's template dropping earlier thinking: assistant turns rendered without their text.
    tok._tokenizer.chat_template = saved.replace(
        "message['content']", "(message['content'] if message['role'] != 'assistant' else '')"
    )
    try:
        chat = mlx_dflash.ChatSession(eng, system="Be brief. " * 8, prefix_cache=PrefixCache(rung_interval=0))
        first = chat.send("def f(x):", max_tokens=6)
        second = chat.send("def g(y):", max_tokens=6)
        boundary = first.stats.prompt_tokens - len(tok.encode("<|im_start|>assistant\n", add_special_tokens=False))
        assert second.stats.cached_tokens == boundary
    finally:
        tok._tokenizer.chat_template = saved


def test_a_reply_that_ended_at_an_eos_is_reused_by_the_next_turn(engines):  # noqa: F811
    """A template that renders the history without the reply's EOS: the next
    turn matched only the previous prompt's boundary (decode(ids) ended in
    the EOS's text, which the rendering lacks), and prefilled the reply again."""
    eng = engines["dense"]
    tok = eng.tokenizer
    first = mlx_dflash.ChatSession(eng, prefix_cache=PrefixCache(rung_interval=0)).send("def f(x):", max_tokens=12)
    stop = first.tokens[5]  # a token the reply reaches: made an EOS, the reply ends there
    saved = set(tok.eos_token_ids)
    tok.eos_token_ids = saved | {stop}
    try:
        chat = mlx_dflash.ChatSession(eng, prefix_cache=PrefixCache(rung_interval=0))
        reply = chat.send("def f(x):", max_tokens=12)
        assert reply.tokens[-1] == stop and len(reply.tokens) <= 6
        turn = reply.stats.prompt_tokens + len(reply.tokens) - 1  # the EOS itself is not rendered
        second = chat.send("def g(y):", max_tokens=4)
        assert second.stats.cached_tokens >= turn, (second.stats.cached_tokens, turn)
        # The turn's output is a cold run's over the same ids.
        ids = chat._ids[: second.stats.prompt_tokens]
        assert mlx_dflash.generate(eng, ids, max_tokens=4).tokens == second.tokens
    finally:
        tok.eos_token_ids = saved


@pytest.mark.parametrize(
    "template, cause",
    [
        ("{{ raise_exception('Only user and assistant roles are supported') }}", "TemplateError: Only user"),
        ("{% for m in messages %}{{ m.content }", "TemplateSyntaxError"),
        ("{{ messages | no_such_filter }}", "TemplateAssertionError"),
    ],
    ids=["raises", "syntax", "filter"],
)
def test_a_chat_template_that_fails_is_one_error(engines, template, cause):  # noqa: F811
    """A template that refuses the conversation (Qwen's call raise_exception)
    or does not compile is a DFlashError naming it, in the API and in a chat
    session (it was jinja's own exception, a traceback in the CLI)."""
    eng = engines["dense"]
    tok = eng.tokenizer
    saved = tok._tokenizer.chat_template
    tok._tokenizer.chat_template = template
    try:
        with pytest.raises(DFlashError, match=f"chat template failed: {cause}"):
            eng.encode("hi", chat_template=True)
        with pytest.raises(DFlashError, match="chat template failed"):
            mlx_dflash.ChatSession(eng).send("hi", max_tokens=2)
    finally:
        tok._tokenizer.chat_template = saved


def test_a_system_prompt_that_is_not_utf8_is_refused(engines):  # noqa: F811
    """chat --system took a lone surrogate (an invalid byte on the command line)
    that generate --system refuses."""
    with pytest.raises(DFlashError, match="the system prompt is not valid UTF-8 text"):
        mlx_dflash.ChatSession(engines["dense"], system="be \udcff brief")


def _read_until(fd, pattern, timeout=240.0):
    buf = b""
    end = time.time() + timeout
    while time.time() < end:
        r, _, _ = select.select([fd], [], [], 0.5)
        if r:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                break
            if not chunk:
                break
            buf += chunk
            m = re.search(pattern, buf.decode(errors="replace"))
            if m:
                return buf.decode(errors="replace"), m
    raise AssertionError(f"no {pattern!r} in output: {buf.decode(errors='replace')[-2000:]}")


def test_chat_repl_through_a_pty(tmp_path):
    """Two turns in a real terminal: the second restores the first's prompt and reply."""
    pid, fd = pty.fork()
    if pid == 0:  # child: the REPL on the embedded pair
        os.chdir(ROOT)
        os.environ["PYTHONPATH"] = str(ROOT)
        os.execv(sys.executable, [sys.executable, "-m", "mlx_dflash", "chat", "--max-tokens", "24"])
    try:
        _read_until(fd, r">> ")
        os.write(fd, b"def fibonacci(n):\n")
        out1, m1 = _read_until(fd, r"\[(\d+) prompt tokens: (\d+) cached, (\d+) prefilled.*tau ([\d.]+).* tok/s")
        os.write(fd, b"def main():\n")
        out2, m2 = _read_until(fd, r"\[(\d+) prompt tokens: (\d+) cached, (\d+) prefilled.*tau ([\d.]+).* tok/s")
        p1, c1 = int(m1.group(1)), int(m1.group(2))
        p2, c2, f2 = int(m2.group(1)), int(m2.group(2)), int(m2.group(3))
        assert c1 == 0
        assert c2 >= p1 and c2 + f2 == p2  # the whole first turn came from the cache
        # A file that cannot be written is reported and the conversation goes on.
        os.write(fd, f"/save {tmp_path / 'missing' / 'x.safetensors'}\n".encode())
        _read_until(fd, r"error: /save .*missing/x.safetensors: the folder .*missing does not exist")
        save = tmp_path / "chat.safetensors"
        os.write(fd, f"/save {save}\n".encode())
        _read_until(fd, r"saved")
        os.write(fd, b"/reset\n")
        _read_until(fd, r"reset")
        os.write(fd, b"/quit\n")
        _, status = os.waitpid(pid, 0)
        assert os.WEXITSTATUS(status) == 0
        assert save.stat().st_size > 0
    finally:
        try:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(fd)


def cli(capsys, *args):
    with pytest.raises(SystemExit) as e:
        main(list(args))
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def test_generate_with_a_prompt_cache_file(capsys, tmp_path, tok_dir):
    f = tmp_path / "prompt.safetensors"
    code, cold, err = cli(
        capsys, "generate", "def fibonacci(n):", "-n", "16", "--verbose", "--prompt-cache-file", str(f)
    )
    assert code in (0, None), err
    assert f.is_file() and re.search(r"cached tokens\s+0\b", err)
    code, warm, err = cli(
        capsys, "generate", "def fibonacci(n):", "-n", "16", "--verbose", "--prompt-cache-file", str(f)
    )
    assert code in (0, None), err
    assert warm == cold
    m = re.search(r"prompt tokens\s+(\d+)", err)
    assert re.search(rf"cached tokens\s+{int(m.group(1)) - 1}\b", err)
    # A file for another model, a truncated file: one error line, exit 2.
    cfg = tiny.target_config()
    other = tiny.save_mlx(tiny.build_target(cfg, seed=1), cfg, tmp_path / "other", tokenizer_dir=tok_dir)
    code, _, err = cli(capsys, "generate", "-m", str(other), "def f():", "-n", "4", "--prompt-cache-file", str(f))
    assert code == 2 and err.startswith("error:") and "another model" in err and "Traceback" not in err
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(f.read_bytes()[:1000])
    code, _, err = cli(capsys, "generate", "def f():", "-n", "4", "--prompt-cache-file", str(bad))
    assert code == 2 and err.startswith("error:") and ("truncated" in err or "corrupt" in err)
    assert bad.read_bytes() == f.read_bytes()[:1000]  # left as it was
    code, _, err = cli(
        capsys,
        "generate",
        "def f():",
        "-n",
        "4",
        "--prompt-cache-file",
        str(tmp_path / "n.safetensors"),
        "--prompt-cache-bytes",
        "100",
    )
    assert code == 2 and "too small for one snapshot" in err


def test_chat_takes_kv_bits_and_the_cache_files_made_with_them(tmp_path):
    """chat had no --kv-bits: a cache file that generate --kv-bits 8 saved
    could never be used by chat, and chat's errors named the flag it lacked."""
    import subprocess

    cache = tmp_path / "kv8.cache"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = lambda *a, text="": subprocess.run(
        [sys.executable, "-m", "mlx_dflash", *a], input=text, capture_output=True, text=True, env=env, timeout=120
    )
    r = run("generate", "def fib(n):", "-n", "4", "--kv-bits", "8", "--prompt-cache-file", str(cache))
    assert r.returncode == 0, r.stderr
    r = run("chat", "-n", "8", "--kv-bits", "8", "--prompt-cache-file", str(cache), text="def fib(n):\n")
    assert r.returncode == 0, r.stderr
    reply = mlx_dflash.ChatSession(mlx_dflash.load()).send("def fib(n):", max_tokens=8, kv_bits=8).text
    assert r.stdout == reply + "\n"
    r = run("chat", "-n", "8", "--prompt-cache-file", str(cache), text="def fib(n):\n")
    assert r.returncode == 2 and "--kv-bits" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_chat_and_generate_help_list_the_cache_flags(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # long option names are not cut in a wide help table
    code, out, _ = cli(capsys, "chat", "--help")
    assert code == 0
    for flag in (
        "--model",
        "--draft",
        "--system",
        "--max-tokens",
        "--temp",
        "--seed",
        "--tree-budget",
        "--prompt-cache-file",
        "--prompt-cache-bytes",
        "/reset",
        "/save",
        "/quit",
    ):
        assert flag in out, flag
    code, out, _ = cli(capsys, "generate", "--help")
    assert "--prompt-cache-file" in out and "--prompt-cache-bytes" in out


def test_ctrl_c_keeps_the_text_its_stats_and_the_cache_file(tmp_path):
    import signal
    import subprocess

    cache = tmp_path / "c.safetensors"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "mlx_dflash", "generate", "def fib(n):", "--baseline", "-v"]
    p = subprocess.Popen(
        cmd + ["-n", "100000", "--prompt-cache-file", str(cache)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    first = p.stdout.read(8)  # generation has begun
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    err = err.decode()
    assert p.returncode == 130 and first and "Traceback" not in err, err
    assert re.search(r"finish reason\s+interrupted", err) and re.search(r"generated tokens\s+[1-9]", err), err
    again = subprocess.run(
        cmd + ["-n", "4", "--prompt-cache-file", str(cache)], capture_output=True, text=True, env=env, timeout=120
    )
    assert again.returncode == 0, again.stderr
    assert int(re.search(r"cached tokens\s+(\d+)", again.stderr).group(1)) > 0  # the file it saved restores


def test_chat_saves_its_prompt_cache_file_at_the_end(tmp_path):
    import subprocess

    cache = tmp_path / "chat.cache"  # any name: the file is read as safetensors whatever its extension
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "mlx_dflash", "chat", "-n", "8", "--prompt-cache-file", str(cache)]
    runs = [
        subprocess.run(cmd, input="def fib(n):\n", capture_output=True, text=True, env=env, timeout=120)
        for _ in range(2)
    ]
    for r in runs:
        assert r.returncode == 0 and f"to {cache})" in r.stderr, r.stderr
    reply = mlx_dflash.ChatSession(mlx_dflash.load()).send("def fib(n):", max_tokens=8).text
    assert runs[0].stdout == reply + "\n"  # piped: stdout holds only the replies, nothing at the end
    first, second = (re.search(r"\[(\d+) prompt tokens: (\d+) cached", r.stderr).groups() for r in runs)
    assert first[1] == "0" and int(second[1]) > 0  # the second session starts from the first one's file
    r = subprocess.run(cmd[:-1] + [str(tmp_path)], input="", capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and "is a folder" in r.stderr


def test_a_turn_that_fails_leaves_the_session_going(tmp_path):
    """A message past the context, or not UTF-8, is one error line; the
    session goes on (the next turn answers) and its cache file is saved."""
    import subprocess

    cache = tmp_path / "c.safetensors"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "mlx_dflash", "chat", "-n", "8", "--prompt-cache-file", str(cache)]
    saves = f"/save {tmp_path}\n/save ~/saved.safetensors\n".encode()
    stdin = ("x " * 5000 + "\n").encode() + b"caf\xe9\n" + saves + b"//not a command\n" + b"def fib(n):\n"
    env["HOME"] = str(tmp_path / "home")
    (tmp_path / "home").mkdir()
    r = subprocess.run(cmd, input=stdin, capture_output=True, env=env, timeout=180)
    err = r.stderr.decode()
    assert r.returncode == 0, err
    assert "error: prompt has" in err and "context limit" in err
    assert err.count("(/reset starts a new conversation)") == 1  # only where a new one would help
    assert f"error: /save {tmp_path} is a folder; give a file path" in err
    assert (tmp_path / "home" / "saved.safetensors").is_file()  # ~ is the user's home, as in the flag
    assert "error: " in err and "UTF-8" in err
    assert err.count("prompt tokens:") == 2  # the "/"-message and the last one were answered
    assert cache.is_file() and "Traceback" not in err


def test_ctrl_c_at_the_prompt_ends_the_session_and_saves(tmp_path):
    import signal
    import subprocess
    import time

    cache = tmp_path / "c.safetensors"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "mlx_dflash", "chat", "-n", "8", "--prompt-cache-file", str(cache)]
    p = subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        # as from a terminal: a suite run in the background inherits SIGINT ignored, and Python keeps it so
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    p.stdin.write(b"def fib(n):\n")
    p.stdin.flush()
    deadline = time.monotonic() + 120
    err = b""
    while b"prompt tokens:" not in err or not err.endswith(b">> "):  # answered; the REPL waits at its prompt
        assert time.monotonic() < deadline and p.poll() is None, err.decode()
        err += os.read(p.stderr.fileno(), 4096)
    time.sleep(0.3)
    interrupt(p, wait=2)
    _, rest = p.communicate(timeout=60)
    err = (err + rest).decode()
    assert p.returncode == 130 and f"to {cache})" in err and "Traceback" not in err, err  # as generate's Ctrl-C
    assert cache.is_file()


def test_a_bad_byte_costs_only_its_own_line_under_a_strict_utf8_locale():
    """Piped input is decoded line by line: under a UTF-8 locale (strict, as on
    a Mac) a bad byte used to lose the whole buffered chunk around it."""
    import subprocess

    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env["PYTHONIOENCODING"] = "utf-8:strict"
    cmd = [sys.executable, "-m", "mlx_dflash", "chat", "-n", "4"]
    r = subprocess.run(cmd, input=b"def f(x):\n\xff\xfe bad\nimport os\n", capture_output=True, env=env, timeout=120)
    err = r.stderr.decode()
    assert r.returncode == 0, err
    assert err.count("error: the line is not valid UTF-8 text (invalid start byte at byte 0)") == 1, err
    assert err.count("prompt tokens:") == 2, err  # both good lines answered


def test_a_closed_stdout_ends_the_session_quietly_and_saves_its_cache(tmp_path):
    """`mlx-dflash chat ... | head -c 0`: the reader is gone before the reply.
    The session ends as main() ends a closed pipe (status 1, no traceback),
    and its cache file is still written; the next session says what it restored."""
    import subprocess

    cache = tmp_path / "c.safetensors"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "mlx_dflash", "chat", "-n", "8", "--prompt-cache-file", str(cache)]
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    p.stdout.close()  # no reader: the first write of the reply fails with EPIPE
    _, err = p.communicate(b"def fib(n):\ndef g():\n", timeout=120)
    err = err.decode()
    assert p.returncode == 1 and "Traceback" not in err and "Exception ignored" not in err, err
    assert f"to {cache})" in err and cache.is_file(), err
    again = subprocess.run(cmd, input=b"", capture_output=True, env=env, timeout=120)
    assert again.returncode == 0, again.stderr.decode()
    assert re.search(
        rf"\(restored [1-9]\d* snapshots?, [\d.]+ MB, from {re.escape(str(cache))}\)", again.stderr.decode()
    )


_SECOND_CTRL_C = """
import os, signal, sys, time
import mlx_dflash.prefix as prefix
from mlx_dflash import cli

finish = prefix.PrefixRun.finish

def finish_hit(self, *args, **kwargs):  # a second Ctrl-C while the reply's snapshot is taken
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.1)
    return finish(self, *args, **kwargs)

class Out:  # the first Ctrl-C as the reply's first piece is shown
    def __init__(self, f):
        self.f, self.hit = f, False
    def write(self, s):
        if s and not self.hit:
            self.hit = True
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
        return self.f.write(s)
    def __getattr__(self, name):
        return getattr(self.f, name)

prefix.PrefixRun.finish = finish_hit
sys.stdout = Out(sys.stdout)
cli.main(sys.argv[1:])
"""


def test_a_second_ctrl_c_while_the_reply_is_snapshotted_is_ignored(tmp_path):
    """Ctrl-C stops a reply; the turn's snapshot is then taken with Ctrl-C held
    off, so a second press in that moment neither prints a traceback
    ("Exception ignored in: <generator ...>") nor drops the snapshot."""
    import subprocess

    cache = tmp_path / "c.safetensors"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    args = ["chat", "-n", "64", "--baseline", "--prompt-cache-file", str(cache)]
    r = subprocess.run(
        [sys.executable, "-c", _SECOND_CTRL_C, *args], input=b"def fib(n):\n", capture_output=True, env=env, timeout=120
    )
    err = r.stderr.decode()
    assert r.returncode == 0 and "Traceback" not in err and "Exception ignored" not in err, err
    again = subprocess.run(
        [sys.executable, "-m", "mlx_dflash", *args], input=b"def fib(n):\n", capture_output=True, env=env, timeout=120
    )
    cached = re.search(r"\[(\d+) prompt tokens: (\d+) cached", again.stderr.decode()).groups()
    assert int(cached[1]) > 0, again.stderr.decode()  # the stopped turn's snapshot was kept


def test_three_double_quotes_make_one_message_of_several_lines():
    """Pasted code stays one message: from a line starting with three double
    quotes to one ending with them. A bad byte inside refuses that whole
    message (its lines are not sent one by one); the end of input closes an
    open block."""
    import subprocess

    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "mlx_dflash", "chat", "-n", "6"]
    stdin = b'"""\ndef f(x):\n    return x\n"""\n' + b'"""a\n\xff\n/quit\nb"""\n' + b'"""/reset\nclass A:'
    r = subprocess.run(cmd, input=stdin, capture_output=True, env=env, timeout=120)
    err = r.stderr.decode()
    assert r.returncode == 0 and "Traceback" not in err, err
    assert err.count("prompt tokens:") == 2 and err.count("not valid UTF-8") == 1, err
    assert "(conversation reset)" not in err  # a block is a message, whatever it starts with
    session = mlx_dflash.ChatSession(mlx_dflash.load())
    replies = [session.send(m, max_tokens=6).text for m in ("def f(x):\n    return x", "/reset\nclass A:")]
    assert r.stdout.decode() == "".join(t + "\n" for t in replies)
