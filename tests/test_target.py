"""Target forward vs mlx-lm's qwen3_5 / qwen3_5_moe, and exact rollback."""

import mlx.core as mx
import numpy as np
import pytest
from support.reference import assert_cache_is_plain_forward

from mlx_dflash.kernels import fused_exp, gated_delta
from mlx_dflash.models.qwen35 import Target


def test_logits_match_mlx_lm_after_chunked_prefill_and_decode(any_model):
    _, model = any_model
    target = Target(model)
    prompt = mx.random.randint(0, 512, (37,), key=mx.random.key(0)).tolist()
    ref_cache = model.make_cache()
    ref = model(mx.array(prompt)[None], cache=ref_cache)[0]
    cache = target.make_cache()
    logits, feats = target.prefill(prompt, cache, capture=[0, 2, 3], chunk_size=8)
    assert feats.shape == (37, 3 * target.hidden_size)
    assert mx.abs(logits[-1] - ref[-1]).max().item() <= 1e-4
    tok = int(mx.argmax(logits[-1]))
    for _ in range(5):
        r = model(mx.array([[tok]]), cache=ref_cache)[0]
        lg, _ = target.forward([tok], cache)
        assert mx.abs(lg - r).max().item() <= 1e-4
        tok = int(mx.argmax(lg[-1]))
    # A multi-token block after decoding also matches.
    block = [5, 9, 11, 2]
    r = model(mx.array([block]), cache=ref_cache)[0]
    lg, _ = target.forward(block, cache)
    assert mx.abs(lg - r).max().item() <= 1e-4


def test_captured_features_are_layer_outputs(dense):
    _, model = dense
    target = Target(model)
    prompt = [1, 5, 7, 9, 30]
    _, feats = target.prefill(prompt, target.make_cache(), capture=[1])
    # Recompute layer 1's output by running mlx-lm's layers by hand.
    h = model.language_model.model.embed_tokens(mx.array(prompt)[None])
    caches = model.make_cache()
    from mlx_lm.models.base import create_attention_mask, create_ssm_mask

    for i, layer in enumerate(model.layers[:2]):
        mask = create_ssm_mask(h, caches[i]) if layer.is_linear else create_attention_mask(h, caches[i])
        h = layer(h, mask=mask, cache=caches[i])
    assert mx.abs(feats - h[0]).max().item() <= 1e-5


@pytest.mark.parametrize("n_keep", [1, 2, 5, 7, 8])
def test_rollback_equals_plain_forward_over_committed(any_model, n_keep):
    _, model = any_model
    target = Target(model)
    prompt = [3, 17, 44, 91, 5, 6, 200]
    block = [12, 99, 150, 7, 8, 300, 41, 42]
    cache = target.make_cache()
    target.prefill(prompt, cache)
    target.forward(block, cache, record=True)
    cache.rollback(n_keep)
    mx.eval(cache.state())
    assert cache.offset == len(prompt) + n_keep
    assert_cache_is_plain_forward(target, cache, prompt + block[:n_keep])
    fresh = target.make_cache()
    target.prefill(prompt + block[:n_keep], fresh)
    # And the next step's logits agree.
    a, _ = target.forward([77], cache)
    b, _ = target.forward([77], fresh)
    assert mx.abs(a - b).max().item() <= 1e-5


def sequential_reference(q, k, v, g, beta, S, mask=None):
    """docs/math.md §1 per token: S = g S; u = S k; delta = beta (v - u); S += delta k^T; y = S q."""
    q, k, v, g, beta, S = (np.array(x, np.float64) for x in (q, k, v, g, beta, S))
    T, Hk, Hv = q.shape[1], q.shape[2], v.shape[2]
    ys, deltas, states = [], [], [S.copy()]
    for t in range(T):
        y = np.zeros(v.shape[:1] + v.shape[2:])
        dl = np.zeros_like(y)
        for h in range(Hv):
            kh = h // (Hv // Hk)
            if mask is not None and not mask[0, t]:
                continue
            Sh = S[0, h] * g[0, t, h]
            u = Sh @ k[0, t, kh]
            d = beta[0, t, h] * (v[0, t, h] - u)
            Sh = Sh + np.outer(d, k[0, t, kh])
            S[0, h] = Sh
            y[0, h] = Sh @ q[0, t, kh]
            dl[0, h] = d
        ys.append(y)
        deltas.append(dl)
        states.append(S.copy())
    return np.stack(ys, 1), np.stack(deltas, 1), states


@pytest.mark.parametrize("T", [1, 5, 16, 23, 70])
@pytest.mark.parametrize("masked", [False, True])
def test_gated_delta_matches_sequential_reference_and_rolls_back(T, masked):
    keys = mx.random.split(mx.random.key(T), 6)
    Hk, Hv, Dk, Dv = 2, 4, 16, 8
    q = mx.random.normal((1, T, Hk, Dk), key=keys[0]) * 0.3
    k = mx.random.normal((1, T, Hk, Dk), key=keys[1]) * 0.3
    v = mx.random.normal((1, T, Hv, Dv), key=keys[2])
    g = mx.random.uniform(0.3, 1.0, (1, T, Hv), key=keys[3])
    beta = mx.random.uniform(0.0, 1.0, (1, T, Hv), key=keys[4])
    s0 = mx.random.normal((1, Hv, Dv, Dk), key=keys[5]) * 0.5
    mask = None
    if masked:
        mask = mx.array([[t % 3 != 1 for t in range(T)]])
    y, sT, tape = gated_delta.gated_delta_chain(q, k, v, g, beta, s0, mask, record=True)
    ry, rdelta, states = sequential_reference(q, k, v, g, beta, s0, None if mask is None else np.array(mask))
    keep = slice(None) if mask is None else np.array(mask)[0]
    np.testing.assert_allclose(np.array(y)[:, keep], ry[:, keep], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.array(tape), rdelta, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.array(sT), states[-1], rtol=1e-4, atol=1e-5)
    for n in range(T + 1):
        got = gated_delta.gated_delta_rollback(s0, k, g, tape, n, mask)
        np.testing.assert_allclose(np.array(got), states[n], rtol=1e-4, atol=1e-5)


def test_rollback_outside_block_is_rejected(dense):
    target = Target(dense[1])
    cache = target.make_cache()
    target.prefill([1, 2, 3], cache)
    with pytest.raises(RuntimeError):
        cache.rollback(1)
    target.forward([4, 5], cache, record=True)
    with pytest.raises(ValueError):
        cache.rollback(3)


@pytest.fixture(scope="module")
def bf16_converted(tmp_path_factory, tok_dir):
    """Tiny dense targets saved in HF format and converted to bf16 by
    ``mlx_lm.convert`` itself (what a user's bf16 checkpoint is)."""
    from mlx_lm.convert import convert

    from tools import tiny

    root = tmp_path_factory.mktemp("bf16")
    out = []
    for seed in (3,):  # (a mutation of either op below parts from mlx-lm within 80 tokens here)
        cfg = tiny.target_config()
        hf = tiny.save_hf(tiny.build_target(cfg, seed=seed), cfg, root / f"hf{seed}", tok_dir)
        convert(str(hf), str(root / f"mlx{seed}"), dtype="bfloat16")
        out.append(root / f"mlx{seed}")
    return out


def test_bf16_plain_greedy_equals_mlx_lm_generate(bf16_converted):
    """Same ops in the same precision as mlx-lm (SiLU of the conv in the input
    dtype, greedy argmax over bf16 log-probabilities): token for token over
    200 tokens. (Longer prompts can part: README, 'Numerics'.)"""
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model
    from test_decode import PROMPTS

    from mlx_dflash.decode import generate_tokens
    from mlx_dflash.loading import load_target

    for path in bf16_converted:
        ref_model, _ = load_model(path)
        target = load_target(path)
        assert target.embed_tokens.weight.dtype == mx.bfloat16
        for prompt in PROMPTS:
            ref = [int(t) for t, _ in generate_step(mx.array(prompt), ref_model, max_tokens=200)]
            ours = [t for ts in generate_tokens(target, prompt, max_tokens=200) for t in ts]
            assert ours == ref, (path.name, prompt, next(i for i, (a, b) in enumerate(zip(ours, ref)) if a != b))


def _reference_attention(q, k, v, scale, keep):
    """float64 softmax attention; keep [T, L] bool."""
    q, k, v = (np.array(a, dtype=np.float64) for a in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    s = np.einsum("bhtd,bhld->bhtl", q * scale, k)
    s = np.where(keep, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhtl,bhld->bhtd", p / p.sum(-1, keepdims=True), v)


@pytest.mark.parametrize(
    "H,Hkv,T,L,mask", [(4, 2, 16, 300, "causal"), (4, 4, 3, 400, None), (8, 2, 5, 277, "bool"), (4, 2, 1, 30, None)]
)
def test_cpu_attention_matches_softmax_reference_and_mx_fast(H, Hkv, T, L, mask):
    """A verify block's attention on a CPU (the fused exp; a single row is mx.fast's)."""
    keys = mx.random.split(mx.random.key(L), 4)
    # Scores spread over hundreds: exercises the exp's range clamp (underflow to 0).
    q = mx.random.normal((1, H, T, 64), key=keys[0]) * 6
    k = mx.random.normal((1, Hkv, L, 64), key=keys[1]) * 6
    v = mx.random.normal((1, Hkv, L, 64), key=keys[2])
    if mask == "bool":
        mask = mx.random.uniform(shape=(T, L), key=keys[3]) > 0.3
        keep = np.array(mask)
    elif mask == "causal":
        keep = np.arange(L)[None, :] <= np.arange(L - T, L)[:, None]
    else:
        keep = np.ones((T, L), dtype=bool)
    got = fused_exp.attention(q, k, v, 0.125, mask, decode_block=True)
    # Scores of a few hundred carry float32 rounding of ~1e-5 into the
    # weights: both kernels are that far from float64, and as close as that to each other.
    want = _reference_attention(q, k, v, 0.125, keep)
    np.testing.assert_allclose(np.array(got), want, rtol=1e-4, atol=1e-4)
    fast = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    np.testing.assert_allclose(np.array(got), np.array(fast), rtol=1e-4, atol=1e-4)
    assert np.abs(np.array(got) - want).max() <= 1.5 * np.abs(np.array(fast) - want).max() + 1e-6
    # Outside a decode block (a prefill) it is mx.fast's, bit for bit: mlx-lm's numerics.
    assert np.array_equal(np.array(fused_exp.attention(q, k, v, 0.125, mask)), np.array(fast))


@pytest.mark.parametrize("mask", ["causal", None, "bool", "blind"])
def test_cpu_attention_in_stretches_is_one_softmax(mask):
    """Rows attended a stretch at a time, the softmax merged across stretches
    (a long context's verify), equal one softmax over all rows, also where a
    row sees no key of some stretch ("blind": none of the first two)."""
    H, Hkv, T, L, n = 4, 2, 6, 700, 128
    keys = mx.random.split(mx.random.key(7), 4)
    q = mx.random.normal((1, H, T, 64), key=keys[0]) * 3
    k = mx.random.normal((1, Hkv, L, 64), key=keys[1]) * 3
    v = mx.random.normal((1, Hkv, L, 64), key=keys[2])
    keep = np.ones((T, L), dtype=bool)
    if mask == "causal":
        keep = np.arange(L)[None, :] <= np.arange(L - T, L)[:, None]
    elif mask in ("bool", "blind"):
        keep = np.array(mx.random.uniform(shape=(T, L), key=keys[3]) > 0.3)
        if mask == "blind":
            keep[0, : 2 * n] = False
        mask = mx.array(keep)
    parts = fused_exp.stretches(k, v, n)
    assert len(parts) == 6 and sum(p[0].shape[2] for p in parts) == L
    got = np.array(fused_exp.attention_stretches(q, parts, 0.125, mask))
    np.testing.assert_allclose(got, _reference_attention(q, k, v, 0.125, keep), rtol=1e-4, atol=1e-5)
    whole = np.array(fused_exp.attention_stretches(q, [(k, v)], 0.125, mask))
    np.testing.assert_allclose(got, whole, rtol=1e-5, atol=1e-6)


def test_cpu_attention_is_finite_when_a_masked_score_is_far_above_the_kept_ones():
    """A masked key (a future block row, a key outside a sliding window) may
    score ~90 or ~270 above every kept one: its weight is 0, never 0 * inf."""
    T, L = 4, 400
    q = mx.ones((1, 2, T, 8))
    k = mx.zeros((1, 2, L, 8))
    v = mx.random.normal((1, 2, L, 8), key=mx.random.key(0))
    for big in (88.7, 266.5):
        k_big = k.at[:, :, L - 1].add(big / 8 / 0.5)  # the last key: masked for all rows but the last
        got = fused_exp.attention(q, k_big, v, 0.5, "causal", decode_block=True)
        assert np.isfinite(np.array(got)).all()
        want = mx.fast.scaled_dot_product_attention(q, k_big, v, scale=0.5, mask="causal")
        np.testing.assert_allclose(np.array(got)[:, :, :-1], np.array(want)[:, :, :-1], rtol=1e-5, atol=1e-6)


def test_cpu_attention_exp_is_within_one_ulp_of_exact():
    x = mx.array(np.linspace(-87.0, 0.0, 200001, dtype=np.float32))
    p, bits = fused_exp._softmax_parts(x, mx.array(0.0), mx.ones(x.shape, dtype=mx.bool_))
    got = np.array(p * bits.view(mx.float32), dtype=np.float64)
    want = np.exp(np.array(x, dtype=np.float64))
    assert np.max(np.abs(got - want) / want) < 1.2e-7


def test_fused_activations_are_within_two_ulp_of_exact():
    """The verify block's SiLU / sigmoid on a CPU (fused_exp.fused_exp_for)."""
    x = mx.array(np.linspace(-80.0, 80.0, 160001, dtype=np.float32))
    xd = np.array(x, dtype=np.float64)
    sig = 1.0 / (1.0 + np.exp(-xd))
    got = np.array(fused_exp.sigmoid_fused(x), dtype=np.float64)
    assert np.max(np.abs(got - sig) / sig) < 2.4e-7
    got = np.array(fused_exp.silu_fused(x), dtype=np.float64)
    assert np.max(np.abs(got - xd * sig) / np.maximum(np.abs(xd * sig), 1e-30)) < 2.4e-7
    # Beyond the float range it saturates instead of overflowing.
    big = np.array(fused_exp.exp_fused(mx.array([-200.0, 200.0])))
    assert 0 <= big[0] < 1e-37 and np.isfinite(big[1]) and big[1] > 1e38
    assert fused_exp.silu_fused(mx.array([1.0], dtype=mx.bfloat16)).dtype == mx.bfloat16


def test_rollback_of_several_layers_at_once_equals_each_layer_alone():
    """The batched chain rollback (one compiled call for all DeltaNet layers)."""
    T, Hk, Hv, Dk, Dv = 9, 2, 4, 16, 8
    tapes = []
    for i in range(3):
        keys = mx.random.split(mx.random.key(40 + i), 4)
        tapes.append(
            (
                mx.random.normal((1, Hv, Dv, Dk), key=keys[0]),
                mx.random.normal((1, T, Hk, Dk), key=keys[1]) * 0.3,
                mx.random.uniform(0.3, 1.0, (1, T, Hv), key=keys[2]),
                mx.random.normal((1, T, Hv, Dv), key=keys[3]),
            )
        )
    for n in (0, 1, 4, T):
        got = gated_delta.gated_delta_rollback_layers(tapes, n)
        for tape, g in zip(tapes, got):
            np.testing.assert_allclose(
                np.array(g), np.array(gated_delta.gated_delta_rollback(*tape, n)), rtol=1e-6, atol=1e-6
            )
    # Layers of different shapes fall back to one call each.
    odd = (tapes[0][0][:, :2], tapes[0][1], tapes[0][2][..., :2], tapes[0][3][:, :, :2])
    got = gated_delta.gated_delta_rollback_layers([tapes[1], odd], 4)
    np.testing.assert_allclose(
        np.array(got[1]), np.array(gated_delta.gated_delta_rollback(*odd, 4)), rtol=1e-6, atol=1e-6
    )
