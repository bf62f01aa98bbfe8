"""DDTree (docs/math.md §5): a best-first draft tree from per-slot top-K, the
walk, and the topology a tree verify reads (ancestor matrix, preorder, path rows).

The draft's slot d (d = 1..L) gives a distribution over the token at depth d.
The tree starts with the top-1 chain; a max-heap on summed log-probability then
adds, for each popped node, its next sibling and its first child, until
``budget`` nodes (root excluded). Node ids follow insertion order, so a
parent always precedes its children.
"""

import heapq
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Dict, List, Sequence, Tuple

import mlx.core as mx
import numpy as np


@dataclass
class Tree:
    tokens: List[int]  # node 0 is the root (the anchor)
    parents: List[int]  # -1 for the root
    depths: List[int]
    children: List[Dict[int, int]] = field(default_factory=list)  # token -> child node

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, token: int, parent: int) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1 if parent >= 0 else 0)
        self.children.append({})
        if parent >= 0:
            self.children[parent][token] = len(self.tokens) - 1
        return len(self.tokens) - 1


def build(draft_logits: mx.array, anchor: int, budget: int, topk: int) -> Tree:
    """Tree over ``draft_logits`` [L, V] (slot d-1 predicts depth d)."""
    tree = Tree([], [], [], [])
    tree.add(anchor, -1)
    L = draft_logits.shape[0]
    if budget < 1 or L < 1:
        return tree
    K = max(1, min(topk, draft_logits.shape[-1]))
    logp = draft_logits.astype(mx.float32)
    logp = logp - mx.logsumexp(logp, axis=-1, keepdims=True)
    ids = mx.argsort(-logp, axis=-1)[:, :K]
    vals = np.array(mx.take_along_axis(logp, ids, axis=-1))
    ids = np.array(ids)
    heap = []  # (-score, tiebreak, depth, rank, parent, parent_score)
    counter = 0

    def push(depth, rank, parent, parent_score):
        nonlocal counter
        # A token the draft cannot propose (logit -inf: outside --draft-vocab) is no candidate.
        if depth <= L and rank < K and np.isfinite(vals[depth - 1, rank]):
            heapq.heappush(heap, (-(parent_score + vals[depth - 1, rank]), counter, depth, rank, parent, parent_score))
            counter += 1

    # Seed the top-1 chain.
    parent, score = 0, 0.0
    for d in range(1, min(L, budget) + 1):
        push(d, 1, parent, score)  # its next sibling is a candidate
        score += vals[d - 1, 0]
        parent = tree.add(int(ids[d - 1, 0]), parent)
    while len(tree) - 1 < budget and heap:
        neg, _, d, r, par, pscore = heapq.heappop(heap)
        node = tree.add(int(ids[d - 1, r]), par)
        push(d, r + 1, par, pscore)
        push(d + 1, 0, node, -neg)
    return tree


def walk(tree: Tree, picks: List[int]) -> List[int]:
    """Nodes from the root along the target's picks; the last node's pick is the bonus."""
    node, path = 0, [0]
    while True:
        child = tree.children[node].get(picks[node])
        if child is None:
            return path
        node = child
        path.append(node)


def ancestor_matrix(parents: Sequence[int]) -> mx.array:
    """anc[t, s] = s is on the path from the root to t (t itself included).
    ``parents[t]`` < t, or -1 for a root. Cached: every layer of one tree
    verify asks for the same tree."""
    return _ancestor_matrix(tuple(parents))


def tree_order(parents: Sequence[int]) -> Tuple[List[int], List[int]]:
    """Depth-first preorder of a tree and each node's depth (0 for a root).

    Validates ``parents`` (each -1 or an earlier node), so the tree kernel,
    which reads states by depth, never indexes outside its stack."""
    return _tree_order(tuple(int(p) for p in parents))


@lru_cache(maxsize=16)
def _tree_order(parents: Tuple[int, ...]) -> Tuple[List[int], List[int]]:
    children: List[List[int]] = [[] for _ in parents]
    roots, depth = [], []
    for t, p in enumerate(parents):
        if not -1 <= p < t:
            raise ValueError(f"parent {p} of node {t} must be -1 or an earlier node")
        depth.append(0 if p < 0 else depth[p] + 1)
        (roots if p < 0 else children[p]).append(t)
    order, todo = [], roots[::-1]
    while todo:
        t = todo.pop()
        order.append(t)
        todo.extend(children[t][::-1])
    return order, depth


@lru_cache(maxsize=16)
def _ancestor_matrix(parents: Tuple[int, ...]) -> mx.array:
    T = len(parents)
    anc = np.zeros((T, T), dtype=bool)
    for t, p in enumerate(parents):
        if p >= t:
            raise ValueError(f"parent {p} of node {t} must precede it")
        if p >= 0:
            anc[t] = anc[p]
        anc[t, t] = True
    return mx.array(anc)


def path_rows(parents: Sequence[int], node: int) -> List[int]:
    """Token rows from the root to ``node``, root first."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]
