"""Shared fixtures: tiny fp32 random models (dense and MoE), a tokenizer; helpers live in support/."""

import pytest

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
