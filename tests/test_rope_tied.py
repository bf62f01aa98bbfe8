"""RoPE scaling given in ``rope_parameters`` (draft inference and training
forward), and targets with tied embeddings."""

import mlx.core as mx
import numpy as np
import pytest
from support.reference import reference_greedy
from test_decode import PROMPTS, ScriptedDraft, run
from test_draft import draft_ref

from mlx_dflash.models.draft import train_logits
from mlx_dflash.models.qwen35 import Target
from tools import tiny


def test_draft_rope_scaling_from_rope_parameters(dense):
    """A draft config in transformers-v5 style (theta and a linear scaling in
    ``rope_parameters``, no top-level keys): the draft's cached forward and
    its training forward both use the scaled RoPE of the reference."""
    cfg, model = dense
    target = Target(model)
    dcfg = tiny.draft_config(cfg, num_hidden_layers=2, block_size=6, target_layer_ids=[0, 2])
    del dcfg["rope_theta"]
    dcfg["rope_parameters"] = {"rope_type": "linear", "factor": 4.0, "rope_theta": 5000.0}
    draft = tiny.build_draft(dcfg, seed=3).bind(target)
    assert draft.config.rope_theta == 5000.0 and draft.config.rope_scaling["type"] == "linear"
    L = 40
    feats = mx.random.normal((L, 2 * target.hidden_size), key=mx.random.key(2))
    tokens = mx.random.randint(4, 400, (L,), key=mx.random.key(3))
    cache = draft.make_cache()
    got_all, pos, consumed = [], 3, 0
    for adv in (0, 6, 9, 13):
        pos += adv
        got = draft(feats[consumed:pos], int(tokens[pos].item()), pos, 6, cache)
        consumed = pos
        want = draft_ref(draft, target, feats, int(tokens[pos].item()), pos, 6, theta=5000.0, pos_scale=0.25)
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)
        unscaled = draft_ref(draft, target, feats, int(tokens[pos].item()), pos, 6, theta=5000.0)
        if pos > 3:
            assert np.abs(np.array(got) - np.array(unscaled)).max() > 1e-3  # the scaling matters
        got_all.append((pos, got))
    train = train_logits(draft, feats[None], tokens[None], mx.array([[p for p, _ in got_all]]))[0]
    for j, (_, got) in enumerate(got_all):
        np.testing.assert_allclose(np.array(train[j]), np.array(got), rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def tied():
    cfg = tiny.target_config(tie_word_embeddings=True)
    return cfg, tiny.build_target(cfg, seed=13)


def test_tied_embedding_target_speculative_equals_mlx_lm(tied, tmp_path):
    """A tied target (no lm_head: logits through the embedding) decodes
    speculatively to mlx-lm's greedy output, and loads from an HF folder
    without an lm_head tensor."""
    from mlx_dflash.loading import load_target

    cfg, model = tied
    assert "lm_head" not in model.language_model
    target = Target(model)
    real = tiny.build_draft(tiny.draft_config(cfg, block_size=8), seed=4).bind(target)
    for prompt in PROMPTS:
        ref = reference_greedy(model, prompt, 24)
        assert run(target, prompt, 24)[0] == ref
        assert (
            run(target, prompt, 24, draft=ScriptedDraft(prompt, ref, target.vocab_size, accept=3), block_size=8)[0]
            == ref
        )
        assert run(target, prompt, 24, draft=real, block_size=8, tree_budget=8)[0] == ref
    hf = tiny.save_hf(model, cfg, tmp_path / "hf")
    from safetensors import safe_open

    with safe_open(str(hf / "model.safetensors"), "np") as f:
        assert not any("lm_head" in k for k in f.keys())
    loaded = load_target(hf)
    prompt = PROMPTS[1]
    want = model(mx.array(prompt)[None])[0]
    assert mx.abs(loaded(prompt) - want).max().item() <= 1e-4
