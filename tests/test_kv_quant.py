"""Quantized attention KV (--kv-bits): attention close to full precision, rollback
and tree compaction exact relative to the quantized cache's own plain decoding,
memory, and bad values rejected."""

import mlx.core as mx
import numpy as np
import pytest
from test_decode import ScriptedDraft

from mlx_dflash.cache import KVBuffer, QuantizedKVBuffer
from mlx_dflash.cli import main
from mlx_dflash.decode import GenerationStats, generate_tokens
from mlx_dflash.errors import DFlashError
from mlx_dflash.models.qwen35 import Target
from tools import tiny

PROMPT = [3, 17, 250, 9, 41, 77, 5]
N = 40


@pytest.fixture(scope="module")
def target64():
    """A tiny target whose attention head dim (64) quantizes in mlx-lm's groups of 64."""
    cfg = tiny.target_config(hidden_size=128, head_dim=64, num_attention_heads=2, num_key_value_heads=1)
    return Target(tiny.build_target(cfg, seed=5))


def decode(target, n, prompt=PROMPT, **kw):
    stats = GenerationStats()
    out = []
    cache = target.make_cache(kv_bits=kw.pop("kv_bits", None))
    for toks in generate_tokens(target, prompt, max_tokens=n, stats=stats, cache=cache, **kw):
        out.extend(toks)
    return out, cache, stats


@pytest.mark.parametrize("bits,tol", [(8, 0.02), (4, 0.2)])
def test_quantized_attention_is_close_to_full_precision(bits, tol):
    rng = np.random.default_rng(0)
    q = mx.array(rng.normal(size=(1, 4, 3, 64)).astype(np.float32))
    k = rng.normal(size=(1, 2, 40, 64)).astype(np.float32)
    k[..., 5] *= 20  # an outlier channel, as real keys have: the rotation spreads it
    k, v = mx.array(k), mx.array(rng.normal(size=(1, 2, 40, 64)).astype(np.float32))
    full = KVBuffer().attend(q, k, v, 0.125, None)
    quant = QuantizedKVBuffer(bits).attend(q, k, v, 0.125, None)
    err = float(mx.abs(quant - full).max() / mx.abs(full).max())
    assert err < tol
    # Without rotating the queries alike the result is wrong: the rotation is really applied.
    buf = QuantizedKVBuffer(bits)
    keys, values = buf.append(k, v)
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    unrotated = quantized_scaled_dot_product_attention(q, keys, values, scale=0.125, mask=None, bits=bits)
    assert float(mx.abs(unrotated - full).max() / mx.abs(full).max()) > 5 * err
    dk, dv = buf.dequantized()
    assert np.allclose(np.array(dk), np.array(k), atol=(0.05 if bits == 8 else 0.8) * float(mx.abs(k).max()) / 10)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group_size", [64, 32])
def test_dequantize_is_mx_dequantize_bit_for_bit(bits, group_size):
    from mlx_dflash.cache import dequantize

    rng = np.random.default_rng(bits + group_size)
    x = mx.array(rng.normal(size=(1, 2, 37, 128)).astype(np.float32) * 3)
    packed = mx.quantize(x, group_size=group_size, bits=bits)
    want = mx.dequantize(*packed, group_size=group_size, bits=bits)
    assert mx.array_equal(dequantize(*packed, group_size=group_size, bits=bits), want)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("mask", ["causal", "tree", None])
@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("stretches", [1, 3])
def test_blocks_attend_over_dequantized_rows_as_the_quantized_matmul_does(bits, mask, verify, stretches):
    """On a CPU a block of >= DEQUANT_MIN_ROWS rows attends over the
    dequantized cache (one float matmul instead of a quantized matmul per row;
    a verify past STRETCH_ROWS rows, a stretch of rows at a time): the
    quantized path's twin, to float32 rounding."""
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    from mlx_dflash.cache import DEQUANT_MIN_ROWS
    from mlx_dflash.kernels.fused_exp import STRETCH_ROWS

    rng = np.random.default_rng(1)
    # T * L over FUSED_SOFTMAX_MIN: a verify takes the fused softmax.
    T, L = 2 * DEQUANT_MIN_ROWS, 256 if stretches == 1 else 2 * STRETCH_ROWS + 100
    q = mx.array(rng.normal(size=(1, 4, T, 64)).astype(np.float32))
    k = mx.array(rng.normal(size=(1, 2, L, 64)).astype(np.float32))
    v = mx.array(rng.normal(size=(1, 2, L, 64)).astype(np.float32))
    if mask == "tree":  # each row sees the context and an ancestor set, as tree verify builds it
        keep = np.tril(rng.random((T, T)) < 0.5) | np.eye(T, dtype=bool)
        mask = mx.array(np.concatenate([np.ones((T, L - T), bool), keep], axis=1))
    buf = QuantizedKVBuffer(bits)
    buf.append(k[:, :, : L - T], v[:, :, : L - T])
    got = buf.attend(q, k[:, :, L - T :], v[:, :, L - T :], 0.125, mask, verify)
    held = buf.state()
    keys, values = held[:3], held[3:]
    want = quantized_scaled_dot_product_attention(
        buf._rotate(q), keys, values, scale=0.125, mask=mask, group_size=64, bits=bits
    )
    assert np.allclose(np.array(got), np.array(want), atol=2e-5, rtol=1e-4)
    # Fewer rows keep the quantized matmul itself, bit for bit.
    for t in (1, DEQUANT_MIN_ROWS - 1):
        small = QuantizedKVBuffer(bits)
        small.append(k[:, :, :-t], v[:, :, :-t])
        m = None if t == 1 else "causal"
        few = small.attend(q[:, :, :t], k[:, :, -t:], v[:, :, -t:], 0.125, m, verify)
        held = small.state()
        ref = quantized_scaled_dot_product_attention(
            small._rotate(q[:, :, :t]), held[:3], held[3:], scale=0.125, mask=m, group_size=64, bits=bits
        )
        assert mx.array_equal(few, ref)


def assert_same_quantized_cache(a, b):
    """Caches equal up to float noise: batched and single-token forwards round
    differently, which can move a row's quantized value by at most a step; on
    average they agree far closer than a step."""
    assert a.offset == b.offset
    for ca, cb in zip(a.layers, b.layers):
        if isinstance(ca, QuantizedKVBuffer):
            ka, va = ca.dequantized()
            kb, vb = cb.dequantized()
            for x, y in ((ka, kb), (va, vb)):
                x, y = np.array(x), np.array(y)
                step = (np.abs(y).max() + 1e-6) / (2**ca.bits - 1) * 2
                assert np.abs(x - y).max() <= step
                assert np.mean(np.abs(x - y)) < step / 20
        else:
            for x, y in zip(ca.state(), cb.state()):
                np.testing.assert_allclose(np.array(x), np.array(y), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bits", [8, 4])
def test_rollback_and_tree_compaction_exact_relative_to_quantized_plain(target64, bits):
    plain, pcache, _ = decode(target64, N, kv_bits=bits)
    for kw in (
        dict(accept=None, seed=1, block_size=8),
        dict(accept=2, block_size=16),
        dict(accept=0, block_size=4),
        dict(accept=3, tree_budget=10, block_size=8),
    ):
        draft = ScriptedDraft(PROMPT, plain, target64.vocab_size, accept=kw.pop("accept"), seed=kw.pop("seed", None))
        out, cache, stats = decode(target64, N, kv_bits=bits, draft=draft, **kw)
        assert out == plain, kw
        assert stats.cycles < N - 1 or kw.get("block_size") == 4
        # The cache after many rollbacks holds what plain decoding's holds, bar
        # the last token (plain decoding's cache also holds one more step queued
        # and undone, or not: compare the committed prefix).
        ref = target64.make_cache(kv_bits=bits)
        target64.prefill(PROMPT + out[:-1], ref, chunk_size=1)
        assert_same_quantized_cache(cache, ref)


@pytest.mark.parametrize("bits", [None, 8, 4])
def test_verify_past_a_stretch_of_rows_keeps_plain_decodings_tokens(target64, bits):
    """Deep in a context a verify attends over the cached rows (quantized
    ones dequantized) a stretch at a time (STRETCH_ROWS), merging the
    softmax: chain and tree verify still commit plain decoding's tokens."""
    from mlx_dflash.kernels.fused_exp import STRETCH_ROWS

    rng = np.random.default_rng(3)
    prompt = [int(t) for t in rng.integers(0, target64.vocab_size, size=STRETCH_ROWS + 90)]
    plain, _, _ = decode(target64, 24, prompt, kv_bits=bits)
    for kw in (dict(accept=None, seed=1, block_size=8), dict(accept=3, tree_budget=10, block_size=8)):
        draft = ScriptedDraft(prompt, plain, target64.vocab_size, accept=kw.pop("accept"), seed=kw.pop("seed", None))
        out, _, stats = decode(target64, 24, prompt, kv_bits=bits, draft=draft, **kw)
        assert out == plain, kw
        assert stats.cycles < 23


def test_kv_memory_per_token(target64):
    _, full, _ = decode(target64, 64)
    _, q8, _ = decode(target64, 64, kv_bits=8)
    _, q4, _ = decode(target64, 64, kv_bits=4)
    assert full.offset == q8.offset == q4.offset
    # fp32 K/V: 4 bytes per value; 8-bit: 1 byte + scale and bias per 64 values.
    assert q8.kv_nbytes() / full.kv_nbytes() == pytest.approx((1 + 8 / 64) / 4)
    assert q4.kv_nbytes() / full.kv_nbytes() == pytest.approx((0.5 + 8 / 64) / 4)


def test_bad_kv_bits(target64, dense, capsys):
    with pytest.raises(DFlashError, match="kv-bits. must be 4 or 8"):
        decode(target64, 4, kv_bits=3)
    with pytest.raises(DFlashError, match="head dim divisible by 32"):
        Target(dense[1]).make_cache(kv_bits=8)  # head dim 16
    with pytest.raises(SystemExit) as e:
        main(["generate", "def f():", "-n", "4", "--kv-bits", "6"])
    assert e.value.code == 2
    assert "error: kv_bits (--kv-bits) must be 4 or 8" in capsys.readouterr().err


@pytest.fixture(scope="module")
def pair():
    """The embedded pair (head dim 128: quantizable)."""
    import mlx_dflash

    return mlx_dflash.load()


def _prompt(eng):
    return eng.encode("Beautiful is better than ugly. Explicit is better than implicit. " * 5 + "def parse(text):")


@pytest.mark.parametrize("bits", [8, pytest.param(4, marks=pytest.mark.slow)])  # ~25 s each here
def test_prefix_cache_with_quantized_kv_restores_exactly(pair, bits):
    """Through the prefix cache (snapshot restored), a quantized-KV generation
    gives exactly the tokens of the same generation without it."""
    import mlx_dflash
    from mlx_dflash.prefix import PrefixCache

    prompt = _prompt(pair)
    kw = dict(max_tokens=12, kv_bits=bits, adaptive=False)
    cold = mlx_dflash.generate(pair, prompt, **kw)
    pc = PrefixCache(rung_interval=32)
    first = mlx_dflash.generate(pair, prompt, prefix_cache=pc, **kw)
    assert first.stats.cached_tokens == 0 and first.tokens == cold.tokens
    again = mlx_dflash.generate(pair, prompt, prefix_cache=pc, **kw)
    assert again.stats.cached_tokens == len(prompt) - 1
    assert again.tokens == cold.tokens and again.stats.accept_hist == first.stats.accept_hist
    nxt = prompt + cold.tokens + pair.encode(" return")
    warm = mlx_dflash.generate(pair, nxt, prefix_cache=pc, **kw)
    assert warm.stats.cached_tokens == len(prompt) + len(cold.tokens) - 1
    assert warm.tokens == mlx_dflash.generate(pair, nxt, **kw).tokens
    # The snapshots hold quantized rows: a fraction of float KV's bytes.
    flt = PrefixCache(rung_interval=32)
    mlx_dflash.generate(pair, prompt, prefix_cache=flt, max_tokens=12, adaptive=False)
    assert pc.snapshots()[:2] == flt.snapshots()[:2]
    kv = lambda c: sum(
        a.nbytes for s in c._snaps for seg, _, _ in s.seg.pieces(s.n) for st in seg.layers.values() for a in st[0]
    )  # noqa: E731
    ratio = ((1 if bits == 8 else 0.5) + 8 / 64) / 4  # as test_kv_memory_per_token (float32 pair)
    assert kv(pc) < kv(flt) * ratio * 1.5


def test_prompt_cache_file_with_quantized_kv(pair, tmp_path):
    """A file saved with 8-bit KV loads and restores the same tokens; a
    file of another KV format is refused clearly, both ways."""
    import mlx_dflash
    from mlx_dflash.prefix import PrefixCache

    prompt = _prompt(pair)
    kw = dict(max_tokens=10, adaptive=False)
    cold8 = mlx_dflash.generate(pair, prompt, kv_bits=8, **kw)
    pc = PrefixCache(rung_interval=0)
    mlx_dflash.generate(pair, prompt, kv_bits=8, prefix_cache=pc, **kw)
    f8 = tmp_path / "q8.safetensors"
    pc.save(f8)
    back = PrefixCache.load(f8, pair)
    assert back.snapshots() == pc.snapshots() and back.nbytes == pc.nbytes
    again = mlx_dflash.generate(pair, prompt, kv_bits=8, prefix_cache=back, **kw)
    assert again.stats.cached_tokens == len(prompt) - 1 and again.tokens == cold8.tokens
    with pytest.raises(DFlashError, match="8-bit KV cache; this generation uses full-precision KV"):
        mlx_dflash.generate(pair, prompt, prefix_cache=PrefixCache.load(f8, pair), **kw)
    with pytest.raises(DFlashError, match="8-bit KV cache; this generation uses 4-bit KV"):
        mlx_dflash.generate(pair, prompt, kv_bits=4, prefix_cache=PrefixCache.load(f8, pair), **kw)
    flt = PrefixCache(rung_interval=0)
    mlx_dflash.generate(pair, prompt, prefix_cache=flt, **kw)
    f32 = tmp_path / "float.safetensors"
    flt.save(f32)
    with pytest.raises(DFlashError, match="full-precision KV cache; this generation uses 8-bit KV"):
        mlx_dflash.generate(pair, prompt, kv_bits=8, prefix_cache=PrefixCache.load(f32, pair), **kw)
    # The same in memory: one prefix cache holds one KV format.
    with pytest.raises(DFlashError, match="one prefix cache .* per KV format"):
        mlx_dflash.generate(pair, prompt, kv_bits=4, prefix_cache=pc, **kw)


def test_cli_prompt_cache_file_with_kv_bits(tmp_path, capsys):
    f = tmp_path / "pc.safetensors"
    outs = []
    for _ in range(2):  # the second run restores from the file the first wrote
        with pytest.raises(SystemExit) as e:
            main(["generate", "def f(x):", "-n", "6", "--no-adaptive", "--kv-bits", "8", "--prompt-cache-file", str(f)])
        out = capsys.readouterr()
        assert e.value.code in (0, None), out.err
        outs.append(out.out)
    assert f.is_file() and outs[0] == outs[1] and outs[0].strip()
    with pytest.raises(SystemExit) as e:
        main(["generate", "def f(x):", "-n", "6", "--no-adaptive", "--prompt-cache-file", str(f)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error:") and "8-bit KV" in err and len(err.strip().splitlines()) == 1
