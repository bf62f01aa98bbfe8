"""Prefix snapshots: a restored prefix gives exactly the cold output and cache,
snapshots are never mutated or wrongly shared, LRU by real bytes, files."""

import gc
import json
import os

import mlx.core as mx
import numpy as np
import pytest

import mlx_dflash
from mlx_dflash.api import Engine
from mlx_dflash.cli import main
from mlx_dflash.errors import DFlashError
from mlx_dflash.loading import load_tokenizer
from mlx_dflash.models.qwen35 import Target
from mlx_dflash.prefix import PrefixCache
from tools import tiny

N = 20


def assert_cache_is_plain_forward(target, cache, tokens):
    """``cache`` equals one unchunked prefill over ``tokens``. A prefill split
    at snapshot positions rounds differently in float32 (the DeltaNet block
    is evaluated in closed form per chunk), hence the tolerance."""
    fresh = target.make_cache()
    target.forward(list(tokens), fresh, logits="none")
    assert cache.offset == fresh.offset == len(tokens)
    got, want = cache.state(), fresh.state()
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.array(g), np.array(w), rtol=1e-4, atol=1e-4)


def make_engine(cfg, model, tok_dir, draft_kind):
    target = Target(model)
    if draft_kind == "window":  # sliding draft: its cache keeps a window of context rows
        dcfg = tiny.draft_config(
            cfg,
            num_hidden_layers=2,
            block_size=8,
            layer_types=["sliding_attention", "sliding_attention"],
            sliding_window=12,
        )
    else:  # full-attention draft: its cache keeps every context row
        dcfg = tiny.draft_config(cfg, num_hidden_layers=2, block_size=8)
    draft = tiny.build_draft(dcfg, seed=5).bind(target)
    return Engine(target, load_tokenizer(tok_dir, eos_token_ids=[2]), draft)


@pytest.fixture(scope="module")
def engines(dense, moe, tok_dir):
    return {"dense": make_engine(*dense, tok_dir, "window"), "moe": make_engine(*moe, tok_dir, "full")}


def ids(seed, n, vocab=400):
    return np.random.default_rng(seed).integers(4, vocab, n).tolist()


# The chain is pinned to the draft's full block: the adaptive width depends on
# timings, and a restored run must verify the blocks the cold run did.
MODES = {
    "plain": dict(baseline=True),
    "chain": dict(adaptive=False),
    "tree": dict(tree_budget=6, tree_topk=2),
}


FAST = {("dense", "chain", False), ("moe", "tree", True), ("moe", "plain", False), ("dense", "chain", True)}
COMBOS = [
    pytest.param(
        w, m, smp, id=f"{w}-{m}-{'sampled' if smp else 'greedy'}", marks=() if (w, m, smp) in FAST else pytest.mark.slow
    )
    for w in ("dense", "moe")
    for m in MODES
    for smp in (False, True)
]


@pytest.mark.parametrize("which,mode,sampled", COMBOS)
def test_restore_equals_cold(engines, which, mode, sampled):
    eng = engines[which]
    kw = dict(MODES[mode], max_tokens=N)
    if sampled:
        kw.update(temperature=0.9, top_p=0.95, seed=3)
    prompt = ids(1, 150)
    cold = mlx_dflash.generate(eng, prompt, **kw)
    pc = PrefixCache(rung_interval=64)
    first = mlx_dflash.generate(eng, prompt, prefix_cache=pc, **kw)
    assert first.stats.cached_tokens == 0 and first.tokens == cold.tokens
    again = mlx_dflash.generate(eng, prompt, prefix_cache=pc, **kw)
    assert again.stats.cached_tokens == len(prompt) - 1  # the retry restores all but one token
    assert again.tokens == cold.tokens
    # Speculation after a restore accepts exactly what it accepts cold.
    assert again.stats.accept_hist == first.stats.accept_hist
    # The next turn extends prompt + reply: the end-of-generation snapshot.
    nxt = prompt + cold.tokens + ids(2, 12)
    warm = mlx_dflash.generate(eng, nxt, prefix_cache=pc, **kw)
    assert warm.stats.cached_tokens == len(prompt) + len(cold.tokens) - 1
    assert warm.stats.prompt_tokens == len(nxt)
    assert warm.tokens == mlx_dflash.generate(eng, nxt, **kw).tokens
    # Diverging at token 100: the rung at 64 is the longest usable prefix.
    div = prompt[:100] + ids(3, 30)
    warm = mlx_dflash.generate(eng, div, prefix_cache=pc, **kw)
    assert warm.stats.cached_tokens == 64
    assert warm.tokens == mlx_dflash.generate(eng, div, **kw).tokens


@pytest.mark.parametrize("which", ["dense", "moe"])
def test_every_snapshot_restores_a_plain_forward(engines, which):
    eng = engines[which]
    target = eng.target
    pc = PrefixCache(rung_interval=32)
    prompt = ids(4, 100)
    out = mlx_dflash.generate(eng, prompt, max_tokens=N, prefix_cache=pc)
    kinds = sorted(kind for _, kind in pc.snapshots())
    assert kinds == ["boundary", "end", "rung", "rung", "rung"]
    seq = prompt + out.tokens
    for snap in list(pc._snaps):
        assert list(snap.tokens) == seq[: snap.n]
        cache = target.make_cache()
        pc._restore(snap, cache, None)
        assert_cache_is_plain_forward(target, cache, seq[: snap.n])
    # A restore plus a partial prefill also equals a plain forward.
    cache = target.make_cache()
    pc.prefill(target, seq[:90] + [5, 6, 7], cache)
    assert_cache_is_plain_forward(target, cache, seq[:90] + [5, 6, 7])


@pytest.mark.parametrize("which", ["moe", "dense"])  # unwindowed / windowed draft
def test_restored_draft_context_equals_a_cold_one(engines, which):
    """Every snapshot's draft context, restored, is the context a cold
    prefill of its tokens gives the draft, and so are the draft's next
    logits (a restore that altered the rows would change the proposals)."""
    eng = engines[which]
    draft = eng.draft
    pc = PrefixCache(rung_interval=32)
    prompt = ids(21, 70)
    mlx_dflash.generate(eng, prompt, max_tokens=8, prefix_cache=pc)
    snaps = [s for s in pc._snaps if s.draft_layout is not None]
    assert sorted(s.kind for s in snaps) == ["boundary", "end", "rung", "rung"]
    assert all((s.draft is None) == (which == "moe") for s in snaps)  # rows in the segments / own
    for snap in snaps:
        dcache = draft.make_cache()
        pc._restore(snap, eng.target.make_cache(), dcache)
        cold = draft.make_cache()
        _, f = eng.target.forward(
            list(snap.tokens), eng.target.make_cache(), capture=draft.target_layer_ids, logits="none"
        )
        draft.add_context(f, cold)
        assert dcache.length == cold.length == snap.n and dcache.positions == cold.positions
        for got, want in zip(dcache.keys + dcache.values, cold.keys + cold.values):
            np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)
        block = [draft(None, 7, snap.n, draft.block_size, c) for c in (dcache, cold)]
        np.testing.assert_allclose(np.array(block[0]), np.array(block[1]), rtol=1e-4, atol=1e-4)


def _all_arrays(pc):
    return [np.array(a) for s in pc._snaps for a in s.arrays()]


def test_no_snapshot_is_mutated(engines):
    eng = engines["dense"]
    pc = PrefixCache(rung_interval=32)
    prompt = ids(5, 90)
    a1 = mlx_dflash.generate(eng, prompt, max_tokens=N, prefix_cache=pc)
    before = _all_arrays(pc)
    n_before = len(pc)
    # Restore the rung at 64 and decode past it in another direction.
    other = mlx_dflash.generate(eng, prompt[:70] + ids(6, 20), max_tokens=N, prefix_cache=pc)
    assert other.stats.cached_tokens == 64
    after = _all_arrays(pc)[: len(before)]
    assert len(pc) > n_before
    for x, y in zip(before, after):
        np.testing.assert_array_equal(x, y)
    a2 = mlx_dflash.generate(eng, prompt, max_tokens=N, prefix_cache=pc)
    assert a2.stats.cached_tokens == len(prompt) - 1 and a2.tokens == a1.tokens


def test_equal_length_prompts_differing_in_one_token_never_share(engines):
    eng = engines["moe"]
    a = ids(7, 80)
    for j in (0, 40, 79):
        b = list(a)
        b[j] = 4 if a[j] != 4 else 5
        pc = PrefixCache(rung_interval=0)
        mlx_dflash.generate(eng, a, max_tokens=8, prefix_cache=pc)
        rb = mlx_dflash.generate(eng, b, max_tokens=8, prefix_cache=pc)
        # Only the boundary at 79 (== a[:79]) can start b, and only if b differs after it.
        assert rb.stats.cached_tokens == (79 if j == 79 else 0)
        assert rb.tokens == mlx_dflash.generate(eng, b, max_tokens=8).tokens
        # b's next turn finds b's longest snapshot (its end), never one of a's;
        # a prompt between b's boundary and end finds the boundary (a's, the
        # same tokens, when a and b differ only in the last token).
        assert pc.lookup(b + rb.tokens).tokens == tuple(b + rb.tokens[:-1])
        assert pc.lookup(b + [9]).tokens == tuple(b[:79])


def test_shared_system_prompt_reuses_the_rung_below_the_divergence(engines):
    eng = engines["dense"]
    pc = PrefixCache(rung_interval=32)
    system = "Beautiful is better than ugly. Explicit is better than implicit. " * 6
    kw = dict(chat_template=True, system=system, max_tokens=8, prefix_cache=pc)
    ra = mlx_dflash.generate(eng, "def fibonacci(n):", **kw)
    a = eng.encode("def fibonacci(n):", chat_template=True, system=system)
    b = eng.encode("class Stack:", chat_template=True, system=system)
    d = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert d > 64
    rb = mlx_dflash.generate(eng, "class Stack:", **kw)
    assert rb.stats.cached_tokens == (d // 32) * 32
    cold = mlx_dflash.generate(eng, "class Stack:", chat_template=True, system=system, max_tokens=8)
    assert rb.tokens == cold.tokens and ra.stats.cached_tokens == 0


def test_stable_boundary_sits_before_the_generation_prompt(engines):
    eng = engines["dense"]
    pc = PrefixCache(rung_interval=0)
    p = eng.encode("hello", chat_template=True)
    tail = eng.tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert p[-len(tail) :] == tail
    assert pc.stable_boundary(eng.tokenizer, p) == len(p) - len(tail)
    assert pc.stable_boundary(eng.tokenizer, [5, 6, 7]) == 2


def test_lru_eviction_by_real_bytes(engines):
    eng = engines["dense"]
    big = PrefixCache(rung_interval=0)
    mlx_dflash.generate(eng, ids(10, 60), max_tokens=8, prefix_cache=big)
    one = big.nbytes  # one conversation: boundary + end snapshots
    pc = PrefixCache(max_bytes=int(2.5 * one), rung_interval=0)
    A, B, C = ids(10, 60), ids(11, 60), ids(12, 60)
    for p in (A, B):
        mlx_dflash.generate(eng, p, max_tokens=8, prefix_cache=pc)
    assert len(pc) == 4
    assert mlx_dflash.generate(eng, A, max_tokens=8, prefix_cache=pc).stats.cached_tokens == 59  # A used last
    mlx_dflash.generate(eng, C, max_tokens=8, prefix_cache=pc)
    assert pc.nbytes <= pc.max_bytes
    assert pc.lookup(A + [1]) is not None and pc.lookup(C + [1]) is not None
    assert pc.lookup(B + [1]) is None  # the least recently used went first


@pytest.fixture
def exact_allocations():
    """No buffer reuse while the test runs: a reused buffer may be larger than
    asked for, which would blur what ``clear()`` frees."""
    old = mx.set_cache_limit(0)
    mx.clear_cache()
    yield
    mx.set_cache_limit(old)


@pytest.mark.parametrize("which", ["moe", "dense"])  # unwindowed / windowed draft
def test_byte_accounting_equals_device_memory(engines, which, exact_allocations):
    """The memory ``clear()`` frees is what ``nbytes`` reports. A snapshot
    that kept a view of a larger buffer (the draft's context buffers grow in
    steps of 256 rows) would free several times what it counts."""
    eng = engines[which]
    assert (eng.draft.make_cache().window is not None) == (which == "dense")
    pc = PrefixCache(rung_interval=32)
    prompt = ids(13, 130)
    mlx_dflash.generate(eng, prompt, max_tokens=N, prefix_cache=pc)
    mlx_dflash.generate(eng, prompt[:50] + ids(14, 40), max_tokens=N, prefix_cache=pc)
    gc.collect()
    held = pc.nbytes
    assert held > 0
    arrays = {id(a): a.nbytes for s in pc._snaps for a in s.arrays()}
    assert sum(arrays.values()) == held
    m1 = mx.get_active_memory()
    pc.clear()
    gc.collect()
    freed = m1 - mx.get_active_memory()
    # The CPU allocator takes exactly the bytes asked for; Metal rounds a
    # buffer up to its 16 KiB page.
    page = 1 if mx.default_device() == mx.cpu else 16384
    assert held <= freed <= sum(-(-n // page) * page for n in arrays.values())


def test_budget_too_small_for_one_snapshot(engines):
    eng = engines["dense"]
    prompt = ids(1, 20)
    # The least one snapshot holds: its recurrent state and one KV row, read off a real snapshot.
    big = PrefixCache(rung_interval=0)
    cold = mlx_dflash.generate(eng, prompt, max_tokens=4, prefix_cache=big).tokens
    s = min(big._snaps, key=lambda s: s.n)
    rec = sum(a.nbytes for arrays, _ in s.layers.values() for a in arrays)
    row = sum(a.nbytes for arrays, _ in s.seg.layers.values() for a in arrays) // (s.seg.end - s.seg.start)
    with pytest.raises(DFlashError, match=f"too small for one snapshot .*at least {rec + row} bytes"):
        mlx_dflash.generate(eng, prompt, max_tokens=4, prefix_cache=PrefixCache(max_bytes=rec + row - 1))
    # Exactly that budget is accepted; this prompt's snapshots are larger, so none is kept.
    pc = PrefixCache(max_bytes=rec + row, rung_interval=0)
    assert mlx_dflash.generate(eng, prompt, max_tokens=4, prefix_cache=pc).tokens == cold
    assert len(pc) == 0 and pc.nbytes == 0
    with pytest.raises(DFlashError, match="must be positive"):
        PrefixCache(max_bytes=0)


def test_one_cache_per_model(engines):
    pc = PrefixCache()
    mlx_dflash.generate(engines["dense"], ids(1, 20), max_tokens=4, prefix_cache=pc)
    with pytest.raises(DFlashError, match="another model"):
        mlx_dflash.generate(engines["moe"], ids(1, 20), max_tokens=4, prefix_cache=pc)


def test_closing_the_stream_early_leaves_the_cache_consistent(engines):
    eng = engines["dense"]
    pc = PrefixCache(rung_interval=32)
    prompt = ids(15, 70)
    for kw in (dict(), dict(baseline=True)):
        pc.clear()
        gen = mlx_dflash.stream_generate(eng, prompt, max_tokens=N, prefix_cache=pc, **kw)
        got = []
        for r in gen:
            got.extend(r.tokens)
            if len(got) >= 5:
                break
        gen.close()
        full = mlx_dflash.generate(eng, prompt, max_tokens=N, **kw).tokens
        assert got == full[: len(got)]
        ends = [s for s in pc._snaps if s.kind == "end"]
        assert len(ends) == 1 and list(ends[0].tokens) == (prompt + full)[: ends[0].n]
        for snap in pc._snaps:
            cache = eng.target.make_cache()
            pc._restore(snap, cache, None)
            assert_cache_is_plain_forward(eng.target, cache, list(snap.tokens))
        nxt = prompt + got + [7, 8]
        warm = mlx_dflash.generate(eng, nxt, max_tokens=N, prefix_cache=pc, **kw)
        assert warm.stats.cached_tokens == ends[0].n
        assert warm.tokens == mlx_dflash.generate(eng, nxt, max_tokens=N, **kw).tokens


def test_save_to_a_path_that_cannot_be_written_names_it(engines, tmp_path):
    """The error names the path given, not the temporary file beside it, and nothing is left."""
    eng = engines["moe"]
    pc = PrefixCache()
    mlx_dflash.generate(eng, ids(16, 100), max_tokens=2, prefix_cache=pc, adaptive=False)
    with pytest.raises(DFlashError, match="the folder .*nodir does not exist"):
        pc.save(tmp_path / "nodir" / "x.safetensors")
    with pytest.raises(DFlashError, match="is a folder; give a file path"):
        pc.save(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_save_load_round_trip(engines, tmp_path):
    eng = engines["moe"]
    pc = PrefixCache(rung_interval=32)
    prompt = ids(16, 100)
    cold = mlx_dflash.generate(eng, prompt, max_tokens=N, prefix_cache=pc, adaptive=False)
    f = tmp_path / "pc.safetensors"
    pc.save(f)
    back = PrefixCache.load(f, eng)
    assert back.snapshots() == pc.snapshots() and back.nbytes == pc.nbytes
    for s, t in zip(sorted(pc._snaps, key=lambda s: s.used), sorted(back._snaps, key=lambda s: s.used)):
        assert s.tokens == t.tokens
        for x, y in zip(s.arrays(), t.arrays()):
            np.testing.assert_array_equal(np.array(x), np.array(y))
    again = mlx_dflash.generate(eng, prompt, max_tokens=N, prefix_cache=back, adaptive=False)
    assert again.stats.cached_tokens == len(prompt) - 1 and again.tokens == cold.tokens
    assert again.stats.accept_hist == cold.stats.accept_hist
    adaptive = mlx_dflash.generate(eng, prompt, max_tokens=N, prefix_cache=back)  # widths from timings
    assert adaptive.stats.cached_tokens == len(prompt) - 1 and adaptive.tokens == cold.tokens


def test_a_file_for_the_same_model_at_another_dtype_says_so(tmp_path):
    """The embedded pair by load() (cast to float32) and by its folders'
    paths (their float16): the file is refused, and the message says why."""
    from mlx_dflash.api import DEFAULT_DRAFT, DEFAULT_MODEL

    pc = PrefixCache(rung_interval=0)
    mlx_dflash.generate(mlx_dflash.load(), "def f():", max_tokens=2, prefix_cache=pc)
    pc.save(tmp_path / "pc.safetensors")
    with pytest.raises(DFlashError, match="another model .*same model at another dtype"):
        PrefixCache.load(tmp_path / "pc.safetensors", mlx_dflash.load(DEFAULT_MODEL, DEFAULT_DRAFT))


def test_bad_cache_files(engines, tmp_path):
    eng = engines["moe"]
    pc = PrefixCache(rung_interval=0)
    mlx_dflash.generate(eng, ids(17, 40), max_tokens=8, prefix_cache=pc)
    f = tmp_path / "pc.safetensors"
    pc.save(f)
    data = f.read_bytes()
    with pytest.raises(DFlashError, match="another model"):
        PrefixCache.load(f, engines["dense"])
    cases = {
        "truncated.safetensors": data[: len(data) // 2],
        "garbage.safetensors": b"\x00\x01not a safetensors file" * 10,
        "flipped.safetensors": data[:-100] + bytes([data[-100] ^ 0xFF]) + data[-99:],
    }
    for name, content in cases.items():
        p = tmp_path / name
        p.write_bytes(content)
        with pytest.raises(DFlashError, match="corrupt|truncated"):
            PrefixCache.load(p, eng)
    with pytest.raises(DFlashError, match="not found"):
        PrefixCache.load(tmp_path / "missing.safetensors", eng)
    os.mkfifo(tmp_path / "fifo")  # it said "not found" of a path that is there
    with pytest.raises(DFlashError, match="fifo is not a regular file"):
        PrefixCache.load(tmp_path / "fifo", eng)
    plain = tmp_path / "plain.safetensors"
    mx.save_safetensors(str(plain), {"x": mx.zeros((2,))})
    with pytest.raises(DFlashError, match="not an mlx-dflash prompt cache"):
        PrefixCache.load(plain, eng)
    with pytest.raises(DFlashError, match="holds none of the .* snapshots"):  # said at load, not later
        PrefixCache.load(f, eng, max_bytes=10)
    with pytest.raises(DFlashError, match="budget must be an integer, got 'x'"):
        PrefixCache(max_bytes="x")


def test_unwindowed_draft_rows_are_stored_once(engines):
    """A full-attention draft's context rows are position-local like target
    KV: all snapshots of a conversation share one copy of each row."""
    eng = engines["moe"]
    pc = PrefixCache(rung_interval=16)
    prompt = ids(30, 100)
    mlx_dflash.generate(eng, prompt, max_tokens=N, prefix_cache=pc)
    assert len(pc) == 8  # 6 rungs, the boundary, the end
    segs = {}
    for s in pc._snaps:
        assert s.draft_layout is not None and s.draft is None
        seg = s.seg
        while seg is not None:
            segs[id(seg)] = seg
            seg = seg.parent
    rows = sum(seg.end - seg.start for seg in segs.values())
    assert rows == len(prompt) + N - 1
    draft_bytes = sum(a.nbytes for seg in segs.values() for a in seg.draft[0])
    k, v = next(iter(segs.values())).draft[0][:2]  # layer 0's keys and values
    per_row = len(eng.draft.layers) * (k.nbytes / k.shape[2] + v.nbytes / v.shape[2])
    assert draft_bytes == rows * per_row


def _rewrite_metadata(path, edit):
    """Edit a safetensors file's string metadata in its JSON header, as a
    hand edit would (the tensors' bytes are left as they are)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    edit(header["__metadata__"])
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(len(new).to_bytes(8, "little") + new + raw[8 + n :])


def _point_at_the_other_segment(meta):
    """Point one conversation's boundary snapshot at the other's KV segment
    (as long as its own): an index that looks consistent and restores the
    wrong rows."""
    index = json.loads(meta["index"])
    a, b = sorted((s for s in index["snapshots"] if s["kind"] == "boundary"), key=lambda s: s["n"])
    assert a["segment"] != b["segment"] and index["segments"][b["segment"]]["end"] >= a["n"]
    a["segment"] = b["segment"]
    meta["index"] = json.dumps(index)


def test_an_edited_index_is_refused(engines, tmp_path):
    eng = engines["moe"]
    pc = PrefixCache(rung_interval=0)
    A, B = ids(40, 60), ids(41, 60)
    for p in (A, B):
        mlx_dflash.generate(eng, p, max_tokens=8, prefix_cache=pc)
    f = tmp_path / "pc.safetensors"
    pc.save(f)
    assert PrefixCache.load(f, eng).snapshots() == pc.snapshots()  # the rewrite itself changes nothing
    _rewrite_metadata(f, lambda meta: None)
    assert PrefixCache.load(f, eng).snapshots() == pc.snapshots()
    edits = {"segments": _point_at_the_other_segment, "rung interval": lambda meta: meta.update(rung_interval="64")}
    for name, edit in edits.items():
        g = tmp_path / f"{name}.safetensors"
        g.write_bytes(f.read_bytes())
        _rewrite_metadata(g, edit)
        with pytest.raises(DFlashError, match="corrupt"):
            PrefixCache.load(g, eng)


def test_cli_refuses_an_edited_prompt_cache_file(dense, tok_dir, tmp_path, capsys):
    cfg, model = dense
    target = tiny.save_mlx(model, cfg, tmp_path / "target", tokenizer_dir=tok_dir)
    dcfg = tiny.draft_config(cfg, num_hidden_layers=2, block_size=8)
    draft = tiny.save_draft(tiny.build_draft(dcfg, seed=5), dcfg, tmp_path / "draft")
    f = tmp_path / "pc.safetensors"

    def run(*args):
        with pytest.raises(SystemExit) as e:
            main(["generate", "-m", str(target), "-d", str(draft), "-n", "6", "--prompt-cache-file", str(f), *args])
        out = capsys.readouterr()
        return e.value.code, out.out, out.err

    for text in ("def fibonacci(n):", "class Stack(list):"):
        code, _, err = run(text)
        assert code in (0, None), err
    _rewrite_metadata(f, _point_at_the_other_segment)
    edited = f.read_bytes()
    code, out, err = run("def fibonacci(n):")
    assert code == 2 and out == ""
    assert err.startswith("error:") and "corrupt" in err and len(err.strip().splitlines()) == 1
    assert f.read_bytes() == edited  # left as it was
    engine = mlx_dflash.load(target, draft)
    with pytest.raises(DFlashError, match="corrupt"):
        PrefixCache.load(f, engine)


def test_an_older_file_version_is_refused(engines, tmp_path):
    """Version 3 stores opaque cache states; a version-2 file (arrays named by
    cache field) is refused with a clear error, not misread."""
    eng = engines["moe"]
    pc = PrefixCache(rung_interval=0)
    mlx_dflash.generate(eng, ids(18, 40), max_tokens=4, prefix_cache=pc)
    f = tmp_path / "pc.safetensors"
    pc.save(f)
    _rewrite_metadata(f, lambda meta: meta.update(version="2"))
    with pytest.raises(DFlashError, match="unsupported prompt cache version '2'.*delete the file"):
        PrefixCache.load(f, eng)


def test_requests_with_other_draft_windows_keep_snapshots_of_their_own(engines):
    """Two draft windows over one prompt: each run's snapshot holds its own
    draft state, and neither replaces the other's (a request alternating
    with another window used to find nothing cached, ever)."""
    eng = engines["dense"]
    prompt = ids(5, 90)
    pc = PrefixCache()
    runs = {}
    for window in [(32, 4), (16, 2), (32, 4), (16, 2)]:
        kw = dict(adaptive=False, max_tokens=8, draft_window=window)
        r = mlx_dflash.generate(eng, prompt, prefix_cache=pc, **kw)
        assert r.tokens == mlx_dflash.generate(eng, prompt, **kw).tokens
        runs.setdefault(window, []).append(r.stats.cached_tokens)
    assert runs == {(32, 4): [0, len(prompt) - 1], (16, 2): [0, len(prompt) - 1]}


@pytest.mark.parametrize("mode", ["plain", "chain"])
def test_a_reply_closed_at_its_first_token_is_snapshotted(engines, mode):
    """A consumer that stops at the first token (Ctrl-C in chat as the reply
    starts) closes the generation there: what it committed, prompt and first
    token, is snapshotted as after a reply stopped later."""
    eng = engines["dense"]
    prompt = ids(9, 40)
    pc = PrefixCache()
    gen = mlx_dflash.stream_generate(eng, prompt, prefix_cache=pc, **dict(MODES[mode], max_tokens=50))
    first = next(gen).tokens
    gen.close()
    nxt = prompt + first + ids(10, 6)
    warm = mlx_dflash.generate(eng, nxt, prefix_cache=pc, **dict(MODES[mode], max_tokens=4))
    assert warm.stats.cached_tokens == len(prompt) + len(first) - 1
    assert warm.tokens == mlx_dflash.generate(eng, nxt, **dict(MODES[mode], max_tokens=4)).tokens


@pytest.mark.parametrize("mode", ["plain", "chain"])
def test_a_one_token_reply_is_snapshotted_as_a_longer_one(engines, mode):
    """max_tokens=1 (or a first token that is EOS) ends right after the
    prefill: the next turn still restores prompt and reply but one token."""
    eng = engines["dense"]
    kw = dict(MODES[mode], max_tokens=1)
    prompt = ids(7, 40)
    pc = PrefixCache()
    first = mlx_dflash.generate(eng, prompt, prefix_cache=pc, **kw)
    nxt = prompt + first.tokens + ids(8, 6)
    warm = mlx_dflash.generate(eng, nxt, prefix_cache=pc, **dict(kw, max_tokens=4))
    assert warm.stats.cached_tokens == len(prompt) + len(first.tokens) - 1
    assert warm.tokens == mlx_dflash.generate(eng, nxt, **dict(kw, max_tokens=4)).tokens
