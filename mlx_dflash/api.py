"""Python API in the style of mlx-lm: load, generate, stream_generate."""

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Sequence, Union

import mlx.core as mx

from .config import GenerationConfig
from .decode import GenerationStats, generate_tokens
from .detokenize import Detokenizer
from .errors import DFlashError, check_text, token_ids
from .loading import (
    check_adapter_fit,
    check_draft_fit,
    draft_vocab_ids,
    load_draft,
    load_target,
    load_tokenizer,
    tokenizer_folder,
)
from .loading.hub import DraftHint, draft_hint, resolve, suggest_draft

DEFAULT_MODEL_DIR = Path(__file__).parent / "default_model"
DEFAULT_MODEL = DEFAULT_MODEL_DIR / "target"
DEFAULT_DRAFT = DEFAULT_MODEL_DIR / "draft"


DTYPES = ("float32", "bfloat16", "float16")


def dtype_of(value, what: str = "dtype"):
    """A float dtype given as an mx.Dtype or by name ("float32", "bfloat16",
    "float16"); None stays None. Anything else is one error naming ``what``."""
    if value is None or isinstance(value, mx.Dtype) and value in tuple(getattr(mx, n) for n in DTYPES):
        return value
    if isinstance(value, str) and value in DTYPES:
        return getattr(mx, value)
    raise DFlashError(f"{what} must be one of {', '.join(DTYPES)}, got {value!r}")


@dataclass
class Engine:
    """A loaded target (+ optional draft) and its tokenizer; made by :func:`load`.

    In a pipeline, ``stage`` is this rank's :class:`~mlx_dflash.distributed.Stage`:
    on rank 0 the engine generates as any other (``target`` is the whole
    pipeline as the decode loop sees it); a rank > 0 holds only its layers
    (no tokenizer, no draft) and runs ``stage.serve()``.
    """

    target: object
    tokenizer: object
    draft: Optional[object] = None
    model_path: Optional[Path] = None
    draft_path: Optional[Path] = None
    # Loaded without a draft: the published DFlash draft(s) that fit the target (hub ids).
    suggested_drafts: List[str] = field(default_factory=list)
    stage: Optional[object] = None
    adapter_path: Optional[Path] = None  # fine-tuning adapters applied to the target

    def config(self, config: Optional[GenerationConfig] = None, **options) -> GenerationConfig:
        """``config`` with keyword ``options`` on top (:meth:`GenerationConfig.build`),
        and what depends on this engine's tokenizer filled in: the tokens XTC
        never cuts, as mlx-lm picks them (newline and EOS), unless given."""
        c = GenerationConfig.build(config, **options)
        tok = self.tokenizer
        if c.xtc_probability and not c.xtc_special_tokens and tok is not None:
            c = c.update(
                xtc_special_tokens=tuple(tok.encode("\n", add_special_tokens=False)) + tuple(tok.eos_token_ids)
            )
        return c

    def encode(
        self,
        prompt: Union[str, Sequence[int]],
        *,
        chat_template: bool = False,
        system: Optional[str] = None,
        chat_template_config: Optional[dict] = None,
        prefill_response: Optional[str] = None,
    ) -> List[int]:
        """Token ids for ``prompt`` (ids pass through); optionally via the chat template,
        with ``chat_template_config`` as extra template arguments (e.g. enable_thinking).
        ``prefill_response``: the start of the reply, which the model continues (as
        mlx-lm's ``--prefill-response``: the template renders it as the last assistant
        message, left open)."""
        check_template_args(system, chat_template_config)
        if prefill_response is not None and not isinstance(prefill_response, str):
            raise DFlashError(f"prefill_response must be text, got {type(prefill_response).__name__}")
        if not isinstance(prompt, str):
            # (chat_template_config may say how the ids were rendered: the prefix cache reads it)
            if chat_template or system or prefill_response is not None:
                raise DFlashError(
                    "a prompt of token ids is used as given: chat_template, system and prefill_response apply to text"
                )
            return token_ids(prompt)
        if (system or chat_template_config or prefill_response is not None) and not chat_template:
            raise DFlashError(
                "system, chat_template_config and prefill_response are parts of the chat template: "
                "give chat_template=True"
            )
        if not prompt:  # (whitespace is a prompt: a blank line or an indent starts code)
            raise DFlashError("empty prompt: give some text")
        check_text(prompt, "the prompt")
        if system:
            check_text(system, "the system prompt")
        if prefill_response:
            check_text(prefill_response, "the prefilled response")
        if chat_template:
            if getattr(self.tokenizer, "chat_template", None) is None:
                raise DFlashError("this model's tokenizer has no chat template; use --no-chat-template")
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": prompt}
            ]
            if prefill_response is not None:
                messages.append({"role": "assistant", "content": prefill_response})
            return list(
                render_chat(
                    self.tokenizer,
                    messages,
                    add_generation_prompt=prefill_response is None,
                    continue_final_message=prefill_response is not None,
                    tokenize=True,
                    **(chat_template_config or {}),
                )
            )
        # As mlx-lm encodes a raw prompt: with what the tokenizer adds (a BOS where its model takes one).
        return list(self.tokenizer.encode(prompt))


def render_chat(tokenizer, messages: List[dict], **kwargs):
    """``tokenizer.apply_chat_template``, its failures one error: a model's
    template may refuse a conversation (Qwen's call ``raise_exception``), hold
    a syntax error, or not be text at all (a GGUF's value of another type)."""
    try:
        return tokenizer.apply_chat_template(messages, **kwargs)
    except Exception as e:
        raise DFlashError(
            f"the model's chat template failed: {type(e).__name__}: {e} (--no-chat-template sends the text as it is)"
        ) from None


def load(
    model: Union[str, Path, None] = None,
    draft: Union[str, Path, None] = None,
    *,
    dtype: Optional[mx.Dtype] = None,
    draft_quantize: Optional[int] = None,
    draft_dtype: Optional[mx.Dtype] = None,
    compile: bool = True,
    pipeline=None,
    adapter_path: Union[str, Path, None] = None,
    draft_vocab=None,
) -> Engine:
    """Load a target (folder, or a llama.cpp GGUF file) and, optionally, its DFlash draft (folder or GGUF).

    ``model`` and ``draft`` are local paths or Hugging Face Hub ids: ``org/name``,
    ``org/name@revision``, and for a GGUF repo ``org/name:QUANT`` or
    ``org/name/FILE.gguf`` (fetched into the Hugging Face cache, or read from it
    offline; see :mod:`mlx_dflash.loading.hub`). A path that exists wins.
    With no ``model`` the embedded default pair is loaded (target and draft, as float32).
    A target loaded without a draft for which a published DFlash draft exists
    gets ``suggested_drafts`` and a :class:`~mlx_dflash.loading.hub.DraftHint` warning.
    ``dtype`` casts float weights (``mx.float32`` or "float32" on a CPU; also
    bfloat16, float16);
    ``draft_quantize`` = 4 or 8 quantizes the draft at load.
    ``compile`` (default): decode-time forwards run as ``mx.compile``'d
    pieces (same results, fewer dispatches); False runs plain MLX ops.
    ``pipeline`` (True or a :class:`~mlx_dflash.distributed.Pipeline`): call on
    every rank of an ``mlx.launch`` run; each loads only its stage of the
    target's layers (``Engine.stage``). Rank 0 also loads the tokenizer and
    the draft and generates; the other ranks call ``engine.stage.serve()``.
    ``adapter_path``: a folder of fine-tuning adapters as mlx-lm's lora
    trainer writes it (LoRA, DoRA or full; ``adapter_config.json`` and
    ``adapters.safetensors``), applied to the target as ``mlx_lm.load(...,
    adapter_path=...)`` applies it. The draft is used as given: one trained
    for the base target proposes for the adapted one (the output is the
    adapted target's either way; acceptance may be lower).
    ``draft_vocab``: the draft proposes only among these tokens: a count N
    (the N lowest ids), a file of ids or a list of them, and the tokenizer's
    added tokens always. It reads only those rows of the head, which on a
    large vocabulary is most of a draft forward; the output is unchanged
    (docs/performance.md#draft-vocabulary).
    """
    name = str(model) if model is not None else ""
    dtype, draft_dtype = dtype_of(dtype), dtype_of(draft_dtype, "draft_dtype")
    if model is None:
        model = DEFAULT_MODEL
        if draft is None:
            draft = DEFAULT_DRAFT
        # Stored in float16 to keep the package small; float32 is exact and fast on every backend.
        dtype = dtype or mx.float32
    model, draft = resolve(model), resolve(draft)
    if draft_vocab is not None:
        if draft is None:
            raise DFlashError("draft_vocab (--draft-vocab) restricts a draft: give one")
        draft_vocab_ids(draft_vocab, None)  # a bad count, file or id fails before the weights load
    if adapter_path is not None:
        adapter_path = check_adapter_fit(adapter_path, model)  # before a load the adapters would not fit anyway
    stage, tok_dir = None, None
    if pipeline:
        from .distributed import Pipeline, load_stage

        stage = load_stage(
            model,
            draft,
            dtype=dtype,
            pipeline=pipeline if isinstance(pipeline, Pipeline) else None,
            adapter_path=adapter_path,
        )
        target = stage.target
        if stage.rank != 0:  # its layers only: it serves rank 0
            set_compiled(target, None, compile)
            return Engine(target, None, model_path=Path(model), stage=stage, adapter_path=adapter_path)
    else:
        tok_dir = tokenizer_folder(model)  # a GGUF's tokenizer is checked before its weights are decoded
        if draft is not None:
            check_draft_fit(draft, model)  # and the draft's files and its fit
        target = load_target(model, dtype=dtype, progress=True, adapter_path=adapter_path)
    eos = target.config.get("eos_token_id", target.config.get("text_config", {}).get("eos_token_id"))
    tokenizer = load_tokenizer(tok_dir or tokenizer_folder(model), eos_token_ids=eos)
    d = None
    if draft is not None:
        d = load_draft(draft, target, quantize_bits=draft_quantize, dtype=draft_dtype or dtype)
        if draft_vocab is not None:
            keep = set(tokenizer.eos_token_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
            try:
                d.restrict_vocab(draft_vocab_ids(draft_vocab, target.vocab_size, keep))
            except ValueError as e:  # a pipeline stage without the head
                raise DFlashError(f"draft_vocab (--draft-vocab): {e}") from None
    set_compiled(target, d, compile)
    engine = Engine(
        target, tokenizer, d, Path(model), Path(draft) if draft else None, stage=stage, adapter_path=adapter_path
    )
    if stage is not None:
        stage.load_peak_memory = mx.get_peak_memory() / 1e9
    if d is None:
        engine.suggested_drafts = suggest_draft(target.config, name)
        if engine.suggested_drafts:
            warnings.warn(draft_hint(engine.suggested_drafts), DraftHint, stacklevel=2)
    return engine


def check_template_args(system, chat_template_config) -> None:
    """One clear error for a system prompt that is not text, or template
    arguments that are not a dict (else the template fails deep inside)."""
    if system is not None and not isinstance(system, str):
        raise DFlashError(f"system must be text, got {type(system).__name__}")
    if system:
        check_text(system, "the system prompt")
    if chat_template_config is not None and not isinstance(chat_template_config, dict):
        raise DFlashError(
            "chat_template_config must be a dict of template arguments (e.g. {'enable_thinking': False}), "
            f"got {type(chat_template_config).__name__}"
        )


def check_engine(engine, prefix_cache=None) -> None:
    """One clear error for an engine or prefix cache that is not one."""
    if not isinstance(engine, Engine):
        raise DFlashError(f"engine must be an Engine (mlx_dflash.load() gives one), got {type(engine).__name__}")
    check_prefix_cache(prefix_cache)


def check_prefix_cache(prefix_cache) -> None:
    from .prefix import PrefixCache

    if prefix_cache is not None and not isinstance(prefix_cache, PrefixCache):
        raise DFlashError(f"prefix_cache must be a mlx_dflash.PrefixCache, got {type(prefix_cache).__name__}")


def set_compiled(target, draft, on: bool) -> None:
    """Compiled (default) or plain-ops decode-time forwards for a pair."""
    target.compiled = on
    if draft is not None:
        draft.compiled = on


@dataclass
class GenerationResponse:
    """One streamed step: the text and token ids committed in it (a drafted
    cycle commits several). ``stats`` is the generation's, live (it ends as
    the final counts in every response); the fields after it are mlx-lm's
    response fields, as they stood when this step was yielded."""

    text: str
    tokens: List[int]
    stats: GenerationStats
    finish_reason: Optional[str] = None
    prompt_tokens: int = 0
    prompt_tps: float = 0.0  # prefilled tokens per second (restored ones not counted)
    generation_tokens: int = 0  # generated so far, this step's included
    generation_tps: float = 0.0  # tokens after the first per second since it (mlx-lm's counts the first too)
    peak_memory: float = 0.0  # GB
    # No ``token``: a step commits ``tokens`` (several after a drafted cycle);
    # code that read mlx-lm's one token per step fails here rather than drop some.


@dataclass
class GenerationResult:
    text: str
    tokens: List[int] = field(default_factory=list)
    stats: GenerationStats = field(default_factory=GenerationStats)

    def __str__(self) -> str:
        return self.text


def stream_generate(
    engine: Engine,
    prompt: Union[str, Sequence[int]],
    config: Optional[GenerationConfig] = None,
    *,
    chat_template: bool = False,
    system: Optional[str] = None,
    chat_template_config: Optional[dict] = None,
    prefill_response: Optional[str] = None,
    prefix_cache=None,
    prompt_progress_callback: Optional[Callable[[int, int], None]] = None,
    **options,
) -> Iterator[GenerationResponse]:
    """Yield text pieces as tokens are committed; ``stats`` is live.

    ``config``: a :class:`~mlx_dflash.GenerationConfig`; keyword ``options``
    (its field names: ``max_tokens``, ``temperature``, ``top_p``, ``top_k``,
    ``min_p``, ``min_tokens_to_keep``, ``repetition_penalty``,
    ``repetition_context_size``, ``xtc_probability``, ``xtc_threshold``,
    ``xtc_special_tokens``, ``seed``, ``block_size``, ``baseline``,
    ``adaptive``, ``tree_budget``, ``tree_topk``, ``auto_tree``,
    ``draft_window``, ``kv_bits``, ``prefill_chunk``, ``profile``,
    ``accept_rule``, ``max_context``) override it.

    ``baseline=True`` (or an engine without a draft) decodes plainly through
    the same loop. At temperature 0 the tokens equal plain greedy decoding.
    At temperature > 0 the output distribution is exactly the target's
    (see ``accept_rule``).
    ``tree_budget`` > 0 verifies a DDTree of that many draft nodes
    (``tree_topk`` candidates per depth) instead of a chain; ``auto_tree`` > 0
    lets the adaptive policy choose per cycle between a chain and such a tree.
    ``profile=True`` synchronises after each phase so ``stats`` splits the
    time into draft / verify / rollback (slower).
    ``accept_rule`` (temperature > 0, chain; default
    ``sampling.DEFAULT_ACCEPT_RULE``): "speculative": the draft
    samples its block and a token is kept with probability min(1, p/q), the
    first rejection resampling from the residual; "equality": the
    draft's greedy block, kept where it equals the target's keyed sample.
    Both give exactly the target's distribution; only "equality" gives the
    same text for a seed in every mode (plain, chain, tree).
    ``chat_template``, ``system``, ``chat_template_config``, ``prefill_response``:
    how a text prompt becomes ids (:meth:`Engine.encode`).
    ``prefix_cache``: a :class:`~mlx_dflash.PrefixCache`; the longest cached
    prefix of the prompt is restored instead of prefilled (``stats.cached_tokens``)
    and this request's prompt and reply are snapshotted into it.
    ``prompt_progress_callback(processed, total)``: prefill progress, as
    mlx-lm's (after each chunk, then ``(total, total)``); an exception it
    raises stops the generation before its first token.
    ``adaptive`` (default on): each cycle's verify width is chosen from the
    pair's measured costs and the acceptance so far, down to plain steps;
    ``block_size`` / ``tree_budget`` pin it. ``kv_bits`` 8 or 4 stores the
    target's attention K/V quantized (not lossless w.r.t. the full-precision target).
    """
    check_engine(engine, prefix_cache)
    if prompt_progress_callback is not None and not callable(prompt_progress_callback):
        raise DFlashError(
            "prompt_progress_callback must be a function of (processed, total), "
            f"got {type(prompt_progress_callback).__name__}"
        )
    config = engine.config(config, **options)
    ids = engine.encode(
        prompt,
        chat_template=chat_template,
        system=system,
        chat_template_config=chat_template_config,
        prefill_response=prefill_response,
    )
    if prefix_cache is not None:
        prefix_cache.bind(engine)
    tok = engine.tokenizer
    detok = Detokenizer(tok)
    stats = GenerationStats()
    try:
        for tokens in generate_tokens(
            engine.target,
            ids,
            config,
            draft=engine.draft,
            eos_token_ids=tok.eos_token_ids,
            stats=stats,
            prefix_cache=prefix_cache,
            prompt_progress_callback=prompt_progress_callback,
            prefix_boundary=(
                prefix_cache.stable_boundary(tok, ids, chat_template_config) if prefix_cache is not None else None
            ),
        ):
            for t in tokens:
                if t not in tok.eos_token_ids:
                    detok.add_token(t)
            if stats.finish_reason is not None:
                detok.finalize()
            yield GenerationResponse(
                detok.last_segment,
                tokens,
                stats,
                stats.finish_reason,
                prompt_tokens=stats.prompt_tokens,
                prompt_tps=stats.prefill_tps,
                generation_tokens=stats.generated_tokens,
                generation_tps=stats.decode_tps,
                peak_memory=stats.peak_memory,
            )
    finally:
        if engine.stage is not None:  # the other stages apply the last rollback, then wait unbounded
            engine.stage.sync()


def generate(
    engine: Engine,
    prompt: Union[str, Sequence[int]],
    config: Optional[GenerationConfig] = None,
    *,
    verbose: bool = False,
    **kwargs,
) -> GenerationResult:
    """Generate to completion; returns text, token ids and stats.

    Takes the arguments of :func:`stream_generate`. ``verbose``: print the
    text as it comes and then the counts, as mlx-lm's ``generate`` does
    (with the tokens per cycle and the widths chosen).
    """
    pieces = stream_generate(engine, prompt, config, **kwargs)
    if not verbose:
        return collect(pieces)
    print("=" * 10)
    result = collect(_echo(pieces))
    print("\n" + "=" * 10)
    s = result.stats
    restored = f" ({s.cached_tokens} restored from the prefix cache)" if s.cached_tokens else ""
    print(f"Prompt: {s.prompt_tokens} tokens{restored}, {s.prefill_tps:.3f} tokens-per-sec")
    print(f"Generation: {s.generated_tokens} tokens, {s.decode_tps:.3f} tokens-per-sec")
    if s.cycles:
        widths = " ".join(f"{w}:{n}" for w, n in s.widths.items())
        print(f"Tokens per cycle: {s.tau:.2f} (widths {widths}; 1 = plain steps)")
    print(f"Peak memory: {s.peak_memory:.3f} GB")
    return result


def _echo(pieces):
    for r in pieces:
        print(r.text, end="", flush=True)
        yield r


def collect(pieces) -> GenerationResult:
    """Join streamed pieces into one result."""
    text, tokens, stats = [], [], None
    for r in pieces:
        text.append(r.text)
        tokens.extend(r.tokens)
        stats = r.stats
    return GenerationResult("".join(text), tokens, stats)
