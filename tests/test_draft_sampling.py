"""The real drafts' sampled proposals (``propose(sample=True)``, v1 and
DFlash 2): the first drafted token is drawn from the q the draft reports, and
that q is the tempered (and filtered) softmax of the draft's own scores. The
speculative rule is exact only if both hold; a q off by a factor in the
temperature would pass every decode-level test that checks only the output."""

import mlx.core as mx
import numpy as np
import pytest
from test_draft2 import random_v2
from test_tree_sampling import chi2_fails

from mlx_dflash.models.qwen35 import Target
from mlx_dflash.sampling import Sampler
from tools import tiny

ANCHOR, POS, B = 17, 12, 4


@pytest.fixture(scope="module")
def drafts(dense, tmp_path_factory):
    cfg, model = dense
    target = Target(model)
    v1 = tiny.build_draft(tiny.draft_config(cfg, num_hidden_layers=2, block_size=B), seed=5).bind(target)
    v2 = random_v2(cfg, target, 4, tmp_path_factory.mktemp("v2"), num_hidden_layers=2, block_size=B)
    return {"v1": v1, "v2": v2}


# Temperatures at which each draft's slot-1 proposal is spread over several
# tokens (the selector's scores are sharper than this v1 draft's logits).
SAMPLERS = {"v1": dict(temperature=0.6, top_p=0.9), "v2": dict(temperature=1.5)}


def expected_q(draft, cache, kw):
    """Slot 1's proposal from the draft's scores, computed here: v1 the
    sampler's distribution of the draft logits (mlx-lm's filters, then 1/T);
    DFlash 2 the softmax of the selector's first-slot scores / T over its
    candidates."""
    hidden = draft.block_hidden(None, ANCHOR, POS, B, cache)[1:]
    logits = draft.logits(hidden)
    if not draft.config.is_v2:
        return np.array(Sampler(**kw, seed=0).probs(logits[:1])[0], np.float64)
    cand, first, _ = draft.candidate_selector.lattice(hidden, logits, ANCHOR)
    s = np.array(first, np.float64) / kw["temperature"]
    p = np.exp(s - s.max())
    q = np.zeros(logits.shape[-1])
    q[np.array(cand[0])] = p / p.sum()
    return q


def first_drafted_tokens(draft, kw, seeds):
    """The first drafted token of ``propose(sample=True)`` for each seed, and
    the q each call reported (all calls see the same context)."""
    rng = np.random.default_rng(0)
    feats = mx.array(rng.normal(size=(POS, len(draft.target_layer_ids) * draft.config.hidden_size)).astype(np.float32))
    cache = draft.make_cache()
    draft.add_context(feats, cache)  # later calls pass no new rows: the block is scratch, not held
    toks, qs = [], []
    for s in seeds:
        t, q = draft.propose(None, ANCHOR, POS, B, cache, Sampler(**kw, seed=s), sample=True)
        toks.append(int(t[0]))
        qs.append(np.array(q[0], np.float64))
    return np.array(toks), qs, cache


def check(draft, kw, n):
    toks, qs, cache = first_drafted_tokens(draft, kw, range(n))
    q = qs[0]
    for other in qs[1:]:
        np.testing.assert_array_equal(other, q)
    assert abs(q.sum() - 1) < 1e-5 and q.max() < 0.9 and (q > 1e-3).sum() >= 3  # a spread-out test case
    np.testing.assert_allclose(q, expected_q(draft, cache, kw), atol=1e-6)
    assert (q[toks] > 0).all()  # never a token q excludes
    fails, stat, crit = chi2_fails(np.bincount(toks, minlength=q.size).astype(np.float64), q, n)
    assert not fails, (stat, crit)


@pytest.mark.parametrize("kind", ["v1", "v2"])
def test_sampled_proposal_follows_the_reported_q(drafts, kind):
    check(drafts[kind], SAMPLERS[kind], 400)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["v1", "v2"])
def test_sampled_proposal_follows_the_reported_q_many_seeds(drafts, kind):
    check(drafts[kind], SAMPLERS[kind], 1500)
