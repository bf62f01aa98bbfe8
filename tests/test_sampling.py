"""The sampler's distribution is mlx-lm's (make_sampler) for the same logits and flags."""

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import make_sampler

from mlx_dflash.errors import DFlashError
from mlx_dflash.sampling import Sampler

V = 32
FLAGS = [
    dict(temp=0.7, top_p=0.9),
    dict(temp=1.0, min_p=0.1),
    dict(temp=1.0, min_p=0.3, min_tokens_to_keep=6),
    dict(temp=1.3, top_k=5),
    dict(temp=0.8, top_p=0.8, min_p=0.05, top_k=10),
    dict(temp=0.5),
]


def logits_row(dtype, seed=0):
    rng = np.random.default_rng(seed)
    return mx.array((rng.normal(size=(1, V)) * 2.5).astype(np.float32)).astype(dtype)


def ours(flags, seed=0):
    return Sampler(
        flags["temp"],
        top_p=flags.get("top_p", 1.0),
        top_k=flags.get("top_k", 0),
        min_p=flags.get("min_p", 0.0),
        seed=seed,
        min_tokens_to_keep=flags.get("min_tokens_to_keep", 1),
    )


def chi2_ok(counts, probs, n):
    exp = probs * n
    big = exp >= 5
    obs = np.append(counts[big], counts[~big].sum())
    ex = np.append(exp[big], exp[~big].sum())
    keep = ex > 0
    stat = (((obs - ex) ** 2)[keep] / ex[keep]).sum()
    df = max(keep.sum() - 1, 1)
    crit = df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3  # 0.999 quantile
    return stat <= crit, stat, crit


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("flags", FLAGS, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_distribution_equals_mlx_lm_make_sampler(flags, dtype):
    logits = logits_row(dtype)
    p = np.array(ours(flags).probs(logits)[0], dtype=np.float64)
    # mlx-lm's own sampler on its own log-probabilities (as generate_step computes them), many draws.
    n = 20000
    mx.random.seed(1)
    logprobs = logits - mx.logsumexp(logits, keepdims=True)
    draws = np.array(make_sampler(**flags)(mx.broadcast_to(logprobs, (n, V))))
    counts = np.bincount(draws, minlength=V).astype(np.float64)
    # Same support: mlx-lm never draws a token we filtered, and draws every token we keep
    # with probability above 1e-3.
    assert counts[p == 0].sum() == 0
    assert (counts[p > 1e-3] > 0).all()
    ok, stat, crit = chi2_ok(counts, p, n)
    assert ok, (stat, crit)
    # Our position-keyed draws follow the same distribution.
    m = 1500
    mine = np.array(ours(flags, seed=5)(mx.broadcast_to(logits, (m, V)), list(range(m))))
    ok, stat, crit = chi2_ok(np.bincount(mine, minlength=V).astype(np.float64), p, m)
    assert ok, (stat, crit)


@pytest.mark.parametrize(
    "flags",
    [
        dict(temp=1.0, xtc_probability=0.5, xtc_threshold=0.1),
        dict(temp=0.7, top_p=0.95, top_k=6, xtc_probability=1.0, xtc_threshold=0.05),
    ],
    ids=["half-the-time", "always-with-filters"],
)
def test_xtc_distribution_equals_mlx_lms(flags):
    """XTC cuts the likeliest tokens on a coin of xtc_probability per step in
    mlx-lm; our draws come from the mixture of the two distributions, keyed
    as every draw is: the same distribution, the special tokens never cut."""
    logits = logits_row(mx.float32, seed=4)
    special = [int(np.argmax(np.array(logits[0])))]  # the likeliest token: cut unless special
    kw = {k: v for k, v in flags.items() if k != "temp"}
    sampler = Sampler(flags["temp"], **kw, seed=5, xtc_special_tokens=special)
    p = np.array(sampler.probs(logits)[0], dtype=np.float64)
    plain = np.array(
        Sampler(flags["temp"], **{k: v for k, v in kw.items() if not k.startswith("xtc")}, seed=0).probs(logits)[0]
    )
    assert np.abs(p - plain).max() > 0.02  # XTC changed the distribution
    mx.random.seed(2)
    mlx_lm_sample = make_sampler(**flags, xtc_special_tokens=special)
    logprobs = logits - mx.logsumexp(logits, keepdims=True)
    n = 3000  # one call per draw: mlx-lm tosses XTC's coin once per call
    draws = np.array([mlx_lm_sample(logprobs).item() for _ in range(n)])
    counts = np.bincount(draws, minlength=V).astype(np.float64)
    assert counts[p == 0].sum() == 0
    ok, stat, crit = chi2_ok(counts, p, n)
    assert ok, (stat, crit)
    m = 1500
    mine = np.array(sampler(mx.broadcast_to(logits, (m, V)), list(range(m))))
    ok, stat, crit = chi2_ok(np.bincount(mine, minlength=V).astype(np.float64), p, m)
    assert ok, (stat, crit)
    with pytest.raises(DFlashError, match="xtc_threshold"):
        Sampler(1.0, seed=0, xtc_probability=0.5, xtc_threshold=0.7)
    with pytest.raises(DFlashError, match="xtc_probability"):
        Sampler(1.0, seed=0, xtc_probability=1.5)


def test_filters_follow_mlx_lm_order_and_precision():
    """Filters act on temperature-1 log-probabilities, in mlx-lm's order (top-p,
    min-p, top-k): a temperature-first or top-k-first sampler keeps other tokens."""
    logits = mx.array(np.random.default_rng(3).normal(size=(1, V)).astype(np.float32))
    kept = lambda s: set(np.nonzero(np.array(s.probs(logits)[0]))[0].tolist())
    p = np.exp(np.array(logits[0] - mx.logsumexp(logits[0])).astype(np.float64))
    order = np.argsort(-p)
    above = np.cumsum(p[order]) - p[order]  # mass strictly above each token
    top_p = lambda t: set(order[above < t].tolist())
    min_p = lambda m: set(np.nonzero(p >= m * p.max())[0].tolist())
    # top-p at temperature 1, whatever the temperature.
    assert kept(Sampler(3.0, top_p=0.5, seed=0)) == top_p(0.5)
    assert len(top_p(0.5)) > 1 and kept(Sampler(0.3, top_p=0.5, seed=0)) == top_p(0.5)
    # top-p, then min-p, then top-k.
    want = set(sorted(top_p(0.8) & min_p(0.3), key=lambda t: -p[t])[:3])
    assert kept(Sampler(1.0, top_p=0.8, min_p=0.3, top_k=3, seed=0)) == want
    # min_tokens_to_keep holds the top tokens min-p would drop.
    assert kept(Sampler(1.0, min_p=0.99, seed=0, min_tokens_to_keep=4)) == set(order[:4].tolist())
    # Greedy: argmax of the log-probabilities in the logits' dtype (mlx-lm's greedy).
    for dt in (mx.float32, mx.bfloat16):
        lg = logits.astype(dt)
        want = mx.argmax(lg - mx.logsumexp(lg, keepdims=True), axis=-1)
        assert Sampler(0.0, seed=0)(lg, [0]).item() == want.item()


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_a_vanishing_temperature_samples_the_greedy_token(dtype):
    # In float16 1 / 1e-6 is inf: tempered in the logits' dtype, every score
    # was -inf or nan and every draw token 0.
    rows = mx.concatenate([logits_row(dtype, seed) for seed in range(8)])
    greedy = Sampler(0.0, seed=0)(rows, list(range(8)))
    flat = mx.array(np.random.default_rng(1).normal(size=(4, 300)).astype(np.float32) * 0.1).astype(dtype)
    flat_greedy = Sampler(0.0, seed=0)(flat, list(range(4)))
    for t in (1e-6, 1e-30, 1e-38, 2e-38):
        assert Sampler(t, seed=3)(rows, list(range(8))).tolist() == greedy.tolist(), t
        # A flat row (its top token well under 3%): scaled unshifted, every score overflowed.
        assert Sampler(t, seed=3)(flat, list(range(4))).tolist() == flat_greedy.tolist(), t
    with pytest.raises(DFlashError, match="must be 0 \\(greedy\\) or at least 1e-38"):
        Sampler(1e-39, seed=0)


def test_mlx_lm_flag_values_and_bad_values():
    logits = logits_row(mx.float32)
    # mlx-lm's "off" values: top_p 0 or 1, min_p 0, top_k 0 (and top_k >= V keeps all).
    full = np.array(Sampler(1.0, seed=0).probs(logits))
    for kw in (dict(top_p=0.0), dict(top_p=1.0), dict(top_k=V), dict(min_p=0.0)):
        np.testing.assert_allclose(np.array(Sampler(1.0, seed=0, **kw).probs(logits)), full, rtol=1e-6)
    for kw, msg in (
        (dict(top_p=1.5), "top_p"),
        (dict(min_p=-0.1), "min_p"),
        (dict(top_k=-1), "top_k"),
        (dict(min_tokens_to_keep=0), "min_tokens_to_keep"),
        (dict(temperature=-1), "temperature"),
    ):
        with pytest.raises(DFlashError, match=msg):
            Sampler(**{"temperature": 1.0, **kw})


def test_keeping_more_tokens_than_the_vocabulary_keeps_them_all():
    """min_tokens_to_keep past the vocabulary, or a repetition window past any
    history (both ints a client may send, up to 2**70), keep every token / the
    whole history. mlx-lm's filters raised on them (argpartition's kth, a
    slice index over 32 bits), and their raise left MLX's random state unusable."""
    logits = logits_row(mx.float32)
    full = np.array(Sampler(1.0, seed=0).probs(logits))
    for keep in (V, V + 1, 3000, 2**70):
        got = np.array(Sampler(1.0, seed=0, min_p=0.3, min_tokens_to_keep=keep).probs(logits))
        np.testing.assert_allclose(got, full, rtol=1e-6)
    history = [[3, 5, 3]]
    short = Sampler(1.0, seed=0, repetition_penalty=1.3, repetition_context_size=3)
    for window in (4, 2**40, 2**70):
        long = Sampler(1.0, seed=0, repetition_penalty=1.3, repetition_context_size=window)
        assert long(logits, [0], history).tolist() == short(logits, [0], history).tolist()
    assert Sampler(0.8).seed >= 0  # an unseeded sampler still draws its seed


def test_a_numpy_integer_seed_draws_as_the_same_python_int():
    """np.int64(3) passed validation (numpy integers are integers) and then
    overflowed in the keys' arithmetic: a bare OverflowError from the sampler."""
    import mlx_dflash

    eng = mlx_dflash.load()
    want = mlx_dflash.generate(eng, "def f(x):", max_tokens=6, temperature=0.7, seed=3).tokens
    for seed in (np.int64(3), np.int32(3), np.uint64(3)):
        assert mlx_dflash.generate(eng, "def f(x):", max_tokens=6, temperature=0.7, seed=seed).tokens == want


def test_a_filter_that_raises_leaves_later_samplers_working(monkeypatch):
    """mlx-lm compiles its filters with MLX's global random state as input and
    output; one raising mid-trace left that state a placeholder, and every
    later unseeded sampler (its seed drawn from that state) failed."""
    from functools import partial

    from mlx_dflash import sampling

    @partial(mx.compile, inputs=mx.random.state, outputs=mx.random.state)
    def raises(logprobs, min_p, keep):
        raise ValueError("a filter's own fault")

    monkeypatch.setattr(sampling, "apply_min_p", raises)
    with pytest.raises(ValueError, match="own fault"):
        Sampler(1.0, seed=1, min_p=0.1)(logits_row(mx.float32), [0], None)
    monkeypatch.undo()
    draws = Sampler(0.8)(mx.broadcast_to(logits_row(mx.float32), (4, V)), [0, 1, 2, 3], None)
    assert len(draws.tolist()) == 4


def test_one_default_acceptance_rule_in_every_layer(dense, tok_dir, tmp_path, capsys):
    """The decode loop, the API and the CLI default to the same rule, and a
    caller that omits it gets that rule (not just the same name)."""
    import inspect

    import mlx_dflash
    from mlx_dflash import cli
    from mlx_dflash.config import GenerationConfig
    from mlx_dflash.decode import generate_tokens
    from mlx_dflash.sampling import ACCEPT_RULES, DEFAULT_ACCEPT_RULE
    from tools import tiny

    assert DEFAULT_ACCEPT_RULE in ACCEPT_RULES
    # The decode loop and the API take it from the config.
    assert GenerationConfig().accept_rule == DEFAULT_ACCEPT_RULE
    for fn in (cli.generate,):
        default = inspect.signature(fn).parameters["accept_rule"].default
        assert getattr(default, "default", default) == DEFAULT_ACCEPT_RULE, fn  # typer: an OptionInfo

    cfg, model = dense
    dcfg = tiny.draft_config(cfg, num_hidden_layers=2, block_size=8)
    target_dir = tiny.save_mlx(model, cfg, tmp_path / "target", tokenizer_dir=tok_dir)
    draft_dir = tiny.save_draft(tiny.build_draft(dcfg, seed=5), dcfg, tmp_path / "draft")
    eng = mlx_dflash.load(target_dir, draft_dir)
    other = next(r for r in ACCEPT_RULES if r != DEFAULT_ACCEPT_RULE)
    ids = eng.encode("def fibonacci(n):", chat_template=False)
    kw = dict(temperature=1.0, max_tokens=24, block_size=8, chat_template=False)

    def loop(seed, **rule):
        return [
            t
            for ts in generate_tokens(
                eng.target, ids, draft=eng.draft, max_tokens=24, block_size=8, temperature=1.0, seed=seed, **rule
            )
            for t in ts
        ]

    # A seed where the two rules write different text, so "the same output" means "the same rule".
    seed = next(s for s in range(20) if loop(s, accept_rule=DEFAULT_ACCEPT_RULE) != loop(s, accept_rule=other))
    want = loop(seed, accept_rule=DEFAULT_ACCEPT_RULE)
    assert loop(seed) == want
    res = mlx_dflash.generate(eng, ids, seed=seed, **kw)
    assert res.tokens == want
    assert res.tokens == mlx_dflash.generate(eng, ids, seed=seed, accept_rule=DEFAULT_ACCEPT_RULE, **kw).tokens
    with pytest.raises(SystemExit) as e:
        cli.main(
            [
                "generate",
                "-m",
                str(target_dir),
                "-d",
                str(draft_dir),
                "--ignore-chat-template",
                "--temp",
                "1",
                "--seed",
                str(seed),
                "-n",
                "24",
                "-b",
                "8",
                "def fibonacci(n):",
            ]
        )
    out = capsys.readouterr().out
    assert e.value.code in (0, None)
    assert out == res.text + "\n"


def test_xtc_through_every_mode_and_interface(capsys):
    """With the equality rule a seed gives the same text in plain, chain and
    tree decoding and in a batch, XTC on; the CLI flags give it too."""
    from test_cli import cli

    import mlx_dflash

    eng = mlx_dflash.load()
    kw = dict(temperature=1.0, seed=3, accept_rule="equality", xtc_probability=0.7, xtc_threshold=0.05, max_tokens=24)
    plain = mlx_dflash.generate(eng, "def f(x):", baseline=True, **kw)
    assert eng.config(**kw).xtc_special_tokens == tuple(eng.tokenizer.encode("\n")) + tuple(eng.tokenizer.eos_token_ids)
    for mode in ({}, {"block_size": 8}, {"tree_budget": 6}):
        assert mlx_dflash.generate(eng, "def f(x):", **mode, **kw).tokens == plain.tokens, mode
    assert mlx_dflash.batch_generate(eng, ["def f(x):", "import os"], **kw)[0].tokens == plain.tokens
    without = {k: v for k, v in kw.items() if not k.startswith("xtc")}
    assert mlx_dflash.generate(eng, "def f(x):", baseline=True, **without).tokens != plain.tokens
    flags = ["--temp", "1", "--seed", "3", "--accept-rule", "equality", "--xtc-probability", "0.7"]
    code, out, err = cli(capsys, "generate", *flags, "--xtc-threshold", "0.05", "-n", "24", "def f(x):")
    assert code in (0, None), err
    assert out.rstrip("\n") == plain.text
    code, _, err = cli(capsys, "generate", "--temp", "1", "--xtc-threshold", "0.9", "x")
    assert code == 2 and "xtc_threshold (--xtc-threshold) must be in [0, 0.5]" in err
    # Tokens XTC never cuts must be tokens of the model: the sampler gathers their logits.
    V = eng.target.vocab_size
    for call, bad in (
        (lambda: mlx_dflash.generate(eng, "def f(x):", **{**kw, "xtc_special_tokens": (1, V)}), V),
        (lambda: mlx_dflash.batch_generate(eng, ["def f(x):"], **{**kw, "xtc_special_tokens": (V + 5,)}), V + 5),
    ):
        with pytest.raises(DFlashError, match=f"xtc_special_tokens: {bad} is not a token of this model"):
            call()
