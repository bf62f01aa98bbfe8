"""The mlx-dflash CLI: help, the embedded default run, and bad input (exit 2, no traceback)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.signals import interrupt

from mlx_dflash import blas
from mlx_dflash.cli import main
from tools import tiny

EMBEDDED = Path(__file__).resolve().parent.parent / "mlx_dflash" / "default_model"


def cli(capsys, *args):
    with pytest.raises(SystemExit) as e:
        main(list(args))
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def test_help_lists_every_flag(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # a wide table: long flag names are not cut
    code, out, _ = cli(capsys, "--help")
    assert code == 0 and "generate" in out and "info" in out
    code, out, _ = cli(capsys, "generate", "--help")
    assert code == 0
    for flag in (
        "--model",
        "--draft",
        "--prompt",
        "--max-tokens",
        "--block-size",
        "--no-chat-template",
        "--system",
        "--baseline",
        "--verbose",
        "--profile",
        "--seed",
        "--temp",
        "--draft-window",
        "--dtype",
        "--draft-model",
        "--num-draft-tokens",
        "--system-prompt",
        "--ignore-chat-template",
        "--chat-template-config",
        "--extra-eos-token",
        "--min-tokens-to-keep",
        "--no-compile",
        "--auto-tree",
    ):
        assert flag in out, flag


def test_console_script_runs_embedded_pair():
    r = subprocess.run(
        [sys.executable, "-m", "mlx_dflash", "generate", "def fibonacci(n):", "-n", "12", "--verbose"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "tau" in r.stderr and "decode" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.skipif(
    blas.openblas_path() is None,
    reason="OpenBLAS is not installed on this machine (apt-get install libopenblas0-pthread)",
)
def test_command_line_runs_under_openblas_with_a_core_left_for_python():
    r = subprocess.run(
        [sys.executable, "-m", "mlx_dflash", "generate", "def f(", "-n", "4", "--verbose"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    n = blas.decode_threads()
    assert "OpenBLAS preloaded" in r.stderr and f", {n} thread{'s' if n != 1 else ''}" in r.stderr, r.stderr


def test_decode_threads_leave_one_core(monkeypatch):
    for cores, want in ((set(range(8)), 7), ({0, 1}, 1), ({3}, 1)):
        monkeypatch.setattr(blas.os, "sched_getaffinity", lambda pid, c=cores: c, raising=False)
        assert blas.decode_threads() == want


def test_dflash_and_baseline_print_the_same_text(capsys):
    code, a, _ = cli(capsys, "generate", "print(", "-n", "20")
    assert code in (0, None)
    code, b, _ = cli(capsys, "generate", "print(", "-n", "20", "--baseline")
    assert code in (0, None)
    assert a == b and a.strip()


@pytest.mark.slow  # 27-36 s: a second cost curve for plain ops (test_compiled covers the math)
def test_no_compile_prints_the_same_text(capsys):
    code, a, _ = cli(capsys, "generate", "def g(", "-n", "24")
    assert code in (0, None)
    code, b, err = cli(capsys, "generate", "def g(", "-n", "24", "--no-compile", "--verbose")
    assert code in (0, None)
    assert a == b and a.strip() and "plain ops (--no-compile)" in err


@pytest.mark.slow  # 17-38 s: a cost curve with trees (test_policy covers auto-tree tokens)
def test_auto_tree_prints_the_same_text(capsys):
    code, a, _ = cli(capsys, "generate", "class A:", "-n", "24", "--baseline")
    assert code in (0, None)
    code, b, err = cli(capsys, "generate", "class A:", "-n", "24", "--auto-tree", "6", "--verbose")
    assert code in (0, None)
    assert a == b and a.strip() and "tree of 6" in err


def test_profile_adds_the_time_split(capsys):
    code, _, err = cli(capsys, "generate", "def f(x):", "-n", "20", "--verbose")
    assert code in (0, None) and "time per cycle" in err and "draft/verify/rollback" not in err
    code, _, err = cli(capsys, "generate", "def f(x):", "-n", "20", "--verbose", "--profile")
    assert code in (0, None) and "draft/verify/rollback" in err


def test_prompt_from_stdin(capsys, monkeypatch):
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO("import os"))
    code, out, err = cli(capsys, "generate", "-", "-n", "4", "--no-chat-template")
    assert code in (0, None), err


@pytest.fixture(scope="module")
def small_ctx_model(tmp_path_factory, tok_dir):
    cfg = tiny.target_config(max_position_embeddings=16)
    model = tiny.build_target(cfg, seed=1)
    return tiny.save_mlx(model, cfg, tmp_path_factory.mktemp("m") / "target", tokenizer_dir=tok_dir)


def bad_cases(tmp_path, small_ctx_model):
    notmodel = tmp_path / "empty"
    notmodel.mkdir()
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama"}))
    latin1_folder = tmp_path / "latin1"
    latin1_folder.mkdir()
    (latin1_folder / "a.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    return [
        (["generate", "hi", "--model", str(tmp_path / "missing")], "does not exist"),
        (["generate", "hi", "--model", str(notmodel)], "no config.json"),
        (["generate", "hi", "--model", str(llama)], "unsupported model_type"),
        (
            [
                "generate",
                "hi",
                "--model",
                str(small_ctx_model),
                "--draft",
                str(__import__("mlx_dflash").api.DEFAULT_DRAFT),
            ],
            "hidden_size",
        ),
        (["generate", "hi", "--block-size", "17"], "(--block-size, --num-draft-tokens) must be in 2..16"),
        (["generate", "hi", "--block-size", "1"], "(--block-size, --num-draft-tokens) must be in 2..16"),
        (["generate", ""], "empty prompt"),
        # "./org/name" is a path: info and convert looked it up as a Hugging Face id (typer's Path dropped the "./")
        (["info", "./no-org/no-model"], "path does not exist"),
        (["convert", "./no-org/no-model", "out"], "does not exist"),
        (
            ["generate", "hi", "--no-chat-template", "--chat-template-config", '{"enable_thinking": false}'],
            "drop it or --no-chat-template",
        ),
        # flags that shape only drafting, where no draft is loaded: they ran plain decoding silently
        (
            ["generate", "hi", "-m", str(__import__("mlx_dflash").api.DEFAULT_MODEL), "--tree-budget", "8"],
            "no draft is loaded: tree_budget",
        ),
        (
            ["generate", "hi", "-m", str(__import__("mlx_dflash").api.DEFAULT_MODEL), "--no-adaptive"],
            "no draft is loaded: adaptive=False",
        ),
        (["generate"], "no prompt"),
        (["generate", "hi", "--max-tokens", "0"], "must be positive"),
        (["generate", "hi", "--max-tokens", "-3"], "must be positive"),
        (
            [
                "generate",
                "a b c d e f g h i j k l m n o p q r s t",
                "--no-chat-template",
                "--model",
                str(small_ctx_model),
            ],
            "context limit is 16",
        ),
        (["generate", "hi", "--temp", "-1"], "temperature"),
        (["generate", "hi", "--temp", "nan"], "temperature (--temp) must be a finite number"),
        (
            ["generate", "hi", "--repetition-penalty", "inf"],
            "repetition_penalty (--repetition-penalty) must be a finite",
        ),
        (["serve", "--temp", "nan"], "temperature (--temp) must be a finite number"),
        # An invalid UTF-8 byte on the command line reaches Python as a lone surrogate.
        (["generate", "a\udcffb"], "not valid UTF-8 text (byte 0xff"),
        (["generate", "hi", "--system", "x\udcfe"], "system prompt is not valid UTF-8"),
        (["generate", "hi", "--dtype", "int8"], "--dtype"),
        (["generate", "hi", "--draft-quantize", "3"], "4 or 8 bits"),
        (["generate", "hi", "--auto-tree", "-1"], "--auto-tree) must be >= 0"),
        (["generate", "hi", "--auto-tree", "4", "--tree-budget", "4"], "not both"),
        (["serve", "--auto-tree", "4", "--tree-budget", "4"], "not both"),
        (["chat", "--auto-tree", "-2"], "must be >= 0"),
        (["info", str(tmp_path / "missing")], "does not exist"),
        (["info", "--draft", str(tmp_path / "missing"), str(tmp_path)], "draft path does not exist"),
        (
            ["generate", "hi", "--baseline", "-b", "4"],
            "(--baseline) decodes without a draft: block_size (--block-size)",
        ),
        (["generate", "hi", "-b", "3", "--auto-tree", "8"], "(--auto-tree) is the adaptive policy's choice"),
        (["generate", "hi", "--temp", "0.7", "--auto-tree", "8"], "speculative rule keeps the full block"),
        (["generate", "hi", "--baseline", "--tree-budget", "4"], "(--tree-budget) would do nothing"),
        (["generate", "hi", "--no-chat-template", "--system", "be brief"], "--system needs the chat template"),
        (["generate", "hi", "--prompt-cache-bytes", "0"], "--prompt-cache-bytes must be positive"),
        (["serve", "--prompt-cache-bytes", "lots"], "'lots' is not a size: give bytes, or a size such as 512MB"),
        (["generate", "hi", "--prompt-cache-file", str(tmp_path / "no" / "x.safetensors")], "does not exist"),
        (["generate", "hi", "--prompt-cache-file", str(tmp_path)], "is a folder"),
        (["bench", "--name", "../x", "--out", str(tmp_path)], "--name must be a plain file name"),
        (["bench", "--out", "/proc/mlx-dflash-results"], "cannot make the results folder"),
        (["bench", "--out", str(latin1_folder / "a.txt")], "a.txt is a file; give a folder path"),
        (["bench", "--tree-budget", "-1", "--out", str(tmp_path)], "--tree-budget must be >= 0"),
        (["bench", "--tree-topk", "3", "--out", str(tmp_path)], "--tree-topk shapes a tree: give --tree-budget too"),
        (["generate", "hi", "--num-draft-tokens", "16"], "(1..15 drafted tokens), got 17 (16 drafted)"),
        (["generate", "hi", "--draft-quantize", "3"], "(--draft-quantize) must be 4 or 8 bits"),
        # flags that would do nothing without another: an error, as --system without the template is
        (["generate", "hi", "--draft-sink", "4"], "give --draft-window too"),
        (["generate", "hi", "--profile"], "give --verbose too"),
        (["generate", "hi", "--prompt-cache-bytes", "1000000"], "give it too"),
        (["bench", "--prompts", str(latin1_folder), "--out", str(tmp_path)], "is not UTF-8 text"),
        (["bench", "--prompts", str(latin1_folder / "a.txt"), "--out", str(tmp_path)], "is a file"),
        # a budget under one snapshot failed every turn of the chat, and /reset could not help
        (["chat", "--prompt-cache-bytes", "10"], "too small for one snapshot"),
        # mlx-lm's habits and contradictions that used to pass silently or mislead
        (["generate", "hi", "-m", "64"], "-m is --model here (mlx-lm's generate and chat take -m for the token count"),
        (["chat", "-m", "64"], "-m is --model here"),
        (["generate", "hi", "--num-draft-tokens", "0"], "--num-draft-tokens must be at least 1"),
        (["generate", "hi", "--baseline", "--draft-window", "8"], "(--draft-window) would do nothing"),
        (["generate", "hi", "--baseline", "--no-adaptive"], "(--no-adaptive) would do nothing"),
        (["generate", "hi", "--baseline", "--draft-vocab", "100"], "--draft-vocab would do nothing"),
        (["chat", "--baseline", "--draft-quantize", "8"], "--draft-quantize would do nothing"),
        (["serve", "--no-prompt-cache", "--prompt-cache-bytes", "1000"], "--no-prompt-cache turns off"),
        (["info", str(tmp_path), "--stages", "-1"], "--stages must be 2 or more"),
        (["info", str(EMBEDDED / "draft"), "--stages", "2"], "--stages splits a target over ranks"),
        (["info", str(EMBEDDED / "target"), "--draft", str(EMBEDDED / "target")], "is a target model"),
        (["generate", "hi", "--draft", str(EMBEDDED / "target")], "not a DFlash draft; give the draft's folder"),
        (["generate", "hi", "--tree-topk", "8"], "--tree-topk shapes a tree: give --tree-budget or --auto-tree"),
        (["generate", "hi", "--tree-topk", "4"], "--tree-topk shapes a tree"),  # the default's value, given: as idle
        (["generate", "hi", "--pipeline-timeout", "5"], "--pipeline-timeout is for --pipeline runs"),
        # a stage's cache took no kv_bits: a TypeError after the whole load, on every rank
        (["generate", "hi", "--pipeline", "--kv-bits", "8"], "--kv-bits (kv_bits) does not work with --pipeline"),
        (["serve", "--pipeline", "--kv-bits", "4"], "--kv-bits (kv_bits) does not work with --pipeline"),
    ]


def test_bad_input_exits_2_with_message(capsys, tmp_path, small_ctx_model):
    for args, message in bad_cases(tmp_path, small_ctx_model):
        code, out, err = cli(capsys, *args)
        assert code == 2, (args, err)
        assert message in err, (args, err)
        assert "Traceback" not in err + out


@pytest.mark.parametrize(
    "args, words",
    [
        (["generate", "hi", "--max-tokens", "abc"], "Invalid value for '--max-tokens'"),
        (["generate", "hi", "--temp"], "requires an argument. (see mlx-dflash generate --help)"),
        (["serve", "--max-batch", "1.5"], "Invalid value for '--max-batch'"),
        (["generate", "--nope"], "No such option: --nope"),
        (["nonesuch"], "No such command 'nonesuch'"),
        (["info"], "Missing argument"),
    ],
)
def test_unparsable_flags_are_one_error_line(args, words, capsys):
    """What the command line parser refuses is one ``error:`` line naming the
    command's --help too, exit 2, not a boxed panel."""
    code, out, err = cli(capsys, *args)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], err
    assert "--help" in lines[0]


def test_bad_input_through_console_script(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "mlx_dflash", "generate", "hi", "--model", str(tmp_path / "x")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2
    assert "error:" in r.stderr and "does not exist" in r.stderr and "Traceback" not in r.stderr


def test_info(capsys, small_ctx_model):
    from mlx_dflash.api import DEFAULT_DRAFT, DEFAULT_MODEL

    code, out, _ = cli(capsys, "info", str(DEFAULT_MODEL), "--draft", str(DEFAULT_DRAFT))
    assert code in (0, None)
    assert "qwen3_5" in out and "6 Gated DeltaNet + 2 full attention" in out
    assert "parameters:" in out and "size on disk:" in out and "fits" in out
    code, out, _ = cli(capsys, "info", str(small_ctx_model), "--draft", str(DEFAULT_DRAFT))
    assert "does NOT fit" in out and "hidden_size" in out
    assert code == 1  # a script can tell a misfit from a fit (0) and from bad input (2)
    code, out, _ = cli(capsys, "info", str(DEFAULT_DRAFT))
    assert "DFlash v1 draft" in out and "block size: 16" in out


def test_info_with_a_corrupt_draft_is_bad_input_not_a_misfit(capsys, tmp_path):
    import shutil

    from mlx_dflash.api import DEFAULT_DRAFT, DEFAULT_MODEL

    draft = tmp_path / "draft"
    shutil.copytree(DEFAULT_DRAFT, draft)
    weights = next(draft.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:4096])  # truncated
    code, out, err = cli(capsys, "info", str(DEFAULT_MODEL), "--draft", str(draft))
    assert code == 2 and "cannot read draft weights" in err and "does NOT fit" not in out
    # Weights gone, or not the ones its own config names: broken files too (they said "does NOT fit", exit 1).
    weights.unlink()
    code, out, err = cli(capsys, "info", str(DEFAULT_MODEL), "--draft", str(draft))
    assert code == 2 and "has no .safetensors weights" in err and "does NOT fit" not in out
    shutil.copy(next(Path(DEFAULT_DRAFT).glob("*.safetensors")), weights)
    cfg = json.loads((draft / "config.json").read_text())
    cfg["num_hidden_layers"] += 1
    cfg["layer_types"].append(cfg["layer_types"][-1])
    (draft / "config.json").write_text(json.dumps(cfg))
    code, out, err = cli(capsys, "info", str(DEFAULT_MODEL), "--draft", str(draft))
    assert code == 2 and "weight names do not match" in err and "does NOT fit" not in out


def test_short_help_and_version(capsys):
    import mlx_dflash

    code, out, _ = cli(capsys, "-h")
    assert code == 0 and "generate" in out and "serve" in out
    code, out, _ = cli(capsys, "serve", "-h")
    assert code == 0 and "--allowed-origins" in out
    code, out, _ = cli(capsys, "--version")
    assert code == 0 and out.strip() == f"mlx-dflash {mlx_dflash.__version__}"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs Linux's /dev/full (writes fail with ENOSPC)")
def test_output_that_cannot_be_written_is_one_error_line():
    with open("/dev/full", "w") as full:
        r = subprocess.run(
            [sys.executable, "-m", "mlx_dflash", "generate", "def fib(n):", "-n", "16"],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
        )
    assert (
        r.returncode == 1
        and r.stderr.strip().splitlines()[-1] == "error: cannot write the output: No space left on device"
    )
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr


def test_ctrl_c_stops_generation_even_where_its_keyboard_interrupt_was_swallowed():
    """generate and chat read their pieces through cli._ctrl_c_stops: a
    Ctrl-C that lands where something catches the KeyboardInterrupt (here a
    broad except inside the stream) still ends the stream after that piece,
    and the previous SIGINT handler is back afterwards."""
    import signal
    import time

    from mlx_dflash.cli import _ctrl_c_stops

    def stream():
        for i in range(50):
            try:
                if i == 3:
                    os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.01)  # the handler runs here, in the try
            except KeyboardInterrupt:
                pass
            yield i

    before = signal.getsignal(signal.SIGINT)
    got = []
    with pytest.raises(KeyboardInterrupt):
        for i in _ctrl_c_stops(stream()):
            got.append(i)
    assert got == [0, 1, 2, 3]
    assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.parametrize("delay", [0.3, 1.0, 2.0, 3.0])
def test_ctrl_c_while_the_command_starts_leaves_no_traceback(delay):
    """Ctrl-C in the first seconds, while the modules load (mlx-lm and
    transformers take 1-2 s), printed a 35-line traceback from the import."""
    import signal

    p = subprocess.Popen(
        [sys.executable, "-m", "mlx_dflash", "serve", "--port", "0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        # as from a terminal: a suite run in the background inherits SIGINT ignored, and Python keeps it so
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        time.sleep(delay)
        interrupt(p)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:  # never left serving behind a failed check
            p.kill()
            p.wait()
    # 130 while loading; -2 (a shell's 130 too) killed by the signal before Python
    # set its handler, in the re-run under OpenBLAS; 0 once serving (a clean shutdown)
    assert p.returncode in (0, 130, -signal.SIGINT), err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


def test_sizes_read_as_mlx_lm_reads_them():
    """--prompt-cache-bytes takes 4GB as mlx-lm's server does (decimal units), and GiB."""
    from mlx_dflash.cli import _size

    assert [_size(t) for t in ("1000", "512MB", "4GB", "1.5G", "2GiB", "12kb", "1TiB", "1tb")] == [
        1000,
        512 * 10**6,
        4 * 10**9,
        15 * 10**8,
        2 * 2**30,
        12000,
        2**40,  # a KeyError before: the pattern took TiB, the table lacked it
        10**12,
    ]


def test_a_stage_plan_of_a_bad_folder_is_one_error(capsys, tmp_path):
    """info --stages read num_hidden_layers with int() and the shards' headers
    unchecked: a bare ValueError, OverflowError or JSONDecodeError."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "num_hidden_layers": "eight"}))
    code, _, err = cli(capsys, "info", str(tmp_path), "--stages", "2")
    assert code == 2 and "num_hidden_layers must be a positive integer, got 'eight'" in err, err
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "num_hidden_layers": 4}))
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 64)
    code, _, err = cli(capsys, "info", str(tmp_path), "--stages", "2")
    assert code == 2 and "cannot read the safetensors header" in err and "Traceback" not in err, err


def test_ctrl_c_while_a_reply_flows_stops_it_between_two_cycles():
    """A Ctrl-C raised KeyboardInterrupt where it landed: mid-cycle, the
    generation then skipped the reply's prefix snapshot (the next chat turn
    prefilled the whole conversation again). It now ends the reply after the
    cycle in flight; before the first piece (the prefill) it stops at once,
    and so does a second Ctrl-C."""
    import signal

    from mlx_dflash.cli import _ctrl_c_stops

    finished = []

    def pieces(kills):
        for i in range(4):
            if i in kills:
                os.kill(os.getpid(), signal.SIGINT)  # lands mid-cycle
            finished.append(i)
            yield i

    got = []
    with pytest.raises(KeyboardInterrupt):
        for p in _ctrl_c_stops(pieces({1})):
            got.append(p)
    assert got == [0, 1] and finished == [0, 1]  # cycle 1 ran to its end
    finished.clear()
    with pytest.raises(KeyboardInterrupt):
        list(_ctrl_c_stops(pieces({0})))  # the prefill: at once
    assert finished == []
    finished.clear()

    def twice():
        yield 0
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # a cycle that does not end: the second one stops it
        finished.append("past")
        yield 1

    with pytest.raises(KeyboardInterrupt):
        list(_ctrl_c_stops(twice()))
    assert finished == []


def test_a_cache_file_path_under_home_is_expanded(tmp_path, monkeypatch):
    """`--prompt-cache-file=~/c.safetensors` (no shell expansion after "=")
    was refused: "the folder ~ does not exist"."""
    from mlx_dflash.errors import DFlashError, writable_file

    monkeypatch.setenv("HOME", str(tmp_path))
    writable_file("~/c.safetensors", "--prompt-cache-file")
    with pytest.raises(DFlashError, match="c.safetensors is a folder"):
        (tmp_path / "c.safetensors").mkdir()
        writable_file("~/c.safetensors", "--prompt-cache-file")
