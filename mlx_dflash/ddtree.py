"""DDTree (docs/math.md §5): a best-first draft tree from per-slot top-K, and the walk.

The draft's slot d (d = 1..L) gives a distribution over the token at depth d.
The tree starts with the top-1 chain; a max-heap on summed log-probability then
adds, for each popped node, its next sibling and its first child, until
``budget`` nodes (root excluded). Node ids follow insertion order, so a
parent always precedes its children.
"""

import heapq
from dataclasses import dataclass, field
from typing import Dict, List

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
        if depth <= L and rank < K:
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
