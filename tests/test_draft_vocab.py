"""A draft restricted to part of the vocabulary (``draft_vocab``, ``--draft-vocab``).

The draft then reads only those rows of the target's head and proposes only
those tokens; verification is unchanged, so greedy output must equal plain
decoding's and sampled output must keep the target's distribution even where
the target picks a token the draft cannot propose (q = 0 there)."""

import json

import mlx.core as mx
import numpy as np
import pytest
from test_draft2 import exact_pairs, sample_counts, small_vocab  # noqa: F401 (a fixture)
from test_tree_sampling import chi2_fails, exact_marginals

import mlx_dflash
from mlx_dflash.benchmark import read_prompts
from mlx_dflash.cli import main
from mlx_dflash.errors import DFlashError
from mlx_dflash.loading import draft_vocab_ids, load_target
from mlx_dflash.models.qwen35 import Target
from mlx_dflash.policy import cost_key
from mlx_dflash.sampling import Sampler
from tools import tiny


@pytest.fixture(scope="module")
def embedded():
    return mlx_dflash.load(), mlx_dflash.load(draft_vocab=1024)


@pytest.mark.parametrize("form", ["untied", "tied", "4-bit"])
def test_head_rows_are_the_heads_columns(form, tmp_path):
    """``Target.head_rows(ids)`` reads a copy of those rows, in the head's
    own format, and gives exactly the full head's logits at those ids."""
    cfg = tiny.target_config(tie_word_embeddings=form == "tied")
    model = tiny.build_target(cfg, seed=4)
    quantize = {"bits": 4, "group_size": 32} if form == "4-bit" else None
    target = load_target(tiny.save_mlx(model, cfg, tmp_path / "t", quantize=quantize))
    ids = mx.array([0, 3, 17, 200, 511], dtype=mx.int32)
    h = mx.random.normal((2, 3, cfg["text_config"]["hidden_size"]), key=mx.random.key(0))
    full, part = target.lm_head(h), target.head_rows(ids)(h)
    assert part.shape == (2, 3, 5)
    assert mx.array_equal(full[..., ids], part).item()


def test_restricted_logits_and_proposals(embedded):
    """Kept ids get the whole head's logits, the others -inf: greedy picks
    and sampled draws stay among the kept ids, and q is 0 elsewhere."""
    whole, cut = (e.draft for e in embedded)
    kept = np.array(cut.vocab)
    assert kept.tolist() == sorted(set(range(1024)) | {0, 1, 2, 3})
    h = mx.random.normal((15, 256), key=mx.random.key(1))
    a, b = np.array(whole.logits(h)), np.array(cut.logits(h))
    np.testing.assert_allclose(b[:, kept], a[:, kept], rtol=1e-5, atol=1e-5)
    assert np.isneginf(np.delete(b, kept, axis=1)).all()
    assert (np.argmax(a, 1) >= 1024).any()  # some slot's whole-vocabulary pick is outside: the test can fail
    eng = embedded[1]
    ids = eng.encode(read_prompts()["code_class"])
    cache = cut.make_cache()
    feats = mx.zeros((len(ids), len(cut.target_layer_ids) * 256))
    toks, _ = cut.propose(feats, ids[-1], len(ids), 16, cache)
    assert set(np.array(toks).tolist()) <= set(kept.tolist())
    toks, q = cut.propose(None, ids[-1], len(ids), 16, cache, Sampler(1.5, seed=0), sample=True)
    q = np.array(q)
    assert set(np.array(toks).tolist()) <= set(kept.tolist())
    np.testing.assert_allclose(q.sum(1), 1, atol=1e-5)
    assert (np.delete(q, kept, axis=1) == 0).all()


def test_speculative_equals_plain_with_a_restricted_draft(embedded):
    """Greedy output of the restricted draft (chain, pinned block, tree,
    batch) is plain decoding's, and the draft is still right often."""
    eng = embedded[1]
    prompts = read_prompts()
    taus = []
    for name in ("code_class", "doc_read_file", "prose_comment"):
        text = prompts[name]
        plain = mlx_dflash.generate(eng, text, max_tokens=64, baseline=True).text
        for kw in (dict(), dict(block_size=16), dict(tree_budget=8)):
            r = mlx_dflash.generate(eng, text, max_tokens=64, **kw)
            assert r.text == plain, (name, kw)
            if kw.get("block_size"):
                taus.append(r.stats.tau)
    assert max(taus) > 3  # drafts were accepted, several a cycle
    texts = [prompts[n] for n in ("code_class", "doc_to_code")]
    batch = mlx_dflash.batch_generate(eng, texts, max_tokens=32)
    for t, r in zip(texts, batch):
        assert r.text == mlx_dflash.generate(eng, t, max_tokens=32, baseline=True).text


def test_sampling_with_a_restricted_draft_keeps_the_target_distribution(small_vocab):  # noqa: F811
    """A real draft restricted to 6 of 12 tokens, sampled with the speculative
    rule: where the target draws a token the draft cannot propose (q = 0) the
    residual must supply it, so the first two tokens' joint and the third's
    marginal are still the target's."""
    target = small_vocab
    kw = dict(temperature=0.8, top_k=8)
    dcfg = tiny.draft_config(tiny.target_config(vocab_size=12), num_hidden_layers=1, block_size=4)
    draft = tiny.build_draft(dcfg, seed=3).bind(target).restrict_vocab([0, 2, 4, 6, 8, 10])
    prompt, n = [1, 5, 7], 400
    joint = exact_pairs(target, prompt, Sampler(**kw, seed=0)).reshape(-1)
    assert joint.reshape(12, 12)[:, 1::2].sum() > 0.2  # the target often writes tokens the draft cannot
    third = exact_marginals(target, prompt, Sampler(**kw, seed=0), 3)[2]
    got_pairs, got_third, accepted = sample_counts(target, prompt, kw, n, draft=draft)
    assert accepted > n // 4
    assert not chi2_fails(got_pairs, joint, n)[0], chi2_fails(got_pairs, joint, n)
    assert not chi2_fails(got_third, third, n)[0], chi2_fails(got_third, third, n)


def test_vocabulary_forms(tmp_path):
    """A count, a JSON list, ids in text and a list give the same set; the
    kept (added) tokens are joined; the whole vocabulary is no restriction."""
    assert draft_vocab_ids(4, 10) == [0, 1, 2, 3]
    assert draft_vocab_ids("4", 10, keep=[9]) == [0, 1, 2, 3, 9]
    (tmp_path / "a.json").write_text(json.dumps([3, 1, 1, 7]))
    (tmp_path / "b.txt").write_text("3\n1, 7\n")
    assert draft_vocab_ids(tmp_path / "a.json", 10) == draft_vocab_ids(str(tmp_path / "b.txt"), 10) == [1, 3, 7]
    assert draft_vocab_ids([5, 2], 10) == [2, 5]
    assert draft_vocab_ids(10, 10) is None and draft_vocab_ids(None, 10) is None


@pytest.mark.parametrize(
    "spec, match",
    [
        (0, "must keep at least 1 token, got 0"),
        (11, "keeps 11 tokens, but the vocabulary has 10"),
        (True, "a token count, a file"),
        (2.5, "a token count, a file"),
        ([1, 10], r"token ids \[10\] outside"),
        ("missing.json", "cannot read"),
        ("floats.json", "not a list of token ids"),
        ("words.txt", "not a list of token ids"),
        ("empty.txt", "not a list of token ids"),
        ("\u00b2", "cannot read"),  # a digit to str.isdigit, not to int(): a file name here
        ("-3", "must keep at least 1 token, got -3"),
    ],
)
def test_bad_vocabularies_are_one_error(spec, match, tmp_path):
    (tmp_path / "floats.json").write_text("[1, 2.5]")
    (tmp_path / "words.txt").write_text("1 2 three")
    (tmp_path / "empty.txt").write_text("\n")
    if isinstance(spec, str) and spec.endswith((".json", ".txt")):
        spec = tmp_path / spec
    with pytest.raises(DFlashError, match=match):
        draft_vocab_ids(spec, 10)


def test_the_form_is_checked_before_the_vocabulary_is_known():
    """Before a model loads only the form is checked: a huge count is not
    built into a set (it waits for the vocabulary), a negative id fails."""
    assert draft_vocab_ids(10**12, None) is None
    assert draft_vocab_ids([3, 1], None) == [1, 3]
    with pytest.raises(DFlashError, match=r"token ids \[-1\] outside the vocabulary"):
        draft_vocab_ids([-1, 3], None)


def test_a_tree_holds_no_token_the_draft_cannot_propose():
    """With fewer kept ids than --tree-topk, the -inf candidates are left out
    of the tree instead of filling it."""
    from mlx_dflash.ddtree import build

    logits = mx.full((3, 12), -mx.inf)
    logits[:, 2] = 1.0
    logits[:, 5] = 0.5
    tree = build(logits, anchor=7, budget=12, topk=4)
    assert set(tree.tokens[1:]) <= {2, 5} and 1 < len(tree.tokens) <= 1 + 2 + 4 + 8


def test_load_checks_before_the_weights(tmp_path, dense, tok_dir):
    cfg, model = dense
    folder = tiny.save_mlx(model, cfg, tmp_path / "t", tokenizer_dir=tok_dir)
    with pytest.raises(DFlashError, match="restricts a draft: give one"):
        mlx_dflash.load(folder, draft_vocab=100)
    with pytest.raises(DFlashError, match="cannot read"):
        mlx_dflash.load(draft_vocab=tmp_path / "none.json")
    with pytest.raises(DFlashError, match="keeps 5000 tokens, but the vocabulary has 2048"):
        mlx_dflash.load(draft_vocab=5000)
    with pytest.raises(DFlashError, match="keeps 1000000000000 tokens"):
        mlx_dflash.load(draft_vocab=10**12)


def test_added_tokens_are_always_kept(tmp_path, dense, tok_dir):
    """Chat and tool markers are added after a BPE vocabulary (high ids, as
    in Qwen's); a count keeps them all the same, and the eos token."""
    from tokenizers import AddedToken, Tokenizer

    cfg, model = dense
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    tok.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    folder = tiny.save_mlx(model, cfg, tmp_path / "t", tokenizer_dir=tok_dir)
    tok.save(str(folder / "tokenizer.json"))
    dcfg = tiny.draft_config(cfg, block_size=4)
    draft = tiny.save_draft(tiny.build_draft(dcfg, seed=1), dcfg, tmp_path / "d")
    eng = mlx_dflash.load(folder, draft, draft_vocab=8)
    think = eng.tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    assert think == [400, 401] and eng.draft.vocab.tolist() == list(range(8)) + think
    assert set(eng.tokenizer.eos_token_ids) <= set(range(8))


def test_the_cost_curve_is_the_restricted_drafts_own(embedded):
    whole, cut = embedded
    assert cost_key(whole.target, whole.draft) != cost_key(cut.target, cut.draft)


def test_cli_takes_and_reports_it(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["generate", "def f(x):", "-n", "24", "--draft-vocab", "1024", "--verbose", "--no-chat-template"])
    assert e.value.code in (0, None)
    err = capsys.readouterr().err
    assert (
        "draft vocabulary              1024 of 2048 tokens; " in err and "of the 24 generated tokens inside it" in err
    )
    for arg, match in (("0", "must keep at least 1 token"), (str(tmp_path / "no.json"), "cannot read")):
        with pytest.raises(SystemExit) as e:
            main(["generate", "def f(x):", "-n", "4", "--draft-vocab", arg])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert match in err and "Traceback" not in err


def test_target_is_the_module_the_restriction_reads(dense):
    """Restricting after the fact replaces the rows; None lifts it."""
    cfg, model = dense
    target = Target(model)
    d = tiny.build_draft(tiny.draft_config(cfg, block_size=4), seed=2).bind(target)
    d.restrict_vocab(range(8))
    assert d.vocab.tolist() == list(range(8))
    for bad in ([5, 512], [-1], []):
        with pytest.raises(ValueError, match="takes token ids in 0..511"):
            d.restrict_vocab(bad)
    d.restrict_vocab(None)
    assert d.vocab is None and d.logits(mx.zeros((1, cfg["text_config"]["hidden_size"]))).shape[-1] == 512


def test_info_says_how_much_of_a_draft_forward_is_the_head(capsys):
    """`info --draft` sizes what a draft forward reads from the files: the
    draft's own weights and the target's head (checked here against the
    safetensors headers, read with the safetensors library)."""
    from safetensors import safe_open

    from mlx_dflash.api import DEFAULT_DRAFT, DEFAULT_MODEL

    def nbytes(folder, keep):
        total = 0
        for f in sorted(folder.glob("*.safetensors")):
            with safe_open(f, "np") as h:
                total += sum(_size(h, k) for k in h.keys() if keep(k))
        return total

    def _size(h, k):
        sl = h.get_slice(k)
        return (
            int(np.prod(sl.get_shape()))
            * np.dtype({"F16": "float16", "F32": "float32", "BF16": "uint16"}[sl.get_dtype()]).itemsize
        )

    head = nbytes(DEFAULT_MODEL, lambda k: "lm_head" in k)
    own = nbytes(DEFAULT_DRAFT, lambda k: True)
    with pytest.raises(SystemExit) as e:
        main(["info", str(DEFAULT_MODEL), "--draft", str(DEFAULT_DRAFT)])
    assert e.value.code in (0, None)
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("a draft forward reads"))
    assert f"its own weights {own / 1e6:.1f} MB and the target's head {head / 1e6:.1f} MB" in line
    assert f"({head / (head + own):.0%}; --draft-vocab N reads N of its 2048 rows)" in line
