"""Tree verify (DDTree) equals plain greedy decoding; sampling at T > 0 is exact."""

import math

import mlx.core as mx
import numpy as np
import pytest
from support.reference import assert_cache_is_plain_forward, reference_greedy
from test_decode import PROMPTS, ScriptedDraft, run

from mlx_dflash import ddtree
from mlx_dflash.decode import longest_match
from mlx_dflash.models.qwen35 import Target
from mlx_dflash.sampling import Sampler
from tools import tiny

N = 24


class RankedDraft(ScriptedDraft):
    """Puts the right token at rank ``rank_of(j)`` of slot j (0 = top-1), the
    rest of the ranking fixed: a chain keeps only rank-0 hits, a tree with
    top-k > rank can find the others."""

    def __init__(self, prompt, reference, vocab, seed):
        super().__init__(prompt, reference, vocab)
        self.rng = np.random.default_rng(seed)

    def __call__(self, features, anchor, anchor_pos, B, cache):
        logits = np.zeros((B - 1, self.vocab), np.float32)
        for j in range(1, B):
            p = anchor_pos + j
            right = self.seq[p] if p < len(self.seq) else 0
            rank = int(self.rng.integers(0, 2))
            decoys = [(right + 1 + i) % self.vocab for i in range(3)]
            order = decoys[:rank] + [right] + decoys[rank:]
            for r, tok in enumerate(order):
                logits[j - 1, tok] = 10.0 - r
        return mx.array(logits)


def test_ddtree_build_and_walk():
    L, V = 5, 10
    logits = mx.array(np.random.default_rng(0).normal(size=(L, V)).astype(np.float32))
    top1 = np.argmax(np.array(logits), -1)
    for budget in (1, 4, 22, 40):
        t = ddtree.build(logits, anchor=7, budget=budget, topk=3)
        assert len(t) == 1 + min(budget, sum(3**d for d in range(1, L + 1)))
        assert t.tokens[0] == 7 and t.parents[0] == -1
        assert all(p < i for i, p in enumerate(t.parents) if i)
        assert max(t.depths) <= L
        # The top-1 chain is seeded first.
        chain = min(budget, L)
        assert t.tokens[1 : chain + 1] == top1[:chain].tolist()
        assert t.parents[1 : chain + 1] == list(range(chain))
    t = ddtree.build(logits, 7, 22, 3)
    picks = [0] * len(t)
    picks[0] = t.tokens[1]
    picks[1] = t.tokens[2]
    picks[2] = 99  # no such child: stop
    assert ddtree.walk(t, picks) == [0, 1, 2]


@pytest.mark.parametrize("kind", ["random", "oracle", "wrong", "ranked"])
@pytest.mark.parametrize("budget", [1, 4, 22, 40])
def test_tree_equals_plain_greedy(any_model, budget, kind):
    cfg, model = any_model
    target = Target(model)
    for prompt in PROMPTS[:2]:
        ref = reference_greedy(model, prompt, N)
        if kind == "random":
            dcfg = tiny.draft_config(cfg, block_size=16)
            draft = tiny.build_draft(dcfg, seed=3).bind(target)
        elif kind == "ranked":
            draft = RankedDraft(prompt, ref, target.vocab_size, seed=budget)
        else:
            draft = ScriptedDraft(prompt, ref, target.vocab_size, accept=None if kind == "oracle" else 0)
        out, st = run(target, prompt, N, draft=draft, block_size=16, tree_budget=budget, tree_topk=3)
        assert out == ref, (prompt, budget, kind)
        assert all(s <= budget + 1 for s in st.tree_sizes)
        if kind == "oracle":
            assert st.cycle_commits[0] == min(budget, 15) + 1
        if kind == "wrong":
            assert set(st.cycle_commits) == {1}


def test_tree_accepts_more_than_chain_when_right_token_is_second(dense):
    cfg, model = dense
    target = Target(model)
    prompt = PROMPTS[1]
    ref = reference_greedy(model, prompt, 48)
    chain_out, chain = run(target, prompt, 48, draft=RankedDraft(prompt, ref, 512, 1), block_size=8)
    tree_out, tree = run(
        target, prompt, 48, draft=RankedDraft(prompt, ref, 512, 1), block_size=8, tree_budget=30, tree_topk=2
    )
    assert chain_out == tree_out == ref
    assert tree.tau > chain.tau + 1.0
    # The right token is always within top-2, so every full cycle reaches depth 1.
    assert all(c >= 2 for c in tree.cycle_commits[:-1])


@pytest.mark.parametrize("accept", [0, 1, 3])
def test_tree_caches_equal_plain_forward(any_model, accept):
    cfg, model = any_model
    target = Target(model)
    prompt = PROMPTS[0]
    ref = reference_greedy(model, prompt, N)
    for n in (accept + 2, N):
        cache = target.make_cache()
        draft = ScriptedDraft(prompt, ref, target.vocab_size, accept=accept)
        out, _ = run(target, prompt, n, draft=draft, block_size=8, tree_budget=12, tree_topk=3, cache=cache)
        assert out == ref[:n]
        assert_cache_is_plain_forward(target, cache, prompt + out[:-1])


# --- sampling -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_vocab():
    cfg = tiny.target_config(vocab_size=12)
    model = tiny.build_target(cfg, seed=21)
    target = Target(model)
    dcfg = tiny.draft_config(cfg, block_size=4, mask_token_id=11)
    draft = tiny.build_draft(dcfg, seed=5).bind(target)
    return target, draft


def exact_marginals(target, prompt, sampler, n):
    """Exact distributions of generated tokens 1..n (marginals) by enumeration."""
    V = target.vocab_size
    seqs, weights = [list(prompt)], np.array([1.0])
    out = []
    for _ in range(n):
        logits, _ = target.batch_forward(mx.array(seqs))
        p = np.array(sampler.probs(logits[:, -1]), dtype=np.float64)  # [S, V]
        joint = weights[:, None] * p
        out.append(joint.sum(0))
        seqs = [s + [v] for s in seqs for v in range(V)]
        weights = joint.reshape(-1)
    return out


def chi2_fails(counts, probs, n):
    """Chi-square goodness of fit at the 0.999 level (cells with expected < 5 pooled)."""
    exp = probs * n
    big = exp >= 5
    obs = np.append(counts[big], counts[~big].sum())
    ex = np.append(exp[big], exp[~big].sum())
    keep = ex > 0
    stat = (((obs - ex) ** 2)[keep] / ex[keep]).sum()
    df = keep.sum() - 1
    z = 3.09  # 0.999 quantile of N(0, 1); Wilson-Hilferty
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat > crit, stat, crit


class SampleScript(ScriptedDraft):
    """Proposes the target's own samples (the plain run with the same seed),
    except with probability ``miss`` per slot, where it proposes the target's
    most likely token instead (a real draft's typical mistake), or another
    token when that is the sample. Right most of the time, so drafted rows
    decide most tokens."""

    def __init__(self, target, prompt, reference, seed, miss=0.25):
        super().__init__(prompt, reference, target.vocab_size)
        logits, _ = target.batch_forward(mx.array([self.seq]))
        self.modes = [None] + mx.argmax(logits[0], axis=-1).tolist()  # argmax for position p
        self.rng_miss = np.random.default_rng(seed)
        self.miss = miss

    def __call__(self, features, anchor, anchor_pos, B, cache):
        logits = np.zeros((B - 1, self.vocab), np.float32)
        for j in range(1, B):
            p = anchor_pos + j
            tok = self.seq[p] if p < len(self.seq) else 0
            if self.rng_miss.random() < self.miss:
                mode = self.modes[p] if p < len(self.modes) else 0
                tok = mode if mode != tok else (tok + 1) % self.vocab
            logits[j - 1, tok] = 1.0
        return mx.array(logits)


class KeyedToBlockStart(Sampler):
    """Mistake: every row of a verified block draws with the noise of its first row."""

    def __call__(self, logits, positions, contexts=None):
        return super().__call__(logits, [positions[0]] * len(positions), contexts)


class ArgmaxAcceptance:
    """Mistake: drafted tokens are checked against the target's argmax, not its
    sample (the bonus token is still the sample). A sampler that records the
    argmax rows, and the acceptance rule that reads them."""

    def __init__(self, sampler):
        self.sampler = sampler
        self.argmax = None

    def __getattr__(self, name):
        return getattr(self.sampler, name)

    def __call__(self, logits, positions, contexts=None):
        self.argmax = mx.argmax(logits, axis=-1).tolist()
        return self.sampler(logits, positions, contexts)

    def acceptance(self, drafted, picks):
        return longest_match(drafted, self.argmax)


SAMPLING = dict(temperature=0.8, top_k=8)
MODES = {"chain": dict(block_size=4), "tree": dict(block_size=4, tree_budget=6, tree_topk=3)}


def speculative_samples(target, prompt, mode, seeds, n=5, mistake=None):
    """For each seed: the plain output and the speculative one with a draft that
    proposes the target's own samples most of the time. Returns (plain outputs,
    speculative outputs, mean committed tokens per cycle)."""
    plains, specs, commits, cycles = [], [], 0, 0
    for s in seeds:
        plain, _ = run(target, prompt, n, sampler=Sampler(**SAMPLING, seed=s))
        draft = SampleScript(target, prompt, plain, seed=s)
        kw = dict(MODES[mode], accept_rule="equality")  # the rule that keeps the plain output
        sampler = Sampler(**SAMPLING, seed=s)
        if mistake == "wrong-key":
            sampler = KeyedToBlockStart(**SAMPLING, seed=s)
        elif mistake == "argmax":
            sampler = ArgmaxAcceptance(sampler)
            kw["acceptance"] = sampler.acceptance
        spec, st = run(target, prompt, n, draft=draft, sampler=sampler, **kw)
        plains.append(plain)
        specs.append(spec)
        commits += st.generated_tokens - 1
        cycles += st.cycles
    return plains, specs, commits / cycles


def counts_of(outs, vocab, k=3):
    c = np.zeros((k, vocab))
    for o in outs:
        for i, t in enumerate(o[:k]):
            c[i, t] += 1
    return c


def check_exact(target, mode, n):
    prompt = [1, 5, 7]
    plains, specs, tau = speculative_samples(target, prompt, mode, range(n))
    assert tau > 2, tau  # drafted rows decide most tokens
    assert specs == plains
    exact = exact_marginals(target, prompt, Sampler(**SAMPLING, seed=0), 3)
    counts = counts_of(specs, target.vocab_size)
    for i in range(3):
        fails, stat, crit = chi2_fails(counts[i], exact[i], n)
        assert not fails, (i, stat, crit)


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_speculative_sampling_is_exact(small_vocab, mode):
    """T > 0 with a draft that is right most of the time (tau > 2): for every
    seed the speculative output is the plain output, and the tokens follow the
    target's exact distribution (marginals by enumeration)."""
    check_exact(small_vocab[0], mode, 120)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_speculative_sampling_is_exact_many_seeds(small_vocab, mode):
    check_exact(small_vocab[0], mode, 600)


@pytest.mark.parametrize("mode,mistake", [("chain", "wrong-key"), ("tree", "wrong-key"), ("chain", "argmax")])
def test_realistic_sampling_mistakes_fail_the_exactness_test(small_vocab, mode, mistake):
    """Noise keyed to the wrong position for drafted rows, or acceptance against
    the argmax instead of the sample: the speculative output leaves the plain
    one (the exactness test's first check) for many seeds."""
    target, _ = small_vocab
    n = 40
    plains, specs, _ = speculative_samples(target, [1, 5, 7], mode, range(n), mistake=mistake)
    differ = sum(a != b for a, b in zip(plains, specs))
    assert differ > n // 4, differ


@pytest.mark.slow
def test_argmax_acceptance_skews_the_distribution(small_vocab):
    """The argmax mistake also fails the distribution check on its own."""
    target, _ = small_vocab
    prompt, n = [1, 5, 7], 600
    _, specs, _ = speculative_samples(target, prompt, "chain", range(n), mistake="argmax")
    exact = exact_marginals(target, prompt, Sampler(**SAMPLING, seed=0), 3)
    counts = counts_of(specs, target.vocab_size)
    assert any(chi2_fails(counts[i], exact[i], n)[0] for i in (1, 2))


def test_same_seed_same_output_in_every_mode(any_model):
    cfg, model = any_model
    target = Target(model)
    dcfg = tiny.draft_config(cfg, block_size=8)
    draft = tiny.build_draft(dcfg, seed=9).bind(target)
    prompt = PROMPTS[1]
    outs = []
    for seed in (1, 1, 2):
        s = lambda: Sampler(temperature=1.0, top_p=0.95, seed=seed)
        plain, _ = run(target, prompt, N, sampler=s())
        chain, _ = run(target, prompt, N, draft=draft, block_size=8, sampler=s(), accept_rule="equality")
        tree, _ = run(target, prompt, N, draft=draft, block_size=8, tree_budget=10, sampler=s(), accept_rule="equality")
        assert plain == chain == tree
        outs.append(plain)
    assert outs[0] == outs[1] and outs[0] != outs[2]


def test_repetition_penalty_is_lossless(dense):
    cfg, model = dense
    target = Target(model)
    dcfg = tiny.draft_config(cfg, block_size=8)
    draft = tiny.build_draft(dcfg, seed=9).bind(target)
    prompt = PROMPTS[0]
    s = lambda: Sampler(0.0, repetition_penalty=1.5, seed=0)
    plain, _ = run(target, prompt, N, sampler=s())
    chain, _ = run(target, prompt, N, draft=draft, block_size=8, sampler=s())
    tree, _ = run(target, prompt, N, draft=draft, block_size=8, tree_budget=8, sampler=s())
    assert plain == chain == tree
    assert plain != reference_greedy(model, prompt, N)  # the penalty changed the output
