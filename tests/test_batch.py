"""Several requests in one forward (slots): each slot's logits, features,
caches and rollback equal its solo run's, bit for bit, and no slot's
operation touches another's arrays; batch_generate equals solo generate."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_dflash.cache import SlotBatch
from mlx_dflash.models.qwen35 import Target
from tools import tiny

PROMPTS = [[1, 10, 20, 30, 40], [7, 7, 7, 100, 250, 31, 64, 99, 12, 5, 300], [2, 450], [9, 8, 7, 6, 5, 4, 3]]
CAPTURE = (1, 3)


# MLX's CPU gather_mm (the MoE experts) runs float32 only: no bf16 MoE here.
MODELS = [("dense", mx.float32), ("dense", mx.bfloat16), ("moe", mx.float32)]
MODEL_IDS = ["dense-f32", "dense-bf16", "moe-f32"]


@pytest.fixture(scope="module")
def targets():
    """Tiny dense and MoE targets (float32, and bfloat16 for the dense one)."""
    out = {}
    for name, dt in MODELS:
        cfg = tiny.target_config(moe=name == "moe")
        out[name, dt] = Target(tiny.build_target(cfg, seed=7 if name == "moe" else 3, dtype=dt))
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
