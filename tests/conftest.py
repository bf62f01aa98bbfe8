"""Shared fixtures: tiny fp32 random models (dense and MoE), a tokenizer, references."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_dflash.models.qwen35 import Target
from tools import tiny


@pytest.fixture(scope="session", autouse=True)
def _cost_cache_in_tmp(tmp_path_factory):
    """Keep the policy's measured-cost cache out of the user's home during tests."""
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
    yield
    mp.undo()


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory):
    return tiny.build_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=400)


def _pair(moe: bool):
    cfg = tiny.target_config(moe=moe)
    model = tiny.build_target(cfg, seed=7 if moe else 3)
    return cfg, model


@pytest.fixture(scope="session")
def dense():
    return _pair(False)


@pytest.fixture(scope="session")
def moe():
    return _pair(True)


@pytest.fixture(scope="session", params=["dense", "moe"])
def any_model(request, dense, moe):
    return dense if request.param == "dense" else moe


def reference_greedy(model, prompt, n):
    """mlx-lm's own greedy generation of ``n`` tokens."""
    from mlx_lm.generate import generate_step

    out = []
    for tok, _ in generate_step(mx.array(prompt), model, max_tokens=n):
        out.append(int(tok))
    return out


def target_of(model):
    return Target(model)


def assert_cache_is_plain_forward(target, cache, tokens):
    """``cache`` equals a fresh prefill over ``tokens`` (KV, DeltaNet and conv state)."""
    fresh = target.make_cache()
    target.prefill(list(tokens), fresh)
    assert cache.offset == fresh.offset
    got, want = cache.state(), fresh.state()
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.array(g), np.array(w), rtol=1e-5, atol=1e-5)
