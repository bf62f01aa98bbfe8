"""References the tests compare against: mlx-lm's greedy decoding, a fresh prefill's cache."""

import mlx.core as mx
import numpy as np


def reference_greedy(model, prompt, n):
    """mlx-lm's own greedy generation of ``n`` tokens."""
    from mlx_lm.generate import generate_step

    out = []
    for tok, _ in generate_step(mx.array(prompt), model, max_tokens=n):
        out.append(int(tok))
    return out


def assert_cache_is_plain_forward(target, cache, tokens):
    """``cache`` equals a fresh prefill over ``tokens`` (KV, DeltaNet and conv state)."""
    fresh = target.make_cache()
    target.prefill(list(tokens), fresh)
    assert cache.offset == fresh.offset
    got, want = cache.state(), fresh.state()
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.array(g), np.array(w), rtol=1e-5, atol=1e-5)
