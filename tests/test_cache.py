"""The per-layer cache protocol (cache.LayerCache): states cut into row
ranges restore exactly, fixed-size states whole, other layouts refused."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_dflash.cache import DeltaNetState, KVBuffer, QuantizedKVBuffer
from mlx_dflash.errors import DFlashError
from mlx_dflash.models.draft import DraftCache

rng = np.random.default_rng(0)


def rand(*shape):
    return mx.array(rng.normal(size=shape).astype(np.float32))


def same(xs, ys):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        np.testing.assert_array_equal(np.array(x), np.array(y))


@pytest.mark.parametrize("make", [KVBuffer, lambda: QuantizedKVBuffer(8), lambda: QuantizedKVBuffer(4)])
def test_kv_restores_from_consecutive_pieces(make):
    k, v = rand(1, 2, 300, 64), rand(1, 2, 300, 64)  # past one growth step (256 rows)
    c = make()
    c.append(k[:, :, :100], v[:, :, :100])
    c.append(k[:, :, 100:], v[:, :, 100:])
    pieces = [c.snapshot_state(0, 120), c.snapshot_state(120, 300)]
    assert [p[1]["rows"] for p in pieces] == [120, 180]
    assert all(a.shape[2] == p[1]["rows"] for p in pieces for a in p[0])  # right-sized copies
    fresh = make()
    fresh.restore_state(pieces)
    assert fresh.rows == 300 and fresh.nbytes() == c.nbytes()
    same(fresh.state(), c.state())
    # Both go on alike: the restored rows are a cache, not a view of one.
    q, k2, v2 = rand(1, 4, 3, 64), rand(1, 2, 3, 64), rand(1, 2, 3, 64)
    same([fresh.attend(q, k2, v2, 0.125, "causal")], [c.attend(q, k2, v2, 0.125, "causal")])
    same(pieces[0][0], c.snapshot_state(0, 120)[0])  # appends after a snapshot never reach it
    c.rollback(300, 2, path=[2, 0])
    assert c.rows == 302


def test_kv_layouts_do_not_mix():
    k = rand(1, 2, 10, 64)
    flt, q8 = KVBuffer(), QuantizedKVBuffer(8)
    flt.append(k, k)
    q8.append(k, k)
    with pytest.raises(DFlashError, match="full-precision KV state into a 8-bit KV cache"):
        QuantizedKVBuffer(8).restore_state([flt.snapshot_state()])
    with pytest.raises(DFlashError, match="8-bit KV state into a 4-bit KV cache"):
        QuantizedKVBuffer(4).restore_state([q8.snapshot_state()])
    with pytest.raises(DFlashError, match="deltanet state into a full-precision KV cache"):
        st = DeltaNetState()
        st.conv, st.ssm = rand(1, 3, 8), rand(1, 2, 4, 4)
        KVBuffer().restore_state([st.snapshot_state()])


def test_deltanet_state_is_taken_whole():
    st = DeltaNetState()
    st.conv, st.ssm = rand(1, 3, 8), rand(1, 2, 4, 4)
    arrays, meta = st.snapshot_state()
    assert meta == {"type": "deltanet"} and arrays[0] is not st.conv
    back = DeltaNetState()
    back.restore_state([(arrays, meta)])
    same(back.state(), st.state())
    assert back.nbytes() == st.nbytes() == st.conv.nbytes + st.ssm.nbytes


def _draft(window, n):
    d = DraftCache([None] * 2, [None] * 2, window=window)
    for s in range(0, n, 7):  # as add_context: rows per layer, then positions, then the window
        rows = min(7, n - s)
        for i in range(2):
            d.write(i, d.rows, rand(1, 1, rows, 16), rand(1, 1, rows, 16))
        d.positions.extend(range(d.length, d.length + rows))
        d.length += rows
        d.trim()
    return d


def test_draft_context_states():
    d = _draft(None, 40)
    assert d.sequence
    back = DraftCache([None] * 2, [None] * 2)
    back.restore_state([d.snapshot_state(0, 25), d.snapshot_state(25, 40)])
    assert back.positions == d.positions and back.length == 40
    same(back.keys + back.values, d.keys + d.values)
    w = _draft((2, 5), 40)
    assert not w.sequence and w.rows == 7
    back = DraftCache([None] * 2, [None] * 2, window=(2, 5))
    back.restore_state([w.snapshot_state()])
    assert back.positions == w.positions == [0, 1, 35, 36, 37, 38, 39] and back.length == 40
    same(back.keys + back.values, w.keys + w.values)
    with pytest.raises(DFlashError, match="cannot restore"):
        DraftCache([None] * 2, [None] * 2).restore_state([w.snapshot_state()])
