"""Train a DFlash v1 or DFlash 2 draft for a supported target (``mlx-dflash train-draft``).

Objective (DFlash paper): sample anchor positions; each block
``[anchor token, MASK x (B-1)]`` attends to the target features of the context
before its anchor and to its own slots (several blocks per sequence in one
forward, see :func:`models.draft.train_logits`); cross-entropy on slots
1..B-1 against the target's tokens, slot k weighted ``exp(-(k-1)/gamma)``. DFlash 2 (``arch="dflash2"``) adds
the candidate selector's loss: along the target's own path (slot k's
predecessor is the target's token at slot k-1, the anchor for slot 1), the
cross-entropy of the target's token among the head's top-K candidates
scored by the selector (slots where it is not among them are left to the
head's loss); its convolutions start as the identity.
"""

import hashlib
import json
import math
import numbers
import os
import shutil
import struct
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from .errors import DFlashError, check_positive, is_int, writable_folder
from .files import left_only_if_used, write_text, written_whole
from .models.draft import DFlashDraft, DraftConfig, default_target_layer_ids, train_hidden


@dataclass
class TrainConfig:
    block_size: int = 16
    num_layers: int = 2
    target_layer_ids: Optional[List[int]] = None
    mask_token_id: Optional[int] = None
    intermediate_size: Optional[int] = None  # default: the target's
    seq_len: int = 256
    # Context positions a block attends to (sliding window on every layer).
    # None: seq_len, the longest context training shows the draft, so that
    # inference never leaves the training distribution; 0: unlimited.
    context_window: Optional[int] = None
    batch_size: int = 8
    blocks_per_seq: int = 8
    steps: int = 1000
    lr: float = 6e-4
    warmup: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    gamma: float = 7.0
    gen_tokens: int = 192  # continuation length with generate_from
    checkpoint_every: int = 200
    init: str = "target"  # "target" (copy what fits) or "random"
    seed: int = 0
    log_every: int = 10
    arch: str = "dflash"  # or "dflash2"
    selector_rank: int = 32
    selector_top_k: int = 8
    conv_kernel_size: int = 2
    conv_group_size: Optional[int] = None  # default: 64 when it divides the hidden size, else the hidden size
    selector_weight: float = 1.0

    def validate(self) -> None:
        """One DFlashError naming the first option out of range (the CLI's
        flag names): for the CLI and the Python API alike, before any work."""
        for f in fields(self):  # the Python API's values: integers where counts go (not bools, not 2.5)
            v, kind = getattr(self, f.name), str(f.type)
            if v is None and "Optional" in kind:
                continue
            if "List[int]" in kind:
                ok, want = isinstance(v, (list, tuple)) and all(is_int(x) for x in v), "a list of integers"
            elif "int" in kind:
                ok, want = is_int(v), "an integer"
            elif "float" in kind:
                ok, want = isinstance(v, numbers.Real) and not isinstance(v, bool), "a number"
            else:
                continue
            if not ok:
                raise DFlashError(f"{f.name} must be {want}, got {v!r}")
        if not 2 <= self.block_size <= 64:
            raise DFlashError(f"block size must be in 2..64, got {self.block_size}")
        if self.seq_len < self.block_size + 2:
            raise DFlashError(f"--seq-len {self.seq_len} must exceed the block size {self.block_size} + 1")
        if self.context_window is not None and self.context_window < 0:
            raise DFlashError(f"context window must be >= 0, got {self.context_window}")
        if self.steps < 1 or self.batch_size < 1 or self.blocks_per_seq < 1 or self.num_layers < 1:
            raise DFlashError("steps, batch size, blocks per sequence and layers must be positive")
        for flag, value, least in (
            ("--warmup", self.warmup, 0),
            ("--checkpoint-every", self.checkpoint_every, 0),
            ("--log-every", self.log_every, 1),
            ("--gen-tokens", self.gen_tokens, 1),
        ):
            if value < least:
                raise DFlashError(f"{flag} must be >= {least}, got {value}")
        for flag, value in (("--lr", self.lr), ("--gamma", self.gamma), ("--grad-clip", self.grad_clip)):
            check_positive(value, flag)
        for flag, value in (("--weight-decay", self.weight_decay), ("selector weight", self.selector_weight)):
            if not (value >= 0 and math.isfinite(value)):
                raise DFlashError(f"{flag} must be a number >= 0, got {value}")
        if self.init not in ("target", "random"):
            raise DFlashError(f"--init must be 'target' or 'random', got {self.init!r}")
        if self.arch not in ("dflash", "dflash2"):
            raise DFlashError(f"--arch must be 'dflash' or 'dflash2', got {self.arch!r}")
        if self.arch == "dflash2" and min(self.selector_rank, self.selector_top_k, self.conv_kernel_size) < 1:
            raise DFlashError("selector rank, selector top-k and conv kernel size must be positive")


# --- data -------------------------------------------------------------------------


def read_texts(paths: Sequence, text_field: str = "text", log=None) -> List[str]:
    """Plain text files (whole file) or JSONL (``text_field`` of each line).
    In a folder, files that are not UTF-8 text (weights, images) are skipped
    (``log`` says how many); a file named itself must be text."""
    texts = []
    files = []
    if isinstance(paths, (str, os.PathLike)):  # one file or folder
        paths = [paths]
    for p in paths:
        p = Path(p).expanduser()
        if not p.exists():
            raise DFlashError(f"corpus path does not exist: {p}")
        if p.is_dir():
            files.extend((f, True) for f in sorted(f for f in p.rglob("*") if f.is_file()))
        else:
            files.append((p, False))
    if text_field != "text" and not any(f.suffix == ".jsonl" for f, _ in files):
        raise DFlashError(f"--text-field {text_field!r} names a JSONL field, and no corpus file is JSONL (.jsonl)")
    skipped = []
    for f, in_folder in files:
        try:
            data = f.read_bytes()
        except OSError as e:
            raise DFlashError(f"cannot read corpus file {f}: {e}") from None
        try:
            raw = data.decode("utf-8-sig")  # a byte-order mark (Windows editors write one) is not text
            if "\x00" in raw:
                raise UnicodeDecodeError("utf-8", data, raw.index("\x00"), raw.index("\x00") + 1, "NUL byte")
        except UnicodeDecodeError as e:
            if not in_folder:
                raise DFlashError(f"corpus file {f} is not UTF-8 text ({e.reason} at byte {e.start})") from None
            skipped.append(f)
            continue
        if f.suffix == ".jsonl":
            for n, line in enumerate(raw.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except ValueError:
                    raise DFlashError(f"{f}:{n}: not a JSON line") from None
                if not isinstance(obj, dict) or text_field not in obj:
                    raise DFlashError(f"{f}:{n}: no {text_field!r} field")
                if not isinstance(obj[text_field], str):
                    raise DFlashError(f"{f}:{n}: the {text_field!r} field is not a string")
                texts.append(obj[text_field])
        else:
            texts.append(raw)
    if skipped and log is not None:
        log(f"skipped {len(skipped)} corpus files that are not UTF-8 text (the first: {skipped[0]})")
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise DFlashError(f"corpus is empty: {', '.join(str(p) for p in paths)}")
    return texts


def corpus_sequences(tokenizer, texts: List[str], seq_len: int, eos: int) -> List[List[int]]:
    ids: List[int] = []
    for t in texts:
        ids.extend(tokenizer.encode(t, add_special_tokens=False))
        ids.append(eos)
    seqs = [ids[i : i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]
    if not seqs:
        raise DFlashError(f"corpus has {len(ids)} tokens, fewer than one sequence of {seq_len}")
    return seqs


def _prompt_buckets(tok, prompts: List[str], seq_len: int) -> dict:
    """Prompt ids (their last ``seq_len // 2`` tokens) grouped by length: one
    batch decodes prompts of one length."""
    buckets = {}
    for p in prompts:
        ids = tok.encode(p, add_special_tokens=False)[-(seq_len // 2) :]
        if ids:
            buckets.setdefault(len(ids), []).append(ids)
    return dict(sorted(buckets.items()))


def _generated_length(n_prompt: int, seq_len: int, gen_tokens: int) -> int:
    """Tokens of a generated sequence: the prompt's and its continuation, up to ``seq_len``."""
    return n_prompt + min(gen_tokens, seq_len - n_prompt)


def generated_batches(
    engine,
    prompts: List[str],
    seq_len: int,
    gen_tokens: int,
    progress=None,
    batch_size: int = 64,
    capture: Sequence[int] = (),
) -> Iterator[Tuple[List[List[int]], Optional[mx.array]]]:
    """The target's own greedy continuations of each prompt (prompt + output),
    and with ``capture`` the target features of every position, taken from
    the same forward passes (cached, as at inference) instead of a second pass.

    Prompts of equal token length decode together in one batch (a plain
    batched greedy loop over the target cache), which costs about as much
    per step as a single sequence on small models. Yields, batch by batch,
    (sequences, their features [b, len, N*H] or None); a sequence is
    :func:`_generated_length` tokens long.
    """
    target, tok = engine.target, engine.tokenizer
    buckets = _prompt_buckets(tok, prompts, seq_len)
    done, total = 0, sum(len(b) for b in buckets.values())
    for n_prompt, group in buckets.items():
        n_new = _generated_length(n_prompt, seq_len, gen_tokens) - n_prompt
        for s in range(0, len(group), batch_size):
            batch = mx.array(group[s : s + batch_size])
            cache = target.make_cache()
            cache_out, feat_out = [], []
            tokens = batch
            for step in range(n_new + (1 if capture else 0)):
                # Batched forward on the cache: the same layers the decode loop
                # uses. With capture, one more step gives the last token's features.
                logits, f = _batched_step(target, tokens, cache, capture)
                if f is not None:
                    feat_out.append(f)
                if step == n_new:
                    mx.eval(f)
                    break
                nxt = mx.argmax(logits[:, -1], axis=-1)[:, None]
                mx.eval(nxt, cache.state(), *feat_out[-1:])
                cache_out.append(nxt)
                tokens = nxt
            out = mx.concatenate([batch] + cache_out, axis=1).tolist()
            fb = mx.concatenate(feat_out, axis=1)[:, :seq_len] if capture else None
            done += batch.shape[0]
            if progress:
                progress(done, total)
            yield [o[:seq_len] for o in out], fb


def generated_sequences(engine, prompts: List[str], seq_len: int, gen_tokens: int, **options):
    """:func:`generated_batches` gathered: (sequences, one [len, N*H] feature
    array per sequence, or None without ``capture``)."""
    seqs, feats = [], []
    for s, f in generated_batches(engine, prompts, seq_len, gen_tokens, **options):
        seqs += s
        if f is not None:
            feats += [f[i] for i in range(f.shape[0])]
    return seqs, (feats if options.get("capture") else None)


def _batched_step(target, tokens: mx.array, cache, capture: Sequence[int] = ()):
    """Logits [Bt, T, V] for tokens [Bt, T] appended to a batched cache, and
    the features [Bt, T, N*H] of the ``capture`` layers (or None)."""
    h, f = target.layers_forward(target.embed_tokens(tokens), cache.layers, capture=capture)
    cache.offset += tokens.shape[1]
    return target.lm_head(target.norm(h)), f


def feature_batches(target, seqs: List[List[int]], layer_ids: List[int], batch: int = 8, progress=None):
    """Target features (no gradient) for equal-length sequences, ``batch``
    sequences at a time: [b, L, N*H] each. ``progress(done, total)`` after each."""
    for s in range(0, len(seqs), batch):
        toks = mx.array(seqs[s : s + batch])
        _, f = target.batch_forward(toks, capture=layer_ids)
        f = mx.stop_gradient(f)
        mx.eval(f)
        if progress is not None:
            progress(min(s + batch, len(seqs)), len(seqs))
        yield f


def compute_features(target, seqs: List[List[int]], layer_ids: List[int], batch: int = 8, progress=None):
    """:func:`feature_batches` in one array: [n, L, N*H]."""
    return mx.concatenate(list(feature_batches(target, seqs, layer_ids, batch, progress)), axis=0)


# --- features on disk ---------------------------------------------------------------
# The features of every training sequence ([n, L, N*H] floats: 20 KB a token for a
# 0.8B target's five captured layers, so 20 GB for a million tokens) outgrow memory
# long before a useful corpus does. They are written as they are computed into one
# safetensors file, its header first and sized for the whole array, and training
# reads the rows of each batch through a memory map.


def _write_features(path: Path, n: int, L: int, width: int, batches) -> None:
    """Write ``batches`` ((sequences, features [b, >= L, width]) in order,
    ``n`` sequences in all) as a safetensors file: the header first, sized
    for the whole array, then the features batch by batch, then the tokens
    (plain writes: a full disk is an OSError, not a fault in a memory map)."""
    fb, tb = n * L * width * 4, n * L * 4
    header = {
        "features": {"dtype": "F32", "shape": [n, L, width], "data_offsets": [0, fb]},
        "tokens": {"dtype": "I32", "shape": [n, L], "data_offsets": [fb, fb + tb]},
    }
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)  # the format aligns the data to 8 bytes
    tokens = []
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for seqs, feats in batches:
            f.write(np.asarray(feats[:, :L].astype(mx.float32)).tobytes())
            tokens += [s[:L] for s in seqs]
        if len(tokens) != n:
            raise RuntimeError(f"{len(tokens)} sequences of features, {n} expected")
        f.write(np.asarray(tokens, dtype=np.int32).tobytes())


def _map_features(path: Path):
    """(tokens [n, L] int32, features [n, L, W] float32) read-only memory maps
    of a feature file; ValueError when it is not a whole one."""
    from .loading.hf import safetensors_header

    path = Path(path)
    header, base = safetensors_header(path)
    t, fe = header.get("tokens"), header.get("features")
    if not isinstance(t, dict) or not isinstance(fe, dict) or (t.get("dtype"), fe.get("dtype")) != ("I32", "F32"):
        raise ValueError("not a feature file (int32 tokens, float32 features)")
    n, L = t["shape"]
    if fe["shape"][:2] != [n, L] or len(fe["shape"]) != 3:
        raise ValueError(f"features of shape {fe['shape']} for tokens of shape {t['shape']}")
    end = base + max(fe["data_offsets"][1], t["data_offsets"][1])
    sizes = (fe["data_offsets"][1] - fe["data_offsets"][0], t["data_offsets"][1] - t["data_offsets"][0])
    if path.stat().st_size < end or sizes != (4 * math.prod(fe["shape"]), 4 * n * L):
        raise ValueError("shorter than its header says")
    tokens = np.memmap(path, np.int32, "r", offset=base + t["data_offsets"][0], shape=(n, L))
    feats = np.memmap(path, np.float32, "r", offset=base + fe["data_offsets"][0], shape=tuple(fe["shape"]))
    return tokens, feats


# --- model init ---------------------------------------------------------------------


def make_draft_config(target, tc: TrainConfig, mask_token_id: int) -> dict:
    a = target.args
    ids = tc.target_layer_ids or default_target_layer_ids(target.num_layers, tc.num_layers)
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": a.hidden_size,
        "num_hidden_layers": tc.num_layers,
        "num_attention_heads": a.num_attention_heads,
        "num_key_value_heads": a.num_key_value_heads,
        "head_dim": a.head_dim,
        "intermediate_size": tc.intermediate_size or a.intermediate_size or a.hidden_size * 3,
        "rms_norm_eps": a.rms_norm_eps,
        "rope_theta": float(a.rope_theta),
        "max_position_embeddings": a.max_position_embeddings,
        "vocab_size": a.vocab_size,
        "num_target_layers": target.num_layers,
        "block_size": tc.block_size,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": list(ids)},
    }
    if tc.arch == "dflash2":
        group = tc.conv_group_size or (64 if a.hidden_size % 64 == 0 else a.hidden_size)
        cfg["architectures"] = ["DFlash2DraftModel"]
        cfg["dflash_config"].update(
            selector_rank=tc.selector_rank,
            selector_top_k=tc.selector_top_k,
            conv_kernel_size=tc.conv_kernel_size,
            conv_group_size=group,
        )
    window = tc.seq_len if tc.context_window is None else tc.context_window
    if window:
        # Every layer sees the last window-1 positions before its anchor;
        # bidirectional inside the block, as the full-attention layers.
        cfg.update(
            layer_types=["sliding_attention"] * tc.num_layers, sliding_window=window + 1, sliding_block_causal=False
        )
    return cfg


def init_from_target(draft: DFlashDraft, target) -> List[str]:
    """Copy a target attention layer's weights into each draft layer where the
    shapes allow (query half of the gated q_proj, k/v/o, q/k norms, a dense
    MLP). Returns the copied parameter names."""
    attn_layers = [l for l in target.layers if not l.is_linear]
    copied = []
    for i, dl in enumerate(draft.layers):
        tl = attn_layers[-1 - (i % len(attn_layers))]
        ta, da = tl.self_attn, dl.self_attn
        if not isinstance(ta.q_proj, nn.Linear) or isinstance(ta.q_proj, nn.QuantizedLinear):
            continue
        nh, D = ta.num_attention_heads, ta.head_dim
        wq = ta.q_proj.weight.reshape(nh, 2 * D, -1)[:, :D].reshape(nh * D, -1)
        pairs = [
            ("self_attn.q_proj.weight", wq, da.q_proj.weight),
            ("self_attn.k_proj.weight", ta.k_proj.weight, da.k_proj.weight),
            ("self_attn.v_proj.weight", ta.v_proj.weight, da.v_proj.weight),
            ("self_attn.o_proj.weight", ta.o_proj.weight, da.o_proj.weight),
            ("self_attn.q_norm.weight", ta.q_norm.weight, da.q_norm.weight),
            ("self_attn.k_norm.weight", ta.k_norm.weight, da.k_norm.weight),
            ("input_layernorm.weight", tl.input_layernorm.weight, dl.input_layernorm.weight),
            ("post_attention_layernorm.weight", tl.post_attention_layernorm.weight, dl.post_attention_layernorm.weight),
        ]
        mlp = tl.mlp
        if (
            hasattr(mlp, "gate_proj")
            and isinstance(mlp.gate_proj, nn.Linear)
            and not isinstance(mlp.gate_proj, nn.QuantizedLinear)
        ):
            for n in ("gate_proj", "up_proj", "down_proj"):
                pairs.append((f"mlp.{n}.weight", getattr(mlp, n).weight, getattr(dl.mlp, n).weight))
        updates = [(n, src.astype(dst.dtype)) for n, src, dst in pairs if src.shape == dst.shape]
        dl.load_weights(updates, strict=False)
        copied += [f"layers.{i}.{n}" for n, _ in updates]
    return copied


def init_dflash2(draft: DFlashDraft, seed: int) -> None:
    """Convolutions to the identity (so a DFlash 2 draft starts as its v1
    backbone) and small random selector codebooks (a zero pair has no gradient)."""
    for layer in draft.layers:
        layer.attention_conv.set_identity()
        layer.mlp_conv.set_identity()
    sel = draft.candidate_selector
    k1, k2 = mx.random.split(mx.random.key(seed + 17))
    sel.predecessor_codebook = 0.02 * mx.random.normal(sel.predecessor_codebook.shape, key=k1)
    sel.successor_codebook = 0.02 * mx.random.normal(sel.successor_codebook.shape, key=k2)


# --- loss ---------------------------------------------------------------------------


def block_loss(draft, features, tokens, anchors, gamma: float, selector_weight: float = 1.0):
    """Weighted CE over slots 1..B-1, and per-slot accuracy [B-1] (DFlash 2:
    plus the selector's CE along the target's path; accuracy is the
    selector's pick given the target's previous token)."""
    B = draft.config.block_size
    hidden = train_hidden(draft, features, tokens, anchors)[:, :, 1:]  # [Bt, m, B-1, H]
    logits = draft.logits(hidden)  # [Bt, m, B-1, V]
    idx = anchors[..., None] + mx.arange(0, B)
    rows = mx.broadcast_to(tokens[:, None, :], (tokens.shape[0], anchors.shape[1], tokens.shape[1]))
    path = mx.take_along_axis(rows, idx, axis=-1)  # [Bt, m, B]: anchor and the target's tokens
    labels = path[..., 1:]
    ce = nn.losses.cross_entropy(logits.astype(mx.float32), labels)  # [Bt, m, B-1]
    w = mx.exp(-mx.arange(B - 1, dtype=mx.float32) / gamma)
    loss = (ce * w).sum(-1).mean() / w.sum()
    if not draft.config.is_v2:
        acc = (mx.argmax(logits, -1) == labels).astype(mx.float32).mean(axis=(0, 1))
        return loss, acc, mx.stack([loss, mx.array(0.0)])
    sel = draft.candidate_selector
    cand, unary = sel.candidates(logits)
    scores = sel.scores(path[..., :-1], sel.hidden_projection(hidden), cand, unary)  # [Bt, m, B-1, K]
    hit = (cand == labels[..., None]).astype(mx.float32)
    present = hit.sum(-1)
    sel_ce = mx.logsumexp(scores, axis=-1) - (scores * hit).sum(-1)
    sel_loss = (sel_ce * present * w).sum() / mx.maximum((present * w).sum(), 1.0)
    pick = mx.take_along_axis(cand, mx.argmax(scores, -1)[..., None], axis=-1)[..., 0]
    acc = (pick == labels).astype(mx.float32).mean(axis=(0, 1))
    return loss + selector_weight * sel_loss, acc, mx.stack([loss, sel_loss])


def sample_anchors(rng, n_seqs: int, m: int, L: int, B: int) -> np.ndarray:
    hi = L - B  # last anchor whose whole block has labels
    if hi < 1:
        raise DFlashError(f"sequence length {L} too short for block size {B}")
    return np.sort(rng.integers(1, hi + 1, size=(n_seqs, m)), axis=1)


# --- main entry ---------------------------------------------------------------------


def _schedule(tc: TrainConfig):
    warm = max(tc.warmup, 1)
    return optim.join_schedules(
        [
            optim.linear_schedule(tc.lr * 0.01, tc.lr, warm),
            optim.cosine_decay(tc.lr, max(tc.steps - warm, 1), tc.lr * 0.05),
        ],
        [warm],
    )


def _save_draft(draft, cfg: dict, path: Path) -> None:
    """The draft's weights and config, each written whole or not at all (a
    run killed while saving leaves the previous draft readable)."""
    part = path / ".partial"  # a folder of its own: a loader reads every *.safetensors beside config.json
    part.mkdir(parents=True, exist_ok=True)
    with written_whole(path / "model.safetensors", scratch=part) as tmp:
        mx.save_safetensors(str(tmp), dict(tree_flatten(draft.parameters())))
    shutil.rmtree(part, ignore_errors=True)  # with what a killed run left there
    write_text(path / "config.json", json.dumps(cfg, indent=2))


def _save_checkpoint(draft, cfg: dict, opt, step: int, tc: "TrainConfig", ckpt: Path) -> None:
    """Weights and optimizer state in files named by their step, then
    ``state.json`` naming them, replaced in one rename: a run killed at any
    moment leaves a whole checkpoint, the previous or this one."""
    ckpt.mkdir(parents=True, exist_ok=True)
    files = {"model": f"model-{step}.safetensors", "optimizer": f"optimizer-{step}.safetensors"}
    mx.save_safetensors(str(ckpt / files["model"]), dict(tree_flatten(draft.parameters())))
    mx.save_safetensors(str(ckpt / files["optimizer"]), dict(tree_flatten(opt.state)))
    write_text(ckpt / "config.json", json.dumps(cfg, indent=2))
    write_text(ckpt / "state.json", json.dumps({"step": step, "train": asdict(tc), **files}))
    for f in ckpt.glob("*.safetensors"):
        if f.name not in files.values():
            f.unlink()


def _read_checkpoint(ckpt: Path, tc: "TrainConfig") -> dict:
    """The checkpoint's state, its files checked whole from their headers:
    one DFlashError before the feature pass (a damaged file failed after it)."""
    from .loading.hf import whole_safetensors

    state_file = ckpt / "state.json"
    if not state_file.exists():
        raise DFlashError(f"--resume: no checkpoint in {ckpt}")
    try:
        state = json.loads(state_file.read_text())
        done = state["step"]
        names = [state.get(k, f"{k}.safetensors") for k in ("model", "optimizer")]
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise DFlashError(
            f"--resume: the checkpoint's {state_file} is damaged ({e}); train afresh without --resume"
        ) from None
    for name in names:
        f = ckpt / str(name)
        try:
            whole_safetensors(f)
        except (OSError, ValueError, struct.error) as e:
            raise DFlashError(
                f"--resume: the checkpoint's {f} is missing or damaged ({e}); train afresh without --resume"
            ) from None
    if not is_int(done) or done >= tc.steps:
        raise DFlashError(f"--resume: the checkpoint is at step {done}; give --steps above it to train on")
    return state


def _refuse_stopped_run(ckpt: Path) -> None:
    """A run without ``--resume`` starts afresh and deletes ``ckpt``: refused
    where that is a stopped run's checkpoint (its step short of its steps),
    maybe the only copy of hours of training. A finished run's is dropped:
    its draft is the folder the new run retrains."""
    try:
        state = json.loads((ckpt / "state.json").read_text())
        step, steps = int(state["step"]), int(state["train"]["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return  # none, or not one --resume could take up either
    if step < steps:
        raise DFlashError(
            f"{ckpt} holds a stopped run's checkpoint (step {step} of {steps}): give --resume to continue it, "
            "or remove that folder to start afresh"
        )


def _same_draft(ckpt: Path, cfg: dict) -> None:
    """That this run's draft is the checkpoint's (its layers, architecture,
    block, target layers): a different one failed after the feature pass."""
    try:
        had = json.loads((ckpt / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise DFlashError(f"--resume: the checkpoint's config.json is missing or damaged ({e})") from None

    def flat(d, at=""):
        return {
            k2: v2
            for k, v in d.items()
            for k2, v2 in (flat(v, f"{at}{k}.") if isinstance(v, dict) else {f"{at}{k}": v}).items()
        }

    a, b = flat(had), flat(cfg)
    differ = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    if differ:
        shown = "; ".join(f"{k}: checkpoint {a.get(k)!r}, now {b.get(k)!r}" for k in differ[:4])
        raise DFlashError(
            f"--resume: this run's draft is not the checkpoint's ({shown}); give the options it was trained with, "
            "or train afresh without --resume"
        )


def _check_output_folder(out: Path, target_path) -> None:
    """Refuse to write a draft over a model: the target's own folder, or one
    whose config.json is not a DFlash draft's (a previous draft is overwritten)."""
    try:
        same = Path(target_path).expanduser().resolve() == out.resolve()
    except (OSError, TypeError):
        same = False
    if same:
        raise DFlashError(f"--out {out} is the target's folder; give the draft a folder of its own")
    cfg = out / "config.json"
    if cfg.is_file():
        try:
            is_draft = "dflash_config" in json.loads(cfg.read_text())
        except (OSError, ValueError):
            is_draft = False
        if not is_draft:
            raise DFlashError(f"--out {out} holds a model that is not a DFlash draft; give an empty or new folder")


def train_draft(target_path, out, **options) -> dict:
    """Train a draft for the target at ``target_path``; write a z-lab-format
    folder to ``out`` (and checkpoints to ``out/checkpoint``). Returns a
    summary dict (final loss, per-slot accuracy, steps, seconds).

    Options: ``corpus`` (text files or folders) or ``generate_from`` (a prompt
    file), ``text_field`` (JSONL), ``feature_cache`` (a folder), ``resume``,
    ``config`` (a :class:`TrainConfig`), ``engine`` (the target, loaded),
    ``log`` (a function of one line). A run that fails leaves no folder it
    made empty behind."""
    with left_only_if_used(out, options.get("feature_cache")):
        return _train_draft(target_path, out, **options)


def _train_draft(
    target_path,
    out,
    *,
    corpus: Optional[Sequence] = None,
    generate_from=None,
    text_field: str = "text",
    feature_cache=None,
    resume: bool = False,
    config: Optional[TrainConfig] = None,
    engine=None,
    log=None,
) -> dict:
    from .api import load
    from .prefix import tree_digest

    tc = TrainConfig() if config is None else config
    if not isinstance(tc, TrainConfig):
        raise DFlashError(f"config must be a TrainConfig, got {type(tc).__name__}")
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    if (corpus is None) == (generate_from is None):
        raise DFlashError("give exactly one data source: a corpus or --generate-from PROMPTS")
    tc.validate()
    out = Path(out).expanduser()
    _check_output_folder(out, target_path)
    state = _read_checkpoint(out / "checkpoint", tc) if resume else None  # now, not after the feature pass
    if feature_cache is not None:
        feature_cache = writable_folder(feature_cache, "--feature-cache folder")
    # now, not after the training: a folder that cannot be made loses the draft
    writable_folder(out, "output folder")
    engine = engine or load(target_path, dtype=mx.float32)
    target, tok = engine.target, engine.tokenizer
    if tc.target_layer_ids is not None:
        bad = [i for i in tc.target_layer_ids if not 0 <= i < target.num_layers]
        if bad:
            raise DFlashError(f"target layer ids {bad} out of range for a {target.num_layers}-layer target")
    mask_id = tc.mask_token_id
    if mask_id is None:
        vocab = tok.get_vocab() if hasattr(tok, "get_vocab") else {}
        mask_id = vocab.get("<|mask|>", target.vocab_size - 1)
    if not 0 <= mask_id < target.vocab_size:
        raise DFlashError(f"mask token id {mask_id} outside the target vocab")
    ckpt = out / "checkpoint"
    dcfg = make_draft_config(target, tc, mask_id)
    ids = dcfg["dflash_config"]["target_layer_ids"]
    if tc.arch == "dflash2":
        from .loading.hf import validate_v2

        validate_v2(DraftConfig.from_dict(dcfg), "to train")
    if resume:
        _same_draft(ckpt, dcfg)
    else:
        _refuse_stopped_run(ckpt)

    # Data and features (tokens [n, L], features [n, L, N*H]).
    if corpus is not None:
        eos = (list(tok.eos_token_ids) or [0])[0]
        seqs = corpus_sequences(tok, read_texts(corpus, text_field, log), tc.seq_len, eos)
        source = seqs
    else:
        pf = Path(generate_from).expanduser()
        if pf.is_dir():
            raise DFlashError(f"--generate-from {pf} is a folder; give a prompt file (one per line, or JSONL)")
        if not pf.is_file():
            raise DFlashError(f"prompt file does not exist: {pf}")
        if pf.suffix == ".jsonl":
            prompts = read_texts([pf], text_field)
        elif text_field != "text":
            raise DFlashError(f"--text-field {text_field!r} names a JSONL field, and the prompt file {pf} is not JSONL")
        else:
            try:
                prompts = [l for l in pf.read_text(encoding="utf-8").splitlines() if l.strip()]
            except UnicodeDecodeError as e:
                raise DFlashError(f"prompt file {pf} is not UTF-8 text ({e.reason} at byte {e.start})") from None
        if not prompts:
            raise DFlashError(f"prompt file is empty: {pf}")
        # now, not after generating: the shortest prompt and its continuation must hold a block
        shortest = min(
            len(tok.encode(p, add_special_tokens=False)[-(tc.seq_len // 2) :]) or tc.seq_len for p in prompts
        )
        if min(shortest + tc.gen_tokens, tc.seq_len) < tc.block_size + 2:
            raise DFlashError(
                f"--gen-tokens {tc.gen_tokens}: the shortest prompt ({shortest} tokens) and its continuation "
                f"make {shortest + tc.gen_tokens} tokens, fewer than a block of {tc.block_size} needs "
                f"({tc.block_size + 2}); give more --gen-tokens"
            )
        source = [prompts, tc.seq_len, tc.gen_tokens]
    # The target's weights are in the key: features of a retrained target at the same path are not reused.
    weights = tree_digest(target.model.parameters())
    key = hashlib.sha256(json.dumps([str(target_path), weights, ids, source]).encode()).hexdigest()[:16]
    fc = Path(feature_cache) / f"features-{key}.safetensors" if feature_cache is not None else None
    maps = None
    if fc is not None and fc.exists():
        try:
            maps = _map_features(fc)
            log(f"tokens and features from cache {fc}")
        except (OSError, ValueError, KeyError, TypeError) as e:  # damaged: computed again
            log(f"feature cache {fc} unreadable ({type(e).__name__}); computing the features again")
    if maps is None:
        t = time.perf_counter()
        if corpus is not None:
            n, L = len(seqs), min(len(s) for s in seqs)
            log(f"target features for {len(seqs)} sequences of {tc.seq_len} tokens")
            every = max(1, len(seqs) // 10)
            progress = lambda i, n: (  # noqa: E731
                log(f"  {i}/{n} ({time.perf_counter() - t:.0f}s)") if i % every < 8 or i == n else None
            )
            chunks = (seqs[i : i + 8] for i in range(0, len(seqs), 8))
            batches = zip(chunks, feature_batches(target, seqs, ids, 8, progress))
        else:
            lengths = [
                _generated_length(p, tc.seq_len, tc.gen_tokens)
                for p, group in _prompt_buckets(tok, prompts, tc.seq_len).items()
                for _ in group
            ]
            if not lengths:
                raise DFlashError(f"no prompt in {pf} has a token")
            n, L = len(lengths), min(lengths)
            log(f"generating target continuations for {len(prompts)} prompts")
            progress = lambda i, n: (  # noqa: E731
                log(f"  {i}/{n} ({time.perf_counter() - t:.0f}s)") if i % 256 < 64 or i == n else None
            )
            batches = generated_batches(engine, prompts, tc.seq_len, tc.gen_tokens, capture=ids, progress=progress)
        if L < tc.block_size + 2:
            raise DFlashError(f"sequences of {L} tokens are too short for block size {tc.block_size}")
        width = len(ids) * target.hidden_size
        path = fc or Path(tempfile.mkdtemp(prefix="mlx-dflash-features-")) / "features.safetensors"
        need = n * L * (width + 1) * 4
        try:
            free = shutil.disk_usage(path.parent).free
            if need > free:
                raise DFlashError(
                    f"the target features need {need / 2**30:.1f} GiB on disk, {path.parent} has "
                    f"{free / 2**30:.1f} GiB free; give --feature-cache a folder with room, or fewer sequences"
                )
            size = f"{need / 2**30:.1f} GiB" if need >= 2**30 else f"{need / 2**20:.0f} MiB"
            where = path if fc is not None else f"{path} (removed at the end)"
            log(f"features: {size}, written to {where} as they are computed")
            with written_whole(path) as tmp:
                _write_features(tmp, n, L, width, batches)
            maps = _map_features(path)
        finally:
            if fc is None:  # mapped, the file lives as long as the maps; no run leaves it behind
                shutil.rmtree(path.parent, ignore_errors=True)
        log(f"target features for {n} x {L} tokens in {time.perf_counter() - t:.1f}s")
    tokens_map, feats = maps
    tokens = mx.array(np.asarray(tokens_map))
    L = tokens.shape[1]

    # Model and optimizer.
    mx.random.seed(tc.seed)
    draft = DFlashDraft(DraftConfig.from_dict(dcfg)).bind(target)
    opt = optim.AdamW(learning_rate=_schedule(tc), weight_decay=tc.weight_decay)
    start = 0
    if resume:  # the files checked before the feature pass
        draft.load_weights(str(ckpt / state.get("model", "model.safetensors")))
        opt.init(draft.trainable_parameters())
        opt.state = tree_unflatten(list(mx.load(str(ckpt / state.get("optimizer", "optimizer.safetensors"))).items()))
        start = state["step"]
        log(f"resumed from step {start}")
    else:
        if ckpt.is_dir():  # a finished run's (a stopped one's is refused above): --resume would misread it
            shutil.rmtree(ckpt, ignore_errors=True)
            log(f"removed the finished earlier run's checkpoint in {ckpt}: this run starts afresh")
        if tc.init == "target":
            copied = init_from_target(draft, target)
            log(f"initialised {len(copied)} draft tensors from the target")
        if tc.arch == "dflash2":
            init_dflash2(draft, tc.seed)
    mx.eval(draft.parameters())

    loss_and_grad = nn.value_and_grad(draft, lambda f, t, a: block_loss(draft, f, t, a, tc.gamma, tc.selector_weight))

    def step_fn(f, t, a):
        (loss, acc, parts), grads = loss_and_grad(f, t, a)
        grads, _ = optim.clip_grad_norm(grads, tc.grad_clip)
        opt.update(draft, grads)
        return loss, acc, parts

    n = tokens.shape[0]
    history = []
    tic = time.perf_counter()
    done_tokens = 0
    loss = acc = None
    for step in range(start, tc.steps):
        rng = np.random.default_rng([tc.seed, step])
        idx = rng.choice(n, size=min(tc.batch_size, n), replace=n < tc.batch_size)
        anchors = mx.array(sample_anchors(rng, len(idx), tc.blocks_per_seq, L, tc.block_size))
        bi = mx.array(idx)
        loss, acc, parts = step_fn(mx.array(feats[idx]), tokens[bi], anchors)  # the rows from disk
        mx.eval(loss, acc, parts, draft.parameters(), opt.state)
        done_tokens += len(idx) * tc.blocks_per_seq * (tc.block_size - 1)
        if (step + 1) % tc.log_every == 0 or step + 1 == tc.steps:
            dt = time.perf_counter() - tic
            a = acc.tolist()
            head, sel = parts.tolist()
            history.append({"step": step + 1, "loss": loss.item(), "acc": a, "head_loss": head, "selector_loss": sel})
            split = f" (head {head:.3f}, selector {sel:.3f})" if draft.config.is_v2 else ""
            log(
                f"step {step + 1}/{tc.steps}  loss {loss.item():.3f}{split}  acc@1 {a[0]:.2f}  "
                f"acc(mean) {sum(a) / len(a):.2f}  {done_tokens / dt:.0f} tok/s"
            )
        # at the end too, so --resume with more --steps trains on from the finished draft
        if tc.checkpoint_every and ((step + 1) % tc.checkpoint_every == 0 or step + 1 == tc.steps):
            _save_checkpoint(draft, dcfg, opt, step + 1, tc, ckpt)
    _save_draft(draft, dcfg, out)
    summary = {
        "steps": tc.steps,
        "start_step": start,
        "final_loss": loss.item() if loss is not None else None,
        "final_acc": acc.tolist() if acc is not None else None,
        "seconds": time.perf_counter() - tic,
        "sequences": n,
        "seq_len": L,
        "history": history,
    }
    write_text(out / "train_summary.json", json.dumps(summary, indent=1))
    return summary
