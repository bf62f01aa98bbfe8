"""Prefix snapshot bytes with float, 8-bit and 4-bit attention KV.

    python bench/prefix_kv_bits.py [--context 1024]

On the embedded pair: a --context-token prompt (the start of argparse.py)
goes through a fresh prefix cache once per KV format; the snapshot at the
stable boundary (all but the last prompt token) is measured by what it
holds: attention KV rows (its segment chain), DeltaNet state, draft
context. A second request then restores it and must give the same tokens
as a generation without the prefix cache (same KV format).
Writes bench/results/prefix-kv-bits.md.
"""

import argparse
import platform
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens (start of argparse.py)")
    ap.add_argument("--tokens", type=int, default=16, help="tokens generated per run")
    args = ap.parse_args()
    import mlx_dflash
    from mlx_dflash.benchmark import context_prompt
    from mlx_dflash.prefix import PrefixCache

    e = mlx_dflash.load()
    ids = context_prompt(e, args.context)
    kw = dict(max_tokens=args.tokens, adaptive=False)
    rows = []
    for bits in (None, 8, 4):
        cold = mlx_dflash.generate(e, ids, kv_bits=bits, **kw)
        pc = PrefixCache(rung_interval=0)
        mlx_dflash.generate(e, ids, kv_bits=bits, prefix_cache=pc, **kw)
        snap = next(s for s in pc._snaps if s.kind == "boundary")
        kv = sum(a.nbytes for seg, _, _ in snap.seg.pieces(snap.n) for st in seg.layers.values() for a in st[0])
        fixed = sum(a.nbytes for st in snap.layers.values() for a in st[0])
        draft = sum(a.nbytes for seg, _, _ in snap.seg.pieces(snap.n) if seg.draft for a in seg.draft[0])
        draft += sum(a.nbytes for a in snap.draft[0]) if snap.draft is not None else 0
        warm = mlx_dflash.generate(e, ids, kv_bits=bits, prefix_cache=pc, **kw)
        rows.append((bits, snap.n, kv, fixed, draft, warm.stats.cached_tokens, warm.tokens == cold.tokens))
        print(rows[-1], flush=True)
    mib = 1 / (1 << 20)
    lines = [
        "# Prefix snapshot bytes by KV format (--kv-bits)",
        "",
        f"- machine: {platform.platform()}",
        f"- embedded pair (float32); prompt: first {args.context} tokens of argparse.py; "
        f"snapshot at the stable boundary; {args.tokens} tokens generated greedily",
        "",
        "| KV | snapshot tokens | attention KV | DeltaNet state | draft context | total | "
        "restored tokens | restored = cold |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for bits, n, kv, fixed, draft, cached, same in rows:
        lines.append(
            f"| {'float32' if bits is None else f'{bits}-bit'} | {n} | {kv * mib:.2f} MiB | {fixed * mib:.2f} MiB | "
            f"{draft * mib:.2f} MiB | {(kv + fixed + draft) * mib:.2f} MiB | {cached} | {same} |"
        )
    lines += [
        "",
        "Attention KV is shared by every snapshot of a conversation (segments); DeltaNet state is per snapshot; "
        "the draft context is the embedded draft's (float, whatever --kv-bits says).",
    ]
    text = "\n".join(lines) + "\n"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "prefix-kv-bits.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
