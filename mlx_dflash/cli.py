"""The ``mlx-dflash`` command line."""

import contextlib
import errno
import os
import re
import shutil
import sys
import threading
from pathlib import Path
from typing import Callable, List, Optional

import typer

from . import blas
from .batch import DEFAULT_MAX_BATCH
from .config import SAMPLING
from .errors import DFlashError, check_positive, writable_file, writable_folder
from .files import left_only_if_used
from .sampling import DEFAULT_ACCEPT_RULE

# What writing the output can fail with that is the output's fault, not ours:
# a reader gone (a closed pipe), a full disk, a device error.
_OUTPUT_ERRNOS = (errno.EPIPE, errno.ENOSPC, errno.EIO, errno.EDQUOT)
# mlx-lm's flags with no counterpart here (mlx_lm.generate's, then chat's and server's), and what to
# do instead.
_MLX_LM_FLAGS = {
    "--max-kv-size": "a rotating KV cache is not implemented (mlx-lm ignores the flag for Qwen3.5 models, which "
    "build their own caches); --kv-bits 8 or 4 shrinks the KV",
    "--kv-group-size": "the quantized KV's groups are 64 wide; --kv-bits sets its bits",
    "--quantized-kv-start": "with --kv-bits the KV is quantized from the first token",
    "--trust-remote-code": "tokenizers load without remote code (Qwen3.5's need none)",
    "--use-default-chat-template": "the tokenizer's own template is used; --chat-template-config passes it arguments",
    "--quantize-activations": "activations keep the model's dtype (--dtype sets it)",
    "--image": "text only: a checkpoint's vision tower is not loaded",
    # mlx_lm.chat's and mlx_lm.server's
    "--pipeline": "chat runs on one machine; generate and serve split a model over several with --pipeline",
    "--chat-template": "each request is rendered by the tokenizer's own template (--chat-template-args passes it "
    "arguments)",
    "--prompt-cache-size": "the prefix cache is bounded in bytes (--prompt-cache-bytes), not in entries",
    "--prompt-concurrency": "each prompt is prefilled alone, in chunks taking turns with the batch's decode "
    "cycles (docs/batching.md); --max-batch bounds the requests that run at once",
}

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Lossless DFlash speculative decoding of Qwen3.5/3.6 models on MLX.",
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},  # -h as mlx-lm's argparse tools take it
)


def _version(value: bool) -> None:
    if value:
        from . import __version__

        typer.echo(f"mlx-dflash {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit.", metavar=""
    ),
) -> None:
    """Lossless DFlash speculative decoding of Qwen3.5/3.6 models on MLX."""


_FROM_COMMAND_LINE = False  # main() runs as the process's own command line (may re-exec)


def _dtype(name: Optional[str]):
    from .api import dtype_of

    return dtype_of(name, "--dtype")


def _read_prompt(arg: Optional[str], opt: Optional[str]) -> str:
    if arg is not None and opt is not None:
        raise DFlashError("give the prompt once: as an argument or with --prompt, not both")
    text = opt if opt is not None else arg
    if text is None:
        raise DFlashError("no prompt: pass it as an argument, with --prompt, or '-' to read stdin")
    if text == "-":
        text = sys.stdin.read()
    if not text:  # (whitespace is a prompt: a blank line or an indent starts code)
        raise DFlashError("empty prompt: give some text")
    return text


def _check_for_draft(gen, engine) -> None:
    """The options against the loaded draft; without one, a flag that shapes
    only drafting is refused (it would run plain decoding silently)."""
    gen.validate(engine.draft)
    if engine.draft is None:
        gen.refuse_without_draft()


def _template_config(text: Optional[str]) -> Optional[dict]:
    """--chat-template-config: a JSON object of keyword arguments for the template."""
    if text is None:
        return None
    import json

    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise DFlashError(f"--chat-template-config is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise DFlashError("--chat-template-config must be a JSON object, e.g. '{\"enable_thinking\": false}'")
    return cfg


# Options several commands share (one definition, one help text).
COMPILE_OPTION = typer.Option(
    True,
    "--compile/--no-compile",
    metavar="",  # a switch: no <bool> after it
    help="Run decode-time forwards as mx.compile'd pieces (same tokens, fewer dispatches); "
    "--no-compile runs plain MLX ops (for troubleshooting).",
)


_SIZE_UNITS = {
    "": 1,
    "K": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "KI": 2**10,
    "MI": 2**20,
    "GI": 2**30,
    "TI": 2**40,
}


def _size(text: str) -> int:
    """A byte count: digits, or a size such as 512MB, 4GB, 1.5G (decimal
    units, as mlx-lm's --prompt-cache-bytes reads them; KiB, MiB, GiB, TiB binary)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([KMGT]I?)?B?\s*", str(text), re.IGNORECASE)
    if m is None:
        raise typer.BadParameter(f"{text!r} is not a size: give bytes, or a size such as 512MB or 4GB")
    return int(float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "").upper()])


PIPELINE_TIMEOUT = 60.0  # --pipeline-timeout's default, seconds
DTYPE_OPTION = typer.Option(None, "--dtype", help="Cast weights to float32, bfloat16 or float16 at load.")
DRAFT_QUANTIZE_OPTION = typer.Option(None, "--draft-quantize", help="Quantize the draft to 4 or 8 bits at load.")
DRAFT_VOCAB_OPTION = typer.Option(
    None,
    "--draft-vocab",
    metavar="N|FILE",
    help="The draft proposes only among N tokens (the N lowest ids) or the ids in FILE (JSON list or "
    "whitespace-separated), plus the tokenizer's added tokens: it reads only those rows of the head, most of "
    "a draft's cost on a large vocabulary. Output unchanged; a token outside them ends an accepted run.",
)
ADAPTER_OPTION = typer.Option(
    None,
    "--adapter-path",
    help="Folder of fine-tuning adapters as mlx-lm's lora writes it (LoRA, DoRA or full: "
    "adapter_config.json, adapters.safetensors), applied to the target at load.",
)
EXTRA_EOS_OPTION = typer.Option(
    None,
    "--extra-eos-token",
    help="Another token that ends generation, as the vocabulary spells it or its id; repeatable.",
)


# Generation options (GenerationConfig's fields, and the CLI's aliases of them): each
# flag defined once; a command takes the ones it offers with @generation_options
# (every sampling flag, config.SAMPLING, wherever it samples).
# name -> (type, default, flags, help)
GENERATION_FLAGS = {
    "max_tokens": (int, 256, ("--max-tokens", "-n"), "Most tokens to generate (EOS may stop earlier)."),
    "block_size": (
        Optional[int],
        None,
        ("--block-size", "-b"),
        "Pin the tokens verified per cycle, 2..the draft's block size (default: chosen each cycle by the "
        "adaptive policy, up to the draft's block). With --tree-budget: the tree's depth "
        "plus one (the draft block its candidates come from).",
    ),
    "num_draft_tokens": (
        Optional[int],
        None,
        ("--num-draft-tokens",),
        "mlx-lm's name: drafted tokens per cycle, i.e. --block-size minus one.",
    ),
    "baseline": (bool, False, ("--baseline",), "Plain autoregressive decoding, no draft (for comparison)."),
    "temperature": (float, 0.0, ("--temp",), "Sampling temperature; 0 = greedy (exactly the target's greedy output)."),
    "top_p": (float, 1.0, ("--top-p",), "Nucleus sampling mass (with --temp > 0); 1 or 0 = off."),
    "top_k": (int, 0, ("--top-k",), "Sample among the k most likely tokens; 0 = off."),
    "min_p": (float, 0.0, ("--min-p",), "Drop tokens below min_p x the top probability; 0 = off."),
    "min_tokens_to_keep": (int, 1, ("--min-tokens-to-keep",), "Tokens --min-p always keeps (the most likely ones)."),
    "repetition_penalty": (
        float,
        1.0,
        ("--repetition-penalty",),
        "Penalise tokens seen in the last --repetition-context-size tokens; 1 = off.",
    ),
    "repetition_context_size": (
        int,
        20,
        ("--repetition-context-size",),
        "Tokens the repetition penalty looks back over.",
    ),
    "xtc_probability": (
        float,
        0.0,
        ("--xtc-probability",),
        "XTC (exclude top choices): how often, per token, the likeliest tokens above --xtc-threshold "
        "are cut but the least of them (with --temp > 0); 0 = off.",
    ),
    "xtc_threshold": (float, 0.1, ("--xtc-threshold",), "XTC's probability threshold, 0..0.5."),
    "seed": (
        Optional[int],
        None,
        ("--seed",),
        "Sampling seed. With --accept-rule equality the same seed gives the same output in plain, chain and tree mode.",
    ),
    "accept_rule": (
        str,
        DEFAULT_ACCEPT_RULE,
        ("--accept-rule",),
        "With --temp > 0 on a chain: 'speculative' samples the draft and keeps a token with "
        "probability min(1, p/q); 'equality' keeps a drafted token when it equals the target's own "
        "sample (same seed, same text in every mode). Both are exact; speculative keeps more drafts.",
    ),
    "tree_budget": (
        int,
        0,
        ("--tree-budget",),
        "Verify a DDTree of this many draft nodes (at most 1024) per cycle instead of a chain; 0 = chain.",
    ),
    "tree_topk": (
        Optional[int],
        None,
        ("--tree-topk",),
        "Candidate tokens per depth when building the tree (default 4; only with a tree).",
    ),
    "auto_tree": (
        int,
        0,
        ("--auto-tree",),
        "Let the adaptive policy choose each cycle between a chain and a DDTree of this many draft "
        "nodes (from their measured costs and the tokens each commits); 0 = chains.",
    ),
    "draft_window": (
        int,
        0,
        ("--draft-window",),
        "Keep only this many recent context positions in the draft cache (plus --draft-sink first "
        "ones); 0 = the draft's own: its sliding window when every layer slides, else keep all.",
    ),
    "draft_sink": (int, 16, ("--draft-sink",), "First context positions always kept with --draft-window."),
    "prefill_chunk": (
        int,
        512,
        ("--prefill-chunk", "--prefill-step-size"),
        "Prompt tokens per prefill forward (--prefill-step-size: mlx-lm's name).",
    ),
    "adaptive": (
        bool,
        True,
        ("--adaptive/--no-adaptive",),
        "Choose each cycle's verify width from the pair's measured costs and the acceptance so far, "
        "down to plain steps when drafting does not pay (costs measured once per machine and model, "
        "cached). --block-size or --tree-budget pin the width; --no-adaptive always uses the draft's "
        "block.",
    ),
    "kv_bits": (
        Optional[int],
        None,
        ("--kv-bits",),
        "Store the target's attention K/V quantized to 8 or 4 bits (group size 64, K Hadamard-rotated). "
        "Saves memory on long contexts; changes the target slightly.",
    ),
    "profile": (
        bool,
        False,
        ("--profile",),
        "With --verbose: synchronise after each phase so the stats split the time per cycle into "
        "draft / verify / rollback (a little slower).",
    ),
}


def generation_options(*names: str, **defaults):
    """Give a command the generation flags ``names`` (``defaults`` overrides theirs);
    the command receives them as one :class:`GenerationConfig` in its ``gen`` parameter."""
    import functools
    import inspect

    def wrap(fn):
        sig = inspect.signature(fn)
        extra = []
        for n in names:
            kind, default, flags, text = GENERATION_FLAGS[n]
            default = defaults.get(n, default)
            extra.append(
                inspect.Parameter(
                    n,
                    inspect.Parameter.KEYWORD_ONLY,
                    annotation=kind,
                    default=typer.Option(default, *flags, help=text, metavar="" if kind is bool else None),
                )
            )

        @functools.wraps(fn)
        def command(**kw):
            flags = {n: kw.pop(n) for n in names}
            # Load options that shape only the draft, given: nothing for them to shape under --baseline.
            drafting = [flag for flag, n in DRAFT_ONLY_OPTIONS if kw.get(n) is not None]
            own_tree = kw.get("tree_budget") if "tree_budget" not in names else None  # bench's own flag
            gen = generation_config(flags, per_request=fn.__name__ == "serve", drafting=drafting, tree_budget=own_tree)
            return fn(gen=gen, **kw)

        command.__signature__ = sig.replace(parameters=[p for p in sig.parameters.values() if p.name != "gen"] + extra)
        return command

    return wrap


DRAFT_ONLY_OPTIONS = (("--draft-quantize", "draft_quantize"), ("--draft-vocab", "draft_vocab"))


def generation_config(flags: dict, per_request: bool = False, drafting=(), tree_budget=None):
    """The GenerationConfig of a command's generation flags (aliases resolved;
    ``per_request``: defaults each request may override, as ``serve``'s;
    ``drafting``: the command's other flags given that shape only the draft;
    ``tree_budget``: the command's own tree flag, apart from the config (``bench``'s))."""
    from .config import GenerationConfig

    flags = dict(flags)
    topk = flags.pop("tree_topk", None)
    if topk is not None:  # given: refused without a tree even at the default (it would do nothing)
        if not (flags.get("tree_budget") or flags.get("auto_tree") or tree_budget):
            trees = [f for f, n in (("--tree-budget", "tree_budget"), ("--auto-tree", "auto_tree")) if n in flags]
            trees += ["--tree-budget"] if tree_budget is not None else []
            raise DFlashError(f"--tree-topk shapes a tree: give {' or '.join(trees)} too, or drop it")
        flags["tree_topk"] = topk
    ndt = flags.pop("num_draft_tokens", None)
    if ndt is not None and ndt < 1:
        raise DFlashError(f"--num-draft-tokens must be at least 1 (a block of 2), got {ndt}")
    if ndt is not None:
        if flags.get("block_size") is not None:
            raise DFlashError("give --block-size or --num-draft-tokens, not both")
        flags["block_size"] = ndt + 1
    window, sink = flags.pop("draft_window", 0), flags.pop("draft_sink", 16)
    if window < 0 or sink < 0:
        raise DFlashError("--draft-window and --draft-sink must be >= 0")
    if not window and sink != GENERATION_FLAGS["draft_sink"][1]:
        raise DFlashError("--draft-sink is the start --draft-window keeps: give --draft-window too, or drop it")
    if window:
        flags["draft_window"] = (sink, window)
    gen = GenerationConfig(**flags)
    gen.validate()  # before loading anything; the draft's block limit once it is loaded
    gen.refuse_unused(per_request, drafting, tree_budget or 0)  # a flag that would do nothing is refused
    return gen


HUB_IDS = (
    "a Hugging Face id (org/name or org/name@revision; a GGUF repo's file as org/name:QUANT "
    "or org/name/FILE.gguf), fetched into the Hugging Face cache"
)


def _local(path: Optional[Path]) -> Optional[Path]:
    """A path argument that may be a Hugging Face id, as a local path (see loading/hub.py)."""
    from .loading.hub import resolve

    _not_a_count(path)
    return resolve(path)


def _not_a_count(model: Optional[Path]) -> None:
    """-m given a number: mlx-lm's -m (the token count), not a model path."""
    if model is not None and str(model).isdigit() and not Path(model).exists():
        raise DFlashError(
            f"no model {str(model)!r}: -m is --model here (mlx-lm's generate and chat take -m for the "
            "token count; that is -n here)"
        )


def _engine_loader(
    model,
    draft,
    *,
    dtype,
    compile_,
    pipeline: bool,
    pipeline_timeout: float,
    draft_quantize=None,
    adapter_path=None,
    draft_vocab=None,
) -> Optional[Callable[[], object]]:
    """How a command gets its engine: a function that loads it (call it where
    the engine is used). With --pipeline every rank loads its stage now: rank 0
    gets a function returning its engine; any other rank serves its layers
    until rank 0 is done and gets None (the command then returns)."""
    from .api import load

    if not pipeline and pipeline_timeout != PIPELINE_TIMEOUT:
        raise DFlashError("--pipeline-timeout is for --pipeline runs; give --pipeline or drop it")
    check_positive(pipeline_timeout, "--pipeline-timeout", "number of seconds")  # before the processes are looked for
    dt = _dtype(dtype)  # a bad --dtype is an error before anything loads
    _not_a_count(model)

    def get(**extra):
        return load(
            model,
            draft,
            dtype=dt,
            draft_quantize=draft_quantize,
            compile=compile_,
            adapter_path=adapter_path,
            draft_vocab=draft_vocab,
            **extra,
        )

    if not pipeline:
        return get
    from .distributed import Pipeline

    engine = get(pipeline=Pipeline(timeout=pipeline_timeout))
    if engine.stage.rank != 0:
        engine.stage.serve()
        return None
    return lambda: engine


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _say_draft_hint(engine, baseline: bool = False) -> None:
    """One stderr line naming the published draft when a target was loaded without one."""
    from .loading.hub import draft_hint

    if engine.draft is None and not baseline and engine.suggested_drafts:
        typer.echo(f"mlx-dflash: {draft_hint(engine.suggested_drafts)} (pass it with -d)", err=True)


def _draft_vocab_row(draft, tokens: List[int]) -> List[tuple]:
    """A stats row for a draft restricted by --draft-vocab: its size, and how
    many of the generated tokens it could have proposed (the rest each end
    an accepted run), which says whether the restriction fits the text."""
    vocab = getattr(draft, "vocab", None)
    if vocab is None:
        return []
    keep = set(vocab.tolist())
    inside = sum(t in keep for t in tokens)
    share = f"; {inside} of the {len(tokens)} generated tokens inside it" if tokens else ""
    return [("draft vocabulary", f"{len(keep)} of {draft.target.vocab_size} tokens{share}")]


def _stats_table(s, mode: str, profile: bool = False, compiled: bool = True, extra=()) -> str:
    rows = [
        ("mode", mode),
        ("BLAS", blas.describe()),
        ("forwards", "compiled (mx.compile)" if compiled else "plain ops (--no-compile)"),
        ("width policy", s.policy),
        *extra,
        ("widths chosen (width:cycles)", " ".join(f"{w}:{c}" for w, c in s.widths.items())),
        ("shadow drafts", f"{s.shadow_drafts} (proposed during plain steps, scored, never verified)"),
        ("prompt tokens", f"{s.prompt_tokens}"),
        ("cached tokens", f"{s.cached_tokens} (restored from the prefix cache, not prefilled)"),
        ("generated tokens", f"{s.generated_tokens}"),
        ("finish reason", f"{s.finish_reason}"),
        ("cycles", f"{s.cycles}"),
        ("block size", f"{s.block_size}"),
        ("tau (tokens/cycle)", f"{s.tau:.2f}"),
        ("acceptance histogram", " ".join(f"{n}:{c}" for n, c in enumerate(s.accept_hist) if c)),
        ("acceptance by depth", " ".join(f"{a:.2f}" for a in s.depth_acceptance)),
        ("tokens verified per cycle", f"{s.mean_tree_size:.1f}"),
        ("prefill", f"{s.prefill_tps:.1f} tok/s ({s.prefill_time * 1e3:.1f} ms)"),
        ("decode", f"{s.decode_tps:.1f} tok/s ({s.decode_time * 1e3:.1f} ms)"),
    ]
    if s.cycles and not profile:
        rows.append(("time per cycle", f"{s.decode_time / s.cycles * 1e3:.2f} ms (--profile splits it)"))
    elif s.cycles:
        c = s.cycles
        rows.append(
            (
                "per cycle: draft/verify/rollback/other",
                f"{s.draft_time / c * 1e3:.2f} / {s.verify_time / c * 1e3:.2f} / "
                f"{s.rollback_time / c * 1e3:.2f} / {s.other_time / c * 1e3:.2f} ms",
            )
        )
    rows.append(("peak memory", f"{s.peak_memory:.3f} GB"))
    w = max(len(k) for k, _ in rows)
    switches = [f"  {line}" for line in s.switches]  # the width policy's reasons, one line per change
    return "\n".join([f"{k:<{w}}  {v}" for k, v in rows] + (["width switches:"] + switches if switches else []))


@app.command()
@generation_options(
    "max_tokens",
    "block_size",
    "num_draft_tokens",
    "baseline",
    *SAMPLING,
    "tree_budget",
    "tree_topk",
    "auto_tree",
    "draft_window",
    "draft_sink",
    "prefill_chunk",
    "adaptive",
    "kv_bits",
    "profile",
)
def generate(
    prompt: Optional[str] = typer.Argument(None, help="Prompt text, or '-' to read it from stdin."),
    prompt_opt: Optional[str] = typer.Option(None, "--prompt", "-p", help="Prompt text (instead of the argument)."),
    model: Optional[str] = typer.Option(
        None,
        "--model",
        "-m",
        metavar="<path>",
        help="Target folder (HF or MLX safetensors), llama.cpp GGUF file, or " + HUB_IDS + ". Default: the "
        "embedded pair shipped with the package.",
    ),
    draft: Optional[str] = typer.Option(
        None,
        "--draft",
        "-d",
        "--draft-model",
        metavar="<path>",
        help="DFlash draft folder (z-lab format), draft GGUF, or Hugging Face id (e.g. z-lab/Qwen3.5-9B-DFlash). "
        "Default: the embedded draft with the embedded target; none (plain decoding, naming the published "
        "draft when one fits) with another --model.",
    ),
    chat_template: Optional[bool] = typer.Option(
        None,
        "--chat-template/--no-chat-template",
        help="Wrap the prompt in the tokenizer's chat template (default: on when the tokenizer has one).",
        metavar="",
    ),
    ignore_chat_template: bool = typer.Option(
        False, "--ignore-chat-template", help="mlx-lm's name for --no-chat-template: use the raw prompt.", metavar=""
    ),
    chat_template_config: Optional[str] = typer.Option(
        None,
        "--chat-template-config",
        help="JSON object of extra chat-template arguments, e.g. '{\"enable_thinking\": false}'.",
    ),
    system: Optional[str] = typer.Option(
        None, "--system", "--system-prompt", help="System message (with the chat template)."
    ),
    prefill_response: Optional[str] = typer.Option(
        None,
        "--prefill-response",
        help="The start of the reply, which the model continues (with the chat template; printed output "
        "is what follows it).",
    ),
    extra_eos_token: Optional[List[str]] = EXTRA_EOS_OPTION,
    draft_quantize: Optional[int] = DRAFT_QUANTIZE_OPTION,
    draft_vocab: Optional[str] = DRAFT_VOCAB_OPTION,
    adapter_path: Optional[Path] = ADAPTER_OPTION,
    dtype: Optional[str] = DTYPE_OPTION,
    compile_: bool = COMPILE_OPTION,
    verbose: bool = typer.Option(
        False,
        "--verbose",
        "-v",
        help="Print a stats table (tau, acceptance, tok/s) to stderr, and a line per change "
        "of verify width saying why (the candidates' expected tok/s, the acceptance evidence).",
        metavar="",
    ),
    pipeline: bool = typer.Option(
        False,
        "--pipeline",
        help="Split the target's layers across the processes of an `mlx.launch` run "
        "(one contiguous stage each, balanced by weight bytes); rank 0 prints.",
        metavar="",
    ),
    pipeline_timeout: float = typer.Option(
        PIPELINE_TIMEOUT,
        "--pipeline-timeout",
        help="With --pipeline: seconds a rank waits for the previous one during "
        "a generation before ending every rank with an error.",
    ),
    prompt_cache_file: Optional[Path] = typer.Option(
        None,
        "--prompt-cache-file",
        help="Prefix snapshots file (safetensors): restore the longest cached prefix of the prompt from it "
        "if it exists, and save the snapshots of this run to it afterwards.",
    ),
    prompt_cache_bytes: Optional[int] = typer.Option(
        None,
        "--prompt-cache-bytes",
        parser=_size,
        metavar="SIZE",
        help="Memory budget of the prefix cache: bytes, or 512MB, 4GB (default: a quarter of device memory).",
    ),
    gen=None,
):
    """Generate text, streaming tokens to stdout as they are committed."""
    from .api import stream_generate

    if pipeline and prompt_cache_file:
        raise DFlashError("--prompt-cache-file does not work with --pipeline (each rank holds its own layers' state)")
    from .distributed.stage import check_pipeline_kv

    check_pipeline_kv(pipeline, gen.kv_bits)
    if prompt_cache_bytes is not None and prompt_cache_bytes <= 0:
        raise DFlashError(f"--prompt-cache-bytes must be positive, got {prompt_cache_bytes}")
    if prompt_cache_file is not None:
        writable_file(prompt_cache_file, "--prompt-cache-file")
    load_engine = _engine_loader(
        model,
        draft,
        dtype=dtype,
        draft_quantize=draft_quantize,
        draft_vocab=draft_vocab,
        adapter_path=adapter_path,
        compile_=compile_,
        pipeline=pipeline,
        pipeline_timeout=pipeline_timeout,
    )
    if load_engine is None:
        return
    if gen.profile and not verbose:
        raise DFlashError("--profile splits the time in the --verbose stats: give --verbose too, or drop it")
    if prompt_cache_bytes is not None and prompt_cache_file is None:
        raise DFlashError("--prompt-cache-bytes sizes the cache of --prompt-cache-file: give it too, or drop it")
    text = _read_prompt(prompt, prompt_opt)
    if ignore_chat_template:
        if chat_template:
            raise DFlashError("--chat-template and --ignore-chat-template contradict each other")
        chat_template = False
    for flag, value in (("--system", system), ("--prefill-response", prefill_response)):
        if chat_template is False and value is not None:
            raise DFlashError(f"{flag} needs the chat template (it is a message of the chat); drop --no-chat-template")
    if chat_template is False and chat_template_config is not None:
        raise DFlashError("--chat-template-config configures the chat template; drop it or --no-chat-template")
    template_kwargs = _template_config(chat_template_config)
    engine = load_engine()
    _say_draft_hint(engine, gen.baseline)
    _check_for_draft(gen, engine)
    _add_eos_tokens(engine, extra_eos_token)
    if chat_template is None:
        chat_template = getattr(engine.tokenizer, "chat_template", None) is not None
        given = (("--system", system), ("--prefill-response", prefill_response))
        for flag, value in given + (("--chat-template-config", chat_template_config),):
            if not chat_template and value is not None:
                raise DFlashError(f"{flag} needs the chat template, and this model's tokenizer has none")
    if not chat_template:
        template_kwargs = None
    pc = _prefix_cache(engine, prompt_cache_file, prompt_cache_bytes, gen.kv_bits) if prompt_cache_file else None
    stats, interrupted, tokens = None, False, []
    try:
        for r in _ctrl_c_stops(
            stream_generate(
                engine,
                text,
                config=gen,
                chat_template=chat_template,
                system=system,
                chat_template_config=template_kwargs,
                prefill_response=prefill_response,
                prefix_cache=pc,
            )
        ):
            sys.stdout.write(r.text)
            sys.stdout.flush()
            stats = r.stats
            tokens += r.tokens
    except KeyboardInterrupt:  # Ctrl-C: the text so far stands, and its stats and cache file are kept
        interrupted = True
        if stats is not None:
            stats.finish_reason = "interrupted"
    sys.stdout.write("\n")
    sys.stdout.flush()
    if pc is not None:
        pc.save(prompt_cache_file)
    if verbose and stats is not None:
        mode = "dflash" if engine.draft is not None and not gen.baseline else "baseline (plain decoding)"
        extra = _draft_vocab_row(engine.draft, tokens) if not gen.baseline else []
        typer.echo(_stats_table(stats, mode, gen.profile, compiled=engine.target.compiled, extra=extra), err=True)
    if interrupted:
        raise SystemExit(130)


def _ctrl_c_stops(pieces):
    """Yield from ``pieces`` until a Ctrl-C. Before the first piece (the
    prefill) it raises KeyboardInterrupt where it lands; once pieces flow it
    sets a flag checked between them, so the generation stops between two
    cycles, where its state is whole and the reply's prefix snapshot is
    taken (raised mid-cycle, it skipped the snapshot). A second Ctrl-C
    raises at once (a cycle that does not end). Main thread only, as signal
    handlers are."""
    import signal
    import threading

    hit, flowing = threading.Event(), threading.Event()

    def on_int(signum, frame):
        if hit.is_set() or not flowing.is_set():
            hit.set()
            raise KeyboardInterrupt
        hit.set()

    old = signal.signal(signal.SIGINT, on_int)
    try:
        for piece in pieces:
            flowing.set()
            yield piece
            if hit.is_set():
                raise KeyboardInterrupt
    finally:
        signal.signal(signal.SIGINT, old)


def _read_line(prompt: str) -> str:
    """One line of input, without its end. Piped, stdout holds only the
    replies (the prompt goes to stderr) and bytes are decoded line by line: a
    bad byte costs its own line, where input() decoding a whole buffered
    chunk lost the lines around it."""
    if sys.stdout.isatty():
        return input(prompt)  # readline redraws its own prompt
    sys.stderr.write(prompt)
    sys.stderr.flush()
    raw = sys.stdin.buffer.readline()
    if not raw:
        raise EOFError
    return raw.decode("utf-8").rstrip("\r\n")


def _read_message() -> tuple:
    """(text, whether it was a block): one line, or the lines from one that
    starts with three double quotes to one that ends with them (pasted code
    stays one message; the quotes are dropped). The end of input closes an
    open block; a line that is not UTF-8 refuses the whole block, after it."""
    line = _read_line(">> ")
    if not line.lstrip().startswith('"""'):
        return line, False
    body, lines, bad = line.lstrip()[3:], [], None
    while True:
        if body.rstrip().endswith('"""'):
            lines.append(body.rstrip()[:-3])
            break
        lines.append(body)
        try:
            body = _read_line(".. ")
        except EOFError:
            break
        except UnicodeDecodeError as e:
            bad, body = bad or e, ""
    if bad is not None:
        raise bad
    if len(lines) > 1 and not lines[0].strip():  # the opening quotes on a line of their own
        lines = lines[1:]
    if len(lines) > 1 and not lines[-1].strip():  # and the closing ones
        lines = lines[:-1]
    return "\n".join(lines), True


@contextlib.contextmanager
def _sigint_held():
    """Ctrl-C is ignored inside (short, must-finish work: a snapshot being
    taken); outside, it acts as before."""
    import signal

    try:
        old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread: no signals land here anyway
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def _add_eos_tokens(engine, tokens: Optional[List[str]]) -> None:
    """--extra-eos-token: each a token as the vocabulary spells it, or an id of the vocabulary."""
    for tok in tokens or ():
        vocab = engine.target.vocab_size
        if tok.strip().lstrip("-").isdigit() and not 0 <= int(tok) < vocab:
            raise DFlashError(f"--extra-eos-token {tok}: not a token id of this vocabulary (0..{vocab - 1})")
        try:
            engine.tokenizer.add_eos_token(tok)
        except ValueError:
            raise DFlashError(f"--extra-eos-token {tok!r} is not a token of this tokenizer") from None


def _prefix_cache(engine, path: Optional[Path], max_bytes: Optional[int], kv_bits: Optional[int] = None):
    """A prefix cache, loaded from ``path`` when that file exists, whose
    budget holds a snapshot (else every prompt, every chat turn, would fail)."""
    from .prefix import PrefixCache

    if max_bytes is not None and max_bytes <= 0:
        raise DFlashError(f"--prompt-cache-bytes must be positive, got {max_bytes}")
    if path is not None and Path(path).expanduser().exists():  # ~ unexpanded by the shell after --flag=
        pc = PrefixCache.load(path, engine, max_bytes=max_bytes)
    else:
        pc = PrefixCache(max_bytes=max_bytes)
    pc.check_budget(engine.target, kv_bits)
    return pc


@app.command()
@generation_options(
    "max_tokens",
    "block_size",
    "num_draft_tokens",
    "baseline",
    *SAMPLING,
    "tree_budget",
    "auto_tree",
    "prefill_chunk",
    "kv_bits",
    max_tokens=512,
)
def chat(
    model: Optional[str] = typer.Option(
        None,
        "--model",
        "-m",
        metavar="<path>",
        help="Target folder, GGUF file or " + HUB_IDS + ". Default: the embedded pair.",
    ),
    draft: Optional[str] = typer.Option(
        None,
        "--draft",
        "-d",
        "--draft-model",
        metavar="<path>",
        help="DFlash draft folder, GGUF or Hugging Face id. Default: the embedded draft with the embedded target.",
    ),
    system: Optional[str] = typer.Option(
        None, "--system", "--system-prompt", help="System message for the conversation."
    ),
    extra_eos_token: Optional[List[str]] = EXTRA_EOS_OPTION,
    draft_quantize: Optional[int] = DRAFT_QUANTIZE_OPTION,
    draft_vocab: Optional[str] = DRAFT_VOCAB_OPTION,
    adapter_path: Optional[Path] = ADAPTER_OPTION,
    dtype: Optional[str] = DTYPE_OPTION,
    compile_: bool = COMPILE_OPTION,
    chat_template_config: Optional[str] = typer.Option(
        None,
        "--chat-template-config",
        help="JSON object of extra chat-template arguments, e.g. '{\"enable_thinking\": false}'.",
    ),
    prompt_cache_file: Optional[Path] = typer.Option(
        None,
        "--prompt-cache-file",
        help="Start from the prefix snapshots in this file (if it exists), and save the conversation's to it "
        "at the end (/quit or end of input).",
    ),
    prompt_cache_bytes: Optional[int] = typer.Option(
        None,
        "--prompt-cache-bytes",
        parser=_size,
        metavar="SIZE",
        help="Memory budget of the prefix cache: bytes, or 512MB, 4GB (default: a quarter of device memory).",
    ),
    gen=None,
):
    """Chat in the terminal; each turn restores the conversation so far from the prefix cache.

    Commands: /reset (new conversation), /save FILE (write the prefix snapshots), /quit. A line that
    starts with three double quotes opens a message of several lines (pasted code), closed by a line
    that ends with them.
    """
    from .api import load
    from .session import ChatSession

    _not_a_count(model)
    if prompt_cache_file is not None:
        writable_file(prompt_cache_file, "--prompt-cache-file")
    engine = load(
        model,
        draft,
        dtype=_dtype(dtype),
        draft_quantize=draft_quantize,
        compile=compile_,
        adapter_path=adapter_path,
        draft_vocab=draft_vocab,
    )
    _say_draft_hint(engine, gen.baseline)
    _check_for_draft(gen, engine)
    _add_eos_tokens(engine, extra_eos_token)
    pc = _prefix_cache(engine, prompt_cache_file, prompt_cache_bytes, gen.kv_bits)
    if len(pc):
        typer.echo(
            f"(restored {_count(len(pc), 'snapshot')}, {pc.nbytes / 1e6:.1f} MB, from {prompt_cache_file})", err=True
        )
    session = ChatSession(
        engine, system=system, prefix_cache=pc, chat_template_config=_template_config(chat_template_config)
    )
    typer.echo(
        'Type a message (""" opens and closes one of several lines); /reset starts over, /save FILE '
        "writes the prefix cache, /quit exits (// sends a message that starts with /).",
        err=True,
    )
    interrupted, closed = False, None
    while True:
        try:
            line, block = _read_message()
        except (EOFError, KeyboardInterrupt) as e:  # end of input, or Ctrl-C at the prompt: the session ends, saved
            # The shell's prompt on a line of its own, past ours (piped: ours is on stderr,
            # and stdout holds only the replies).
            (sys.stdout if sys.stdout.isatty() else sys.stderr).write("\n")
            interrupted = isinstance(e, KeyboardInterrupt)
            break
        except UnicodeDecodeError as e:
            typer.echo(f"error: the line is not valid UTF-8 text ({e.reason} at byte {e.start})", err=True)
            continue
        if not line.strip():
            continue
        if block:  # a message as typed, whatever it starts with
            pass
        elif line.startswith("//"):
            line = line[1:]
        elif line.startswith("/"):
            cmd, _, arg = line.strip().partition(" ")
            if cmd in ("/quit", "/exit"):
                break
            if cmd == "/reset":
                session.reset()
                typer.echo("(conversation reset)", err=True)
            elif cmd == "/save" and arg.strip():
                try:
                    to = Path(arg.strip()).expanduser()
                    writable_file(to, "/save")
                    pc.save(to, engine)
                    typer.echo(f"(saved {_count(len(pc), 'snapshot')}, {pc.nbytes / 1e6:.1f} MB, to {to})", err=True)
                except (OSError, DFlashError) as e:
                    typer.echo(f"error: {e}", err=True)
            else:
                typer.echo("commands: /reset, /save FILE, /quit", err=True)
            continue
        stats, reply = None, session.stream(line, gen)
        try:
            try:
                for r in _ctrl_c_stops(reply):
                    sys.stdout.write(r.text)
                    sys.stdout.flush()
                    stats = r.stats
            except KeyboardInterrupt:  # stop this reply, keep the conversation
                pass
            sys.stdout.write("\n")
            sys.stdout.flush()
        except DFlashError as e:  # this turn (say, past the context): the session goes on
            full = "context limit" in str(e)  # only a new conversation gets past that
            typer.echo(f"error: {e}" + (" (/reset starts a new conversation)" if full else ""), err=True)
            continue
        except OSError as e:  # stdout is gone (a closed pipe) or full: end the session, its cache saved
            if e.errno not in _OUTPUT_ERRNOS:
                raise
            closed = e
            break
        finally:
            with _sigint_held():  # the reply's end-of-turn snapshot: a second Ctrl-C must not cut it
                reply.close()
        if stats is not None:
            s = stats
            typer.echo(
                f"[{s.prompt_tokens} prompt tokens: {s.cached_tokens} cached, "
                f"{s.prompt_tokens - s.cached_tokens} prefilled in {s.prefill_time * 1e3:.0f} ms | "
                f"{s.generated_tokens} generated, tau {s.tau:.2f}, {s.decode_tps:.1f} tok/s]",
                err=True,
            )
    if prompt_cache_file is not None:
        pc.save(prompt_cache_file, engine)
        typer.echo(f"(saved {_count(len(pc), 'snapshot')}, {pc.nbytes / 1e6:.1f} MB, to {prompt_cache_file})", err=True)
    if closed is not None:  # main() ends a closed pipe quietly, a full disk with its error
        raise closed
    if interrupted:  # as generate's Ctrl-C: a script can tell it from the end of its input
        raise SystemExit(130)


@app.command("train-draft")
def train_draft_cmd(
    model: str = typer.Option(
        ...,
        "--model",
        "-m",
        metavar="<path>",
        help="Target folder, GGUF file (or Hugging Face id) the draft is trained for.",
    ),
    out: Path = typer.Option(
        ..., "--out", "-o", help="Output draft folder (z-lab format); checkpoints go to OUT/checkpoint."
    ),
    corpus: Optional[List[Path]] = typer.Option(
        None, "--corpus", help="Text files, folders of them, or JSONL files (repeatable)."
    ),
    generate_from: Optional[Path] = typer.Option(
        None,
        "--generate-from",
        help="Prompt file (one per line, or JSONL): train on the target's own "
        "greedy continuations of these prompts (drafts learn best on them).",
    ),
    text_field: str = typer.Option("text", "--text-field", help="JSONL field holding the text."),
    feature_cache: Optional[Path] = typer.Option(
        None,
        "--feature-cache",
        help="Folder to keep the target features in, so reruns skip the target (default: a temporary "
        "file, removed at the end; features go to disk as they are computed, not to memory).",
    ),
    resume: bool = typer.Option(
        False,
        "--resume",
        help="Continue from OUT/checkpoint (weights, optimizer, step): a stopped run, "
        "or a finished one given more --steps.",
        metavar="",
    ),
    block_size: int = typer.Option(16, "--block-size", "-b", help="Draft block size (anchor + B-1 masks)."),
    layers: int = typer.Option(2, "--layers", help="Draft transformer layers."),
    target_layer_ids: Optional[str] = typer.Option(
        None,
        "--target-layer-ids",
        help="Comma list of target layers to read features from "
        "(default: z-lab's spread for the number of draft layers).",
    ),
    mask_token_id: Optional[int] = typer.Option(
        None, "--mask-token-id", help="Mask token (default: <|mask|> if in the vocab, else the last id)."
    ),
    seq_len: int = typer.Option(256, "--seq-len", help="Tokens per training sequence."),
    context_window: Optional[int] = typer.Option(
        None,
        "--context-window",
        help="Context positions a block attends to, in training and at inference "
        "(a sliding window on every draft layer). Default: --seq-len, the longest "
        "context training shows; 0 = unlimited.",
    ),
    batch_size: int = typer.Option(8, "--batch-size", help="Sequences per step."),
    blocks_per_seq: int = typer.Option(8, "--blocks-per-seq", help="Anchored blocks per sequence per step."),
    steps: int = typer.Option(1000, "--steps", help="Optimizer steps."),
    lr: float = typer.Option(6e-4, "--lr", help="Peak learning rate (AdamW, linear warmup then cosine)."),
    warmup: int = typer.Option(50, "--warmup", help="Warmup steps."),
    weight_decay: float = typer.Option(0.01, "--weight-decay", help="AdamW weight decay."),
    grad_clip: float = typer.Option(1.0, "--grad-clip", help="Clip the global gradient norm to this."),
    gamma: float = typer.Option(7.0, "--gamma", help="Slot k's loss weight is exp(-(k-1)/gamma)."),
    gen_tokens: int = typer.Option(192, "--gen-tokens", help="Continuation length with --generate-from."),
    checkpoint_every: int = typer.Option(
        200, "--checkpoint-every", help="Save a checkpoint every N steps (0 = never)."
    ),
    init: str = typer.Option(
        "target", "--init", help="'target': copy a target attention layer where shapes fit; 'random'."
    ),
    seed: int = typer.Option(0, "--seed", help="Seed for initialisation and anchor sampling."),
    log_every: int = typer.Option(10, "--log-every", help="Progress line every N steps."),
    arch: str = typer.Option(
        "dflash",
        "--arch",
        help="'dflash' (v1) or 'dflash2' (block convolutions and a candidate selector; also trains the selector).",
    ),
    selector_rank: int = typer.Option(32, "--selector-rank", help="DFlash 2: rank of the selector's codebooks."),
    selector_top_k: int = typer.Option(8, "--selector-top-k", help="DFlash 2: candidates per slot the selector ranks."),
    conv_kernel_size: int = typer.Option(2, "--conv-kernel-size", help="DFlash 2: taps of the block convolutions."),
    conv_group_size: Optional[int] = typer.Option(
        None,
        "--conv-group-size",
        help="DFlash 2: channels sharing one dynamic coefficient "
        "(default: 64 when it divides the hidden size, else the hidden size).",
    ),
):
    """Train a DFlash v1 or DFlash 2 draft for a target (corpus or the target's own outputs)."""
    from .train import TrainConfig, train_draft

    ids = None
    if target_layer_ids is not None:
        try:
            ids = [int(x) for x in target_layer_ids.split(",") if x.strip()]
        except ValueError:
            ids = []
        if not ids:
            raise DFlashError(f"--target-layer-ids must be a comma list of integers, got {target_layer_ids!r}")
    tc = TrainConfig(
        block_size=block_size,
        num_layers=layers,
        target_layer_ids=ids,
        mask_token_id=mask_token_id,
        seq_len=seq_len,
        context_window=context_window,
        batch_size=batch_size,
        blocks_per_seq=blocks_per_seq,
        steps=steps,
        lr=lr,
        warmup=warmup,
        weight_decay=weight_decay,
        grad_clip=grad_clip,
        gamma=gamma,
        gen_tokens=gen_tokens,
        checkpoint_every=checkpoint_every,
        init=init,
        seed=seed,
        log_every=log_every,
        arch=arch,
        selector_rank=selector_rank,
        selector_top_k=selector_top_k,
        conv_kernel_size=conv_kernel_size,
        conv_group_size=conv_group_size,
    )
    if corpus and gen_tokens != 192:  # --gen-tokens' default
        raise DFlashError("--gen-tokens is the continuation length of --generate-from; a --corpus has none")
    summary = train_draft(
        _local(model),
        out,
        corpus=corpus or None,
        generate_from=generate_from,
        text_field=text_field,
        feature_cache=feature_cache,
        resume=resume,
        config=tc,
    )
    acc = summary["final_acc"] or []
    typer.echo(
        f"wrote {out}: {summary['steps']} steps, final loss {summary['final_loss']:.3f}, "
        f"mean per-slot accuracy {sum(acc) / max(len(acc), 1):.2f}"
    )


@app.command()
@generation_options("block_size", "tree_topk", "adaptive")
def bench(
    model: Optional[str] = typer.Option(
        None,
        "--model",
        "-m",
        metavar="<path>",
        help="Target folder, GGUF or Hugging Face id (default: the embedded pair).",
    ),
    draft: Optional[str] = typer.Option(
        None,
        "--draft",
        "-d",
        metavar="<path>",
        help="Draft folder, GGUF or Hugging Face id (default: the embedded draft with the embedded target).",
    ),
    prompts: Optional[Path] = typer.Option(
        None, "--prompts", help="Folder of *.txt prompts (default: the prompt set shipped with the package)."
    ),
    max_tokens: List[int] = typer.Option([128, 512], "--max-tokens", "-n", help="Generation lengths (repeatable)."),
    repeats: int = typer.Option(
        3,
        "--repeats",
        help="Timed runs per case after one warm-up: tok/s is the median run, a speedup the median of the per-repeat ratios to the reference.",
    ),
    chat_template: bool = typer.Option(
        True,
        "--chat-template/--no-chat-template",
        help="Wrap prompts in the tokenizer's chat template (when it has one).",
        metavar="",
    ),
    out: Path = typer.Option(Path("bench/results"), "--out", help="Folder for NAME.json, NAME.md and NAME.png."),
    name: str = typer.Option("bench", "--name", help="Base name of the result files."),
    blas_mode: str = typer.Option(
        "auto",
        "--blas",
        help=blas.HELP,
    ),
    dtype: Optional[str] = DTYPE_OPTION,
    compile_: bool = COMPILE_OPTION,
    tree_budget: int = typer.Option(
        0, "--tree-budget", help="Also run DFlash with a DDTree of this many nodes; 0 = chain only."
    ),
    context: Optional[List[int]] = typer.Option(
        None,
        "--context",
        help="Also bench a prompt of this many tokens (repeatable: a context-length axis; "
        "tokens of Python's argparse.py that end where the longest row ends, so every row "
        "continues the same text), generating the first --max-tokens.",
    ),
    pipeline: bool = typer.Option(
        False,
        "--pipeline",
        help="Run under `mlx.launch`, the target split across its processes "
        "(no mlx-lm mode: plain decoding is the reference); rank 0 writes the results.",
        metavar="",
    ),
    pipeline_timeout: float = typer.Option(
        PIPELINE_TIMEOUT,
        "--pipeline-timeout",
        help="With --pipeline: seconds a rank waits for the previous one during "
        "a generation before ending every rank with an error.",
    ),
    draft2: Optional[str] = typer.Option(
        None,
        "--draft2",
        metavar="<path>",
        help="A second draft folder for the same target (e.g. a DFlash 2 head): adds the mode "
        "'dflash2', a chain on it, so both drafts' tau and tok/s sit side by side.",
    ),
    gen=None,
):
    """Benchmark mlx-lm vs plain decoding vs DFlash on a prompt set; fail if DFlash's tokens differ from plain decoding's.

    Agreement with mlx-lm is reported, not required."""
    from .benchmark import can_plot, read_prompts, run_bench, write_results

    if blas_mode not in blas.MODES:
        raise DFlashError(f"--blas must be auto, openblas or bundled, got {blas_mode!r}")
    if any(n < 1 for n in max_tokens):
        raise DFlashError("--max-tokens values must be positive")
    if any(n < 1 for n in context or ()):
        raise DFlashError("--context values must be positive")
    if tree_budget < 0:
        raise DFlashError(f"--tree-budget must be >= 0 (0: no tree mode), got {tree_budget}")
    if not name or Path(name).name != name or name in (".", ".."):
        raise DFlashError(f"--name must be a plain file name (the results go to --out), got {name!r}")
    if _FROM_COMMAND_LINE:  # never re-execute a host process (tests, notebooks)
        blas.ensure_openblas(blas_mode, argv=[sys.executable, "-m", "mlx_dflash"] + sys.argv[1:])
    with left_only_if_used(out):  # a failed run leaves no empty results folder it made
        writable_folder(out, "results folder (--out)")  # now rather than after the whole run
        with_plot = can_plot()
        if not with_plot:  # said now, not after a run of many minutes
            typer.echo(
                f"mlx-dflash: no matplotlib: {name}.png is not drawn (pip install 'mlx-dflash[bench]')", err=True
            )
        texts = read_prompts(prompts)
        load_engine = _engine_loader(
            model, draft, dtype=dtype, compile_=compile_, pipeline=pipeline, pipeline_timeout=pipeline_timeout
        )
        if load_engine is None:
            return
        typer.echo(f"BLAS: {blas.describe()}", err=True)
        engine = load_engine()
        _say_draft_hint(engine)
        if engine.draft is not None:
            gen.validate(engine.draft)
        second = None
        if draft2 is not None:
            import mlx.core as mx

            from .loading import load_draft

            # as load() does for the first: the embedded pair runs in float32
            second = load_draft(
                _local(draft2), engine.target, dtype=_dtype(dtype) or (mx.float32 if model is None else None)
            )
            second.compiled = compile_
            gen.validate(second)
        res = run_bench(
            engine,
            texts,
            max_tokens=max_tokens,
            repeats=repeats,
            block_size=gen.block_size,
            chat_template=chat_template,
            tree_budget=tree_budget,
            tree_topk=gen.tree_topk,
            log=lambda s: typer.echo(s, err=True),
            pipeline=pipeline,
            draft2=second,
            draft2_path=draft2,
            contexts=context or (),
            adaptive=gen.adaptive,
        )
        for p in write_results(res, out, name, with_plot=with_plot):
            typer.echo(f"wrote {p}")


@app.command()
def convert(
    # str, not Path: Path("./org/name") drops the "./" that says it is a path, not a Hugging Face id
    gguf_file: str = typer.Argument(
        ...,
        help="A qwen35 / qwen35moe GGUF file (llama.cpp), or a Hugging Face GGUF repo's file "
        "(org/name:QUANT or org/name/FILE.gguf).",
    ),
    out: Path = typer.Argument(..., help="Output MLX folder (safetensors, config.json, tokenizer, chat template)."),
    keep_precision: bool = typer.Option(False, "--keep-precision", help="Store every tensor as float.", metavar=""),
    bits: Optional[List[str]] = typer.Option(
        None,
        "--bits",
        help="Requantize one source type to other MLX bits, e.g. --bits Q6_K=4 (repeatable). "
        "Default: each type's own form, group 32: Q8_0 8-bit, Q4_0/Q4_1/Q4_K 4-bit, "
        "Q5_* 5-bit exactly; Q6_K, Q3_K, Q2_K, IQ* 8-bit; MXFP4 mxfp4 (docs/gguf.md).",
    ),
    dtype: Optional[str] = typer.Option(
        None,
        "--dtype",
        help="Float type of unquantized weights and of scales that it holds exactly (default: "
        "float32 for K-quant files, whose scales need it; else the file's half type, "
        "float16 for Q8_0/Q4_0-style files, float32 for all-F32 files).",
    ),
):
    """Convert a GGUF target to an MLX folder once, so later loads skip the slow decode.

    The folder is laid out as mlx_lm.convert writes one (safetensors shards and
    index, config.json with the quantization block, tokenizer files), so mlx-lm
    loads it too.
    """
    import time

    from mlx_lm.utils import save_config, save_model

    from .loading import load_tokenizer
    from .loading.gguf import load_gguf_target, tokenizer_dir_for

    bmap = {}
    for b in bits or []:
        k, _, v = b.partition("=")
        k = k.strip().upper()
        if not k or not v.isdigit() or int(v) not in (2, 3, 4, 5, 6, 8):
            raise DFlashError(f"--bits takes TYPE=BITS with BITS one of 2, 3, 4, 5, 6, 8, got {b!r}")
        if bmap.get(k, int(v)) != int(v):
            raise DFlashError(f"--bits gives {k} two values ({bmap[k]} and {v})")
        bmap[k] = int(v)
    if bmap and keep_precision:
        raise DFlashError("--keep-precision stores floats: --bits has nothing to requantize then")
    if out.exists() and not out.is_dir():
        raise DFlashError(f"output folder {out} is a file")
    if out.exists() and any(out.iterdir()):
        raise DFlashError(f"output folder is not empty: {out}")
    tic = time.perf_counter()
    # Nothing half-written: what this command wrote goes (the folder was empty), and
    # the folders it made for it, parents too.
    with left_only_if_used(out):
        writable_folder(out, "output folder")  # now, not after the whole GGUF is decoded
        try:
            gguf_file = _local(gguf_file)
            tok_dir = tokenizer_dir_for(gguf_file)
            target, cfg = load_gguf_target(
                gguf_file, keep_precision=keep_precision, bits=bmap or None, dtype=_dtype(dtype), progress=True
            )
            save_model(out, target.model)
            save_config(cfg, out / "config.json")
            load_tokenizer(tok_dir, eos_token_ids=cfg.get("eos_token_id")).save_pretrained(out)
        except BaseException:
            for child in out.iterdir():
                shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink(missing_ok=True)
            raise
    typer.echo(
        f"wrote {out} ({cfg['torch_dtype']}"
        + (f", {cfg['quantization']['bits']}-bit" if "quantization" in cfg else "")
        + f") in {time.perf_counter() - tic:.1f}s"
    )


@app.command()
def info(
    path: str = typer.Argument(  # a str: see convert
        ..., help="A target or draft folder, a GGUF file (target or draft), or " + HUB_IDS + "."
    ),
    draft: Optional[str] = typer.Option(
        None,
        "--draft",
        "-d",
        metavar="<path>",
        help="Also check whether this draft (folder, GGUF or Hugging Face id) fits the target.",
    ),
    stages: int = typer.Option(
        0,
        "--stages",
        help="Also show how --pipeline would split the target over this many processes "
        "(layers and bytes per rank; nothing is loaded).",
    ),
):
    """Describe a model folder or GGUF file: architecture, layer mix, quantization, size; and draft fit.

    Exits 1 when --draft does not fit the target, 2 for bad input."""
    from .info import describe

    if stages and stages < 2:
        raise DFlashError(f"--stages must be 2 or more, got {stages}")
    path, draft = _local(path), _local(draft)
    if draft is not None and not Path(draft).exists():  # a draft that is not there is an error, not a misfit
        raise DFlashError(f"draft path does not exist: {draft}")
    plan = None
    if stages:  # planned first: a split it cannot make is an error before any report
        from .distributed import stage_plan
        from .loading import is_draft_path

        if is_draft_path(path):
            raise DFlashError("--stages splits a target over ranks: give a target folder, not a draft folder")

        plan = stage_plan(path, stages, draft)
    text, fits = describe(path, draft)
    typer.echo(text)
    if plan is not None:
        typer.echo(plan.describe())
    if fits is False:  # a script's check: 1 as for a difference found (cmp, diff), 2 stays for bad input
        raise typer.Exit(1)


@app.command()
@generation_options(
    "max_tokens",
    *SAMPLING,
    "block_size",
    "num_draft_tokens",
    "tree_budget",
    "auto_tree",
    "prefill_chunk",
    "kv_bits",
    max_tokens=512,
)
def serve(
    model: Optional[str] = typer.Option(
        None,
        "--model",
        "-m",
        metavar="<path>",
        help="Target folder, GGUF file or " + HUB_IDS + ". Default: the embedded pair shipped with the package.",
    ),
    draft: Optional[str] = typer.Option(
        None,
        "--draft",
        "-d",
        "--draft-model",
        metavar="<path>",
        help="DFlash draft folder, GGUF or Hugging Face id. Default: the embedded draft "
        "with the embedded target; none (plain decoding) with another --model.",
    ),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind; loopback unless told otherwise."),
    port: int = typer.Option(8080, "--port", help="Port to listen on (0: any free port, said at start)."),
    api_key: Optional[str] = typer.Option(
        None,
        "--api-key",
        help="Require this key on every endpoint but /health ('Authorization: Bearer KEY' or 'x-api-key: KEY').",
    ),
    model_name: Optional[str] = typer.Option(
        None,
        "--model-name",
        help="Model id clients send and /v1/models lists (default: the --model "
        "argument, or 'mlx-dflash' for the embedded pair).",
    ),
    draft_quantize: Optional[int] = DRAFT_QUANTIZE_OPTION,
    draft_vocab: Optional[str] = DRAFT_VOCAB_OPTION,
    adapter_path: Optional[Path] = ADAPTER_OPTION,
    dtype: Optional[str] = DTYPE_OPTION,
    compile_: bool = COMPILE_OPTION,
    max_queue: int = typer.Option(64, "--max-queue", help="Requests that may wait for the engine; more get HTTP 429."),
    timeout: float = typer.Option(
        600.0, "--timeout", help="Seconds a request may take from arrival (queue + generation) before it is stopped."
    ),
    max_body_mb: float = typer.Option(
        32.0, "--max-body-mb", help="Largest request body accepted, in MiB (else HTTP 413)."
    ),
    keepalive: float = typer.Option(
        10.0,
        "--keepalive",
        metavar="SECONDS",
        help="While a streamed reply sends nothing (queued, prefilling a long prompt, a pause), send an SSE "
        "comment (': keep-alive') every this many seconds, so clients and proxies with read timeouts keep "
        "the connection; SSE parsers skip it. 0: off.",
    ),
    chat_template_args: Optional[str] = typer.Option(
        None,
        "--chat-template-args",
        help="JSON keyword arguments for the chat template, e.g. '{\"enable_thinking\": false}'; "
        "a request's chat_template_kwargs override them.",
    ),
    prompt_cache_bytes: Optional[int] = typer.Option(
        None,
        "--prompt-cache-bytes",
        parser=_size,
        metavar="SIZE",
        help="Memory budget of the shared prefix cache: bytes, or 512MB, 4GB "
        "(default: the prefix cache's own, a quarter of device memory).",
    ),
    no_prompt_cache: bool = typer.Option(
        False,
        "--no-prompt-cache",
        help="Prefill every prompt in full (no prefix cache shared across requests).",
        metavar="",
    ),
    log_level: str = typer.Option(
        "info", "--log-level", help="uvicorn/server log level: debug, info, warning, error, critical (any case)."
    ),
    allowed_origins: str = typer.Option(
        "*",
        "--allowed-origins",
        help="Comma list of origins browser clients may call from (CORS), as mlx-lm's server takes it; "
        "'*' any, '' none (no CORS headers).",
    ),
    max_batch: Optional[int] = typer.Option(
        None,
        "--max-batch",
        "--decode-concurrency",
        help="Requests decoded together in one batch (continuous batching: requests join and leave between "
        "cycles); 1 = one at a time. Default: "
        + str(DEFAULT_MAX_BATCH)
        + ", or fewer if memory (each slot's KV for the full context, its DeltaNet state and draft context) "
        "does not hold that many; a value above what memory holds is refused. "
        "(--decode-concurrency: mlx-lm's name.)",
    ),
    pipeline: bool = typer.Option(
        False,
        "--pipeline",
        help="Split the target's layers across the processes of an `mlx.launch` run; "
        "rank 0 serves HTTP, the other ranks run their stages (no prefix cache). Runs one request at a time.",
        metavar="",
    ),
    pipeline_timeout: float = typer.Option(
        PIPELINE_TIMEOUT,
        "--pipeline-timeout",
        help="With --pipeline: seconds a rank waits for the previous one during "
        "a generation before ending every rank with an error.",
    ),
    gen=None,
):
    """Serve the model over HTTP: OpenAI (/v1/chat/completions, /v1/completions, /v1/responses) and Anthropic (/v1/messages) APIs.

    The generation options are the defaults of requests that do not set their own."""
    import json

    from .server import Settings, bind, model_names
    from .server import serve as run_server

    if not 0 <= port < 65536:
        raise DFlashError(f"--port must be in 0..65535 (0: any free port), got {port}")
    if max_queue < 1:
        raise DFlashError(f"--max-queue must be positive, got {max_queue}")
    check_positive(timeout, "--timeout")
    check_positive(max_body_mb, "--max-body-mb")
    if not (keepalive >= 0 and keepalive != float("inf")):  # NaN compares false
        raise DFlashError(f"--keepalive must be a number of seconds, 0 or more (0: off), got {keepalive:g}")
    if prompt_cache_bytes is not None and prompt_cache_bytes <= 0:
        raise DFlashError(f"--prompt-cache-bytes must be positive, got {prompt_cache_bytes}")
    if no_prompt_cache and prompt_cache_bytes is not None:
        raise DFlashError("--prompt-cache-bytes sizes the prefix cache that --no-prompt-cache turns off; drop one")
    log_level = log_level.lower()
    if log_level not in ("critical", "error", "warning", "info", "debug", "trace"):
        raise DFlashError(f"--log-level must be debug, info, warning, error or critical, got {log_level!r}")
    if max_batch is not None and max_batch < 1:
        raise DFlashError(f"--max-batch must be at least 1 (1 = one request at a time), got {max_batch}")
    if pipeline and max_batch is not None and max_batch > 1:
        raise DFlashError(
            "--max-batch > 1 does not run with --pipeline (a batch needs the whole target in one process); "
            "leave --max-batch out or give 1"
        )
    try:
        template_args = json.loads(chat_template_args) if chat_template_args else {}
    except ValueError as e:
        raise DFlashError(f"--chat-template-args is not valid JSON: {e}") from None
    if not isinstance(template_args, dict):
        raise DFlashError("--chat-template-args must be a JSON object")
    if api_key is not None and not api_key.strip():
        raise DFlashError("--api-key is empty (an unset variable?): give a key, or leave the flag out")
    from .distributed.stage import check_pipeline_kv

    check_pipeline_kv(pipeline, gen.kv_bits)
    sock = bind(host, port)  # before the model loads
    mid, aliases = model_names(model)
    settings = Settings(
        model_id=model_name or mid,
        aliases=aliases if model_name is None else (mid, *aliases),
        api_key=api_key,
        max_body_bytes=int(max_body_mb * 1024 * 1024),
        max_queue=max_queue,
        timeout=timeout,
        keepalive=keepalive,
        generation=gen,
        chat_template_args=template_args,
        prompt_cache=not no_prompt_cache and not pipeline,
        prompt_cache_bytes=prompt_cache_bytes,
        max_batch=1 if pipeline else max_batch,
        allowed_origins=tuple(o.strip() for o in allowed_origins.split(",") if o.strip()),
    )
    get_engine = _engine_loader(
        model,
        draft,
        dtype=dtype,
        draft_quantize=draft_quantize,
        draft_vocab=draft_vocab,
        adapter_path=adapter_path,
        compile_=compile_,
        pipeline=pipeline,
        pipeline_timeout=pipeline_timeout,
    )
    if get_engine is None:
        sock.close()
        return
    generate_fn = _pipeline_server(get_engine().stage, no_prompt_cache) if pipeline else None

    def load_engine():
        engine = get_engine()
        _say_draft_hint(engine)
        _check_for_draft(gen, engine)
        if gen.max_tokens > engine.target.max_context:  # else every request without max_tokens gets a 400
            raise DFlashError(
                f"--max-tokens {gen.max_tokens} is more than this model's context ({engine.target.max_context} tokens)"
            )
        return engine

    try:
        run_server(settings, load_engine, host=host, log_level=log_level, generate_fn=generate_fn, sock=sock)
    except (DFlashError, KeyboardInterrupt) as e:
        if not _FROM_COMMAND_LINE:
            raise
        # The engine thread has run MLX, or is loading the model still (a
        # Ctrl-C during the load): the interpreter's teardown would then abort
        # in MLX's C++ destructors ("terminate called ...").
        if isinstance(e, DFlashError):
            typer.echo(f"error: {e}", err=True)
        _exit_now(2 if isinstance(e, DFlashError) else 130)
    if _FROM_COMMAND_LINE and threading.active_count() > 1:  # the engine thread still loading at Ctrl-C
        _exit_now(0)


def _exit_now(code: int) -> None:
    """Exit without the interpreter's teardown (see serve), output flushed."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _pipeline_server(stage, no_prompt_cache: bool):
    """Rank 0 serving a pipeline: the server's generate function, which ends
    the server when a rank is lost, and a SIGTERM handler that releases the others."""
    import signal

    from .api import stream_generate

    if not no_prompt_cache:
        typer.echo("mlx-dflash: --pipeline: prefix cache off (each rank holds only its own layers' state)", err=True)

    def generate_fn(engine, prompt, **kwargs):
        # A lost rank leaves the ring unusable: end the server (like the watchdog) rather than fail requests.
        try:
            yield from stream_generate(engine, prompt, **kwargs)
        except DFlashError as e:
            if stage.link.broken:
                sys.stderr.write(f"error: {e}; stopping the server\n")
                sys.stderr.flush()
                os._exit(2)
            raise

    def stop(*_):
        # uvicorn re-raises SIGTERM after its graceful shutdown: release the
        # other ranks (Stage.close), flush, and exit 0 without the
        # interpreter's teardown, which now and then (about 1 run in 20)
        # aborted in MLX's C++ destructors on rank 0 after everything was done.
        stage.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    return generate_fn


def _bundled_bench(args: List[str]) -> bool:
    """Whether a command line is ``bench ... --blas bundled``."""
    if "bench" not in args:
        return False
    after = args[args.index("bench") + 1 :]
    return "--blas=bundled" in after or any(a == "--blas" and b == "bundled" for a, b in zip(after, after[1:]))


def main(argv: Optional[List[str]] = None) -> None:
    """Entry point: user errors print one line and exit 2, no traceback.

    Run from the command line (``argv`` None) on Linux, every command first
    re-executes itself with OpenBLAS preloaded when it is installed (see
    blas.py); ``--verbose`` and bench results say which BLAS ran."""
    global _FROM_COMMAND_LINE
    _FROM_COMMAND_LINE = argv is None
    if argv is None:
        from . import blas

        # bench --blas bundled asks for the reference BLAS: preloading OpenBLAS
        # here, for bench to re-execute without it, would go round forever.
        mode = "bundled" if _bundled_bench(sys.argv[1:]) else "auto"
        blas.ensure_openblas(mode, argv=[sys.executable, "-m", "mlx_dflash"] + sys.argv[1:])
    import warnings

    from .loading.hub import DraftHint

    try:
        with warnings.catch_warnings():  # the commands print load()'s draft hint as one line of their own
            warnings.simplefilter("ignore", DraftHint)
            code = app(args=argv, standalone_mode=False, prog_name="mlx-dflash")
    except DFlashError as e:
        typer.echo(f"error: {e}", err=True)
        raise SystemExit(2)
    except typer.TyperException as e:  # what the command line parser refused: one line too
        ctx = getattr(e, "ctx", None)
        if type(e).__name__ == "NoArgsIsHelpError" and ctx is not None:  # a bare command: its help
            typer.echo(ctx.get_help(), err=True)
        else:
            where = ctx.command_path if ctx is not None else "mlx-dflash"
            words = sys.argv[1:] if argv is None else argv
            commands = typer.main.get_command(app).commands
            if where == "mlx-dflash" and words and words[0] in commands:  # an option's value missing
                where = f"mlx-dflash {words[0]}"
            flag = getattr(e, "option_name", "")
            if flag in _MLX_LM_FLAGS:  # an mlx-lm flag this engine does not take: say what to give instead
                typer.echo(
                    f"error: {flag} is an mlx-lm flag this engine does not take: {_MLX_LM_FLAGS[flag]} (see {where} --help)",
                    err=True,
                )
                raise SystemExit(2)
            typer.echo(f"error: {e.format_message()} (see {where} --help)", err=True)
        raise SystemExit(2)
    except (KeyboardInterrupt, typer.Abort):
        raise SystemExit(130)
    except OSError as e:  # the output could not be written: a closed pipe ends quietly, a full disk says so
        if e.errno not in _OUTPUT_ERRNOS:
            raise
        try:  # so that the interpreter's last flush of stdout does not fail again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        if e.errno != errno.EPIPE:
            typer.echo(f"error: cannot write the output: {e.strerror}", err=True)
        raise SystemExit(1)
    raise SystemExit(code if isinstance(code, int) else 0)  # typer.Exit(code) comes back as the code


if __name__ == "__main__":
    main()
