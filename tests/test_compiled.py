"""The compiled decode-time forwards (target layers, rollback, draft block)
against the same code run as plain MLX ops: equal logits, features, caches
and tokens, on dense and MoE targets, and weights changed after the first
compile are seen."""

import mlx.core as mx
import numpy as np
import pytest
from support.reference import reference_greedy

from mlx_dflash.decode import generate_tokens
from mlx_dflash.models.qwen35 import Target
from tools import tiny

PROMPT = [1, 10, 20, 30, 40, 7, 9]


def _close(a, b, tol=1e-5):
    np.testing.assert_allclose(np.array(a), np.array(b), rtol=tol, atol=tol)


def _twins(model):
    """The same model as a compiled and a plain-ops target."""
    on, off = Target(model), Target(model)
    off.compiled = False
    assert on.compiled
    return on, off


def test_plain_steps_and_verify_with_rollback_match_plain_ops(any_model):
    _, model = any_model
    on, off = _twins(model)
    caches = [t.make_cache() for t in (on, off)]
    for t, c in zip((on, off), caches):
        t.prefill(PROMPT, c, capture=[1, 3])
    for step in range(3):  # plain steps (T = 1) several times: the compiled graph is replayed
        outs = [t.forward([5 + step], c, capture=[1, 3]) for t, c in zip((on, off), caches)]
        _close(outs[0][0], outs[1][0])
        _close(outs[0][1], outs[1][1])
    for width, keep in ((16, 5), (4, 4), (7, 1)):  # recorded blocks, rolled back partly, fully, to one
        block = [(3 * j + width) % 200 for j in range(width)]
        outs = [t.forward(block, c, capture=[1, 3], record=True) for t, c in zip((on, off), caches)]
        _close(outs[0][0], outs[1][0])
        _close(outs[0][1], outs[1][1])
        for c in caches:
            c.rollback(keep)
        assert caches[0].offset == caches[1].offset
        for a, b in zip(caches[0].state(), caches[1].state()):
            _close(a, b)


def test_compiled_target_decodes_mlx_lm_greedy_with_and_without_a_draft(any_model):
    cfg, model = any_model
    on, off = _twins(model)
    draft = tiny.build_draft(tiny.draft_config(cfg, num_hidden_layers=2, block_size=8), seed=5)
    N = 40
    ref = reference_greedy(model, PROMPT, N)
    for t in (on, off):
        d = draft.bind(t)
        assert sum(generate_tokens(t, PROMPT, max_tokens=N), []) == ref
        assert sum(generate_tokens(t, PROMPT, draft=d, max_tokens=N, block_size=8), []) == ref
        assert sum(generate_tokens(t, PROMPT, draft=d, max_tokens=N), []) == ref  # adaptive widths


def test_compiled_draft_block_matches_plain_ops(dense):
    cfg, model = dense
    target = Target(model)
    draft = tiny.build_draft(
        tiny.draft_config(
            cfg,
            num_hidden_layers=2,
            block_size=8,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=6,
        ),
        seed=5,
    ).bind(target)
    _, feats = target.prefill(PROMPT, target.make_cache(), capture=draft.target_layer_ids)
    out = {}
    for flag in (True, False):
        draft.compiled = flag
        cache = draft.make_cache()
        rows = [draft(feats[:-2], 3, len(PROMPT) - 2, 8, cache)]  # prompt context, then one and then one more row
        rows.append(draft(feats[-2:-1], 4, len(PROMPT) - 1, 8, cache))
        rows.append(draft(feats[-1:], 5, len(PROMPT), 8, cache))
        out[flag] = rows
    for a, b in zip(out[True], out[False]):
        _close(a, b)


def test_weights_changed_after_compiling_are_seen(dense):
    _, model = dense
    target = Target(model)
    layer = target.layers[0]
    before = target.forward([3], target.make_cache())[0]
    saved = layer.mlp.down_proj.weight
    try:
        layer.mlp.down_proj.weight = saved * 0.5  # e.g. a test rigging a model, or a weight update
        after = target.forward([3], target.make_cache())[0]
        off = Target(model)
        off.compiled = False
        _close(after, off.forward([3], off.make_cache())[0])
        assert mx.abs(after - before).max().item() > 1e-3
    finally:
        layer.mlp.down_proj.weight = saved


@pytest.mark.parametrize("kv_bits", [8, 4])
def test_compiled_target_with_quantized_kv_matches_plain_ops(kv_bits):
    model = tiny.build_target(
        tiny.target_config(hidden_size=128, head_dim=64, num_attention_heads=2, num_key_value_heads=1), seed=2
    )
    on, off = _twins(model)
    outs = []
    for t in (on, off):
        c = t.make_cache(kv_bits=kv_bits)
        t.prefill(PROMPT, c)
        lg, _ = t.forward([4, 8, 15, 16], c, record=True)
        c.rollback(2)
        outs.append((lg, t.forward([23], c)[0]))
    _close(outs[0][0], outs[1][0])
    _close(outs[0][1], outs[1][1])


def test_only_decode_forwards_are_compiled(dense):
    """Prefills (any length) run as plain ops; a plain step and a recorded
    verify are compiled, one trace per layer and width."""
    _, model = dense
    target = Target(model)
    cache = target.make_cache()
    target.prefill(PROMPT, cache)  # 7 tokens, not recorded
    target.forward([3, 4, 5], cache)  # a short unrecorded block (a prefix-cache suffix, say)
    assert target._fns == {}
    target.forward([6], cache)
    target.forward([7, 8, 9, 10], cache, record=True)
    cache.rollback(2)
    n = target.num_layers
    widths = {key[1] for key in target._fns}
    assert widths == {1, 4} and len(target._fns) <= 2 * 2 * n


def test_a_dynamic_rope_draft_runs_as_plain_ops_and_matches(dense):
    """mlx-lm's dynamic-NTK RoPE compares its offset in Python, so it cannot
    take the array offset of a compiled forward: that draft runs as plain ops."""
    cfg, model = dense
    target = Target(model)
    dcfg = tiny.draft_config(cfg, num_hidden_layers=2, block_size=6, target_layer_ids=[0, 2])
    dcfg["rope_scaling"] = {"type": "dynamic", "factor": 2.0}
    draft = tiny.build_draft(dcfg, seed=3).bind(target)
    _, feats = target.prefill(PROMPT, target.make_cache(), capture=draft.target_layer_ids)
    out = {}
    for flag in (True, False):
        draft.compiled = flag
        out[flag] = draft(feats, 4, len(PROMPT), 6, draft.make_cache())
    _close(out[True], out[False])
    assert "_compiled_fns" not in draft.__dict__ or not draft.__dict__["_compiled_fns"]


def _v2_draft(cfg, target, tmp_path):
    from test_draft2 import random_v2

    draft = random_v2(
        cfg, target, 5, tmp_path, block_size=8, layer_types=["sliding_attention", "full_attention"], sliding_window=6
    )
    assert draft.config.is_v2
    return draft


def test_dflash2_draft_compiles_and_matches_plain_ops_bit_for_bit(dense, tmp_path):
    """A DFlash 2 draft's blocks (convolutions around the attention and the
    MLP) run as compiled steps like v1's, with the same hidden rows, logits
    and proposals as plain ops, bit for bit."""
    cfg, model = dense
    target = Target(model)
    draft = _v2_draft(cfg, target, tmp_path)
    _, feats = target.prefill(PROMPT, target.make_cache(), capture=draft.target_layer_ids)
    n = len(PROMPT)
    out = {}
    for flag in (True, False):
        draft.compiled = flag
        cache = draft.make_cache()
        rows = []
        for f, anchor, pos in ((feats[:-2], 3, n - 2), (feats[-2:-1], 4, n - 1), (feats[-1:], 5, n)):
            hidden = draft.block_hidden(f, anchor, pos, 8, cache)
            rows += [hidden, draft.logits(hidden[1:]), draft.propose(None, anchor, pos, 8, cache)[0]]
        out[flag] = rows
        if flag:
            keys = set(draft.__dict__.get("_compiled_fns", {}))
            assert {(i, 8, kind) for i in range(2) for kind in ("pre", "post")} == {k[:3] for k in keys}
    for a, b in zip(out[True], out[False]):
        assert a.dtype == b.dtype and np.array_equal(np.array(a), np.array(b))


def test_compiled_dflash2_draft_decodes_plain_greedy(dense, tmp_path):
    cfg, model = dense
    target = Target(model)
    draft = _v2_draft(cfg, target, tmp_path)
    N = 40
    ref = reference_greedy(model, PROMPT, N)
    assert sum(generate_tokens(target, PROMPT, draft=draft, max_tokens=N, block_size=8), []) == ref
    assert draft.__dict__.get("_compiled_fns")  # the compiled steps ran
