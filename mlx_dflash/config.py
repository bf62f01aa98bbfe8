"""One generation's options (sampling, speculation, limits) and their checks.

The Python API, the CLI and the server all build a :class:`GenerationConfig`
and the decode loop validates it once against the draft it runs with; a new
option is a field here (and, for the command line, a flag in cli.py's group).
"""

import numbers
from dataclasses import dataclass, fields, replace
from typing import List, Optional, Sequence, Tuple

from .errors import DFlashError, is_int
from .sampling import ACCEPT_RULES, DEFAULT_ACCEPT_RULE, SAMPLER_OPTIONS, Sampler

NOT_LOADED = object()  # validate() before the engine is loaded
# A tree commits at most the draft's block of tokens, whatever its size, while its
# verify grows with every node (and its masks with the square): far past any budget
# that pays, and short of one that exhausts memory.
MAX_TREE_NODES = 1024
TREE_TOPK = 4  # candidates per depth a tree takes by default
# The fields a server request may set (by the same name in its body).
SAMPLING = tuple(n for n in SAMPLER_OPTIONS if n != "xtc_special_tokens") + ("seed", "accept_rule")
# mlx-lm's generate() keywords with no field of that name, and what to give instead.
MLX_LM_NAMES = {
    "temp": "temp is make_sampler's name; give temperature",
    "sampler": "sampler: give the sampling fields (temperature, top_p, top_k, min_p); exact speculative "
    "sampling needs the distribution they define, not a callable",
    "logits_processors": "logits_processors: give repetition_penalty and repetition_context_size; exact "
    "speculative sampling needs the distribution they define, not a callable",
    "prompt_cache": "prompt_cache: give prefix_cache=mlx_dflash.PrefixCache()",
    "draft_model": "draft_model: give the draft to load(model, draft)",
    "num_draft_tokens": "num_draft_tokens N: give block_size=N + 1",
    "max_kv_size": "max_kv_size: a rotating KV cache is not implemented (mlx-lm ignores it for Qwen3.5 models, "
    "whose make_cache builds their caches); kv_bits=8 or 4 shrinks the KV",
    "prefill_step_size": "prefill_step_size N: give prefill_chunk=N",
    "kv_group_size": "kv_group_size: the quantized KV's group size is 64 (give kv_bits)",
    "quantized_kv_start": "quantized_kv_start: the KV is quantized from the first token (give kv_bits)",
}
# Each option's kind, checked before its range: a string, a float where a count
# belongs or NaN would otherwise fail deep inside (or never stop).
_INTS = ("top_k", "min_tokens_to_keep", "repetition_context_size", "tree_budget", "tree_topk", "auto_tree")
_INTS += ("prefill_chunk", "max_tokens")
_OPTIONAL_INTS = ("seed", "block_size", "kv_bits", "max_context")
_NUMBERS = ("temperature", "top_p", "min_p", "repetition_penalty", "xtc_probability", "xtc_threshold")
_BOOLS = ("baseline", "adaptive", "profile")


@dataclass(frozen=True, kw_only=True)  # fields by name: GenerationConfig(0.7) set a temperature
class GenerationConfig:
    # --- sampling (mlx-lm's names; temperature 0 = greedy) ---
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    min_tokens_to_keep: int = 1
    repetition_penalty: float = 1.0
    repetition_context_size: int = 20
    xtc_probability: float = 0.0  # XTC: how often to cut the likeliest tokens (0 = off)
    xtc_threshold: float = 0.1
    # Tokens XTC never cuts; empty: the engine fills in mlx-lm's (newline and EOS).
    xtc_special_tokens: Tuple[int, ...] = ()
    seed: Optional[int] = None
    accept_rule: str = DEFAULT_ACCEPT_RULE
    # --- speculation ---
    block_size: Optional[int] = None  # None: the draft's (or the adaptive policy's choice)
    baseline: bool = False  # plain decoding even when a draft is loaded
    adaptive: bool = True
    tree_budget: int = 0
    tree_topk: int = TREE_TOPK
    auto_tree: int = 0
    draft_window: Optional[Tuple[int, int]] = None  # (sink, window) of the draft cache
    kv_bits: Optional[int] = None  # the target's attention KV for this generation
    prefill_chunk: int = 512
    profile: bool = False
    # --- limits ---
    max_tokens: int = 256
    max_context: Optional[int] = None  # None: the target's

    @classmethod
    def names(cls) -> Tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def update(self, **options) -> "GenerationConfig":
        """A copy with ``options`` set; an unknown name is an error (not silently dropped)."""
        unknown = sorted(set(options) - set(self.names()))
        if unknown:
            hints = [MLX_LM_NAMES[u] for u in unknown if u in MLX_LM_NAMES]
            raise DFlashError(
                f"unknown generation option(s): {', '.join(unknown)}" + (f" ({'; '.join(hints)})" if hints else "")
            )
        return replace(self, **options) if options else self

    @classmethod
    def build(cls, config: Optional["GenerationConfig"] = None, **options) -> "GenerationConfig":
        """``config`` (default: the defaults) with keyword ``options`` overriding it."""
        if config is not None and not isinstance(config, GenerationConfig):
            raise DFlashError(
                f"config must be a GenerationConfig (or None), got {type(config).__name__}; "
                "give options by keyword, e.g. max_tokens=64"
            )
        return (config if config is not None else cls()).update(**options)

    def check_types(self) -> None:
        """Each option of its kind: counts are integers, sampling values real numbers."""

        def bad(name, want):
            v = getattr(self, name)
            raise DFlashError(f"{name} must be {want}, got {v!r} ({type(v).__name__})")

        for name in _INTS:
            if not is_int(getattr(self, name)):
                bad(name, "an integer")
        for name in _OPTIONAL_INTS:
            v = getattr(self, name)
            if v is not None and not is_int(v):
                bad(name, "an integer (or None)")
        for name in _NUMBERS:
            v = getattr(self, name)
            if not isinstance(v, numbers.Real) or isinstance(v, bool):
                bad(name, "a number")
        for name in _BOOLS:
            if not isinstance(getattr(self, name), bool):
                bad(name, "True or False")
        if not isinstance(self.accept_rule, str):
            bad("accept_rule", "a string")
        x = self.xtc_special_tokens
        if not isinstance(x, (tuple, list)) or not all(is_int(t) for t in x):
            bad("xtc_special_tokens", "a tuple of token ids")
        w = self.draft_window
        if w is not None and not (isinstance(w, (tuple, list)) and len(w) == 2 and all(is_int(x) for x in w)):
            bad("draft_window", "None or two integers (sink, window)")

    def with_request(self, request, max_tokens: int) -> "GenerationConfig":
        """A copy with a server request's sampling fields (those it sets, by name) and ``max_tokens``."""
        options = {"max_tokens": max_tokens}
        for name in SAMPLING:
            value = getattr(request, name, None)
            if value is not None:
                default = getattr(self, name)
                options[name] = type(default)(value) if isinstance(default, (int, float)) else value
        return self.update(**options)

    def sampler(self) -> Sampler:
        """The sampler these options describe. Greedy needs no seed: none is drawn
        (drawing one would move MLX's global random state)."""
        seed = 0 if self.seed is None and self.temperature == 0 else self.seed
        return Sampler(**self.sampler_options(), seed=seed)

    def sampler_options(self) -> dict:
        """The sampler's filter options (seed apart), by the names :class:`Sampler` takes."""
        return {name: getattr(self, name) for name in SAMPLER_OPTIONS}

    def refuse_unused(self, per_request: bool = False, drafting: Sequence[str] = (), tree_budget: int = 0) -> None:
        """Fields that shape drafting set where nothing they shape runs, a
        :class:`DFlashError` naming them. The CLI's check: a flag typed that
        would do nothing is a mistake, where a config in Python may carry
        them on purpose (``baseline=True`` on a base config to compare).
        ``per_request``: defaults that each request may override (a server):
        ``auto_tree`` then serves the requests that leave the width to the policy.
        ``drafting``: names of other options given that shape only the draft
        (the CLI's load flags), refused alike under ``baseline``;
        ``tree_budget``: a tree the caller runs apart from this config (``bench``'s)."""
        if self.baseline:
            given = list(drafting) + self.drafting_given()
            if given:
                raise DFlashError(
                    f"baseline (--baseline) decodes without a draft: {' and '.join(given)} would do nothing; drop one"
                )
        if self.tree_topk != TREE_TOPK and not (self.tree_budget or self.auto_tree or tree_budget):
            raise DFlashError(
                "tree_topk (--tree-topk) shapes a tree: give tree_budget (--tree-budget) or auto_tree "
                "(--auto-tree) too, or drop it"
            )
        if self.auto_tree and not per_request:
            # The policy considers a tree only while it chooses widths itself.
            why = (
                "block_size (--block-size) pins the width"
                if self.block_size is not None
                else "adaptive=False (--no-adaptive) pins the width"
                if not self.adaptive
                else "sampling under the speculative rule keeps the full block (use accept_rule='equality')"
                if self.accept_rule == "speculative" and self.temperature > 0
                else None
            )
            if why:
                raise DFlashError(f"auto_tree (--auto-tree) is the adaptive policy's choice, and {why}: drop one")

    def refuse_without_draft(self) -> None:
        """The CLI's check once the model is loaded without a draft: a flag
        that shapes only drafting would do nothing (a config in Python may
        carry one on purpose, as under ``baseline``)."""
        given = [] if self.baseline else self.drafting_given()
        if given:
            raise DFlashError(
                f"no draft is loaded: {' and '.join(given)} would do nothing; give a draft (--draft) or drop them"
            )

    def drafting_given(self) -> List[str]:
        """The fields set away from their defaults that shape only drafting, named with their flags."""
        return [
            name
            for name, on in (
                ("block_size (--block-size)", self.block_size is not None),
                ("tree_budget (--tree-budget)", bool(self.tree_budget)),
                ("auto_tree (--auto-tree)", bool(self.auto_tree)),
                ("draft_window (--draft-window)", self.draft_window is not None),
                ("adaptive=False (--no-adaptive)", not self.adaptive),
            )
            if on
        ]

    def validate(self, draft=NOT_LOADED) -> None:
        """Every check of these options, raising :class:`DFlashError` naming the cause.

        ``draft``: the draft that will run (anything with ``block_size``, or that
        block size as an int), None when no draft is loaded; left out (before
        loading), the checks that need it wait for the decode loop's call.
        """
        from .cache import check_kv_bits

        self.check_types()
        Sampler.check(**self.sampler_options())
        if self.seed is not None and not 0 <= self.seed < 2**63:  # the keys are taken modulo 2**63
            raise DFlashError(f"seed (--seed) must be in 0..2**63 - 1, got {self.seed}")
        if self.max_tokens < 1:
            raise DFlashError(f"max_tokens (--max-tokens) must be positive, got {self.max_tokens}")
        if self.prefill_chunk < 1:
            raise DFlashError(f"prefill_chunk (--prefill-chunk) must be positive, got {self.prefill_chunk}")
        if self.accept_rule not in ACCEPT_RULES:
            raise DFlashError(
                f"accept_rule (--accept-rule) must be one of {', '.join(ACCEPT_RULES)}, got {self.accept_rule!r}"
            )
        check_kv_bits(self.kv_bits)
        if self.tree_budget < 0 or self.auto_tree < 0:
            raise DFlashError(
                f"tree_budget and auto_tree (--tree-budget, --auto-tree) must be >= 0, got {self.tree_budget} and {self.auto_tree}"
            )
        if max(self.tree_budget, self.auto_tree) > MAX_TREE_NODES:
            raise DFlashError(
                f"tree_budget and auto_tree (--tree-budget, --auto-tree) must be at most {MAX_TREE_NODES} draft "
                f"nodes, got {max(self.tree_budget, self.auto_tree)}"
            )
        if self.tree_topk < 1:
            raise DFlashError(f"tree_topk (--tree-topk) must be >= 1, got {self.tree_topk}")
        if self.auto_tree and self.tree_budget:
            raise DFlashError(
                "give tree_budget (--tree-budget: a tree every cycle) or auto_tree (--auto-tree: the policy's choice), not both"
            )
        if self.draft_window is not None and min(self.draft_window) < 0:
            raise DFlashError("draft_window (--draft-window, --draft-sink) must be >= 0")
        if self.draft_window is not None and self.draft_window[1] < 1:  # the CLI's --draft-window 0 is None
            raise DFlashError(
                f"draft_window (sink, window): the window of recent rows must be >= 1 (None keeps every row), "
                f"got {tuple(self.draft_window)}"
            )
        if self.max_context is not None and self.max_context < 2:
            raise DFlashError(f"the context limit must be at least 2, got {self.max_context}")
        if self.block_size is None or self.baseline or draft is NOT_LOADED:
            return
        if draft is None:
            raise DFlashError("no draft is loaded: block_size (--block-size) would do nothing")
        limit = draft if isinstance(draft, int) else draft.block_size
        if not 2 <= self.block_size <= limit:
            raise DFlashError(  # a block is the drafted tokens (--num-draft-tokens) and one more
                f"block_size (--block-size, --num-draft-tokens) must be in 2..{limit} for this draft "
                f"(1..{limit - 1} drafted tokens), got {self.block_size} ({self.block_size - 1} drafted)"
            )
