"""Target forward vs mlx-lm's qwen3_5 / qwen3_5_moe, and exact rollback."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_dflash import kernels
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
    fresh = target.make_cache()
    target.prefill(prompt + block[:n_keep], fresh)
    assert cache.offset == fresh.offset == len(prompt) + n_keep
    got, want = cache.state(), fresh.state()
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(np.array(g), np.array(w), rtol=1e-5, atol=1e-5)
    # And the next step's logits agree.
    a, _ = target.forward([77], cache)
    b, _ = target.forward([77], fresh)
    assert mx.abs(a - b).max().item() <= 1e-5


def test_tape_replay_is_bit_exact():
    key = mx.random.key(3)
    k1, k2, k3, k4, k5, k6 = mx.random.split(key, 6)
    T, Hk, Hv, Dk, Dv = 9, 2, 4, 16, 8
    q = mx.random.normal((1, T, Hk, Dk), key=k1)
    k = mx.random.normal((1, T, Hk, Dk), key=k2) * 0.3
    v = mx.random.normal((1, T, Hv, Dv), key=k3)
    g = mx.random.uniform(0.5, 1.0, (1, T, Hv), key=k4)
    beta = mx.random.uniform(0.0, 1.0, (1, T, Hv), key=k5)
    s0 = mx.random.normal((1, Hv, Dv, Dk), key=k6)
    _, _, tape = kernels.gated_delta_chain(q, k, v, g, beta, s0, record=True)
    assert mx.array_equal(kernels.gated_delta_rollback(s0, k, g, tape, 0), s0).item()
    for n in range(1, T + 1):
        _, want, _ = kernels.gated_delta_chain(q[:, :n], k[:, :n], v[:, :n], g[:, :n], beta[:, :n], s0)
        got = kernels.gated_delta_rollback(s0, k, g, tape, n)
        assert mx.array_equal(got, want).item(), n


def test_rollback_outside_block_is_rejected(dense):
    target = Target(dense[1])
    cache = target.make_cache()
    target.prefill([1, 2, 3], cache)
    with pytest.raises(RuntimeError):
        cache.rollback(1)
    target.forward([4, 5], cache, record=True)
    with pytest.raises(ValueError):
        cache.rollback(3)
