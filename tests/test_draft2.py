"""DFlash 2 drafts: the published folder format loads; the forward equals a
reference written from the description (block convolutions with the anchor
boundary, the selector's lattice and walk) and the authors' own
``dflash.model_mlx``; greedy decoding is lossless; the speculative-sampling
rule gives the target's distribution; bad folders give one clear error."""

import math

import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import save_file
from support.reference import reference_greedy
from test_draft import rope_ref
from test_tree_sampling import chi2_fails, exact_marginals

from mlx_dflash.decode import GenerationStats, Hooks, _generate_tokens
from mlx_dflash.errors import DFlashError
from mlx_dflash.loading import load_draft
from mlx_dflash.models.qwen35 import Target
from mlx_dflash.sampling import Sampler, speculative_rule
from tools import tiny

V2 = dict(selector_rank=8, selector_top_k=6, conv_kernel_size=2, conv_group_size=16)


def config(target_cfg, v2=True, **kw):
    cfg = tiny.draft_config(target_cfg, **kw)
    if v2:
        cfg["architectures"] = ["DFlash2DraftModel"]
        cfg["dflash_config"].update(V2)
    return cfg


def published_weights(cfg, seed):
    """Random weights under the names and shapes the published checkpoints use
    (written here from the layout, not from our modules)."""
    rng = np.random.default_rng(seed)
    H, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, nkv, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    F = len(cfg["dflash_config"]["target_layer_ids"]) * H
    lin = lambda o, i: rng.normal(0, 1 / math.sqrt(i), (o, i))
    norm = lambda n: 1 + 0.2 * rng.normal(size=n)
    w = {"fc.weight": lin(H, F), "hidden_norm.weight": norm(H), "norm.weight": norm(H)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        w.update(
            {
                p + "self_attn.q_proj.weight": lin(nh * D, H),
                p + "self_attn.k_proj.weight": lin(nkv * D, H),
                p + "self_attn.v_proj.weight": lin(nkv * D, H),
                p + "self_attn.o_proj.weight": lin(H, nh * D),
                p + "self_attn.q_norm.weight": norm(D),
                p + "self_attn.k_norm.weight": norm(D),
                p + "mlp.gate_proj.weight": lin(I, H),
                p + "mlp.up_proj.weight": lin(I, H),
                p + "mlp.down_proj.weight": lin(H, I),
                p + "input_layernorm.weight": norm(H),
                p + "post_attention_layernorm.weight": norm(H),
            }
        )
        if "DFlash2DraftModel" in cfg["architectures"]:
            dc = cfg["dflash_config"]
            taps, groups = dc["conv_kernel_size"], H // dc["conv_group_size"]
            for conv in ("attention_conv", "mlp_conv"):
                base = 0.4 * rng.normal(size=(2, taps, H))
                base[:, 0] += 1.0
                w[p + conv + ".base_kernel"] = base
                w[p + conv + ".kernel_projection.weight"] = 0.3 * lin(2 * taps * groups, H)
    if "DFlash2DraftModel" in cfg["architectures"]:
        r = cfg["dflash_config"]["selector_rank"]
        w["candidate_selector.predecessor_codebook"] = rng.normal(size=(V, r))
        w["candidate_selector.successor_codebook"] = rng.normal(size=(V, r))
        w["candidate_selector.hidden_projection.weight"] = 2 * lin(r, H)
    return {k: v.astype(np.float32) for k, v in w.items()}


def write_folder(path, cfg, weights):
    import json

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(weights, str(path / "model.safetensors"))
    return path


# --- a reference written from the description (numpy, float64) -------------------


def rms(x, w, eps=1e-6):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def conv_ref(x, base, coeff, group):
    """out[t] = sum_o (base[o] + coeff[t, o, group(c)]) * x[t - o]; rows before the anchor are 0."""
    B = x.shape[0]
    out = np.zeros_like(x)
    for o in range(base.shape[0]):
        shifted = np.zeros_like(x)
        shifted[o:] = x[: B - o]
        out += (base[o][None] + np.repeat(coeff[:, o], group, axis=-1)) * shifted
    return out


def hidden_ref(W, cfg, emb, feats, anchor, anchor_pos, B, window=None):
    """Normed final rows [B, H] of one uncached draft forward."""
    W = {k: np.asarray(v, np.float64) for k, v in W.items()}
    v2 = "DFlash2DraftModel" in cfg["architectures"]
    dc = cfg["dflash_config"]
    nh, nkv, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    ctx_pos = list(range(anchor_pos))
    if window is not None and len(ctx_pos) > sum(window):
        ctx_pos = ctx_pos[: window[0]] + ctx_pos[-window[1] :]
    S = len(ctx_pos)
    ctx = rms(feats[ctx_pos] @ W["fc.weight"].T, W["hidden_norm.weight"])
    h = emb[[anchor] + [dc["mask_token_id"]] * (B - 1)]
    blk_pos = [anchor_pos + j for j in range(B)]
    types = cfg.get("layer_types") or ["full_attention"] * cfg["num_hidden_layers"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."

        def attend(x):
            q = rms((x @ W[p + "self_attn.q_proj.weight"].T).reshape(B, nh, D), W[p + "self_attn.q_norm.weight"])
            rows = np.concatenate([ctx, x])
            k = rms(
                (rows @ W[p + "self_attn.k_proj.weight"].T).reshape(S + B, nkv, D), W[p + "self_attn.k_norm.weight"]
            )
            v = (rows @ W[p + "self_attn.v_proj.weight"].T).reshape(S + B, nkv, D)
            q, k = rope_ref(q, blk_pos, cfg["rope_theta"]), rope_ref(k, ctx_pos + blk_pos, cfg["rope_theta"])
            k, v = np.repeat(k, nh // nkv, axis=1), np.repeat(v, nh // nkv, axis=1)
            s = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(D)
            ok = np.ones((B, S + B), bool)
            if types[i] == "sliding_attention":
                ok[:, :S] = (np.array(ctx_pos) >= anchor_pos - (cfg["sliding_window"] - 1))[None]
                ok[:, S:] = np.tril(np.ones((B, B), bool))
            s = np.where(ok[None], s, -np.inf)
            a = np.exp(s - s.max(-1, keepdims=True))
            a /= a.sum(-1, keepdims=True)
            return np.einsum("hqk,khd->qhd", a, v).reshape(B, nh * D) @ W[p + "self_attn.o_proj.weight"].T

        def mlp(x):
            g = x @ W[p + "mlp.gate_proj.weight"].T
            return (g / (1 + np.exp(-g)) * (x @ W[p + "mlp.up_proj.weight"].T)) @ W[p + "mlp.down_proj.weight"].T

        for norm, conv, fn in (
            ("input_layernorm", "attention_conv", attend),
            ("post_attention_layernorm", "mlp_conv", mlp),
        ):
            x = rms(h, W[p + norm + ".weight"])
            if not v2:
                h = h + fn(x)
                continue
            base = W[p + conv + ".base_kernel"]
            c = (x @ W[p + conv + ".kernel_projection.weight"].T).reshape(B, 2, base.shape[1], -1)
            g = dc["conv_group_size"]
            h = h + conv_ref(fn(conv_ref(x, base[0], c[:, 0], g)), base[1], c[:, 1], g)
    return rms(h, W["norm.weight"])


def walk_ref(W, hidden, logits, anchor, K, choose=None):
    """Selector lattice walk: per slot the top-K candidates, scores
    unary + <A[prev] * P h, B[cand]>; greedy = best successor."""
    A = np.asarray(W["candidate_selector.predecessor_codebook"], np.float64)
    Bc = np.asarray(W["candidate_selector.successor_codebook"], np.float64)
    P = np.asarray(W["candidate_selector.hidden_projection.weight"], np.float64)
    prev, path, rows = anchor, [], []
    for i in range(hidden.shape[0]):
        cand = np.argsort(-logits[i], kind="stable")[:K]
        scores = logits[i][cand] + Bc[cand] @ (A[prev] * (P @ hidden[i]))
        j = int(np.argmax(scores)) if choose is None else choose(i, cand)
        prev = int(cand[j])
        path.append(prev)
        rows.append((cand, scores))
    return path, rows


# --- fixtures ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair(dense, tmp_path_factory):
    cfg, model = dense
    target = Target(model)
    dcfg = config(
        cfg,
        num_hidden_layers=2,
        block_size=6,
        target_layer_ids=[0, 2],
        layer_types=["full_attention", "sliding_attention"],
        sliding_window=7,
    )
    W = published_weights(dcfg, seed=1)
    path = write_folder(tmp_path_factory.mktemp("v2") / "draft", dcfg, W)
    feats = np.random.default_rng(2).normal(size=(60, 2 * target.hidden_size)).astype(np.float32)
    return target, model, dcfg, W, path, feats


def test_published_folder_loads_and_matches_the_description(pair):
    target, _, dcfg, W, path, feats = pair
    draft = load_draft(path, target)
    assert draft.config.is_v2 and draft.config.selector_top_k == 6
    emb = np.array(target.embed_tokens.weight, np.float64)
    head = lambda h: np.array(target.lm_head(mx.array(h.astype(np.float32))), np.float64)
    for window in (None, (2, 5)):
        cache = draft.make_cache(window)
        pos, consumed = 9, 0
        for step, (adv, B) in enumerate([(0, 6), (3, 6), (1, 3), (7, 6), (4, 2)]):
            pos += adv
            anchor = 30 + 7 * step
            hid = draft.block_hidden(mx.array(feats[consumed:pos]), anchor, pos, B, cache)
            consumed = pos
            want = hidden_ref(W, dcfg, emb, feats.astype(np.float64), anchor, pos, B, window)
            np.testing.assert_allclose(np.array(hid), want, rtol=2e-4, atol=2e-4)
            logits = draft.logits(hid[1:])
            path, rows = walk_ref(W, want[1:], head(want[1:]), anchor, 6)
            toks, cand, scores = draft.candidate_selector.walk(hid[1:], logits, anchor, lambda s, i: mx.argmax(s))
            assert toks.tolist() == path
            for i, (c, s) in enumerate(rows):
                assert np.array(cand[i]).tolist() == c.tolist()
                np.testing.assert_allclose(np.array(scores[i]), s, rtol=1e-3, atol=1e-3)
    # propose() drafts the same greedy walk, from a fresh cache.
    toks, q = draft.propose(mx.array(feats[:12]), 5, 12, 6, draft.make_cache())
    hid = hidden_ref(W, dcfg, emb, feats.astype(np.float64), 5, 12, 6)
    assert q is None and toks.tolist() == walk_ref(W, hid[1:], head(hid[1:]), 5, 6)[0]


def test_convolution_sees_no_row_before_the_anchor(pair):
    """Only block rows are convolved: the anchor row of a DFlash 2 layer is
    unchanged when the masks after it change (no wrap-around)."""
    target, _, dcfg, _, path, feats = pair
    draft = load_draft(path, target)
    conv = draft.layers[0].attention_conv
    x = mx.random.normal((1, 6, target.hidden_size), key=mx.random.key(0))
    c = conv.coefficients(x)
    y = conv(x, c, 0)
    x2 = x.at[:, 1:].add(3.0)
    y2 = conv(x2, conv.coefficients(x2), 0)
    assert mx.allclose(y[:, 0], y2[:, 0]).item()
    assert not mx.allclose(y[:, 1], y2[:, 1]).item()


# --- parity with the authors' implementation ---------------------------------------------


@pytest.fixture
def reference(monkeypatch):
    """dflash.model_mlx (the DFlash authors' MLX code, installed from PyPI by
    the test extras) loading local folders."""
    ref = pytest.importorskip("dflash.model_mlx", reason="the authors' dflash package is not installed")
    monkeypatch.setattr(ref, "snapshot_download", lambda path, **kw: path)
    return ref


@pytest.mark.parametrize("v2", [False, True])
def test_parity_with_dflash_model_mlx(pair, reference, tmp_path, v2):
    target, model, _, _, _, feats = pair
    dcfg = config(
        tiny.target_config(moe=False),
        v2=v2,
        num_hidden_layers=2,
        block_size=6,
        target_layer_ids=[0, 2],
        layer_types=["full_attention", "sliding_attention"],
        sliding_window=64,
    )
    path = write_folder(tmp_path / "d", dcfg, published_weights(dcfg, seed=3 if v2 else 4))
    ours = load_draft(path, target)
    theirs = reference.load_draft(str(path)).bind(model)
    c_ours, c_theirs = ours.make_cache(), theirs.make_cache()
    mask = dcfg["dflash_config"]["mask_token_id"]
    pos = consumed = 0
    for step, (adv, B) in enumerate([(8, 6), (3, 6), (5, 4), (2, 6)]):
        pos += adv
        anchor = 40 + step
        new = mx.array(feats[consumed:pos])
        block = mx.array([[anchor] + [mask] * (B - 1)])
        consumed = pos
        if not v2:
            got = ours(new, anchor, pos, B, c_ours)
            want = theirs(block, new[None], c_theirs, logits_start=1)[0]
            np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)
            continue
        hid = ours.block_hidden(new, anchor, pos, B, c_ours)[1:]
        logits = ours.logits(hid)
        sel = ours.candidate_selector
        if step % 2 == 0:  # greedy: the same drafted path
            path_ref, _, _ = theirs.propose(block, new[None], c_theirs, 0.0, logits_start=1)
            toks, _, _ = sel.walk(hid, logits, anchor, lambda s, i: mx.argmax(s))
            assert toks.tolist() == path_ref[0].tolist()
            continue
        # sampled: our q rows along the path the reference sampled
        mx.random.seed(step)
        T = 0.7
        path_ref, cand_ref, q_ref = theirs.propose(block, new[None], c_theirs, T, logits_start=1)
        path_ref = path_ref[0].tolist()
        cand, _ = sel.candidates(logits)
        cand_l = np.array(cand).tolist()
        toks, cand, sc = sel.walk(hid, logits, anchor, lambda s, i: cand_l[i].index(path_ref[i]))
        assert toks.tolist() == path_ref
        q = np.array(mx.softmax(sc / T, axis=-1))
        for i in range(B - 1):
            theirs_row = dict(zip(np.array(cand_ref[0, i]).tolist(), np.array(q_ref[0, i]).tolist()))
            ours_row = dict(zip(cand_l[i], q[i].tolist()))
            assert set(ours_row) == set(theirs_row)
            for tok, pq in ours_row.items():
                assert pq == pytest.approx(theirs_row[tok], abs=1e-5)


# --- decoding ------------------------------------------------------------------------------


def random_v2(target_cfg, target, seed, tmp_path, **kw):
    dcfg = config(target_cfg, **kw)
    return load_draft(write_folder(tmp_path / f"d{seed}", dcfg, published_weights(dcfg, seed)), target)


def run(target, prompt, n, **kw):
    stats = GenerationStats()
    out = []
    for toks in _generate_tokens(target, prompt, max_tokens=n, stats=stats, hooks=Hooks.take(kw), **kw):
        out.extend(toks)
    return out, stats


@pytest.mark.parametrize("which", ["dense", "moe"])
def test_greedy_speculative_equals_plain(dense, moe, tmp_path, which):
    cfg, model = dense if which == "dense" else moe
    target = Target(model)
    draft = random_v2(cfg, target, 5, tmp_path, block_size=8, layer_types=["sliding_attention"] * 2, sliding_window=6)
    for prompt in ([1, 10, 20, 30, 40], [7, 7, 7, 100, 250, 31, 64, 99, 12, 5, 300]):
        ref = reference_greedy(model, prompt, 20)
        for B in (2, 8):
            got, st = run(target, prompt, 20, draft=draft, block_size=B)
            assert got == ref and st.cycles > 0
        tree, _ = run(target, prompt, 20, draft=draft, tree_budget=6)
        assert tree == ref


class OftenRightDraft:
    """A stand-in draft that proposes from the target's own next-token
    distribution, sharpened (q proportional to p^4): often right, never exact."""

    def __init__(self, target, prompt, sampler, memo):
        self.target, self.sampler, self.memo = target, sampler, memo
        self.history = list(prompt)
        self.block_size, self.target_layer_ids = 4, []
        self.last = None
        self.rng = np.random.default_rng(sampler.seed + 1000)

    def make_cache(self, window=None):
        return None

    def propose(self, features, anchor, anchor_pos, B, cache, sampler=None, sample=False):
        assert sample
        if self.last is not None:  # the accepted drafts of the last cycle, then the new anchor
            pos0, drafted = self.last
            self.history += drafted[: anchor_pos - pos0 - 1]
        self.history.append(anchor)
        assert len(self.history) == anchor_pos + 1
        seq, toks, qs = list(self.history), [], []
        for _ in range(B - 1):
            key = tuple(seq)
            if key not in self.memo:  # the same prefixes recur across runs
                logits, _ = self.target.batch_forward(mx.array([seq]))
                p = np.array(self.sampler.probs(logits[:, -1]), np.float64)[0]
                self.memo[key] = p**4 / (p**4).sum()
            q = self.memo[key]
            t = int(self.rng.choice(len(q), p=q))
            toks.append(t)
            qs.append(q)
            seq.append(t)
        self.last = (anchor_pos, toks)
        return mx.array(toks, dtype=mx.int32), mx.array(np.array(qs, np.float32))


def wrong_rule(p, q, drafted, picks, seed, positions):
    """Resamples a rejected row from p instead of the residual max(p - q, 0)."""
    acc, _ = speculative_rule(p, q, drafted, picks, seed, positions)
    n = drafted.shape[0]
    return acc, mx.concatenate([picks[:n], picks[n:]])


@pytest.fixture(scope="module")
def small_vocab():
    cfg = tiny.target_config(vocab_size=12)
    return Target(tiny.build_target(cfg, seed=21))


def exact_pairs(target, prompt, sampler):
    """Exact joint distribution [V, V] of the first two generated tokens."""
    V = target.vocab_size
    first, _ = target.batch_forward(mx.array([list(prompt)]))
    second, _ = target.batch_forward(mx.array([list(prompt) + [a] for a in range(V)]))
    p0 = np.array(sampler.probs(first[:, -1]), np.float64)[0]
    return p0[:, None] * np.array(sampler.probs(second[:, -1]), np.float64)


def sample_counts(target, prompt, kw, n, rule=speculative_rule, draft=None):
    """Counts of the first two tokens (joint) and of the third; drafts kept.
    ``draft``: a real draft (default: an :class:`OftenRightDraft` per run)."""
    V = target.vocab_size
    pairs, third = np.zeros((V, V)), np.zeros(V)
    accepted, memo = 0, {}
    for seed in range(n):
        s = Sampler(**kw, seed=seed)
        out, st = run(
            target,
            prompt,
            5,
            draft=draft if draft is not None else OftenRightDraft(target, prompt, s, memo),
            sampler=s,
            block_size=4,
            accept_rule="speculative",
            spec_rule=rule,
        )
        accepted += sum((c - 1) * k for c, k in enumerate(st.accept_hist) if c)
        pairs[out[0], out[1]] += 1
        third[out[2]] += 1
    return pairs.reshape(-1), third, accepted


def mode_z(counts, joint, n):
    """z-score of how often the second token is the target's most likely one
    given the first (a rule biased towards the draft's favourites inflates it)."""
    V = joint.shape[0]
    modes = joint.argmax(1)
    p = joint[np.arange(V), modes].sum()
    hits = counts.reshape(V, V)[np.arange(V), modes].sum()
    return (hits - n * p) / math.sqrt(n * p * (1 - p))


@pytest.mark.parametrize(
    "kw", [dict(temperature=0.5, top_k=8), dict(temperature=0.8, top_k=8, xtc_probability=0.5, xtc_threshold=0.1)]
)
def test_speculative_rule_gives_the_target_distribution(small_vocab, kw):
    # With XTC the target's distribution is a mixture of the cut and the whole one.
    target = small_vocab
    prompt, n = [1, 5, 7], 400
    joint = exact_pairs(target, prompt, Sampler(**kw, seed=0))
    third = exact_marginals(target, prompt, Sampler(**kw, seed=0), 3)[2]
    got_pairs, got_third, accepted = sample_counts(target, prompt, kw, n)
    assert accepted > n  # the draft was often right: more than one kept draft per run
    assert not chi2_fails(got_pairs, joint.reshape(-1), n)[0], chi2_fails(got_pairs, joint.reshape(-1), n)
    assert not chi2_fails(got_third, third, n)[0], chi2_fails(got_third, third, n)
    assert abs(mode_z(got_pairs, joint, n)) < 4
    if "xtc_probability" not in kw:  # (XTC flattens the mode this statistic looks at)
        # A rule that resamples a rejected row from p instead of the residual is caught.
        wrong, _, _ = sample_counts(target, prompt, kw, n, rule=wrong_rule)
        assert mode_z(wrong, joint, n) > 4


def sharpened_q_rule(p, q, drafted, picks, seed, positions):
    """The rule fed q**2 (renormalised) instead of the q the draft drew from:
    what a draft reporting the proposal of half its temperature would cause."""
    q2 = q * q
    return speculative_rule(p, q2 / q2.sum(axis=-1, keepdims=True), drafted, picks, seed, positions)


@pytest.mark.parametrize(
    "kw",
    [
        pytest.param(dict(temperature=0.5, top_k=8), marks=pytest.mark.slow),  # 1200 generations (~40-100 s)
        # In the default run: XTC's p goes through a real draft's own q (which has no XTC).
        dict(temperature=0.8, top_k=8, xtc_probability=0.5, xtc_threshold=0.1),
    ],
    ids=["plain", "xtc"],
)
def test_speculative_rule_with_a_real_draft_gives_the_target_distribution(small_vocab, kw):
    """As above, but the drafts come from a real (random-weight) DFlash draft
    through its own sampled propose path, so its reported q, its draws and
    the rule's residual are checked together against the target's own
    sampling distribution; a residual that is p, or a q the draft did not
    draw from, fails the same test."""
    target = small_vocab
    dcfg = tiny.draft_config(tiny.target_config(vocab_size=12), num_hidden_layers=1, block_size=4)
    draft = tiny.build_draft(dcfg, seed=3).bind(target)
    # XTC's mixture is flatter: more runs to tell a wrong q from the right one.
    prompt, n = [1, 5, 7], 800 if "xtc_probability" in kw else 400
    joint = exact_pairs(target, prompt, Sampler(**kw, seed=0)).reshape(-1)
    third = exact_marginals(target, prompt, Sampler(**kw, seed=0), 3)[2]
    got_pairs, got_third, accepted = sample_counts(target, prompt, kw, n, draft=draft)
    assert accepted > n // 2  # drafts kept and drafts rejected: both branches of the rule ran
    assert not chi2_fails(got_pairs, joint, n)[0], chi2_fails(got_pairs, joint, n)
    assert not chi2_fails(got_third, third, n)[0], chi2_fails(got_third, third, n)
    wrong, _, _ = sample_counts(target, prompt, kw, n, rule=wrong_rule, draft=draft)
    assert chi2_fails(wrong, joint, n)[0], chi2_fails(wrong, joint, n)
    sharp, _, _ = sample_counts(target, prompt, kw, n, rule=sharpened_q_rule, draft=draft)
    assert chi2_fails(sharp, joint, n)[0], chi2_fails(sharp, joint, n)


def test_speculative_rule_unit():
    """Row 0 always accepted when q <= p; a q far above p at row 1 is rejected
    and resampled where p exceeds q; all accepted -> the bonus pick."""
    V = 4
    p = mx.array([[0.5, 0.5, 0, 0], [0.1, 0.9, 0, 0], [0.25, 0.25, 0.25, 0.25]])
    q = mx.array([[0.4, 0.6, 0, 0], [1.0, 0, 0, 0]])
    hits = np.zeros(V)
    for seed in range(200):
        acc, tok = speculative_rule(p, q, mx.array([0, 0]), mx.array([9, 9, 3]), seed, [10, 11, 12])
        acc = acc.tolist()
        assert acc[0]
        if not acc[1]:
            hits[tok.tolist()[1]] += 1
    assert hits[1] == hits.sum() > 150  # rejected ~90%: always the residual's token 1


def test_sampled_decoding_runs_with_either_rule(dense, tmp_path):
    cfg, model = dense
    target = Target(model)
    draft = random_v2(cfg, target, 6, tmp_path, block_size=6)
    prompt = [1, 10, 20, 30, 40]
    for rule in ("equality", "speculative"):
        a, _ = run(target, prompt, 16, draft=draft, sampler=Sampler(0.9, seed=3), accept_rule=rule)
        b, _ = run(target, prompt, 16, draft=draft, sampler=Sampler(0.9, seed=3), accept_rule=rule)
        assert a == b and len(a) == 16  # reproducible for a seed in one mode
    plain, _ = run(target, prompt, 16, sampler=Sampler(0.9, seed=3))
    eq, _ = run(target, prompt, 16, draft=draft, sampler=Sampler(0.9, seed=3), accept_rule="equality")
    assert plain == eq
    with pytest.raises(DFlashError, match="accept_rule"):
        run(target, prompt, 4, draft=draft, sampler=Sampler(0.9, seed=3), accept_rule="typical")


# --- bad folders ----------------------------------------------------------------------------


def test_bad_dflash2_folders_give_one_clear_error(pair, tmp_path):
    import json

    target, _, dcfg, W, _, _ = pair
    cases = []
    no_sel = json.loads(json.dumps(dcfg))
    del no_sel["dflash_config"]["selector_rank"], no_sel["dflash_config"]["selector_top_k"]
    cases.append((no_sel, W, "lacks selector_rank, selector_top_k"))
    renamed = dict(W)
    renamed["candidate_selector.successor_codebook.weight"] = renamed.pop("candidate_selector.successor_codebook")
    cases.append((dcfg, renamed, "weight names do not match a DFlash 2 draft"))
    as_v1 = json.loads(json.dumps(dcfg))
    as_v1["architectures"] = ["DFlashDraftModel"]
    cases.append((as_v1, W, "weight names do not match a DFlash v1 draft"))
    bad_group = json.loads(json.dumps(dcfg))
    bad_group["dflash_config"]["conv_group_size"] = 24
    cases.append((bad_group, W, "conv_group_size 24 does not divide"))
    shape = dict(W)
    shape["candidate_selector.hidden_projection.weight"] = np.zeros((5, 64), np.float32)
    cases.append((dcfg, shape, "hidden_projection"))
    for i, (c, w, msg) in enumerate(cases):
        path = write_folder(tmp_path / f"bad{i}", c, w)
        with pytest.raises(DFlashError, match=msg):
            load_draft(path, target)
    # info reads the config alone: a missing selector size is bad input there too (it said "rank None", exit 0)
    from mlx_dflash.info import describe

    with pytest.raises(DFlashError, match="lacks selector_rank, selector_top_k"):
        describe(tmp_path / "bad0")


def test_info_shows_the_draft_kind(pair):
    from mlx_dflash.info import describe

    *_, path, _ = pair
    out, _ = describe(path)
    assert "kind: DFlash 2 draft" in out and "selector: top-6, rank 8" in out


# --- CLI and bench -----------------------------------------------------------------------------


def test_bench_and_generate_take_a_dflash2_draft(dense, tok_dir, tmp_path, capsys):
    import json

    from mlx_dflash.cli import main

    cfg, model = dense
    path = tiny.save_mlx(model, cfg, tmp_path / "m", tokenizer_dir=tok_dir)
    v1 = config(cfg, v2=False, block_size=6)
    v2 = config(cfg, block_size=6)
    d1 = write_folder(tmp_path / "v1", v1, published_weights(v1, 1))
    d2 = write_folder(tmp_path / "v2", v2, published_weights(v2, 2))
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "code.txt").write_text("def add(a, b):\n")

    def cli(*args):
        with pytest.raises(SystemExit) as e:
            main(list(args))
        out = capsys.readouterr()
        return e.value.code, out.out + out.err

    code, out = cli(
        "bench",
        "-m",
        str(path),
        "-d",
        str(d1),
        "--draft2",
        str(d2),
        "--prompts",
        str(tmp_path / "p"),
        "-n",
        "8",
        "--repeats",
        "1",
        "--blas",
        "bundled",
        "--out",
        str(tmp_path / "r"),
        "--name",
        "b",
    )
    assert code in (0, None), out
    res = json.loads((tmp_path / "r" / "b.json").read_text())
    assert (
        res["modes"] == ["mlx-lm", "baseline", "dflash", "dflash-pinned", "dflash2"]
        and res["draft2_kind"] == "DFlash 2"
    )
    assert res["results"][0]["modes"]["dflash2"]["generated"] == 8
    md = (tmp_path / "r" / "b.md").read_text()
    assert "dflash2 tau" in md and "Acceptance histograms, dflash2 chain" in md
    for rule in ("equality", "speculative"):
        code, out = cli(
            "generate",
            "-m",
            str(path),
            "-d",
            str(d2),
            "--temp",
            "0.8",
            "--seed",
            "1",
            "-n",
            "8",
            "--accept-rule",
            rule,
            "--no-chat-template",
            "def f(x):",
        )
        assert code in (0, None), out
    code, out = cli("generate", "-m", str(path), "-d", str(d2), "--temp", "0.8", "--accept-rule", "typical", "x")
    assert code == 2 and "accept_rule (--accept-rule) must be" in out and "Traceback" not in out
    code, out = cli("info", str(d2))
    assert "kind: DFlash 2 draft" in out
