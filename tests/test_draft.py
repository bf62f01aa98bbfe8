"""DFlash draft forward vs a reference written from the math (docs/math.md), and draft loading."""

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_dflash.cache import Rows
from mlx_dflash.loading import load_draft
from mlx_dflash.models.draft import default_target_layer_ids
from mlx_dflash.models.qwen35 import Target
from tools import tiny


def rope_ref(x, positions, theta):
    """NeoX (rotate-half) RoPE over the full head dim. x [S, nh, D]."""
    D = x.shape[-1]
    inv = theta ** (-np.arange(0, D, 2) / D)
    ang = np.asarray(positions, np.float64)[:, None] * inv[None]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def draft_ref(draft, target, feats, anchor, anchor_pos, B, window=None, theta=None, pos_scale=1.0):
    """Uncached draft forward, straight from the math (docs/math.md). ``theta``
    and ``pos_scale`` (linear RoPE scaling: positions times 1/factor) override
    the config's RoPE."""
    cfg = draft.config
    npa = lambda t: np.array(t, dtype=np.float64)
    ctx_pos = list(range(anchor_pos))
    if window is not None:
        sink, recent = window
        if len(ctx_pos) > sink + recent:
            ctx_pos = ctx_pos[:sink] + ctx_pos[-recent:]
    ctx = draft.hidden_norm(draft.fc(feats[mx.array(ctx_pos)]))  # [S, H]
    S = len(ctx_pos)
    ids = mx.array([anchor] + [cfg.mask_token_id] * (B - 1))
    h = target.embed(ids)  # [B, H]
    blk_pos = [anchor_pos + j for j in range(B)]
    nh, nkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    for i, layer in enumerate(draft.layers):
        at = layer.self_attn
        x = layer.input_layernorm(h)
        q = npa(at.q_norm(at.q_proj(x).reshape(B, nh, D)))
        kv_in = mx.concatenate([ctx, x], axis=0)
        k = npa(at.k_norm(at.k_proj(kv_in).reshape(S + B, nkv, D)))
        v = npa(at.v_proj(kv_in).reshape(S + B, nkv, D))
        th = theta or cfg.rope_theta
        q = rope_ref(q, np.array(blk_pos) * pos_scale, th)
        k = rope_ref(k, np.array(ctx_pos + blk_pos) * pos_scale, th)
        rep = nh // nkv
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(D)
        allowed = np.ones((B, S + B), bool)
        if cfg.layer_types and cfg.layer_types[i] == "sliding_attention":
            W = cfg.sliding_window
            allowed[:, :S] = (np.array(ctx_pos) >= anchor_pos - (W - 1))[None]
            if cfg.sliding_block_causal:
                allowed[:, S:] = np.tril(np.ones((B, B), bool))
        scores = np.where(allowed[None], scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out = np.einsum("hqk,khd->qhd", p, v).reshape(B, nh * D)
        h = h + at.o_proj(mx.array(out.astype(np.float32)))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return target.lm_head(draft.norm(h[1:]))


@pytest.fixture(scope="module")
def setup(dense):
    cfg, model = dense
    target = Target(model)
    dcfg = tiny.draft_config(
        cfg,
        num_hidden_layers=3,
        block_size=8,
        layer_types=["full_attention", "sliding_attention", "full_attention"],
        sliding_window=5,
        target_layer_ids=[0, 1, 3],
    )
    draft = tiny.build_draft(dcfg, seed=5).bind(target)
    feats = mx.random.normal((60, 3 * target.hidden_size), key=mx.random.key(1))
    return target, draft, dcfg, feats


@pytest.mark.parametrize("window", [None, (2, 6)])
def test_draft_matches_spec_reference_over_cycles(setup, window):
    target, draft, _, feats = setup
    cache = draft.make_cache(window)
    pos, consumed = 11, 0
    for step, (adv, B) in enumerate([(0, 8), (3, 8), (1, 4), (8, 8), (5, 2), (2, 8)]):
        pos += adv
        new = feats[consumed:pos]
        got = draft(new, anchor=40 + step, anchor_pos=pos, block_size=B, cache=cache)
        consumed = pos
        want = draft_ref(draft, target, feats, 40 + step, pos, B, window)
        assert got.shape == (B - 1, target.vocab_size)
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)
    if window is not None:
        assert len(cache.positions) == sum(window)


def test_unwindowed_context_grows_in_place_not_by_concatenation(setup):
    """Context rows and each cycle's block rows are written into buffers that
    grow in steps, so a cycle does not copy the whole context: over 40 cycles
    the buffers are allocated once; what they hold is exactly the context."""
    target, draft, _, feats = setup
    cache = draft.make_cache()
    draft(feats[:10], 40, 10, 8, cache)
    caps = set()
    for pos in range(11, 51):
        got = draft(feats[pos - 1 : pos], 40, pos, 8, cache)
        caps.update(b.shape[2] for r in cache._rows for b in r.bufs)
    assert caps == {Rows.step}
    assert all(k.shape[2] == len(cache.positions) == 50 for k in cache.keys)
    want = draft_ref(draft, target, feats, 40, 50, 8, None)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)


def test_all_sliding_draft_keeps_only_its_window_and_matches_training_forward(dense):
    """A draft trained with a context window (every layer sliding, block
    bidirectional) keeps W-1 context rows by default; each cycle's logits
    equal the reference and the training forward over the same anchors."""
    from mlx_dflash.models.draft import train_logits

    cfg, model = dense
    target = Target(model)
    W = 9
    dcfg = tiny.draft_config(
        cfg,
        num_hidden_layers=2,
        block_size=6,
        target_layer_ids=[0, 2],
        layer_types=["sliding_attention"] * 2,
        sliding_window=W,
    )
    dcfg["sliding_block_causal"] = False
    draft = tiny.build_draft(dcfg, seed=3).bind(target)
    L = 48
    feats = mx.random.normal((L, 2 * target.hidden_size), key=mx.random.key(2))
    tokens = mx.random.randint(4, 400, (L,), key=mx.random.key(3))
    cache = draft.make_cache()
    anchors, pos, consumed = [], 3, 0
    for adv in (0, 6, 2, 9, 1, 12, 5):
        pos += adv
        got = draft(feats[consumed:pos], int(tokens[pos].item()), pos, 6, cache)
        consumed = pos
        assert len(cache.positions) == min(pos, W - 1)
        want = draft_ref(draft, target, feats, int(tokens[pos].item()), pos, 6)
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)
        anchors.append((pos, got))
    train = train_logits(draft, feats[None], tokens[None], mx.array([[a for a, _ in anchors]]))[0]
    for j, (_, got) in enumerate(anchors):
        np.testing.assert_allclose(np.array(train[j]), np.array(got), rtol=1e-4, atol=1e-4)


def test_draft_rejects_out_of_step_context(setup):
    _, draft, _, feats = setup
    cache = draft.make_cache()
    draft(feats[:5], 1, 5, 4, cache)
    with pytest.raises(ValueError, match="out of step"):
        draft(feats[:3], 1, 9, 4, cache)


def test_default_layer_ids():
    assert default_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]  # round(1 + i * 60 / 4)
    assert default_target_layer_ids(8, 1) == [4]


def test_draft_folder_roundtrip_and_quantized_load(setup, tmp_path):
    target, draft, dcfg, feats = setup
    path = tiny.save_draft(draft, dcfg, tmp_path / "draft")
    loaded = load_draft(path, target)
    a = draft(feats[:9], 5, 9, 8, draft.make_cache())
    b = loaded(feats[:9], 5, 9, 8, loaded.make_cache())
    assert mx.array_equal(a, b).item()
    q = load_draft(path, target, quantize_bits=8, group_size=32)
    assert isinstance(q.layers[0].mlp.up_proj, nn.QuantizedLinear)
    c = q(feats[:9], 5, 9, 8, q.make_cache())
    assert mx.abs(c - a).max().item() < 0.1 * mx.abs(a).max().item()


def test_sliding_layer_attends_only_its_window(setup, monkeypatch):
    """A sliding layer's attention reads the context rows in its window, not
    all the rows a full layer keeps: its cost stays flat as the context grows
    (and what it computes is the spec's, test_draft_matches_spec_reference_over_cycles)."""
    import mlx_dflash.models.draft as draft_mod

    target, draft, _, feats = setup
    seen = []
    real = draft_mod.attention

    def spy(q, keys, values, scale, mask=None, **kw):
        seen.append(keys.shape[2])
        return real(q, keys, values, scale, mask, **kw)

    monkeypatch.setattr(draft_mod, "attention", spy)
    cache = draft.make_cache()
    got = draft(feats[:50], 40, 50, 8, cache)
    full, sliding, _ = seen  # layers: full, sliding (window 5), full
    assert full == 50 + 8 and sliding == 5 - 1 + 8
    want = draft_ref(draft, target, feats, 40, 50, 8, None)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)
