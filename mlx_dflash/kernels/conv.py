"""Depthwise causal conv1d + SiLU (DeltaNet's short conv): the MLX twin, the
Metal launch and the dispatcher, the windows of a tree block, and the conv
state's rollback."""

from functools import lru_cache
from typing import Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from . import metal
from .fused_exp import silu_fused
from .gated_delta import slot_trees
from .metal import Launch


def conv_windows(parents: Sequence[int], kernel_size: int) -> np.ndarray:
    """Row indices into ``concat(conv_state, block)`` of each token's K-row
    window, oldest first, gathered along the parent chain (chain: the usual
    sliding window). Rows 0..K-2 are the conv state, row K-1+t is token t.
    Cached per tree like :func:`ddtree.ancestor_matrix`."""
    return _conv_windows(tuple(parents), kernel_size)


@lru_cache(maxsize=16)
def _conv_windows(parents: Tuple[int, ...], kernel_size: int) -> np.ndarray:
    K = kernel_size
    idx = np.zeros((len(parents), K), dtype=np.int32)
    for t in range(len(parents)):
        cur, back = t, 0  # back = rows taken from the conv state so far
        for j in range(K - 1, -1, -1):
            if cur >= 0:
                idx[t, j] = K - 1 + cur
                cur = parents[cur]
            else:
                back += 1
                idx[t, j] = K - 1 - back
    return idx


def causal_conv1d_silu(
    conv_in: mx.array,
    weight: mx.array,
    parents: Optional[Sequence[int]] = None,
    *,
    force_twin: bool = False,
    fused_exp: bool = False,
) -> mx.array:
    """Depthwise causal conv1d + SiLU.

    ``conv_in`` [B, K-1+T, C] is the conv state (the last K-1 pre-conv rows)
    followed by the block's T rows; ``weight`` [C, K, 1] (MLX layout).
    ``parents`` (tree mode): each token's window follows its parent chain;
    one list per batch row gives each row (slot) its own tree (:func:`slot_trees`).
    Returns [B, T, C]. K shifted multiply-adds: about twice as fast on a CPU
    as MLX's grouped conv1d for depthwise kernels. ``fused_exp``: the SiLU
    by :func:`silu_fused` (a verify block on a CPU).
    """
    K = weight.shape[1]
    T = conv_in.shape[1] - K + 1
    trees = None if parents is None else slot_trees(parents, conv_in.shape[0])
    for p in trees or ():
        if len(p) != T:
            raise ValueError(f"{T} tokens but {len(p)} parents")
    if metal.use_metal(force_twin):
        static = None if parents is None else trees or tuple(int(p) for p in parents)
        return metal.run_with_twin_vjp(_conv_kernel, _conv_twin_outputs, (static,), (conv_in, weight))[0]
    dtype = conv_in.dtype
    x = conv_in.astype(mx.float32)  # accumulate in fp32, like the kernel
    w = weight[:, :, 0].astype(dtype).astype(mx.float32)
    if trees is not None:  # a gather per row: the same values, so each row's solo bits
        idx = mx.array(_windows(trees, K))
        rows = [mx.take_along_axis(x, idx[:, :, j, None], axis=1) for j in range(K)]
    elif parents is not None:
        idx = conv_windows(parents, K)
        rows = [x[:, mx.array(idx[:, j])] for j in range(K)]
    else:
        rows = [x[:, j : j + T] for j in range(K)]
    out = rows[0] * w[:, 0]
    for j in range(1, K):
        out = out + rows[j] * w[:, j]
    # Round the conv to the input dtype, then SiLU in that dtype, as mlx-lm's
    # nn.silu(conv1d(x)) does (its conv accumulates in fp32 like this loop).
    return (silu_fused if fused_exp else nn.silu)(out.astype(dtype))


def conv_state_rollback(conv_in: mx.array, n: int, kernel_size: int) -> mx.array:
    """Conv state after the first ``n`` block tokens: rows n .. n+K-2 of
    ``concat(conv_state_prev, block)``."""
    return conv_in[:, n : n + kernel_size - 1]


def conv_state_rollback_slots(conv_in: mx.array, ns: Sequence[int], kernel_size: int) -> mx.array:
    """:func:`conv_state_rollback` with slot b (batch row b) keeping ``ns[b]`` tokens."""
    idx = mx.array([[n + j for j in range(kernel_size - 1)] for n in ns], dtype=mx.int32)
    return mx.take_along_axis(conv_in, idx[:, :, None], axis=1)


def _windows(trees, kernel_size: int) -> np.ndarray:
    """:func:`conv_windows` of each row's tree, [B, T, K]."""
    return np.stack([conv_windows(p, kernel_size) for p in trees])


def conv_launch(conv_in, weight, idx) -> Launch:
    """``idx``: the windows [T, K] of every batch row, or [B, T, K] per row."""
    B, R, C = conv_in.shape
    T, K = idx.shape[-2:]
    return Launch(
        "conv1d_silu",
        [
            ("conv_in", conv_in),
            ("weight", weight[:, :, 0].astype(conv_in.dtype)),
            ("idx", mx.array(np.broadcast_to(idx, (B, T, K)), dtype=mx.int32)),
            ("R", R),
            ("T", T),
        ],
        [("out", (B, T, C), conv_in.dtype)],
        [("InT", conv_in.dtype), ("K", K), ("C", C)],
        (C, T, B),
        (min(C, 64), 1, 1),
    )


def _conv_kernel(static, conv_in, weight):
    (parents,) = static
    T, K = conv_in.shape[1] - weight.shape[1] + 1, weight.shape[1]
    if parents is not None and slot_trees(parents, conv_in.shape[0]):
        return conv_launch(conv_in, weight, _windows(parents, K))
    return conv_launch(conv_in, weight, conv_windows(parents if parents is not None else list(range(-1, T - 1)), K))


def _conv_twin_outputs(static, conv_in, weight):
    return [causal_conv1d_silu(conv_in, weight, static[0], force_twin=True)]
