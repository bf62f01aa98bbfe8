"""Half precision: plain greedy vs mlx_lm.generate, and speculative vs plain.

Tiny dense Qwen3.5 targets are written in HF format and converted to bf16 by
``mlx_lm.convert`` itself; both runtimes then decode random prompts of several
lengths greedily for 200 tokens. Reports the first differing output token
(``-`` = none) with the default prefill (closed-form DeltaNet blocks of up to
64 tokens) and with ``--prefill-chunk 1`` (the per-token recurrence, mlx-lm's
order of operations on the CPU), plus how many bf16 DeltaNet outputs of one
block differ between the closed form and the per-token recurrence.
Then, for bf16, 4-bit and 8-bit (``mlx_lm.convert -q``) dense and MoE
targets, two prompts each: where chain and tree greedy output (drafts that
propose the plain continuation, right in full or in part) first differ from
plain greedy output over 200 tokens.

    python bench/bf16_numerics.py   # writes bench/results/bf16-numerics.md
"""

import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/

import mlx.core as mx
import numpy as np

from mlx_dflash.decode import generate_tokens
from mlx_dflash.kernels import gated_delta
from mlx_dflash.loading import load_target
from tools import tiny

N = 200
LENGTHS = (5, 40, 150, 600)
SEEDS = (3, 4, 5)


def first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def block_rounding(T=150, seed=0):
    """Fraction of bf16 outputs y of one DeltaNet block (27B head shapes, 1 key
    head) that differ between the closed form and the per-token recurrence."""
    mx.random.seed(seed)
    Hk, Hv, Dk, Dv = 1, 3, 128, 128
    q = mx.random.normal((1, T, Hk, Dk))
    k = mx.random.normal((1, T, Hk, Dk))
    q = (q / mx.linalg.norm(q, axis=-1, keepdims=True) * Dk**-0.5).astype(mx.bfloat16)
    k = (k / mx.linalg.norm(k, axis=-1, keepdims=True)).astype(mx.bfloat16)
    v = mx.random.normal((1, T, Hv, Dv)).astype(mx.bfloat16)
    g = mx.random.uniform(0.8, 1.0, (1, T, Hv))
    beta = mx.random.uniform(0.0, 1.0, (1, T, Hv)).astype(mx.bfloat16)
    S0 = mx.zeros((1, Hv, Dv, Dk))
    y, S, _ = gated_delta.gated_delta_chain(q, k, v, g, beta, S0, force_twin=True)
    ys, St = [], S0
    for t in range(T):
        yt, St, _ = gated_delta.gated_delta_chain(
            q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], g[:, t : t + 1], beta[:, t : t + 1], St, force_twin=True
        )
        ys.append(yt)
    yseq = mx.concatenate(ys, axis=1)
    frac = (y != yseq).astype(mx.float32).mean().item()
    return frac, mx.abs(S - St).max().item()


class ScriptedDraft:
    """Proposes the plain continuation; with ``seed``, right for a random
    number of tokens per cycle, then wrong (so rollbacks land everywhere)."""

    def __init__(self, seq, vocab, seed=None, block_size=8):
        self.seq, self.vocab, self.block_size = seq, vocab, block_size
        self.rng = np.random.default_rng(seed) if seed is not None else None
        self.target_layer_ids = []

    def make_cache(self, window=None):
        return None

    def __call__(self, features, anchor, pos, B, cache):
        logits = np.zeros((B - 1, self.vocab), np.float32)
        right = B if self.rng is None else int(self.rng.integers(0, B))
        for j in range(1, B):
            tok = self.seq[pos + j] if pos + j < len(self.seq) else 0
            logits[j - 1, tok if j <= right else (tok + 1) % self.vocab] = 1.0
        return mx.array(logits)


SPEC_KINDS = {
    "bf16": dict(dtype="bfloat16"),
    "4-bit": dict(quantize=True, q_bits=4, q_group_size=32, dtype="bfloat16"),
    "8-bit": dict(quantize=True, q_bits=8, q_group_size=32, dtype="float16"),
}
SPEC_PROMPTS = [[1, 10, 20, 30, 40], [7, 7, 7, 100, 250, 31, 64, 99, 12, 5, 300, 17, 45, 201, 3, 9]]


def spec_vs_plain(root, tok):
    """Rows: (kind, target, prompt, mode, first differing token or None)."""
    from mlx_lm.convert import convert

    rows = []
    for moe in (False, True):
        cfg = tiny.target_config(moe=moe)
        hf = tiny.save_hf(tiny.build_target(cfg, seed=5 if moe else 3), cfg, root / f"spec-hf{moe}", tok)
        for kind, args in SPEC_KINDS.items():
            if kind == "bf16" and moe:
                continue  # MLX's CPU gather_mm (unquantized experts) runs in float32 only
            out = root / f"spec-{kind}-{moe}"
            convert(str(hf), str(out), **args)
            target = load_target(out)
            for i, prompt in enumerate(SPEC_PROMPTS):
                plain = [t for ts in generate_tokens(target, prompt, max_tokens=N) for t in ts]
                seq = prompt + plain
                for mode, kw in (
                    ("chain, oracle", dict(block_size=8)),
                    ("chain, partly right", dict(block_size=8)),
                    ("tree 10", dict(tree_budget=10, tree_topk=2)),
                ):
                    draft = ScriptedDraft(seq, target.vocab_size, seed=1 if "partly" in mode else None)
                    got = [t for ts in generate_tokens(target, prompt, max_tokens=N, draft=draft, **kw) for t in ts]
                    rows.append((kind, "MoE" if moe else "dense", i, mode, first_diff(plain, got)))
                    print(rows[-1], flush=True)
    return rows


def main():
    from mlx_lm.convert import convert
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    root = Path(tempfile.mkdtemp())
    tok = tiny.build_tokenizer(root / "tok", vocab_size=400)
    rng = np.random.default_rng(0)
    rows = []
    for seed in SEEDS:
        cfg = tiny.target_config()
        hf = tiny.save_hf(tiny.build_target(cfg, seed=seed), cfg, root / f"hf{seed}", tok)
        out = root / f"mlx{seed}"
        convert(str(hf), str(out), dtype="bfloat16")
        ref_model, _ = load_model(out)
        target = load_target(out)
        for L in LENGTHS:
            prompt = rng.integers(1, 399, L).tolist()
            ref = [int(t) for t, _ in generate_step(mx.array(prompt), ref_model, max_tokens=N)]
            ours = [t for ts in generate_tokens(target, prompt, max_tokens=N) for t in ts]
            seq = [t for ts in generate_tokens(target, prompt, max_tokens=N, prefill_chunk=1) for t in ts]
            rows.append((seed, L, first_diff(ref, ours), first_diff(ref, seq)))
            print(rows[-1], flush=True)
    spec = spec_vs_plain(root, tok)
    shutil.rmtree(root, ignore_errors=True)
    frac, sdiff = block_rounding()
    fmt = lambda x: "-" if x is None else str(x)
    lines = (
        [
            "# bf16: plain greedy vs mlx_lm.generate",
            "",
            f"Tiny dense targets (`tiny.target_config()`, seeds {', '.join(map(str, SEEDS))}) converted by "
            f"`mlx_lm.convert --dtype bfloat16`; random prompts; {N} greedy tokens; CPU. First differing "
            "output token, `-` = all equal.",
            "",
            "| seed | prompt tokens | default prefill | --prefill-chunk 1 |",
            "|---:|---:|---:|---:|",
        ]
        + [f"| {s} | {L} | {fmt(a)} | {fmt(b)} |" for s, L, a, b in rows]
        + [
            "",
            f"One 150-token DeltaNet block in bf16 (3 value heads of 128 x 128): {frac:.2%} of the bf16 outputs "
            f"differ by rounding between the closed form and the per-token recurrence (state max abs diff "
            f"{sdiff:.2e}).",
            "",
            "## Speculative vs plain greedy, half precision",
            "",
            f"Converted by `mlx_lm.convert` (bf16; `-q` 4-bit and 8-bit, group 32); {N} tokens; block 8. "
            "First token where chain / tree output differs from plain greedy output, `-` = all equal. "
            "(No bf16 MoE: MLX's CPU `gather_mm` runs in float32 only.)",
            "",
            "| weights | target | prompt | mode | first difference |",
            "|---|---|---:|---|---:|",
        ]
        + [f"| {k} | {t} | {i} | {m} | {fmt(d)} |" for k, t, i, m, d in spec]
    )
    out = Path(__file__).parent / "results" / "bf16-numerics.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
