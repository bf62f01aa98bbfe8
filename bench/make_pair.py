"""Build the trained benchmark pair and make it the embedded default.

    python bench/make_pair.py [--out mlx_dflash/default_model] [--target-steps N] [--draft-steps N]

1. A byte-level BPE tokenizer trained on the Python standard library's .py
   sources (present on every machine; the file list is sorted and fixed).
2. A small Qwen3.5 target (hidden 256, 6 Gated DeltaNet + 2 attention layers,
   ~8M parameters) trained from scratch in MLX on those sources.
3. A 2-layer DFlash draft trained with ``train_draft`` on the target's own
   greedy continuations (features of target layers 1, 3, 5, 7 captured while
   generating) of 16-64-token prompts cut from the sources, held-out files
   first; its layers slide over the training sequence length.

Deterministic for a given Python version (fixed seeds, sorted inputs).
"""

import argparse
import json
import random
import shutil
import sys
import sysconfig
import time
from pathlib import Path

from mlx_dflash import blas  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tools/
PROMPT_LENGTHS = (16, 32, 48, 64)
SKIP = ("test", "idlelib", "lib2to3", "site-packages", "turtledemo", "ensurepip", "__pycache__", "pydoc_data")


def stdlib_sources(limit_bytes: int):
    base = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p
        for p in base.rglob("*.py")
        if not any(s in p.relative_to(base).parts[0] for s in SKIP)
        and not any(part.startswith("test") for part in p.relative_to(base).parts)
    )
    texts, total = [], 0
    for f in files:
        t = f.read_text(encoding="utf-8", errors="replace")
        texts.append((str(f.relative_to(base)), t))
        total += len(t)
        if total >= limit_bytes:
            break
    return texts


def target_config():
    from tools import tiny

    cfg = tiny.target_config(
        vocab_size=2048,
        hidden_size=256,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=768,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        full_attention_interval=4,
    )
    cfg["eos_token_id"] = cfg["text_config"]["eos_token_id"] = 2
    return cfg


def train_target(cfg, ids, steps, seq_len=128, batch=16, lr=1e-3, log=print):
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    import numpy as np

    from mlx_dflash.models.qwen35 import Target
    from tools import tiny

    model = tiny.build_target(cfg, seed=0)
    # Start from plain norms (1.0), as a real init would.
    from mlx.utils import tree_flatten

    model.load_weights(
        [
            (k, mx.ones_like(v))
            for k, v in tree_flatten(model.parameters())
            if k.endswith("norm.weight") and "linear_attn.norm" not in k
        ],
        strict=False,
    )
    target = Target(model)
    data = np.array(ids, dtype=np.int32)
    warm = 50
    sched = optim.join_schedules(
        [optim.linear_schedule(lr * 0.01, lr, warm), optim.cosine_decay(lr, max(steps - warm, 1), lr * 0.1)], [warm]
    )
    opt = optim.AdamW(learning_rate=sched, weight_decay=0.1)

    def loss_fn(x):
        logits, _ = target.batch_forward(x[:, :-1])
        return nn.losses.cross_entropy(logits, x[:, 1:]).mean()

    lg = nn.value_and_grad(model, loss_fn)
    rng = np.random.default_rng(0)
    tic = time.perf_counter()
    for step in range(steps):
        starts = rng.integers(0, len(data) - seq_len - 1, size=batch)
        x = mx.array(np.stack([data[s : s + seq_len + 1] for s in starts]))
        loss, grads = lg(x)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        mx.eval(loss, model.parameters(), opt.state)
        if (step + 1) % 25 == 0 or step == 0:
            dt = time.perf_counter() - tic
            log(f"target step {step + 1}/{steps} loss {loss.item():.3f} ({dt / (step + 1):.2f} s/step)")
    return model


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--out",
        type=Path,
        default=ROOT / "mlx_dflash" / "default_model",
        help="output folder for the pair (target/ and draft/); built in OUT.building, then moved there",
    )
    ap.add_argument(
        "--target-steps", type=int, default=300, help="target training steps (batches of 16 sequences of 128 tokens)"
    )
    ap.add_argument(
        "--target-lr",
        type=float,
        default=1e-3,
        help="the target's peak learning rate (AdamW; 50 warm-up steps, then cosine decay to a tenth)",
    )
    ap.add_argument("--draft-steps", type=int, default=3000, help="draft training steps")
    ap.add_argument(
        "--prompts", type=int, default=4000, help="at most this many prompts whose target continuations train the draft"
    )
    ap.add_argument(
        "--seq-len",
        type=int,
        default=160,
        help="draft training sequence (prompt + continuation); also the draft's context window",
    )
    ap.add_argument(
        "--corpus-mb",
        type=float,
        default=4.0,
        help="stdlib .py source to read, in millions of characters (a tenth of the files held out)",
    )
    blas.add_flag(ap)
    ap.add_argument(
        "--draft-only", action="store_true", help="keep OUT/target (already trained) and rebuild only the draft"
    )
    ap.add_argument("--arch", default="dflash", choices=["dflash", "dflash2"], help="draft architecture")
    ap.add_argument(
        "--feature-cache",
        type=Path,
        default=None,
        help="cache the generated continuations and features here (reused by a rerun "
        "with the same prompts, e.g. for the other --arch)",
    )
    args = ap.parse_args()
    blas.ensure_openblas(args.blas)
    log = lambda s: print(s, flush=True)
    log(f"BLAS: {blas.describe()}")

    import mlx.core as mx

    from mlx_dflash.train import TrainConfig, train_draft
    from tools import tiny

    t0 = time.perf_counter()
    work = args.out.parent / (args.out.name + ".building")
    if work.exists():
        shutil.rmtree(work)
    if args.draft_only:
        shutil.copytree(args.out / "target", work / "target")
    texts = stdlib_sources(int(args.corpus_mb * 1e6))
    rnd = random.Random(0)
    names = [n for n, _ in texts]
    held = set(rnd.sample(names, max(len(names) // 10, 1)))
    train_text = "\n".join(t for n, t in texts if n not in held)
    held_text = [t for n, t in texts if n in held]
    log(f"corpus: {len(texts)} stdlib files, {len(train_text) / 1e6:.1f} MB train, {len(held)} held out")

    tdir = work / "target"
    if not args.draft_only:
        tiny.build_tokenizer(tdir, vocab_size=2048, corpus=train_text, chat_template=tiny.COMPLETION_TEMPLATE)
        from tokenizers import Tokenizer

        tk = Tokenizer.from_file(str(tdir / "tokenizer.json"))
        ids = tk.encode(train_text).ids
        log(f"tokenizer: {tk.get_vocab_size()} tokens; corpus {len(ids)} tokens")
        cfg = target_config()
        model = train_target(cfg, ids, args.target_steps, lr=args.target_lr, log=log)
        # Stored in float16 (the package stays small); load() reads it back as float32.
        model.update(__import__("mlx.utils").utils.tree_map(lambda p: p.astype(mx.float16), model.parameters()))
        tiny.save_mlx(model, cfg, tdir, tokenizer_dir=tdir)
    t1 = time.perf_counter()
    log(f"target trained in {(t1 - t0) / 60:.1f} min")

    # Prompts: windows of the sources starting at a line, 16 to 64 tokens long
    # (real prompts are longer than a line or two); the draft learns the
    # target's continuations of them. Four lengths keep generation batched.
    from tokenizers import Tokenizer

    tk = Tokenizer.from_file(str(tdir / "tokenizer.json"))
    prompts = []
    for t in held_text + [t for n, t in texts if n not in held]:
        lines = t.splitlines(keepends=True)
        for i in range(0, len(lines), 7):
            ids = tk.encode("".join(lines[i : i + 12])).ids
            n = rnd.choice(PROMPT_LENGTHS)
            if len(ids) >= n:
                prompts.append(tk.decode(ids[:n]))
    rnd.shuffle(prompts)
    prompts = prompts[: args.prompts]
    pfile = work / "prompts.txt"
    pfile.write_text("\n".join(json.dumps({"text": p}) for p in prompts) + "\n")
    pjsonl = work / "prompts.jsonl"
    pfile.rename(pjsonl)
    tc = TrainConfig(
        block_size=16,
        num_layers=2,
        target_layer_ids=[1, 3, 5, 7],
        seq_len=args.seq_len,
        gen_tokens=args.seq_len,
        batch_size=8,
        blocks_per_seq=8,
        steps=args.draft_steps,
        lr=1e-3,
        warmup=50,
        checkpoint_every=0,
        log_every=100,
        arch=args.arch,
    )
    summary = train_draft(
        tdir, work / "draft", generate_from=pjsonl, config=tc, log=log, feature_cache=args.feature_cache
    )
    dw = mx.load(str(work / "draft" / "model.safetensors"))  # float16 on disk, like the target
    mx.save_safetensors(str(work / "draft" / "model.safetensors"), {k: v.astype(mx.float16) for k, v in dw.items()})
    pjsonl.unlink()
    t2 = time.perf_counter()
    log(f"draft trained in {(t2 - t1) / 60:.1f} min; final per-slot acc {summary['final_acc']}")
    (work / "draft" / "train_summary.json").unlink()
    target_info = {"target_steps": args.target_steps, "target_minutes": round((t1 - t0) / 60, 1)}
    if args.draft_only:  # the target (and its build record) is the one already there
        old = json.loads((args.out / "BUILD.json").read_text()) if (args.out / "BUILD.json").exists() else {}
        target_info = {k: old.get(k) for k in target_info}
    (work / "BUILD.json").write_text(
        json.dumps(
            {
                "python": sys.version.split()[0],
                **target_info,
                "draft_arch": args.arch,
                "draft_steps": args.draft_steps,
                "prompts": len(prompts),
                "draft_minutes": round((t2 - t1) / 60, 1),
                "draft_seq_len": args.seq_len,
                "draft_target_layer_ids": tc.target_layer_ids,
                "blas": blas.describe(),
                "draft_final_loss": summary["final_loss"],
                "draft_final_acc": summary["final_acc"],
                "note": "the draft rebuilt with --draft-only" if args.draft_only else "one full run",
            },
            indent=1,
        )
    )
    if args.out.exists():
        shutil.rmtree(args.out)
    work.rename(args.out)
    log(f"wrote {args.out} in {(t2 - t0) / 60:.1f} min")


if __name__ == "__main__":
    main()
