"""How a target splits into pipeline stages: parameter bytes per layer
(read from file headers, nothing loaded) and the contiguous split that
minimises the largest stage."""

import re
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from ..errors import DFlashError, is_count
from ..loading import tensor_sizes, text_config
from ..loading.gguf import is_gguf

LAYER_NAME = re.compile(r"(?:^|\.)(?:layers|blk)\.(\d+)\.")  # a decoder layer's tensor, HF/MLX or GGUF
_SKIP = ("mtp", "visual", "vision")  # multi-token-prediction heads and vision towers: not loaded


@dataclass
class Costs:
    """Parameter bytes of a target: per decoder layer, embedding, head, final norm."""

    layers: List[int]
    embed: int = 0
    head: int = 0  # 0 with tied embeddings (the head is the embedding)
    norm: int = 0

    @property
    def total(self) -> int:
        return sum(self.layers) + self.embed + self.head + self.norm


def costs_from_sizes(sizes: Dict[str, int], num_layers: int) -> Costs:
    """Group tensor byte sizes by layer (names as in HF/MLX folders or GGUF files)."""
    c = Costs([0] * num_layers)
    for name, n in sizes.items():
        if any(s in name for s in _SKIP):
            continue
        m = LAYER_NAME.search(name)
        if m is not None:
            i = int(m.group(1))
            if i < num_layers:  # layers past the last are MTP layers, dropped at load
                c.layers[i] += n
        elif "embed_tokens" in name or name.startswith("token_embd"):
            c.embed += n
        elif "lm_head" in name or name.startswith("output."):
            c.head += n
        else:
            c.norm += n
    return c


def plan_stages(costs: Sequence[int], n: int, first_extra: int = 0, last_extra: int = 0) -> List[Tuple[int, int]]:
    """Split layers into ``n`` contiguous non-empty stages minimising the
    largest stage's bytes; stage 0 also holds ``first_extra`` (the embedding),
    stage n-1 ``last_extra`` (norm, head, draft). Returns [(start, end)] by stage."""
    L = len(costs)
    if not 1 <= n <= L:
        raise DFlashError(f"cannot split {L} layers into {n} pipeline stages (at most one stage per layer)")
    pre = [0]
    for c in costs:
        pre.append(pre[-1] + c)

    def stage_cost(s, a, b):
        return pre[b] - pre[a] + (first_extra if s == 0 else 0) + (last_extra if s == n - 1 else 0)

    INF = float("inf")
    # best[s][j]: the smallest max cost of stages 0..s covering layers 0..j-1
    best = [[INF] * (L + 1) for _ in range(n)]
    cut = [[0] * (L + 1) for _ in range(n)]
    for j in range(1, L + 1):
        best[0][j] = stage_cost(0, 0, j)
    for s in range(1, n):
        for j in range(s + 1, L + 1):
            for i in range(s, j):
                v = max(best[s - 1][i], stage_cost(s, i, j))
                if v < best[s][j]:
                    best[s][j], cut[s][j] = v, i
    bounds, j = [], L
    for s in range(n - 1, 0, -1):
        i = cut[s][j]
        bounds.append((i, j))
        j = i
    bounds.append((0, j))
    return bounds[::-1]


@dataclass
class StagePlan:
    """How a target splits over ``n`` ranks (stage order: the first stage first)."""

    costs: Costs
    bounds: List[Tuple[int, int]]
    shares: List[int]  # bytes each stage's rank loads
    draft_bytes: int
    tied: bool
    gguf: bool

    def describe(self) -> str:
        def size(b):
            return f"{b / 1e9:.2f} GB" if b >= 1e9 else f"{b / 1e6:.1f} MB"

        n = len(self.bounds)
        lines = [
            f"pipeline over {n} ranks: {len(self.costs.layers)} layers, "
            f"{size(self.costs.total + self.draft_bytes)} on disk"
        ]
        for s, ((a, b), share) in enumerate(zip(self.bounds, self.shares)):
            extra = (["embedding"] if s == 0 else []) + (
                ["norm", "head"] + (["draft", "embedding copy"] if self.draft_bytes else []) if s == n - 1 else []
            )
            lines.append(
                f"  rank {n - 1 - s}: layers {a}-{b - 1}"
                + (f" + {', '.join(extra)}" if extra else "")
                + f": {size(share)}"
            )
        return "\n".join(lines)


def stage_plan(model, n: int, draft=None) -> StagePlan:
    """The stage split of ``model`` (folder or GGUF) over ``n`` ranks, from
    tensor sizes alone (nothing is loaded)."""
    cfg = text_config(model)
    sizes = tensor_sizes(model)
    layers = cfg.get("num_hidden_layers")
    if layers is None:
        raise DFlashError(f"{model}: no num_hidden_layers in its config (not a Qwen3.5 target?)")
    if not is_count(layers):
        raise DFlashError(f"{model}: num_hidden_layers must be a positive integer, got {layers!r}")
    tied = bool(cfg.get("tie_word_embeddings", False))
    costs = costs_from_sizes(sizes, layers)
    draft_bytes = sum(tensor_sizes(draft).values()) if draft is not None else 0
    head = costs.norm + (costs.embed if tied else costs.head)
    last_extra = head + draft_bytes + (costs.embed if draft is not None and not tied else 0)
    bounds = plan_stages(costs.layers, n, first_extra=costs.embed, last_extra=last_extra)
    shares = [sum(costs.layers[a:b]) for a, b in bounds]
    shares[0] += costs.embed
    shares[-1] += last_extra
    return StagePlan(costs, bounds, shares, draft_bytes, tied, is_gguf(model))
