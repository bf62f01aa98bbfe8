"""Several requests in one forward (slots): each slot's logits, features,
caches and rollback equal its solo run's, bit for bit, and no slot's
operation touches another's arrays; batch_generate equals solo generate."""

import re

import mlx.core as mx
import numpy as np
import pytest

import mlx_dflash
from mlx_dflash.cache import SlotBatch
from mlx_dflash.errors import DFlashError
from mlx_dflash.models.qwen35 import Target
from tools import tiny

PROMPTS = [[1, 10, 20, 30, 40], [7, 7, 7, 100, 250, 31, 64, 99, 12, 5, 300], [2, 450], [9, 8, 7, 6, 5, 4, 3]]
CAPTURE = (1, 3)


# MLX's CPU gather_mm (the MoE experts) runs float32 only: no bf16 MoE here.
# "q4": 4-bit weights (float32 activations).
MODELS = [("dense", mx.float32), ("dense", mx.bfloat16), ("moe", mx.float32), ("dense", "q4"), ("moe", "q4")]
MODEL_IDS = ["dense-f32", "dense-bf16", "moe-f32", "dense-q4", "moe-q4"]


@pytest.fixture(scope="module")
def targets():
    """Tiny dense and MoE targets (float32, bfloat16 for the dense one, 4-bit)."""
    import mlx.nn as nn

    out = {}
    for name, dt in MODELS:
        cfg = tiny.target_config(moe=name == "moe")
        model = tiny.build_target(cfg, seed=7 if name == "moe" else 3, dtype=mx.float32 if dt == "q4" else dt)
        if dt == "q4":  # as mlx-lm does: the layers whose width the group size divides
            nn.quantize(
                model, 32, 4, class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % 32 == 0
            )
        out[name, dt] = Target(model)
    return out


def prefilled(target, prompts):
    caches = []
    for p in prompts:
        c = target.make_cache()
        target.prefill(p, c, chunk_size=4)
        caches.append(c)
    return caches


def same(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and bool(mx.array_equal(a, b).item())


def assert_same_state(got, want):
    g, w = got.state(), want.state()
    assert len(g) == len(w)
    assert got.offset == want.offset
    for x, y in zip(g, w):
        assert same(x, y)


def block_tokens(S, W, seed):
    return mx.array(np.random.default_rng(seed).integers(0, 400, size=(S, W)), dtype=mx.int32)


@pytest.mark.parametrize("W, record", [(1, False), (5, False), (5, True), (16, True)])
@pytest.mark.parametrize("model", MODELS, ids=MODEL_IDS)
def test_forward_slots_equals_solo_forward(targets, model, W, record):
    """Plain steps (W = 1), a plain block, and verify blocks (recorded)."""
    target = targets[model]
    solo = prefilled(target, PROMPTS)
    slots = SlotBatch(prefilled(target, PROMPTS))
    tokens = block_tokens(len(PROMPTS), W, seed=W)
    logits, feats = target.forward_slots(tokens, slots, capture=CAPTURE, record=record)
    for b, c in enumerate(solo):
        lg, f = target.forward(tokens[b], c, capture=CAPTURE, record=record)
        assert same(logits[b], lg), b
        assert same(feats[b], f), b
        assert_same_state(slots.caches[b], c)
        assert slots.caches[b].block == c.block
        for got, want in zip(slots.caches[b].layers, c.layers):
            if getattr(want, "tape", None) is not None:
                assert all(same(x, y) for x, y in zip(got.tape[:5], want.tape[:5]))


@pytest.mark.parametrize("model", MODELS, ids=MODEL_IDS)
def test_slot_rollback_equals_solo_rollback(targets, model):
    """Per-slot kept counts (some keep the whole block, some one token) give
    each slot the state its solo rollback gives, bit for bit."""
    target = targets[model]
    W = 6
    for ns in ([1, 3, 6, 2], [6, 6, 1, 6], [4, 4, 4, 4]):
        solo = prefilled(target, PROMPTS)
        slots = SlotBatch(prefilled(target, PROMPTS))
        tokens = block_tokens(len(PROMPTS), W, seed=sum(ns))
        target.forward_slots(tokens, slots, capture=CAPTURE, record=True)
        slots.rollback(ns)
        for b, (c, n) in enumerate(zip(solo, ns)):
            target.forward(tokens[b], c, capture=CAPTURE, record=True)
            c.rollback(n)
            assert_same_state(slots.caches[b], c)
            assert slots.caches[b].block == 0
        # The next block runs on from the rolled-back states exactly as solo.
        nxt = block_tokens(len(PROMPTS), 3, seed=1)
        logits, _ = target.forward_slots(nxt, slots, record=True)
        for b, c in enumerate(solo):
            assert same(logits[b], target.forward(nxt[b], c, record=True)[0])


def random_trees(S, T, seed):
    """S random trees of T nodes (root first, each node's parent before it)
    and in each a random root path."""
    from mlx_dflash.ddtree import path_rows

    rng = np.random.default_rng(seed)
    parents = [[-1] + [int(rng.integers(0, t)) for t in range(1, T)] for _ in range(S)]
    paths = [path_rows(p, int(rng.integers(0, T))) for p in parents]
    return parents, paths


@pytest.mark.parametrize("model", MODELS, ids=MODEL_IDS)
def test_tree_per_slot_forward_and_rollback_equal_solo(targets, model):
    """A tree per slot (each its own topology, the same node count): logits,
    features, caches after the rollback along each slot's accepted path, and
    the next block, equal each slot's solo tree verify, bit for bit."""
    from mlx_dflash.ddtree import path_rows

    target = targets[model]
    T = 7
    parents, paths = random_trees(len(PROMPTS), T, seed=3)
    parents[1] = [-1, 0, 1, 2, 3, 4, 5]  # a chain-shaped tree among them
    paths[1] = path_rows(parents[1], 6)
    assert len({tuple(p) for p in parents}) == len(PROMPTS)
    solo = prefilled(target, PROMPTS)
    slots = SlotBatch(prefilled(target, PROMPTS))
    tokens = block_tokens(len(PROMPTS), T, seed=11)
    logits, feats = target.forward_slots(tokens, slots, capture=CAPTURE, record=True, parents=parents)
    slots.rollback([len(p) for p in paths], paths)
    for b, c in enumerate(solo):
        lg, f = target.forward(tokens[b], c, capture=CAPTURE, record=True, parents=parents[b])
        assert same(logits[b], lg), b
        assert same(feats[b], f), b
        c.rollback(len(paths[b]), path=paths[b])
        assert_same_state(slots.caches[b], c)
        assert slots.caches[b].block == 0
    nxt = block_tokens(len(PROMPTS), 3, seed=2)
    logits, _ = target.forward_slots(nxt, slots, record=True)
    for b, c in enumerate(solo):
        assert same(logits[b], target.forward(nxt[b], c, record=True)[0])
    with pytest.raises(ValueError, match="recorded"):
        target.forward_slots(tokens, slots, parents=parents)
    with pytest.raises(ValueError, match="parent lists"):
        target.forward_slots(tokens, slots, record=True, parents=parents[:2])


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["f32", "bf16"])
def test_rolling_back_one_slot_leaves_the_others_untouched(targets, dtype):
    target = targets["dense", dtype]
    W = 5
    for b in range(len(PROMPTS)):
        slots = SlotBatch(prefilled(target, PROMPTS))
        target.forward_slots(block_tokens(len(PROMPTS), W, seed=b), slots, record=True)
        before = [[mx.array(a) for a in c.state()] for c in slots.caches]
        offsets = [c.offset for c in slots.caches]
        ns = [W] * len(PROMPTS)
        ns[b] = 2
        slots.rollback(ns)
        for o, c in enumerate(slots.caches):
            if o == b:
                assert c.offset == offsets[o] - W + 2
                continue
            assert c.offset == offsets[o]
            after = c.state()
            assert len(after) == len(before[o]) and all(same(x, y) for x, y in zip(after, before[o]))
        # A slot's own truncation (its KV) touches only that slot.
        snap = [[mx.array(a) for a in c.state()] for c in slots.caches]
        for layer in slots.caches[b].layers:
            if layer.sequence:
                layer.truncate(1)
        for o, c in enumerate(slots.caches):
            if o != b:
                assert all(same(x, y) for x, y in zip(c.state(), snap[o]))


def test_forward_slots_with_a_rope_that_takes_no_array_offsets(dense):
    """mlx-lm's dynamic-NTK RoPE compares its offset in Python: each slot's
    attention inputs are then computed at its own int offset, still exact;
    a draft with that RoPE proposes slot by slot."""
    from mlx_dflash.models.draft import propose_slots
    from mlx_dflash.sampling import Sampler

    cfg = tiny.target_config()
    cfg["text_config"]["rope_parameters"].update(rope_type="dynamic", factor=2.0)
    target = Target(tiny.build_target(cfg, seed=3))
    assert not target._compilable
    solo = prefilled(target, PROMPTS)
    slots = SlotBatch(prefilled(target, PROMPTS))
    tokens = block_tokens(len(PROMPTS), 4, seed=2)
    logits, _ = target.forward_slots(tokens, slots, record=True)
    for b, c in enumerate(solo):
        assert same(logits[b], target.forward(tokens[b], c, record=True)[0])
    dcfg = tiny.draft_config(dense[0], num_hidden_layers=2, block_size=6)
    dcfg["rope_scaling"] = {"type": "dynamic", "factor": 2.0}
    draft = tiny.build_draft(dcfg, seed=3).bind(target)
    feats = [target.prefill(p, target.make_cache(), capture=draft.target_layer_ids)[1] for p in PROMPTS]
    got = propose_slots(
        draft, [(f, 4, len(p), draft.make_cache(), Sampler(), False) for f, p in zip(feats, PROMPTS)], 6
    )
    for (toks, _), f, p in zip(got, feats, PROMPTS):
        assert same(toks, draft.propose(f, 4, len(p), 6, draft.make_cache())[0])


def test_slot_rollback_refuses_bad_counts(targets):
    target = targets["dense", mx.float32]
    slots = SlotBatch(prefilled(target, PROMPTS[:2]))
    with pytest.raises(RuntimeError, match="without a recorded block"):
        slots.rollback([1, 1])
    target.forward_slots(block_tokens(2, 4, seed=0), slots, record=True)
    with pytest.raises(ValueError, match="outside"):
        slots.rollback([0, 4])
    with pytest.raises(ValueError, match="kept counts for 2 slots"):
        slots.rollback([1])
    with pytest.raises(ValueError, match="paths of"):
        slots.rollback([2, 1], [[0], [0]])


# --- batch_generate and the BatchDecoder ------------------------------------------


class SlotScripts:
    """A scripted draft for a batch: the k-th cache it makes (one per request,
    in the order they join) proposes from the k-th known continuation, a
    random number of proposals right per cycle."""

    def __init__(self, seqs, vocab, block_size=8, seed=0):
        self.seqs, self.vocab, self.block_size, self.seed = list(seqs), vocab, block_size, seed
        self.target_layer_ids = []
        self.made = 0

    def make_cache(self, window=None):
        k = self.made
        self.made += 1
        return {"seq": self.seqs[k % len(self.seqs)], "rng": np.random.default_rng(self.seed + k)}

    def __call__(self, features, anchor, anchor_pos, B, cache):
        seq = cache["seq"]
        assert seq[anchor_pos] == anchor
        accept = int(cache["rng"].integers(0, B))
        logits = np.zeros((B - 1, self.vocab), np.float32)
        for j in range(1, B):
            p = anchor_pos + j
            tok = seq[p] if p < len(seq) else 0
            logits[j - 1, tok if j <= accept else (tok + 1) % self.vocab] = 1.0
        return mx.array(logits)


BATCH_PROMPTS = [PROMPTS[1], PROMPTS[2], PROMPTS[0] * 3, PROMPTS[3]]
MAX_TOKENS = [12, 20, 7, 16]


@pytest.fixture(scope="module")
def engines(dense, moe, tok_dir):
    from mlx_dflash import Engine
    from mlx_dflash.loading import load_tokenizer

    out = {}
    for name, (cfg, model) in (("dense", dense), ("moe", moe)):
        target = Target(model)
        dcfg = tiny.draft_config(cfg, num_hidden_layers=2, block_size=8)
        draft = tiny.build_draft(dcfg, seed=5).bind(target)
        out[name] = Engine(target, load_tokenizer(tok_dir, eos_token_ids=[2]), draft)
    return out


def solo(engine, prompts, configs):
    import mlx_dflash

    return [mlx_dflash.generate(engine, p, c) for p, c in zip(prompts, configs)]


def scripted(engine, prompts, results, seed=0):
    """The engine with a scripted draft proposing each request's solo output."""
    from dataclasses import replace

    seqs = [list(p) + r.tokens for p, r in zip(prompts, results)]
    return replace(engine, draft=SlotScripts(seqs, engine.target.vocab_size, seed=seed))


def configs_for(**kw):
    from mlx_dflash import GenerationConfig

    return [GenerationConfig(max_tokens=m, block_size=4, **kw) for m in MAX_TOKENS]


def assert_same_results(got, want):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.tokens == w.tokens, i
        assert g.text == w.text, i
        assert g.stats.finish_reason == w.stats.finish_reason, i
        assert g.stats.generated_tokens == len(g.tokens)


@pytest.mark.parametrize("max_batch", [4, 2])
@pytest.mark.parametrize("which", ["dense", "moe"])
def test_batch_generate_equals_solo_greedy(engines, which, max_batch):
    """Each request's tokens are its solo run's, all at once (4 slots) or with
    later requests joining as earlier ones finish (2 slots)."""
    import mlx_dflash

    engine = engines[which]
    configs = configs_for()
    want = solo(engine, BATCH_PROMPTS, configs)
    assert_same_results(mlx_dflash.batch_generate(engine, BATCH_PROMPTS, configs=configs, max_batch=max_batch), want)
    # A draft that gets a random part of each block right: slots keep different counts.
    eng = scripted(engine, BATCH_PROMPTS, want, seed=max_batch)
    got = mlx_dflash.batch_generate(eng, BATCH_PROMPTS, configs=configs, max_batch=max_batch)
    assert_same_results(got, want)
    assert any(sum(r.stats.accept_hist[2:]) > 0 for r in got)  # some cycles kept drafts


@pytest.mark.parametrize("which", ["dense", "moe"])
def test_batch_generate_equals_solo_sampled(engines, which):
    """Sampling with the equality rule and a seed per request (one with a
    repetition penalty, one with min-p and top-k: options per request)."""
    import mlx_dflash

    engine = engines[which]
    configs = [
        c.update(temperature=0.9, top_p=0.95, seed=100 + i, accept_rule="equality") for i, c in enumerate(configs_for())
    ]
    configs[1] = configs[1].update(repetition_penalty=1.3, repetition_context_size=8)
    configs[2] = configs[2].update(temperature=0.7, min_p=0.05, top_k=30)
    want = solo(engine, BATCH_PROMPTS, configs)
    assert len({tuple(r.tokens[:5]) for r in want}) > 1
    got = mlx_dflash.batch_generate(engine, BATCH_PROMPTS, configs=configs, max_batch=3)
    assert_same_results(got, want)
    eng = scripted(engine, BATCH_PROMPTS, want)
    assert_same_results(mlx_dflash.batch_generate(eng, BATCH_PROMPTS, configs=configs, max_batch=3), want)


def test_batch_generate_shared_options_and_plain(engines):
    """Keyword options shared by all requests; baseline (plain steps for the
    batch); text prompts (tokenized and detokenized as generate does)."""
    import mlx_dflash

    engine = engines["dense"]
    for kw in (dict(max_tokens=9, block_size=6), dict(max_tokens=9, baseline=True)):
        want = [mlx_dflash.generate(engine, p, **kw) for p in BATCH_PROMPTS]
        assert_same_results(mlx_dflash.batch_generate(engine, BATCH_PROMPTS, max_batch=3, **kw), want)
    texts = ["def f(x):", "import os\nfor i in range(3):", "Simple is better"]
    want = [mlx_dflash.generate(engine, t, max_tokens=10, block_size=4) for t in texts]
    assert_same_results(mlx_dflash.batch_generate(engine, texts, max_batch=2, max_tokens=10, block_size=4), want)
    # Through the chat template, with a system message, as generate takes them.
    chat = mlx_dflash.load()
    kw = dict(max_tokens=10, chat_template=True, system="Answer in code.")
    want = [mlx_dflash.generate(chat, t, **kw) for t in texts]
    assert want[0].stats.prompt_tokens > len(chat.encode(texts[0]))  # the template was applied
    assert_same_results(mlx_dflash.batch_generate(chat, texts, max_batch=3, **kw), want)


def test_request_with_an_early_eos_leaves_alone(engines, tok_dir):
    """One request stops at an EOS after a few tokens, inside a cycle; the
    others run on to their own ends, each as solo."""
    from dataclasses import replace

    import mlx_dflash
    from mlx_dflash.loading import load_tokenizer

    base = engines["dense"]
    configs = configs_for()
    plain = solo(base, BATCH_PROMPTS, configs)
    toks = plain[1].tokens
    k = next(i for i in range(3, len(toks)) if toks[i] not in toks[:i])
    engine = replace(base, tokenizer=load_tokenizer(tok_dir, eos_token_ids=[toks[k]]))
    want = solo(engine, BATCH_PROMPTS, configs)
    assert want[1].tokens == toks[: k + 1] and want[1].stats.finish_reason == "stop"
    assert_same_results(mlx_dflash.batch_generate(engine, BATCH_PROMPTS, configs=configs, max_batch=4), want)
    eng = scripted(engine, BATCH_PROMPTS, want, seed=3)
    assert_same_results(mlx_dflash.batch_generate(eng, BATCH_PROMPTS, configs=configs, max_batch=4), want)
    # A request whose first token is EOS leaves before its first cycle (its
    # slot goes to the queued one at once).
    engine = replace(base, tokenizer=load_tokenizer(tok_dir, eos_token_ids=[plain[2].tokens[0]]))
    want = solo(engine, BATCH_PROMPTS, configs)
    assert want[2].tokens == plain[2].tokens[:1] and want[2].stats.finish_reason == "stop"
    assert_same_results(mlx_dflash.batch_generate(engine, BATCH_PROMPTS, configs=configs, max_batch=3), want)


@pytest.mark.parametrize("which", ["dense", "moe"])
def test_slot_caches_equal_a_plain_forward(engines, which):
    """After every step, each active slot's cache equals a fresh prefill over
    its committed tokens (all but the last, which is not in the cache yet)."""
    from support.reference import assert_cache_is_plain_forward

    from mlx_dflash import BatchDecoder

    engine = engines[which]
    configs = configs_for()
    want = solo(engine, BATCH_PROMPTS, configs)
    eng = scripted(engine, BATCH_PROMPTS, want, seed=1)
    batch = BatchDecoder(eng.target, eng.draft, max_batch=3, eos_token_ids=[2])
    for p, c in zip(BATCH_PROMPTS, configs):
        batch.add(p, c)
    out = [[] for _ in BATCH_PROMPTS]
    seen = {}
    while not batch.done:
        for ev in batch.step():
            out[ev.index].extend(ev.tokens)
        for i, d in batch.active:
            seen[i] = d
            assert_cache_is_plain_forward(eng.target, d.cache, d.history[:-1])
    assert out == [r.tokens for r in want]
    assert sorted(seen) == list(range(len(BATCH_PROMPTS)))


def test_bad_batch_input(engines):
    import mlx_dflash
    from mlx_dflash import BatchDecoder, DFlashError

    engine = engines["dense"]
    for bad in (0, -2):
        with pytest.raises(DFlashError, match="max_batch"):
            mlx_dflash.batch_generate(engine, BATCH_PROMPTS, max_batch=bad)
    with pytest.raises(DFlashError, match="auto-tree.*prices chains"):  # the reason is stated
        mlx_dflash.batch_generate(engine, BATCH_PROMPTS, auto_tree=6)
    with pytest.raises(DFlashError, match="same block_size, baseline, adaptive, tree_budget"):
        mlx_dflash.batch_generate(engine, BATCH_PROMPTS[:2], configs=[None, configs_for()[0].update(tree_budget=3)])
    trees = [configs_for()[0].update(tree_budget=3, tree_topk=k) for k in (1, 4)]  # trees of 4 and of 5 nodes
    with pytest.raises(DFlashError, match="with a tree. tree_topk"):
        mlx_dflash.batch_generate(engine, BATCH_PROMPTS[:2], configs=trees)
    with pytest.raises(DFlashError, match="same block_size"):
        mlx_dflash.batch_generate(engine, BATCH_PROMPTS[:2], configs=configs_for()[:1] + [None], max_batch=2)
    with pytest.raises(DFlashError, match="configs for"):
        mlx_dflash.batch_generate(engine, BATCH_PROMPTS, configs=configs_for()[:2])
    batch = BatchDecoder(engine.target, engine.draft)
    with pytest.raises(DFlashError, match="empty prompt"):
        batch.add([])
    with pytest.raises(DFlashError, match="context limit"):
        batch.add(list(range(20)), max_context=20)


def test_cancel_frees_the_slot_and_leaves_the_others(engines):
    """Cancelling one running and one queued request: the others' tokens are
    still their solo ones, and the freed slot admits the next request."""
    from mlx_dflash import BatchDecoder

    engine = engines["moe"]
    configs = configs_for()
    want = solo(engine, BATCH_PROMPTS, configs)
    eng = scripted(engine, BATCH_PROMPTS, want, seed=2)
    batch = BatchDecoder(eng.target, eng.draft, max_batch=2, eos_token_ids=[2])
    for p, c in zip(BATCH_PROMPTS, configs):
        batch.add(p, c)
    out = [[] for _ in BATCH_PROMPTS]
    reasons = {}
    steps = 0
    while not batch.done:
        for ev in batch.step():
            out[ev.index].extend(ev.tokens)
            reasons[ev.index] = ev.finish_reason
        steps += 1
        if steps == 2:
            assert [i for i, _ in batch.active] == [0, 1]
            ev = batch.cancel(1)
            assert ev.finish_reason == "cancelled" and ev.stats.generated_tokens == len(out[1])
            assert batch.cancel(3).finish_reason == "cancelled"  # still queued
            assert batch.cancel(3) is None
            reasons[1] = reasons[3] = "cancelled"
    assert out[0] == want[0].tokens and out[2] == want[2].tokens
    assert 0 < len(out[1]) < len(want[1].tokens) and out[1] == want[1].tokens[: len(out[1])]
    assert out[3] == []
    assert reasons == {0: "length", 1: "cancelled", 2: "length", 3: "cancelled"}


def test_a_long_prefill_takes_several_steps_and_can_be_cancelled_between_them(engines):
    """With nothing decoding, a step still ends after its prefill budget, so a
    caller (the server) can cancel a long prompt or admit others mid-prefill;
    the request after it gets its solo tokens."""
    from mlx_dflash import BatchDecoder, GenerationConfig

    engine = engines["dense"]
    long, short = BATCH_PROMPTS[2], BATCH_PROMPTS[0]
    c = GenerationConfig(max_tokens=8, block_size=4, prefill_chunk=4)
    batch = BatchDecoder(engine.target, engine.draft, max_batch=2, eos_token_ids=[2], prefill_budget=4)
    first = batch.add(long, c)
    assert len(long) > 8
    assert batch.step() == [] and batch.step() == []  # two chunks in, no first token yet
    ev = batch.cancel(first)
    assert ev.finish_reason == "cancelled" and ev.tokens == [] and batch.done
    second = batch.add(short, c)
    got = []
    while not batch.done:
        got += [t for e in batch.step() if e.index == second for t in e.tokens]
    assert got == solo(engine, [short], [c])[0].tokens


def test_batch_generate_equals_solo_in_bfloat16(tok_dir):
    """bf16 verify rows are computed as single steps are (row_exact): the
    batched path gives each request its solo tokens there too."""
    import mlx_dflash
    from mlx_dflash import Engine
    from mlx_dflash.loading import load_tokenizer

    cfg = tiny.target_config()
    target = Target(tiny.build_target(cfg, seed=3, dtype=mx.bfloat16))
    dcfg = tiny.draft_config(cfg, num_hidden_layers=2, block_size=8)
    draft = tiny.build_draft(dcfg, seed=5, dtype=mx.bfloat16).bind(target)
    engine = Engine(target, load_tokenizer(tok_dir, eos_token_ids=[2]), draft)
    configs = configs_for()
    want = solo(engine, BATCH_PROMPTS, configs)
    assert_same_results(mlx_dflash.batch_generate(engine, BATCH_PROMPTS, configs=configs, max_batch=3), want)
    eng = scripted(engine, BATCH_PROMPTS, want, seed=4)
    assert_same_results(mlx_dflash.batch_generate(eng, BATCH_PROMPTS, configs=configs, max_batch=3), want)


def test_batch_with_quantized_kv_and_a_windowed_draft(tok_dir):
    """Per-request KV formats (8-bit, 4-bit, full) and a sliding-window draft
    context in one batch: each request as solo."""
    import mlx_dflash
    from mlx_dflash import Engine
    from mlx_dflash.loading import load_tokenizer

    cfg = tiny.target_config(hidden_size=128, head_dim=64, num_attention_heads=2, num_key_value_heads=1)
    target = Target(tiny.build_target(cfg, seed=1))
    dcfg = tiny.draft_config(
        cfg, num_hidden_layers=2, block_size=8, layer_types=["sliding_attention"] * 2, sliding_window=6
    )
    engine = Engine(target, load_tokenizer(tok_dir, eos_token_ids=[2]), tiny.build_draft(dcfg, seed=9).bind(target))
    configs = [c.update(kv_bits=b, draft_window=(0, 6)) for c, b in zip(configs_for(), (8, None, 4, 8))]
    want = solo(engine, BATCH_PROMPTS, configs)
    assert_same_results(mlx_dflash.batch_generate(engine, BATCH_PROMPTS, configs=configs, max_batch=4), want)
    eng = scripted(engine, BATCH_PROMPTS, want, seed=5)
    assert_same_results(mlx_dflash.batch_generate(eng, BATCH_PROMPTS, configs=configs, max_batch=4), want)


@pytest.mark.parametrize("which, cached", [("dense", False), ("moe", False), ("dense", True)])
def test_long_prefill_is_interleaved_with_running_cycles(engines, which, cached):
    """A long prompt joining a running batch prefills one chunk per step (its
    own chunk boundaries, so its solo output), while the running slots get
    tokens in every step; with a prefix cache too (it prefilled in one step)."""
    from mlx_dflash import BatchDecoder, PrefixCache

    engine = engines[which]
    long = [(7 * i + 3) % 400 for i in range(37)]
    prompts = [BATCH_PROMPTS[1], long, BATCH_PROMPTS[3]]
    configs = [c.update(prefill_chunk=4) for c in configs_for()[:3]]
    want = solo(engine, prompts, configs)
    cache = PrefixCache() if cached else None
    batch = BatchDecoder(
        engine.target, engine.draft, max_batch=3, eos_token_ids=[2], prefill_budget=4, prefix_cache=cache
    )
    batch.add(prompts[0], configs[0])
    first = batch.step()
    assert [ev.index for ev in first] == [0, 0]  # its first token, then its first cycle
    batch.add(prompts[1], configs[1])
    batch.add(prompts[2], configs[2])
    out = [[] for _ in prompts]
    for ev in first:
        out[ev.index].extend(ev.tokens)
    shared = 0  # steps run while the long prompt waited and others decoded
    while not batch.done:
        waiting = any(j == 1 for j, *_ in batch.queue) or any(j == 1 for j, *_ in batch.prefilling)
        running = {j for j, _ in batch.active}
        events = batch.step()
        for ev in events:
            out[ev.index].extend(ev.tokens)
        if waiting and running:
            shared += 1
            assert running <= {ev.index for ev in events if ev.tokens}  # they kept streaming
    assert out == [r.tokens for r in want]
    # 37 tokens are 10 chunks of 4: one per step while others decode.
    assert shared >= 10


def test_short_prompts_join_together(engines):
    """Prompts that fit in one step's prefill budget all join in that step
    and run their first cycle together."""
    from mlx_dflash import BatchDecoder

    engine = engines["dense"]
    configs = configs_for()
    batch = BatchDecoder(engine.target, engine.draft, max_batch=4, eos_token_ids=[2])
    for p, c in zip(BATCH_PROMPTS, configs):
        batch.add(p, c)
    events = batch.step()
    firsts = [ev.index for ev in events[: len(BATCH_PROMPTS)]]
    assert sorted(firsts) == list(range(len(BATCH_PROMPTS)))  # every first token
    assert [ev.index for ev in events[len(BATCH_PROMPTS) :]] == list(range(len(BATCH_PROMPTS)))  # one cycle for all
    small = BatchDecoder(engine.target, engine.draft, max_batch=4, eos_token_ids=[2], prefill_budget=1)
    for p, c in zip(BATCH_PROMPTS, configs):
        small.add(p, c)
    assert [ev.index for ev in small.step()] == [0, 0]  # one prompt's prefill, then its cycle
    with pytest.raises(DFlashError, match="prefill_budget"):
        BatchDecoder(engine.target, engine.draft, prefill_budget=0)


def _draft(cfg, kind, seed=5):
    if kind == "window":
        dcfg = tiny.draft_config(
            cfg, num_hidden_layers=2, block_size=8, layer_types=["sliding_attention"] * 2, sliding_window=6
        )
    else:
        dcfg = tiny.draft_config(cfg, num_hidden_layers=2, block_size=8)
    if kind == "v2":  # DFlash 2: block convolutions and a candidate selector
        dcfg["architectures"] = ["DFlash2DraftModel"]
        dcfg["dflash_config"].update(selector_rank=8, selector_top_k=6, conv_kernel_size=2, conv_group_size=16)
    return tiny.build_draft(dcfg, seed=seed)


@pytest.mark.parametrize("sample", [False, True])
@pytest.mark.parametrize("kind", ["full", "window", "v2"])
def test_draft_slots_equal_solo_proposals(dense, kind, sample):
    """One draft forward for several requests proposes what each would alone
    (tokens and q bit for bit), and leaves each context cache as alone."""
    from mlx_dflash.models.draft import propose_slots
    from mlx_dflash.sampling import Sampler

    cfg, model = dense
    target = Target(model)
    draft = _draft(cfg, kind).bind(target)
    W = 6
    items, solo_items = [], []
    for b, p in enumerate(BATCH_PROMPTS):
        c = target.make_cache()
        _, feats = target.prefill(p, c, capture=draft.target_layer_ids)
        sampler = Sampler(temperature=0.8, top_k=20, seed=b)
        items.append([feats, p[-1], len(p), draft.make_cache(), sampler, sample])
        solo_items.append([feats, p[-1], len(p), draft.make_cache(), sampler, sample])
    for rnd in range(2):
        got = propose_slots(draft, items, W)
        for it, (toks, q) in zip(solo_items, got):
            want_toks, want_q = draft.propose(it[0], it[1], it[2], W, it[3], it[4], it[5])
            assert same(toks, want_toks)
            assert (q is None) == (want_q is None) and (q is None or same(q, want_q))
        for it, sit in zip(items, solo_items):
            assert len(it[3].state()) == len(sit[3].state())
            assert all(same(x, y) for x, y in zip(it[3].state(), sit[3].state()))
            # The next round: a few new context rows each (different counts).
            n = 1 + len(it[3].positions) % 3
            new = mx.random.normal((n, it[0].shape[-1]), key=mx.random.key(rnd + n))
            for x in (it, sit):
                x[0], x[1], x[2] = new, 5 + n, x[2] + n


@pytest.mark.parametrize("kind", ["full", "window", "v2"])
def test_draft_logits_for_slots_equal_solo_logits(dense, kind):
    """The logits a tree per slot is built from, drafted for several
    requests in one forward, equal each one's solo draft call bit for bit,
    with each context cache as alone."""
    from mlx_dflash.models.draft import draft_logits_slots

    cfg, model = dense
    target = Target(model)
    draft = _draft(cfg, kind).bind(target)
    items, solo = [], []
    for p in BATCH_PROMPTS:
        _, feats = target.prefill(p, target.make_cache(), capture=draft.target_layer_ids)
        items.append((feats, p[-1], len(p), draft.make_cache()))
        solo.append((feats, p[-1], len(p), draft.make_cache()))
    got = draft_logits_slots(draft, items, 5)
    assert len(got) == len(items) and got[0].shape == (4, target.vocab_size)
    for lg, (f, a, pos, c), it in zip(got, solo, items):
        assert same(lg, draft(f, a, pos, 5, c))
        assert all(same(x, y) for x, y in zip(it[3].state(), c.state()))


def test_speculative_rule_through_the_batch_keeps_the_target_distribution(engines):
    """The speculative rule (a draft sampling its block, min(1, p/q)) run per
    slot in a batch: the first two tokens of many seeded requests follow the
    target's own joint distribution (chi-square at 0.999)."""
    from dataclasses import replace

    from test_tree_sampling import chi2_fails

    import mlx_dflash
    from mlx_dflash import GenerationConfig
    from mlx_dflash.sampling import Sampler

    class Sharpened:
        """Proposes from the target's own next-token logits, sharpened
        (q near p but not p: drafts kept and rejected alike)."""

        block_size, target_layer_ids = 8, []

        def make_cache(self, window=None):
            return None

        def __call__(self, features, anchor, anchor_pos, B, cache):
            logits = mx.zeros((B - 1, target.vocab_size))
            if anchor_pos == len(prompt):  # the first cycle (the one tested)
                logits[0] = 4.0 * target(prompt + [anchor])[-1]
            return logits

    target = engines["dense"].target
    engine = replace(engines["dense"], draft=Sharpened())
    prompt = PROMPTS[1]
    kw = dict(temperature=1.0, top_k=3)
    n = 320
    configs = [GenerationConfig(**kw, seed=s, accept_rule="speculative", max_tokens=3, block_size=4) for s in range(n)]
    got = mlx_dflash.batch_generate(engine, [prompt] * n, configs=configs, max_batch=8)
    sampler = Sampler(**kw, seed=0)
    p1 = np.array(sampler.probs(target(prompt)[-1:])[0], np.float64)
    firsts = np.nonzero(p1)[0]
    joint = {}
    for t1 in firsts:
        p2 = np.array(sampler.probs(target(prompt + [int(t1)])[-1:])[0], np.float64)
        for t2 in np.nonzero(p2)[0]:
            joint[int(t1), int(t2)] = p1[t1] * p2[t2]
    pairs = sorted(joint)
    counts = np.zeros(len(pairs))
    for r in got:
        assert tuple(r.tokens[:2]) in joint  # never a pair the target excludes
        counts[pairs.index(tuple(r.tokens[:2]))] += 1
    fails, stat, crit = chi2_fails(counts, np.array([joint[p] for p in pairs]), n)
    assert not fails, (stat, crit)
    # The second token came from a verify of 4 rows, its draft often kept.
    assert all(r.stats.cycle_commits and r.stats.tree_sizes[0] == 4 for r in got)
    kept = sum(r.stats.cycle_commits[0] > 1 for r in got)
    assert n // 10 < kept < n - n // 10


@pytest.mark.slow  # 400 seeded requests through the batch (~30-60 s)
def test_speculative_rule_through_the_batch_with_a_real_draft(tok_dir):
    """The speculative rule in a batch with a real (random-weight) DFlash draft
    sampling its block through propose_slots: the first two tokens follow the
    target's own joint distribution, with drafts both kept and rejected (the
    single-request twin, tests/test_draft2.py, shows the same check failing
    for a wrong residual or q)."""
    from test_draft2 import exact_pairs
    from test_tree_sampling import chi2_fails

    import mlx_dflash
    from mlx_dflash import Engine, GenerationConfig
    from mlx_dflash.loading import load_tokenizer
    from mlx_dflash.sampling import Sampler

    target = Target(tiny.build_target(tiny.target_config(vocab_size=12), seed=21))
    dcfg = tiny.draft_config(tiny.target_config(vocab_size=12), num_hidden_layers=1, block_size=4)
    draft = tiny.build_draft(dcfg, seed=3).bind(target)
    engine = Engine(target, load_tokenizer(tok_dir, eos_token_ids=[99]), draft)  # 99: never generated
    prompt, kw, n = [1, 5, 7], dict(temperature=0.5, top_k=8), 400
    joint = exact_pairs(target, prompt, Sampler(**kw, seed=0)).reshape(-1)
    configs = [GenerationConfig(**kw, seed=s, accept_rule="speculative", max_tokens=3, block_size=4) for s in range(n)]
    got = mlx_dflash.batch_generate(engine, [prompt] * n, configs=configs, max_batch=8)
    counts = np.zeros(joint.size)
    for r in got:
        counts[r.tokens[0] * 12 + r.tokens[1]] += 1
    kept = sum(r.stats.cycle_commits[0] > 1 for r in got)
    assert n // 10 < kept < n - n // 10, kept  # both branches of the rule ran
    assert not chi2_fails(counts, joint, n)[0], chi2_fails(counts, joint, n)


# --- the batch's width policy --------------------------------------------------------


class ScriptedWidths:
    """A batch width policy that plays a fixed cycle of widths (cut to the
    room), to switch widths under the batch at every cycle."""

    adaptive = False

    def __init__(self, widths, max_width=8):
        self.widths, self.max_width, self.fixed, self.k = list(widths), max_width, None, 0
        self.played = []

    def plan(self, slots, room):
        W = min(self.widths[self.k % len(self.widths)], room)
        self.k += 1
        self.played.append(W)
        return W

    def observe(self, slots, seconds=0.0):
        pass

    def describe(self, S):
        return "scripted"


class TableCosts:
    """An injected batch cost model: seconds of a cycle of S slots at width W."""

    def __init__(self, fn):
        self.fn = fn
        self.asked = set()

    def cycle(self, S, W):
        self.asked.add((S, W))
        return self.fn(S, W)

    def observed(self, S, W, seconds):
        pass  # fixed: the test's costs, not this machine's


class Always:
    """A draft that proposes each request's known continuation, right every
    time (``right``) or wrong every time."""

    def __init__(self, seqs, vocab, right=True, block_size=8, wrong_calls=0):
        self.seqs, self.vocab, self.right, self.block_size = list(seqs), vocab, right, block_size
        self.wrong_calls = wrong_calls  # wrong in its first calls, whatever ``right`` says
        self.target_layer_ids = []
        self.made = self.calls = 0

    def make_cache(self, window=None):
        self.made += 1
        return self.seqs[(self.made - 1) % len(self.seqs)]

    def __call__(self, features, anchor, anchor_pos, B, seq):
        self.calls += 1
        right = self.right and self.calls > self.wrong_calls
        logits = np.zeros((B - 1, self.vocab), np.float32)
        for j in range(1, B):
            tok = seq[anchor_pos + j] if anchor_pos + j < len(seq) else 0
            logits[j - 1, tok if right else (tok + 1) % self.vocab] = 1.0
        return mx.array(logits)


def run_batch(engine, prompts, configs, policy=None, max_batch=4):
    """Each request's (tokens, stats) through a BatchDecoder."""
    from mlx_dflash import BatchDecoder

    batch = BatchDecoder(
        engine.target, engine.draft, max_batch=max_batch, eos_token_ids=engine.tokenizer.eos_token_ids, policy=policy
    )
    for p, c in zip(prompts, configs):
        batch.add(p, c)
    out, stats = [[] for _ in prompts], [None] * len(prompts)
    while not batch.done:
        for ev in batch.step():
            out[ev.index].extend(ev.tokens)
            stats[ev.index] = ev.stats
    return out, stats, batch


def adaptive_configs(n=40, **kw):
    from mlx_dflash import GenerationConfig

    return [GenerationConfig(max_tokens=n + 5 * i, **kw) for i in range(len(BATCH_PROMPTS))]


@pytest.mark.parametrize("which", ["dense", "moe"])
def test_width_switches_every_cycle_keep_solo_tokens(engines, which):
    """Widths 1 (a plain step for the batch), 3, 8, 2, 5 in turn under the
    same slots, with a real draft and with one right a random part of each
    block, greedy and seeded sampling (equality rule): each request's
    tokens are its solo run's."""
    engine = engines[which]
    for kw in ({}, dict(temperature=0.8, top_p=0.9, accept_rule="equality")):
        configs = [c.update(seed=50 + i) for i, c in enumerate(adaptive_configs(20, **kw))]
        want = solo(engine, BATCH_PROMPTS, configs)
        for eng in (engine, scripted(engine, BATCH_PROMPTS, want, seed=7)):
            policy = ScriptedWidths([1, 3, 8, 2, 1, 1, 5])
            got, stats, _ = run_batch(eng, BATCH_PROMPTS, configs, policy=policy, max_batch=3)
            assert got == [r.tokens for r in want]
            assert {1, 2, 3, 5, 8} <= set(policy.played)
            assert all({1, 3, 8} <= set(st.widths) for st in stats)


def test_batch_policy_sums_slots_and_prices_the_batch():
    """The choice is the batch's: slot rates summed over the batch cycle's
    cost. One slot whose draft is always right and three whose drafts never
    are: alone that slot would draft, the batch steps plainly; tokens past a
    slot's max_tokens earn nothing; pinned widths ignore costs."""
    from mlx_dflash.batch import BatchPolicy

    costs = TableCosts(lambda S, W: 1.0 if W == 1 else 1.0 + 0.5 * S * (W - 1) / 7)
    good = BatchPolicy(8, costs)
    for _ in range(12):
        good.acceptance(0).observe(7, 7)
        for i in (1, 2, 3):
            good.acceptance(i).observe(7, 0)
    good.warmup = 0
    assert good.best([(0, 100)], room=100) == 8  # alone, it drafts the full block
    slots = [(0, 100), (1, 100), (2, 100), (3, 100)]
    assert good.best(slots, room=100) == 1  # the batch does not pay for it
    assert good.rate(slots, 1) == pytest.approx(4.0)
    assert good.rate(slots, 8) < 4.0
    assert (4, 8) in costs.asked and (1, 8) in costs.asked
    # All four right: the batch drafts, as wide as pays.
    for i in (1, 2, 3):
        good.acc[i] = good.acceptance(0)
    assert good.best(slots, room=100) == 8
    assert good.best(slots, room=5) == 5  # the tightest context room caps it
    # Every slot one token from its max_tokens: drafted rows would not be emitted.
    assert good.best([(i, 1) for i in range(4)], room=100) == 1
    pinned = BatchPolicy(8, None, fixed=4)
    assert [pinned.plan(slots, room) for room in (100, 3, 1)] == [4, 3, 1]


def test_batch_policy_plain_runs_and_shadow_drafts():
    """A useless draft: after the two drafted warm-up cycles and two plain
    verdicts, plain runs of 16, 32, ... cycles; the last cycle of each also
    drafts, unverified (a shadow), scored by the tokens the target commits
    next. A shadow draft the target agrees with brings drafting back."""
    from mlx_dflash.batch import BatchPolicy

    costs = TableCosts(lambda S, W: 1.0 if W == 1 else 1.5 + 0.05 * W)
    p = BatchPolicy(8, costs)
    slots = [(0, 10**6), (1, 10**6)]
    history = [[], []]
    widths, shadows = [], []

    def cycle(right):
        W = p.plan(slots, room=10**6)
        widths.append(W)
        if p.shadow:  # as BatchDecoder._cycle: each slot's draft of the block from its anchor
            shadows.append(len(widths) - 1)
            for i in (0, 1):
                p.shadows[i] = (len(history[i]) - 1, [7] * 7)
        p.observe([(i, left, 1) for i, left in slots])  # drafts rejected: one token each
        for h in history:
            h.append(7 if right else 8)
        p.score_shadows([(i, left, history[i]) for i, left in slots], room=10**6)

    for h in history:
        h.append(0)
    for _ in range(80):
        cycle(right=False)
    drafted = [k for k, W in enumerate(widths) if W > 1]
    assert drafted == [0, 1, 2]  # two warm-up cycles, one more after the first plain verdict
    assert shadows == [3 + 15, 3 + 16 + 31]  # the last cycle of a 16- and a 32-cycle plain run
    assert not p.shadows and p.plain_run == 64
    # The target now agrees with the draft: the next shadow, once its 7
    # positions are committed, brings drafting back.
    while len(shadows) < 3:
        cycle(right=True)
    assert p.shadows and widths[-1] == 1
    for _ in range(6):
        cycle(right=True)
        assert widths[-1] == 1
    cycle(right=True)
    assert not p.shadows and p.plan(slots, room=10**6) > 1


@pytest.mark.parametrize("which", ["dense", "moe"])
def test_adaptive_batch_chooses_plain_or_drafting_by_cost_and_acceptance(engines, which):
    """With injected costs (no timings): drafting dear or the draft always
    wrong -> mostly plain steps for the batch; drafting cheap and the draft
    always right -> full blocks. Tokens are the solo ones every time."""
    from dataclasses import replace

    from mlx_dflash.batch import BatchPolicy

    engine = engines[which]
    configs = adaptive_configs(40)
    want = solo(engine, BATCH_PROMPTS, configs)
    seqs = [list(p) + r.tokens for p, r in zip(BATCH_PROMPTS, want)]
    V = engine.target.vocab_size
    cheap = lambda S, W: 1.0 if W == 1 else 1.0 + 0.1 * W  # noqa: E731
    dear = lambda S, W: 1.0 if W == 1 else 20.0  # noqa: E731
    for costs, right, plain in ((dear, True, True), (cheap, False, True), (cheap, True, False)):
        eng = replace(engine, draft=Always(seqs, V, right=right))
        got, stats, _ = run_batch(eng, BATCH_PROMPTS, configs, policy=BatchPolicy(8, TableCosts(costs)))
        assert got == [r.tokens for r in want]
        if costs is cheap and not right:  # the drafted cycles before the first plain one
            first_plain = stats[0].tree_sizes.index(1)
        for st in stats:
            plain_cycles = st.widths.get(1, 0)
            if plain:
                assert plain_cycles > sum(n for w, n in st.widths.items() if w > 1), st.widths
            else:
                assert plain_cycles == 0 and max(st.widths) == 8, st.widths
                assert st.tau > 4
    # Wrong until the batch turns to plain steps, right from then on: the
    # shadow draft at the end of the first plain run brings drafting back.
    eng = replace(engine, draft=Always(seqs, V, wrong_calls=first_plain * len(BATCH_PROMPTS)))
    got, stats, _ = run_batch(eng, BATCH_PROMPTS, configs, policy=BatchPolicy(8, TableCosts(cheap)))
    assert got == [r.tokens for r in want]
    for st in stats:
        last_plain = max([k for k, w in enumerate(st.tree_sizes) if w == 1], default=None)
        assert last_plain is not None, (st.tree_sizes, st.cycle_commits)
        assert 16 <= st.widths[1] < 16 + 8 and st.cycle_commits[last_plain + 1 :], st.widths
        assert all(n > 1 for n in st.cycle_commits[last_plain + 1 :]), st.cycle_commits


def test_adaptive_batch_measures_its_costs_and_pins_like_solo(engines, tmp_path):
    """Without block_size the batch is adaptive on measured batch costs
    (S slots at each ladder width, cached on disk per S, between batch sizes
    interpolated); block_size, adaptive=False or the speculative rule pin
    the width as a solo run does."""
    from mlx_dflash.batch import BatchCosts

    engine = engines["dense"]
    costs = BatchCosts(engine.target, engine.draft, cache_dir=tmp_path)
    t2, t4 = costs.table(2), costs.table(4)
    assert costs.measured == [2, 4] and sorted(t2) == [1, 2, 4, 8]
    assert all(t > 0 for t in t2.values()) and list(t2.values()) == sorted(t2.values())
    assert costs.cycle(3, 8) == pytest.approx((t2[8] + t4[8]) / 2)
    again = BatchCosts(engine.target, engine.draft, cache_dir=tmp_path)
    assert again.table(4) == t4 and again.measured == []  # read back, not measured
    assert costs.cycle(2, 3) == pytest.approx((t2[2] + t2[4]) / 2)

    configs = adaptive_configs(16)
    want = solo(engine, BATCH_PROMPTS, configs)
    got, stats, batch = run_batch(engine, BATCH_PROMPTS, configs)
    assert got == [r.tokens for r in want]
    assert batch.policy.adaptive and "adaptive" in stats[0].policy
    eng = scripted(engine, BATCH_PROMPTS, want, seed=3)
    for kw in (dict(block_size=4), dict(adaptive=False)):
        cfgs = [c.update(**kw) for c in configs]
        got, stats, batch = run_batch(eng, BATCH_PROMPTS, cfgs)
        assert got == [r.tokens for r in want]
        assert not batch.policy.adaptive and "pinned" in stats[0].policy
        assert all(max(st.widths) == kw.get("block_size", 8) for st in stats), [st.widths for st in stats]
    spec = [c.update(temperature=0.8, seed=i) for i, c in enumerate(configs)]  # the speculative rule
    _, stats, batch = run_batch(engine, BATCH_PROMPTS, spec)
    # The full block while batched; a slot left alone runs its solo loop (cut to its room at the end).
    assert all(max(st.widths) == 8 and "pinned" in st.policy for st in stats), [st.widths for st in stats]
    with pytest.raises(DFlashError, match="adaptive"):
        run_batch(engine, BATCH_PROMPTS[:2], [configs[0], configs[1].update(adaptive=False)])


def test_a_drained_batch_makes_its_widths_again_for_a_new_shape(engines):
    """A long-lived BatchDecoder (the server's) that drained takes requests of
    another shape, and its width policy is made again for them: requests
    pinned to block 4 after adaptive ones are verified at most 4 wide (the
    adaptive policy kept from before could verify up to the draft's block,
    past what their stats hold). And speculative-rule requests first do not
    pin the widths of the greedy ones after them: the adaptive policy resumes."""
    from mlx_dflash import BatchDecoder

    engine = engines["dense"]
    adaptive = adaptive_configs(16)
    want = solo(engine, BATCH_PROMPTS, adaptive)

    def drain(batch, configs):
        index = {batch.add(p, c): k for k, (p, c) in enumerate(zip(BATCH_PROMPTS, configs))}
        out, stats = [[] for _ in configs], [None] * len(configs)
        while not batch.done:
            for ev in batch.step():
                out[index[ev.index]].extend(ev.tokens)
                stats[index[ev.index]] = ev.stats
        return out, stats

    batch = BatchDecoder(engine.target, engine.draft, max_batch=4, eos_token_ids=engine.tokenizer.eos_token_ids)
    got, _ = drain(batch, adaptive)
    assert got == [r.tokens for r in want] and batch.policy.adaptive
    got, stats = drain(batch, [c.update(block_size=4) for c in adaptive])
    assert got == [r.tokens for r in want]
    assert not batch.policy.adaptive and batch.policy.fixed == 4
    assert all(max(st.widths) <= 4 for st in stats), [st.widths for st in stats]

    batch = BatchDecoder(engine.target, engine.draft, max_batch=4, eos_token_ids=engine.tokenizer.eos_token_ids)
    drain(batch, [c.update(temperature=0.8, seed=i) for i, c in enumerate(adaptive)])  # the speculative rule
    got, _ = drain(batch, adaptive)
    assert got == [r.tokens for r in want] and batch.policy.adaptive


@pytest.mark.parametrize("which", ["dense", "moe"])
def test_batch_tree_per_slot_equals_solo_tree(engines, which):
    """tree_budget: a DDTree per slot each cycle (built from its own draft
    logits), verified in one forward and rolled back along each slot's own
    path: greedy and seeded sampling (equality rule) give each request its
    solo tree run's tokens, with the real draft and a scripted one right a
    random part of each block; after every step each slot's cache equals a
    plain forward over its tokens."""
    from support.reference import assert_cache_is_plain_forward

    engine = engines[which]
    for kw in ({}, dict(temperature=0.8, top_k=20, accept_rule="equality")):
        configs = [c.update(tree_budget=5, seed=70 + i, **kw) for i, c in enumerate(configs_for())]
        want = solo(engine, BATCH_PROMPTS, configs)
        for eng in (engine, scripted(engine, BATCH_PROMPTS, want, seed=9)):
            got, stats, batch = run_batch(eng, BATCH_PROMPTS, configs, max_batch=3)
            assert got == [r.tokens for r in want]
            # Trees of 6 nodes (a slot alone runs its solo loop: smaller trees near its end).
            assert all(max(st.widths) == 6 for st in stats), [st.widths for st in stats]
            assert "tree of 5" in stats[0].policy
    batch = run_batch(eng, BATCH_PROMPTS[:0], [])[2]  # a fresh decoder, stepped by hand below
    for p, c in zip(BATCH_PROMPTS, configs):
        batch.add(p, c)
    while not batch.done:
        batch.step()
        for _, d in batch.active:
            assert_cache_is_plain_forward(eng.target, d.cache, d.history[:-1])


@pytest.mark.parametrize("kw", [dict(baseline=True), dict(block_size=4), {}])
def test_lone_slot_runs_its_solo_loop_and_hands_over(engines, kw):
    """A request decoding alone runs its solo loop (pipelined plain steps,
    drafted cycles with the next draft launched early); a second request
    joining mid-run pauses it between two yields: the plain step queued
    ahead is undone and the early draft dropped, so from the first batched
    cycle on every slot's cache is a plain forward over its tokens (one
    ahead while a plain batch step is queued), and both requests keep their
    solo tokens."""
    from support.reference import assert_cache_is_plain_forward

    from mlx_dflash import BatchDecoder

    engine = engines["dense"]
    configs = [c.update(**kw) for c in adaptive_configs(30)[:2]]
    want = solo(engine, BATCH_PROMPTS[:2], configs)
    batch = BatchDecoder(engine.target, engine.draft, max_batch=2, eos_token_ids=engine.tokenizer.eos_token_ids)
    out = [[], []]
    batch.add(BATCH_PROMPTS[0], configs[0])
    for _ in range(6):
        for ev in batch.step():
            out[ev.index] += ev.tokens
    assert batch.lone is not None and 6 <= len(out[0]) < len(want[0].tokens)
    batch.add(BATCH_PROMPTS[1], configs[1])
    while not batch.done:
        for ev in batch.step():
            out[ev.index] += ev.tokens
        for _, d in batch.active if len(batch.active) == 2 else ():
            # The anchor is not in the cache yet, unless a plain batch step is
            # queued on it (test_plain_batch_steps_run_one_ahead_and_undo_at_the_end).
            ahead = batch.queued is not None and any(q is d for q, _ in batch.queued[0])
            assert d.cache.offset == len(d.history) - 1 + ahead
            if kw.get("baseline") and not ahead:  # (rolled-back caches match to rounding: the tests above)
                assert_cache_is_plain_forward(engine.target, d.cache, d.history[:-1])
    assert out == [r.tokens for r in want]


@pytest.mark.parametrize("which", ["dense", "moe"])
def test_plain_batch_steps_run_one_ahead_and_undo_at_the_end(engines, which):
    """Plain batch steps are pipelined: the next is queued on each slot's
    pick before the host reads it, so between steps a slot's cache holds its
    anchor too (the queued snapshot: exactly the committed tokens). A slot
    that ends (max_tokens, at different steps) has its queued row undone at
    once: its cache is then a plain forward over its committed tokens, and
    the other slots' queued rows stand. Tokens equal each request's solo run."""
    from support.reference import assert_cache_is_plain_forward

    from mlx_dflash import BatchDecoder, GenerationConfig

    engine = engines[which]
    configs = [GenerationConfig(max_tokens=m, baseline=True) for m in (7, 12, 20)]
    want = solo(engine, BATCH_PROMPTS[:3], configs)
    batch = BatchDecoder(engine.target, engine.draft, max_batch=3, eos_token_ids=engine.tokenizer.eos_token_ids)
    for p, c in zip(BATCH_PROMPTS, configs):
        batch.add(p, c)
    out, ahead, ended = [[], [], []], 0, []
    while not batch.done:
        running = dict(batch.active)
        for ev in batch.step():
            out[ev.index] += ev.tokens
            d = running.get(ev.index)
            if ev.finish_reason is not None and d is not None:
                ended.append(ev.index)
                assert d.cache.offset == len(d.history) - 1
                assert_cache_is_plain_forward(engine.target, d.cache, d.history[:-1])
        if batch.queued is not None and len(batch.active) > 1:
            for q, snap in batch.queued[0]:
                if any(q is d for _, d in batch.active):
                    ahead += 1
                    assert q.cache.offset == len(q.history) and snap[0] == len(q.history) - 1
    assert out == [r.tokens for r in want]
    assert ahead >= 10 and len(ended) >= 2, (ahead, ended)


def test_pipelined_plain_batch_steps_sample_as_solo(engines):
    """Sampled requests (a seed each, their own options) through pipelined
    plain batch steps: each pick is queued on before it is read, and equals
    the request's solo plain decoding."""
    import mlx_dflash
    from mlx_dflash import GenerationConfig

    engine = engines["dense"]
    configs = [
        GenerationConfig(max_tokens=m, baseline=True, temperature=0.9, top_p=0.95, seed=7 + i)
        for i, m in enumerate((9, 14, 20))
    ]
    configs[2] = configs[2].update(temperature=0.7, min_p=0.05, top_k=30)
    want = solo(engine, BATCH_PROMPTS[:3], configs)
    assert len({tuple(r.tokens[:5]) for r in want}) > 1
    assert_same_results(mlx_dflash.batch_generate(engine, BATCH_PROMPTS[:3], configs=configs, max_batch=3), want)


def test_batch_costs_follow_observed_cycle_times(engines, tmp_path):
    """Observed cycle times replace the measured prior per (S, W): the first
    at each shape untimed (it traces), then the median of the last 5, each
    clipped to 3x the estimate; a shape unseen for 64 cycles goes back to
    the prior."""
    from mlx_dflash.batch import BatchCosts

    engine = engines["dense"]
    costs = BatchCosts(engine.target, engine.draft, cache_dir=tmp_path)
    costs.tables = {2: {1: 1.0, 8: 2.0}, 4: {1: 2.0, 8: 4.0}}  # a prior, not measured here
    assert costs.cycle(3, 8) == pytest.approx(3.0)
    costs.observed(3, 8, 0.5)  # the first at (3, 8): tracing, not counted
    assert costs.cycle(3, 8) == pytest.approx(3.0)
    for t in (2.0, 2.2, 100.0):
        costs.observed(3, 8, t)
    assert costs.seen[3, 8] == pytest.approx([2.0, 2.2, 6.6])  # 100 clipped to 3x the estimate then (2.2)
    assert costs.cycle(3, 8) == pytest.approx(2.2) and costs.cycle(3, 1) == pytest.approx(1.5)
    for _ in range(65):
        costs.observed(2, 1, 1.0)
    assert costs.cycle(3, 8) == pytest.approx(3.0) and costs.measured == []


@pytest.mark.parametrize("edge,resumes", [(1.05, False), (1.3, True)])
def test_batch_policy_needs_a_margin_to_leave_plain_steps(edge, resumes):
    """As the solo policy (Policy.margin): a shadow look after which drafting
    only just pays (5% over plain steps, on one scored block per slot) does
    not restart drafted cycles, which cost several plain steps each; a plain
    run twice as long follows. One after which it pays by 30% does restart
    them. (Without a margin both restarted.)"""
    from mlx_dflash.batch import BatchPolicy
    from mlx_dflash.policy import SWITCH_MARGIN, Acceptance, Policy

    seen = Acceptance(8)
    seen.observe(7, 2)  # what each slot's shadow will show: 2 right, then a miss
    e = max(seen.expected(W) for W in Policy(8).ladder(10**6))
    # A drafted batch cycle costs so much that the best width commits `edge` x plain's tokens per second.
    p = BatchPolicy(8, TableCosts(lambda S, W: 1.0 if W == 1 else e / edge))
    slots = [(0, 10**6), (1, 10**6)]
    p.warmup, p.plain_left, p.plain_run = 0, 1, 16
    assert p.plan(slots, room=10**6) == 1 and p.shadow  # a plain run's last cycle looks
    history = [[0], [0]]
    for i in (0, 1):
        p.shadows[i] = (0, [7] * 7)
    p.observe([(i, left, 1) for i, left in slots])
    for token in (7, 7, 8):
        for h in history:
            h.append(token)
        p.score_shadows([(i, left, history[i]) for i, left in slots], room=10**6)
    assert not p.shadows
    assert p.margin(slots) == pytest.approx(1 + SWITCH_MARGIN / 2**0.5)
    W = p.plan(slots, room=10**6)
    assert (W > 1) == resumes, (W, p.plain_left)
    assert p.plain_left == (0 if resumes else 32)  # a plain run twice as long


@pytest.mark.parametrize("kind", ["full", "window", "v2"])
def test_shadow_drafts_with_real_drafts_keep_solo_tokens(dense, tok_dir, kind):
    """Plain runs with shadow drafts (the draft reads its context and
    proposes in plain cycles, unverified), then drafting again, with real
    DFlash drafts (full context, a sliding window, DFlash 2): each request's
    tokens are its solo run's."""
    from mlx_dflash import Engine
    from mlx_dflash.batch import BatchPolicy
    from mlx_dflash.loading import load_tokenizer

    cfg, model = dense
    target = Target(model)
    engine = Engine(target, load_tokenizer(tok_dir, eos_token_ids=[2]), _draft(cfg, kind).bind(target))
    configs = adaptive_configs(30)
    want = solo(engine, BATCH_PROMPTS, configs)
    # Drafting dear for the first 12 cycles (a plain run starts), then cheap:
    # the shadow at the end of the run brings drafting back.
    clock = {"cycles": 0}

    class Turning(TableCosts):
        def observed(self, S, W, seconds):
            pass

    def fn(S, W):
        return 1.0 if W == 1 else (30.0 if clock["cycles"] < 12 else 1.01)

    policy = BatchPolicy(8, Turning(fn))
    plan = policy.plan

    def counted(slots, room):
        clock["cycles"] += 1
        return plan(slots, room)

    policy.plan = counted
    got, stats, _ = run_batch(engine, BATCH_PROMPTS, configs, policy=policy)
    assert got == [r.tokens for r in want]
    for st in stats:
        sizes = st.tree_sizes
        first_plain = sizes.index(1)
        assert sizes[first_plain : first_plain + 16] == [1] * 16, sizes
        assert any(w > 1 for w in sizes[first_plain + 16 :]), sizes


def test_a_prefix_cache_is_saved_only_for_its_own_model_and_holds_one_kv_format(tmp_path):
    """save(engine=another model) stamped the snapshots with that model's
    fingerprint, and load then restored them into it (other tokens than a
    cold run). Requests of one batch with different kv_bits put two KV
    formats in one cache, which then restored in neither."""
    from mlx.utils import tree_map

    eng = mlx_dflash.load()
    pc = mlx_dflash.PrefixCache()
    ids = eng.encode("def quicksort(arr):")
    mlx_dflash.generate(eng, ids, max_tokens=4, prefix_cache=pc)
    other = mlx_dflash.load()
    other.target.model.update(tree_map(lambda a: a * 1.5 if a.ndim == 1 else a, other.target.model.parameters()))
    with pytest.raises(DFlashError, match="snapshots of another model"):
        pc.save(tmp_path / "p.safetensors", engine=other)
    assert not (tmp_path / "p.safetensors").exists()
    GC = mlx_dflash.GenerationConfig
    with pytest.raises(DFlashError, match="need one KV format: kv_bits None here, 8 in this batch"):
        mlx_dflash.batch_generate(
            eng,
            [ids, ids[:-1]],
            configs=[GC(kv_bits=8, max_tokens=4), GC(max_tokens=4)],
            prefix_cache=mlx_dflash.PrefixCache(),
        )
    with pytest.raises(DFlashError, match="snapshots of a full-precision KV cache"):
        mlx_dflash.batch_generate(eng, [ids], configs=[GC(kv_bits=8, max_tokens=4)], prefix_cache=pc)


def test_bad_batch_input_is_one_error_when_given_not_at_a_later_step(tmp_path):
    eng = mlx_dflash.load()
    ids = eng.encode("def f(x):")
    bd = mlx_dflash.BatchDecoder(eng.target, eng.draft, eos_token_ids=eng.tokenizer.eos_token_ids)
    cases = [
        (lambda: bd.add(None), "a prompt is text or a list of token ids, got NoneType"),
        (lambda: bd.add(5), "got int"),
        (lambda: bd.add(mx.array([1.5])), "must be integers"),
        (lambda: bd.add(ids, prefix_boundary="x"), "prefix_boundary must be a token count"),
        (lambda: bd.add(ids, prefix_boundary=2.5), "prefix_boundary must be a token count"),
        (lambda: mlx_dflash.BatchDecoder(eng.target, draft="x"), "draft must be a loaded draft"),
        (lambda: mlx_dflash.BatchDecoder(eng.target, eos_token_ids=None), "eos_token_ids must be a sequence"),
        (lambda: mlx_dflash.BatchDecoder(eng.target, eos_token_ids=2), "eos_token_ids must be a sequence"),
        (lambda: mlx_dflash.BatchDecoder(eng.target, prefill_budget="5"), "prefill_budget must be"),
        (lambda: mlx_dflash.BatchDecoder(eng.target, max_batch=True), "max_batch must be"),
        (lambda: mlx_dflash.PrefixCache().save(None), "path must be a file path"),
        (lambda: mlx_dflash.PrefixCache().save(tmp_path / "x", engine="x"), "engine must be an Engine"),
        (lambda: mlx_dflash.PrefixCache.load(None, eng), "path must be a file path"),
    ]
    for call, words in cases:
        with pytest.raises(DFlashError, match=re.escape(words)):
            call()
    # a numpy array of ids is a prompt, as generate takes it
    i = bd.add(np.array(ids), max_tokens=3, baseline=True)
    got = []
    while not bd.done:
        got += [t for ev in bd.step() if ev.index == i for t in ev.tokens]
    assert got == mlx_dflash.generate(eng, ids, max_tokens=3, baseline=True).tokens


def test_a_prefix_two_requests_share_is_prefilled_once(engines):
    """Two requests added together with a shared long prefix (the same system
    prompt): the second waits for the first's prefill and restores its
    snapshot instead of prefilling the prefix itself; both give their solo
    tokens. A third prompt that shares nothing is not held back."""
    from mlx_dflash import BatchDecoder, PrefixCache

    engine = engines["dense"]
    system = [(5 * i + 11) % 400 for i in range(40)]
    prompts = [system + [21, 22, 23], system + [31, 32], [(3 * i + 1) % 400 for i in range(12)]]
    boundary = len(system)  # the stable boundary a chat template gives
    configs = [c.update(prefill_chunk=8) for c in configs_for()[:3]]
    want = solo(engine, prompts, configs)
    batch = BatchDecoder(
        engine.target, engine.draft, max_batch=3, eos_token_ids=[2], prefill_budget=8, prefix_cache=PrefixCache()
    )
    for p, c in zip(prompts, configs):
        batch.add(p, c, prefix_boundary=boundary if p[:boundary] == system else None)
    out = [[] for _ in prompts]
    stats = {}
    first_at = {}
    step = 0
    while not batch.done:
        step += 1
        for ev in batch.step():
            out[ev.index].extend(ev.tokens)
            stats[ev.index] = ev.stats
            first_at.setdefault(ev.index, step)
    assert out == [r.tokens for r in want]
    assert stats[0].cached_tokens == 0 and stats[1].cached_tokens == boundary
    assert first_at[2] < first_at[1]  # the unrelated prompt went ahead of the waiting one


def test_batch_stats_count_only_the_tokens_handed_out():
    """A cycle that accepts past max_tokens books only the tokens a request
    got (its tau counted the rest, 3.0 where 2 tokens were handed out). The embedded pair:
    its draft is right for whole blocks on this prompt."""
    engine = mlx_dflash.load()
    p = "import os\nimport sys\n\n\ndef parse_args(argv):\n    options = {}\n    for arg in argv:\n"
    for n in (2, 3):
        got = mlx_dflash.batch_generate(engine, [p, p], max_tokens=n, block_size=13)
        want = mlx_dflash.generate(engine, p, max_tokens=n, block_size=13)
        for r in got:
            assert r.tokens == want.tokens
            assert 1 + sum(r.stats.cycle_commits) == r.stats.generated_tokens == n
            assert r.stats.tau == sum(r.stats.cycle_commits) / len(r.stats.cycle_commits)


def test_batch_generate_takes_generates_chat_options_and_names_no_prompt_for_the_calls_errors():
    """prefill_response, as generate takes it (it was an unknown option);
    an error in the call's own options is no one prompt's (it read "prompt 0: ...")."""
    import mlx_dflash

    eng = mlx_dflash.load()
    kw = dict(chat_template=True, system="Be brief.", prefill_response="def", max_tokens=8)
    got = mlx_dflash.batch_generate(eng, ["write a function", "sort a list"], **kw)
    for prompt, r in zip(["write a function", "sort a list"], got):
        assert r.tokens == mlx_dflash.generate(eng, prompt, **kw).tokens
    with pytest.raises(DFlashError) as e:
        mlx_dflash.batch_generate(eng, ["a", "b"], temp=0.5)
    assert "unknown generation option" in str(e.value) and "prompt 0" not in str(e.value)
