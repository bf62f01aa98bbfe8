"""What a verify costs at the published Qwen3.5-35B-A3B shape (MoE), against a plain step.

    python bench/moe_shape.py [--layers 40] [--widths 2,3,4,6,8,12,16] [--reps 3]

A dense target reads its weights once per forward however many rows it
verifies, so a block of 16 costs little more than one token where weights
dominate (bench/real_shapes.py). A mixture of experts does not: each row
routes to 8 of 256 experts, and a block of B rows reads every expert any of
its rows picked. This measures, in one process, the modes taking turns:

- T_plain (one token), T_verify(B) (a recorded block with the draft's
  capture, then rolled back) and T_draft(16) on a random-weight target of
  the published 35B-A3B config (tools/shapes.moe_config), float32, whose
  layers share one set of routed experts (the whole model's 32 B expert
  parameters do not fit this machine; every layer keeps its own router, so
  a step still reads 8 experts per layer and a block the distinct experts
  its rows pick), with mlx-lm's plain step of the same model beside it;
- the distinct experts B rows route to (every layer's router on the
  verify's own rows);
- from those counts, what a verify reads against a plain step (at any one
  bit width for all weights), the ratio a GPU that streams the weights (a
  Mac) sees, next to the ratio this CPU measured.

The draft is the published 0.8B draft's recipe at this width (5 layers,
block 16): no DFlash draft for 35B-A3B was found with a published shape.
From the ratios: the speedup over plain decoding at each width for a draft
whose tau at block 16 is the published 0.8B card's (per-depth acceptance
held fixed). Writes bench/results/moe-shape.md (``--out``).
"""

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/, bench/

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from mlx_dflash import blas  # noqa: E402
from mlx_dflash.models.qwen35 import Target  # noqa: E402
from tools import shapes, tiny  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
TAU16 = 5.71  # Moonlight556/Qwen3.5-0.8B-DFlash card, Math500 (bench/real_shapes.py PUBLISHED_TAU)


def tau_at(B: int, tau16: float = TAU16) -> float:
    """Committed tokens per cycle at width B for a draft whose per-depth
    acceptance alpha gives ``tau16`` at 16: (1 - alpha^B) / (1 - alpha)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        lo, hi = (a, hi) if sum(a**k for k in range(16)) < tau16 else (lo, a)
    return sum(lo**k for k in range(B))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--layers",
        type=int,
        default=40,
        help="decoder layers kept, at least 4 (the published model has 40; every 4th is full attention)",
    )
    ap.add_argument("--widths", default="2,3,4,6,8,12,16", help="verify widths B")
    ap.add_argument("--prompt", type=int, default=128, help="context tokens before the terms are timed")
    ap.add_argument("--reps", type=int, default=3, help="repeats of each term (median)")
    ap.add_argument("--out", default=str(RESULTS / "moe-shape.md"), help="result file")
    blas.add_flag(ap)
    args = ap.parse_args()
    if args.layers < 4:
        # Every fourth layer is full attention; mlx-lm's Qwen3.5 builds its
        # attention mask from the first one's cache, so a model needs one.
        ap.error(f"--layers must be at least 4 (the first full-attention layer is the 4th), got {args.layers}")
    blas.ensure_openblas(args.blas)
    t0 = time.perf_counter()
    widths = [int(w) for w in args.widths.split(",")]
    cfg = shapes.moe_config(args.layers)
    text = cfg["text_config"]
    model = shapes.build_shared_experts(cfg)
    target = Target(model, cfg)
    dcfg = shapes.draft_config(shapes.target_config("2b"))
    dcfg["num_target_layers"] = args.layers
    dcfg["dflash_config"]["target_layer_ids"] = [i for i in (3, 7, 11, 15, 19) if i < args.layers] or [0]
    draft = tiny.build_draft(dcfg, seed=1).bind(target)
    print(f"built in {time.perf_counter() - t0:.0f} s; BLAS: {blas.describe()}", flush=True)

    V = target.vocab_size
    prompt = shapes.prompt_ids(args.prompt, V)
    capture = draft.target_layer_ids
    cache = target.make_cache()
    _, feats = target.prefill(prompt, cache, capture=capture)
    dcache = draft.make_cache()
    mx.eval(draft.propose(feats, prompt[-1], len(prompt), 16, dcache)[0], cache.state())
    from mlx_lm.models.cache import make_prompt_cache

    mcache = make_prompt_cache(model)
    mx.eval(model(mx.array(prompt)[None], cache=mcache))
    # The terms take turns within each repeat, after a warm-up round (compiles, first touch).
    T = shapes.cycle_terms(
        target,
        draft,
        cache,
        dcache,
        verify_widths=widths,
        draft_widths=[16],
        reps=args.reps,
        model=model,
        mlx_cache=mcache,
    )
    for B in widths:  # a verify here counts its rollback, as the speedup below prices a cycle
        T[f"T_verify({B})"] += T.pop(f"T_rollback({B})")

    # Distinct experts per block, every layer's router on rows of this context.
    x = mx.random.normal((max(widths), text["hidden_size"]), key=mx.random.key(3))
    distinct = {1: [], **{B: [] for B in widths}}
    for layer in model.language_model.model.layers:
        g = layer.mlp.gate(x)
        picks = mx.argpartition(-g, text["num_experts_per_tok"] - 1, axis=-1)[:, : text["num_experts_per_tok"]]
        picks = picks.tolist()
        for B in distinct:
            distinct[B].append(len({e for row in picks[:B] for e in row}))
    D = {B: statistics.mean(v) for B, v in distinct.items()}

    # Parameters read per forward: experts as counted; everything else once.
    counts = {"rest": 0, "head": 0, "embed": 0}
    for name, p in tree_flatten(model.parameters()):
        if "switch_mlp" in name:
            continue  # one layer's set, shared: counted per layer below
        counts["head" if "lm_head" in name else "embed" if "embed_tokens" in name else "rest"] += p.size
    per_expert = 3 * text["hidden_size"] * text["moe_intermediate_size"]
    L = text["num_hidden_layers"]

    def read(B):  # weights a forward of B rows reads (the embedding: B rows, negligible)
        return counts["rest"] + counts["head"] + L * D[B] * per_expert

    lines = [
        f"# Verify cost at the Qwen3.5-35B-A3B shape ({L} layers)",
        "",
        f"`python bench/moe_shape.py --layers {args.layers} --widths {args.widths} --prompt {args.prompt} "
        f"--reps {args.reps}`",
        "",
        f"- machine: {platform.platform()}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"MLX device {mx.default_device()}; BLAS: {blas.describe()}; the terms take turns in each repeat, "
        f"median of {args.reps}",
        "- target: random weights, the published config (tools/shapes.moe_config), float32, every layer "
        "with its own router over one shared set of 256 routed experts; "
        f"{(counts['rest'] + counts['head'] + counts['embed']) / 1e9:.2f} B parameters besides the experts, "
        f"{per_expert * 256 / 1e6:.0f} M routed-expert parameters a layer",
        f"- context {args.prompt} tokens; draft: the 0.8B draft's recipe at width 2048 (5 layers, block 16)",
        "",
        "## A block against a plain step",
        "",
        "Memory-bound estimate: parameters a forward reads (non-expert weights and the head once, and per "
        "layer the distinct experts its rows picked), verify over plain step: what a GPU that streams the "
        "weights (a Mac) pays, at any one bit width.",
        "",
        "| B | T_verify ms | / T_plain (this CPU) | distinct experts a layer | memory-bound estimate |",
        "|---:|---:|---:|---:|---:|",
        f"| 1 (plain) | {T['T_plain'] * 1e3:.0f} | 1.00 | {D[1]:.1f} | 1.00 |",
    ]
    for B in widths:
        v = T[f"T_verify({B})"]
        lines.append(f"| {B} | {v * 1e3:.0f} | {v / T['T_plain']:.2f} | {D[B]:.1f} | {read(B) / read(1):.2f} |")
    d = T["T_draft(16)"] / T["T_plain"]
    lines += [
        "",
        f"T_plain mlx-lm {T['T_plain mlx-lm'] * 1e3:.0f} ms (the engine's plain step "
        f"{T['T_plain mlx-lm'] / T['T_plain']:.2f}x as fast); T_draft(16) {T['T_draft(16)'] * 1e3:.0f} ms "
        f"({d:.2f} plain steps).",
        "",
        "## Speedup over plain decoding by width",
        "",
        f"A draft right with the per-depth acceptance that gives tau {TAU16} at block 16 (the published 0.8B "
        "card's), drafting its block each cycle: speedup(B) = tau(B) / (T_verify(B) / T_plain + T_draft / "
        "T_plain), with the draft's cost as measured here, and with a draft at 0.25 plain steps (its head read "
        "from 32768 rows, or a GPU's).",
        "",
        "| B | tau(B) | this CPU | memory-bound, draft as measured | memory-bound, draft 0.25 |",
        "|---:|---:|---:|---:|---:|",
    ]
    for B in widths:
        tau = tau_at(B)
        cpu = tau / (T[f"T_verify({B})"] / T["T_plain"] + d)
        mem = tau / (read(B) / read(1) + d)
        mem2 = tau / (read(B) / read(1) + 0.25)
        lines.append(f"| {B} | {tau:.2f} | {cpu:.2f}x | {mem:.2f}x | {mem2:.2f}x |")
    lines += [
        "",
        "## Cost terms (ms; ratios to the engine's plain step)",
        "",
        "As bench/real_shapes.py writes them, so `bench/policy_replay.py --curve` can price the width policy "
        "by them (T_verify(B) here includes its rollback).",
        "",
        "| term | fp32 ms | / T_plain |",
        "|---|---:|---:|",
    ]
    for k in ["T_plain", "T_plain mlx-lm"] + [f"T_verify({B})" for B in widths] + ["T_draft(16)"]:
        lines.append(f"| {k} | {T[k] * 1e3:.1f} | {T[k] / T['T_plain']:.2f} |")
    lines.append("")
    lines.append(f"Run took {(time.perf_counter() - t0) / 60:.1f} min.")
    out = "\n".join(lines) + "\n"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(out)
    print(out)


if __name__ == "__main__":
    main()
