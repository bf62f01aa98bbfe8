"""GenerationConfig: one set of options, validated in one place, taken by every entry point."""

import inspect
import re

import pytest

from mlx_dflash.config import GenerationConfig
from mlx_dflash.decode import GenerationStats, generate_tokens
from mlx_dflash.errors import DFlashError
from mlx_dflash.models.qwen35 import Target
from tools import tiny

PROMPT = [3, 17, 42, 5, 99, 7]


@pytest.mark.parametrize(
    "options,draft_block,words",
    [
        (
            dict(block_size=17),
            16,
            "block_size (--block-size, --num-draft-tokens) must be in 2..16 for this draft (1..15 drafted tokens), got 17 (16 drafted)",
        ),
        (
            dict(block_size=1),
            16,
            "block_size (--block-size, --num-draft-tokens) must be in 2..16 for this draft (1..15 drafted tokens), got 1 (0 drafted)",
        ),
        (dict(block_size=4), None, "no draft is loaded: block_size (--block-size) would do nothing"),
        (dict(max_tokens=0), 16, "max_tokens (--max-tokens) must be positive, got 0"),
        (dict(prefill_chunk=0), 16, "prefill_chunk (--prefill-chunk) must be positive, got 0"),
        (dict(accept_rule="typical"), 16, "accept_rule (--accept-rule) must be one of"),
        (dict(kv_bits=3), 16, "kv_bits (--kv-bits) must be 4 or 8"),
        (dict(tree_budget=-1), 16, "tree_budget and auto_tree (--tree-budget, --auto-tree) must be >= 0, got -1 and 0"),
        (dict(tree_topk=0), 16, "tree_topk (--tree-topk) must be >= 1, got 0"),
        (dict(tree_budget=100000), 16, "must be at most 1024 draft nodes, got 100000"),
        (dict(auto_tree=5000), 16, "must be at most 1024 draft nodes, got 5000"),
        (dict(tree_budget=6, auto_tree=6), 16, "not both"),
        (dict(draft_window=(16, -1)), 16, "draft_window (--draft-window, --draft-sink) must be >= 0"),
        (dict(draft_window=(0, 0)), 16, "the window of recent rows must be >= 1 (None keeps every row), got (0, 0)"),
        (dict(temperature=-1.0), 16, "temperature (--temp) must be a finite number >= 0"),
        (dict(temperature=float("nan")), 16, "temperature (--temp) must be a finite number >= 0, got nan"),
        (dict(temperature=float("inf")), 16, "temperature (--temp) must be a finite number >= 0, got inf"),
        (dict(top_p=1.5), 16, "top_p (--top-p) must be in [0, 1]"),
        (dict(top_k=-1), 16, "top_k (--top-k) must be >= 0"),
        (dict(min_p=2.0), 16, "min_p (--min-p) must be in [0, 1]"),
        (dict(min_tokens_to_keep=0), 16, "min_tokens_to_keep (--min-tokens-to-keep) must be >= 1"),
        (
            dict(repetition_penalty=0.0),
            16,
            "repetition_penalty (--repetition-penalty) must be a finite positive number",
        ),
        (
            dict(repetition_penalty=float("nan")),
            16,
            "repetition_penalty (--repetition-penalty) must be a finite positive number, got nan",
        ),
        (dict(repetition_context_size=0), 16, "repetition_context_size (--repetition-context-size) must be positive"),
        (dict(top_p=1e-300), 16, "top_p (--top-p) must be 0 or 1 (off) or at least 1e-38"),
    ],
)
def test_validate_names_the_cause(options, draft_block, words):
    with pytest.raises(DFlashError) as e:
        GenerationConfig(**options).validate(draft_block)
    assert words in str(e.value)


@pytest.mark.parametrize(
    "options,words",
    [
        (dict(max_tokens=float("nan")), "max_tokens must be an integer, got nan"),  # NaN never stopped
        (dict(max_tokens=16.0), "max_tokens must be an integer"),
        (dict(max_tokens="16"), "max_tokens must be an integer"),
        (dict(max_tokens=True), "max_tokens must be an integer"),
        (dict(top_k=2.5), "top_k must be an integer"),
        (dict(seed=1.5), "seed must be an integer (or None)"),
        (dict(block_size="8"), "block_size must be an integer (or None)"),
        (dict(temperature=None), "temperature must be a number"),
        (dict(top_p="0.9"), "top_p must be a number"),
        (dict(baseline="no"), "baseline must be True or False"),
        (dict(draft_window=5), "draft_window must be None or two integers"),
        (dict(draft_window=(1, 2, 3)), "draft_window must be None or two integers"),
        (dict(accept_rule=None), "accept_rule must be a string"),
    ],
)
def test_validate_checks_each_options_kind(options, words):
    with pytest.raises(DFlashError) as e:
        GenerationConfig(**options).validate()
    assert words in str(e.value)


def test_build_takes_a_config_not_a_dict():
    with pytest.raises(DFlashError, match="config must be a GenerationConfig.*got dict"):
        GenerationConfig.build({"max_tokens": 4}, max_tokens=3)


@pytest.mark.parametrize(
    "options,words",
    [
        (dict(baseline=True, tree_budget=8), "tree_budget (--tree-budget) would do nothing"),
        (dict(baseline=True, block_size=4), "block_size (--block-size) would do nothing"),
        (dict(tree_topk=2), "tree_topk (--tree-topk) shapes a tree"),
        (dict(auto_tree=8, block_size=3), "block_size (--block-size) pins the width"),
        (dict(auto_tree=8, adaptive=False), "(--no-adaptive) pins the width"),
        (dict(auto_tree=8, temperature=0.7), "the speculative rule keeps the full block"),
    ],
)
def test_refuse_unused_names_what_would_do_nothing(options, words):
    """The CLI's check of flags that would do nothing (the API's configs may carry them)."""
    GenerationConfig(**options).validate(16)
    with pytest.raises(DFlashError) as e:
        GenerationConfig(**options).refuse_unused()
    assert words in str(e.value)


def test_refuse_unused_passes_what_runs():
    GenerationConfig(auto_tree=8, temperature=0.7, accept_rule="equality").refuse_unused()
    GenerationConfig(tree_budget=8, tree_topk=2, block_size=8).refuse_unused()
    GenerationConfig(baseline=True).refuse_unused()
    GenerationConfig(auto_tree=8, temperature=0.7).refuse_unused(per_request=True)  # a server's defaults


def test_validate_accepts_what_runs():
    GenerationConfig(block_size=16).validate(16)
    GenerationConfig(block_size=2).validate(16)
    GenerationConfig(block_size=4, baseline=True).validate(None)  # baseline ignores the block size
    GenerationConfig(auto_tree=6, kv_bits=8, temperature=0.7, top_p=0.9).validate(16)


def test_unknown_option_is_an_error_not_ignored():
    with pytest.raises(DFlashError, match="unknown generation option.*temp_typo"):
        GenerationConfig.build(temp_typo=1.0)
    base = GenerationConfig(temperature=0.5, max_tokens=9)
    assert GenerationConfig.build(base, max_tokens=3) == GenerationConfig(temperature=0.5, max_tokens=3)
    assert GenerationConfig.build(base) is base


def test_entry_points_take_a_config_not_a_parameter_each():
    from mlx_dflash import api, decode

    for fn in (api.stream_generate, api.generate, decode.generate_tokens):
        params = inspect.signature(fn).parameters
        assert "config" in params, fn
        # Options live in the config; test hooks live in decode.Hooks.
        for name in GenerationConfig.names() + ("acceptance", "spec_rule", "policy", "sampler"):
            assert name not in params, (fn, name)


def test_config_and_keywords_give_the_same_tokens(dense):
    _, model = dense
    target = Target(model)
    draft = tiny.build_draft(tiny.draft_config(dense[0], num_hidden_layers=1, block_size=8), seed=2)
    draft.bind(target)
    # The equality rule: a seed's text is the same whatever the width (max_tokens cuts the last block).
    cfg = GenerationConfig(max_tokens=12, temperature=0.8, top_k=20, seed=4, block_size=4, accept_rule="equality")
    st_a, st_b = GenerationStats(), GenerationStats()
    a = sum(generate_tokens(target, PROMPT, cfg, draft=draft, stats=st_a), [])
    b = sum(
        generate_tokens(
            target,
            PROMPT,
            draft=draft,
            stats=st_b,
            max_tokens=12,
            temperature=0.8,
            top_k=20,
            seed=4,
            block_size=4,
            accept_rule="equality",
        ),
        [],
    )
    assert a == b and len(a) == 12 and st_a.block_size == st_b.block_size == 4
    # Keywords override the config's fields.
    c = sum(generate_tokens(target, PROMPT, cfg, draft=draft, max_tokens=5), [])
    assert c == a[:5]
    # The loop validates the config against the draft it runs with.
    with pytest.raises(
        DFlashError,
        match=r"block_size \(--block-size, --num-draft-tokens\) must be in 2..8 for this draft \(1..7 drafted tokens\), got 9",
    ):
        next(generate_tokens(target, PROMPT, cfg, draft=draft, block_size=9))


def test_every_sampling_option_is_a_flag_of_every_command_that_samples():
    from mlx_dflash import cli
    from mlx_dflash.config import SAMPLING

    assert set(SAMPLING) <= set(GenerationConfig.names())
    for command in (cli.generate, cli.chat, cli.serve):
        params = inspect.signature(command).parameters
        for name in SAMPLING:
            assert getattr(params[name].default, "help", ""), (command, name)  # a typer option with help text


def test_cli_flags_become_one_config():
    from mlx_dflash.cli import generation_config

    gen = generation_config(dict(num_draft_tokens=3, draft_window=64, draft_sink=4, temperature=0.5))
    assert gen == GenerationConfig(block_size=4, draft_window=(4, 64), temperature=0.5)
    with pytest.raises(DFlashError, match="not both"):
        generation_config(dict(num_draft_tokens=3, block_size=4))
    with pytest.raises(DFlashError, match="--draft-window and --draft-sink must be >= 0"):
        generation_config(dict(draft_window=-1))


def test_server_request_sets_the_sampling_fields_it_names():
    from types import SimpleNamespace

    defaults = GenerationConfig(max_tokens=512, temperature=0.7, block_size=8, tree_budget=0)
    req = SimpleNamespace(
        temperature=None, top_p=0.9, top_k=5, seed=3, repetition_penalty=None, block_size=2, max_tokens=99
    )  # not a sampling field: the server's stays
    got = defaults.with_request(req, max_tokens=40)
    assert got == GenerationConfig(max_tokens=40, temperature=0.7, top_p=0.9, top_k=5, seed=3, block_size=8)
    assert isinstance(got.top_p, float)


def test_sampler_options_are_named_once():
    """The sampler and its checks take the config's sampling fields from one
    helper: every option ``Sampler.check`` takes, no more, by the same name."""
    from mlx_dflash.sampling import Sampler

    cfg = GenerationConfig(
        temperature=0.7,
        top_p=0.9,
        top_k=5,
        min_p=0.05,
        min_tokens_to_keep=2,
        repetition_penalty=1.1,
        repetition_context_size=7,
        seed=3,
    )
    options = cfg.sampler_options()
    assert set(options) == set(inspect.signature(Sampler.check).parameters)
    sampler = cfg.sampler()
    for name, value in options.items():
        assert getattr(sampler, name) == value, name
    assert sampler.seed == 3


def test_fields_are_given_by_name():
    """GenerationConfig(0.7) used to set a temperature without saying so."""
    with pytest.raises(TypeError):
        GenerationConfig(0.7)


def test_bench_tree_flag_is_its_own_and_takes_tree_topk():
    """bench holds --tree-budget apart from its generation config: --tree-topk
    with it was refused as "give --tree-budget" (and named --auto-tree, which
    bench does not have)."""
    from mlx_dflash.cli import generation_config

    assert generation_config({"tree_topk": 3}, tree_budget=12).tree_topk == 3
    with pytest.raises(DFlashError, match=r"give --tree-budget too, or drop it"):
        generation_config({"tree_topk": 3}, tree_budget=0)


def test_flags_that_shape_only_drafting_are_refused_by_the_cli_without_a_draft():
    """The CLI's check after loading a target alone: these ran plain decoding
    silently. A config in Python may carry them on purpose: validate passes."""
    for options, words in [
        (dict(tree_budget=8), "tree_budget (--tree-budget)"),
        (dict(auto_tree=8), "auto_tree (--auto-tree)"),
        (dict(draft_window=(0, 8)), "draft_window (--draft-window)"),
        (dict(adaptive=False), "adaptive=False (--no-adaptive)"),
    ]:
        c = GenerationConfig(**options)
        c.validate(None)
        with pytest.raises(DFlashError, match=r"no draft is loaded: " + re.escape(words) + " would do nothing"):
            c.refuse_without_draft()
        GenerationConfig(baseline=True, **options).validate(None)
    GenerationConfig().refuse_without_draft()
