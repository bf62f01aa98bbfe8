"""Random-weight models at the published Qwen3.5 shapes, written as mlx-lm
folders, and an oracle draft (bench/real_shapes.py, bench/long_context.py).

The target config.json values are the published Qwen/Qwen3.5-0.8B and -2B
ones (text_config; sources in docs/performance.md). mlx-lm needs head_dim,
the linear_* fields, rope_parameters and tie_word_embeddings inside
text_config, or it falls back to Qwen3-Next defaults. ``scale`` shrinks the
shape (layers, width, vocabulary) for a quick development run.
"""

import gc
import json
from pathlib import Path
from typing import Optional, Sequence

import mlx.core as mx

from tools import tiny

# Published text_config of Qwen/Qwen3.5-{0.8B,2B}: only these differ.
SIZES = {
    "0.8b": {"hidden_size": 1024, "intermediate_size": 3584},
    "2b": {"hidden_size": 2048, "intermediate_size": 6144},
}


def target_config(size: str = "0.8b", scale: int = 1) -> dict:
    """The published config.json of Qwen3.5-``size``; ``scale`` > 1 divides
    layers (by 4 at most, keeping the 3:1 DeltaNet/attention pattern), width
    and vocabulary for a fast development model of the same layout."""
    s = SIZES[size]
    layers = 24 if scale == 1 else max(24 // scale, 4)
    hidden = s["hidden_size"] // scale
    text = {
        "model_type": "qwen3_5_text",
        "vocab_size": 248320 // scale,
        "hidden_size": hidden,
        "intermediate_size": s["intermediate_size"] // scale,
        "num_hidden_layers": layers,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 256 // min(scale, 2),
        "attention_bias": False,
        "attn_output_gate": True,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-06,
        "max_position_embeddings": 262144,
        "full_attention_interval": 4,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128 // min(scale, 2),
        "linear_value_head_dim": 128 // min(scale, 2),
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 16,
        "mamba_ssm_dtype": "float32",
        "mtp_num_hidden_layers": 1,
        "tie_word_embeddings": True,
        "eos_token_id": 248044,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
    }
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "tie_word_embeddings": True,
        "eos_token_id": 248044,
        "text_config": text,
    }


def moe_config(layers: int = 40) -> dict:
    """The published text config of Qwen/Qwen3.5-35B-A3B (transformers'
    Qwen3_5MoeTextConfig defaults, which its docstring names as that
    checkpoint's): hidden 2048, 40 layers at full_attention_interval 4,
    16 query / 2 KV heads of 256, DeltaNet 16 key / 32 value heads of 128,
    256 experts of 512 with 8 routed per token and a shared expert of 512,
    vocabulary 248320, head not tied. ``layers`` keeps the first so many."""
    text = target_config("2b")["text_config"]
    text.update(
        model_type="qwen3_5_moe_text",
        hidden_size=2048,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=2,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        norm_topk_prob=True,
        tie_word_embeddings=False,
    )
    text.pop("intermediate_size", None)
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "tie_word_embeddings": False,
        "eos_token_id": 248044,
        "text_config": text,
    }


def build_shared_experts(cfg: dict, seed: int = 0):
    """A random-weight mlx-lm model of ``cfg`` (a MoE config) whose layers
    all use the first layer's routed experts (one array each: the full
    35B-A3B's 40 x 805 M expert parameters do not fit this machine's memory
    in float32). Every layer keeps its own router, so each picks its own
    experts per token: a step still reads 8 experts' weights per layer and a
    verify of B rows the distinct experts its rows pick, as the full model's
    would. Built lazily, so the replaced experts are never allocated."""
    from mlx_lm.utils import _get_classes

    mx.random.seed(seed)
    model_cls, args_cls = _get_classes(cfg)
    model = model_cls(args_cls.from_dict(json.loads(json.dumps(cfg))))
    layers = model.language_model.model.layers
    for layer in layers[1:]:
        layer.mlp.switch_mlp = layers[0].mlp.switch_mlp
    mx.eval(model.parameters())
    model.eval()
    return model


def draft_config(target_cfg: dict) -> dict:
    """The published 0.8B draft's shape (Moonlight556/Qwen3.5-0.8B-DFlash:
    5 layers, taps [3, 7, 11, 15, 19], block 16, mask 248077; its attention
    and MLP sizes copy the target's, as SpecForge's Qwen3.5 drafts do), scaled
    with the target. For 2B: the same recipe at 2B's width."""
    text = target_cfg["text_config"]
    n = text["num_hidden_layers"]
    taps = [3, 7, 11, 15, 19] if n == 24 else [min(1 + 4 * i, n - 1) for i in range(min(5, n - 1))]
    taps = sorted(set(taps))
    cfg = tiny.draft_config(
        target_cfg,
        num_hidden_layers=5,
        block_size=16,
        target_layer_ids=taps,
        mask_token_id=min(248077, text["vocab_size"] - 1),
        num_attention_heads=text["num_attention_heads"],
        num_key_value_heads=text["num_key_value_heads"],
        head_dim=text["head_dim"],
        intermediate_size=text["intermediate_size"],
    )
    cfg["architectures"] = ["DFlashDraftModel"]
    cfg["rope_theta"] = 10000000
    cfg["max_position_embeddings"] = 262144
    cfg["tie_word_embeddings"] = True
    cfg["dflash_config"]["block_size"] = 16
    return cfg


def write_models(root, size: str = "0.8b", scale: int = 1, bits: Sequence[int] = (4,), seed: int = 0) -> dict:
    """Write the float32 target, its quantized copies (mlx_lm.convert's
    convention: mlx_lm.utils.quantize_model, group 64) and the draft under
    ``root``; folders already written with the same config are reused.
    Returns {"fp32": path, "4bit": path, ..., "draft": path}."""
    root = Path(root)
    cfg = target_config(size, scale)
    dcfg = draft_config(cfg)
    out = {"fp32": root / "fp32", "draft": root / "draft", **{f"{b}bit": root / f"{b}bit" for b in bits}}

    def fresh(p: Path, c: dict) -> bool:
        f = p / "config.json"
        if not f.is_file():
            return False
        old = json.loads(f.read_text())
        old.pop("quantization", None)
        old.pop("quantization_config", None)
        return old == c

    if not all(fresh(out[k], cfg) for k in out if k != "draft"):
        model = tiny.build_target(cfg, seed=seed)
        tiny.save_mlx(model, cfg, out["fp32"])
        for b in bits:
            tiny.save_mlx(model, cfg, out[f"{b}bit"], quantize={"bits": b, "group_size": 64})
        del model
        gc.collect()
        mx.clear_cache()
    if not fresh(out["draft"], dcfg):
        tiny.save_draft(tiny.build_draft(dcfg, seed=seed + 1), dcfg, out["draft"])
    return out


class OracleDraft:
    """A draft that proposes the target's own greedy continuation, known from
    a plain run (``sequence`` = prompt + plain output), so every drafted
    token is accepted: the ceiling tau = B. With ``inner`` (a bound DFlash
    draft) it also runs that draft's forward every cycle and makes its
    proposal depend on the result, so a cycle pays the real draft's cost
    (context, attention over it, block forward, head).

    A verify that commits another token than ``sequence`` holds means
    speculative output parted from the plain run it was given. ``strict``
    raises then; otherwise ``parted_at`` keeps the first such position and
    the oracle proposes nothing useful from there on, so a benchmark reports
    the parting (and the tau it cost) instead of dying on it: on a GPU whose
    several-row matmuls round otherwise than one-row ones it is a finding."""

    def __init__(self, sequence: Sequence[int], inner=None, block_size: int = 16, strict: bool = True):
        self.sequence = list(sequence)
        self.inner = inner
        self._block = inner.block_size if inner is not None else block_size
        self.strict = strict
        self.parted_at: Optional[int] = None
        self.last_cache = None  # the draft cache of the latest generation (the bench times it)

    @property
    def target_layer_ids(self):
        return self.inner.target_layer_ids if self.inner is not None else []

    @property
    def block_size(self) -> int:
        return self._block

    def make_cache(self, window=None):
        self.last_cache = self.inner.make_cache(window) if self.inner is not None else _NoCache()
        return self.last_cache

    def tokens(self, anchor: int, anchor_pos: int, block_size: int) -> mx.array:
        seq = self.sequence
        if self.parted_at is None and anchor_pos < len(seq) and seq[anchor_pos] != anchor:
            if self.strict:
                raise ValueError(f"oracle out of step: anchor {anchor} at {anchor_pos}, expected {seq[anchor_pos]}")
            self.parted_at = anchor_pos
        nxt = [] if self.parted_at is not None else seq[anchor_pos + 1 : anchor_pos + block_size]
        return mx.array(nxt + [0] * (block_size - 1 - len(nxt)), dtype=mx.int32)

    def propose(self, features, anchor, anchor_pos, block_size, cache, sampler=None, sample: bool = False):
        oracle = self.tokens(anchor, anchor_pos, block_size)
        if self.inner is None:
            return oracle, None
        drafted, _ = self.inner.propose(features, anchor, anchor_pos, block_size, cache, sampler, False)
        # Tied to the draft's output, so its forward is evaluated (and paid) with the proposal.
        return oracle + drafted * 0, None


class _NoCache:
    """What a draft without a forward keeps between cycles: nothing."""

    def skip(self, rows: int) -> int:
        return 0


def mlx_lm_generate(model, prompt: Sequence[int], max_tokens: int, prompt_cache=None, prefill_step_size: int = 2048):
    """mlx-lm's greedy decoding (generate_step): (tokens, prefill seconds,
    decode seconds for the tokens after the first)."""
    import time

    from mlx_lm.generate import generate_step

    toks = []
    t0 = time.perf_counter()
    t1 = None
    for tok, _ in generate_step(
        mx.array(list(prompt)),
        model,
        max_tokens=max_tokens,
        sampler=lambda x: mx.argmax(x, axis=-1),
        prompt_cache=prompt_cache,
        prefill_step_size=prefill_step_size,
    ):
        toks.append(int(tok))
        if t1 is None:
            t1 = time.perf_counter()
    t2 = time.perf_counter()
    return toks, t1 - t0, t2 - t1


def load(folder, draft_folder: Optional[Path] = None):
    """(Target, bound draft or None) from the folders, through mlx-dflash's loaders."""
    from mlx_dflash.loading import load_draft, load_target

    target = load_target(folder)
    draft = load_draft(draft_folder, target) if draft_folder is not None else None
    return target, draft


def matching_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens two greedy runs share from the start."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def prompt_ids(n: int, vocab: int, seed: int = 1) -> list:
    """``n`` pseudo-random token ids (a fixed LCG: the same prompt every run)."""
    out, x = [], seed
    for _ in range(n):
        x = (1103515245 * x + 12345) % 2**31
        out.append(x % vocab)
    return out


def cycle_terms(target, draft, cache, dcache, *, verify_widths, draft_widths, reps: int, model=None, mlx_cache=None):
    """Median seconds of each cost term at the caches' context, the terms
    taking turns within each repeat (after one warm-up round):

    - "T_plain": one plain step of the engine (target.forward of 1 token);
      "T_plain mlx-lm": one step of mlx-lm's model on its own cache;
    - "T_verify(B)": a recorded forward of B tokens with capture, then
      "T_rollback(B)": the caches restored to B/2 accepted tokens;
    - "T_draft(B)": the draft's block proposal after 4 new context rows.

    Each call advances the caches a little (a few tokens per repeat), as
    decoding does; every call ends with its outputs and caches evaluated."""
    import statistics
    import time

    capture = draft.target_layer_ids
    V = target.vocab_size
    nfeat = len(capture) * target.hidden_size
    newf = mx.zeros((4, nfeat), dtype=mx.float32)

    def plain():
        lg, _ = target.forward([5], cache)
        mx.eval(mx.argmax(lg, -1), cache.state())

    def mlx_plain():
        lg = model(mx.array([[5]]), cache=mlx_cache)
        mx.eval(mx.argmax(lg[:, -1], -1), [c.state for c in mlx_cache])

    def verify(B):
        block = [(11 * j + 1) % V for j in range(B)]

        def run():
            t0 = time.perf_counter()
            lg, f = target.forward(block, cache, capture=capture, record=True)
            mx.eval(mx.argmax(lg, -1), f, cache.state())
            t1 = time.perf_counter()
            cache.rollback(max(B // 2, 1))
            mx.eval(cache.state())
            return {f"T_verify({B})": t1 - t0, f"T_rollback({B})": time.perf_counter() - t1}

        return run

    def drafting(B):
        def run():
            toks, _ = draft.propose(newf, 9, dcache.length + 4, B, dcache)
            mx.eval(toks, dcache.state())

        return run

    fns = [("T_plain", plain)]
    if model is not None:
        fns.append(("T_plain mlx-lm", mlx_plain))
    fns += [(None, verify(B)) for B in verify_widths]
    fns += [(f"T_draft({B})", drafting(B)) for B in draft_widths]
    times = {}
    for r in range(reps + 1):
        for name, fn in fns:
            t = time.perf_counter()
            got = fn()
            dt = time.perf_counter() - t
            if r == 0:
                continue
            for k, v in (got or {name: dt}).items():
                times.setdefault(k, []).append(v)
    return {k: statistics.median(v) for k, v in times.items()}


def shape_arguments(ap, *, tokens: int, reps: int, out: Path) -> None:
    """The options every published-shape bench shares: the shape, the
    precisions, the decode runs' sizes, where models and results go, the BLAS."""
    ap.add_argument("--size", default="0.8b", choices=sorted(SIZES), help="published target shape")
    ap.add_argument("--scale", type=int, default=1, help="shrink the shape N times (development runs)")
    ap.add_argument("--precisions", default="fp32,4bit", help="comma list of: fp32, 4bit")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens of the decode runs")
    ap.add_argument("--tokens", type=int, default=tokens, help="tokens generated per decode run")
    ap.add_argument("--rounds", type=int, default=2, help="decode rounds (the modes take turns in each)")
    ap.add_argument("--reps", type=int, default=reps, help="repeats of each cost term (median)")
    ap.add_argument("--models", default="/tmp/mlx-dflash-shapes", help="where the model folders are written")
    ap.add_argument("--out", default=str(out), help="result file")
    from mlx_dflash import blas

    blas.add_flag(ap)


def run_precisions(args, measure, report) -> str:
    """Write the shape's models (once; see :func:`write_models`), then
    ``measure(precision, target folder, draft folder, args)`` for each of
    ``args.precisions``, rewriting ``args.out`` with ``report(results, args)``
    after each, so a run cut short keeps what it measured. Returns the report."""
    import time

    from mlx_dflash import blas

    blas.ensure_openblas(args.blas)
    precisions = args.precisions.split(",")
    root = Path(args.models) / f"{args.size}-x{args.scale}"
    t0 = time.perf_counter()
    paths = write_models(root, args.size, args.scale, bits=[4] if "4bit" in precisions else [])
    print(f"models in {root} ({time.perf_counter() - t0:.0f} s); BLAS: {blas.describe()}", flush=True)
    results, text = [], ""
    for p in precisions:
        results.append(measure(p, paths[p], paths["draft"], args))
        gc.collect()  # the models of this precision go before the next loads
        mx.clear_cache()
        text = report(results, args)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    print(text)
    print(f"Run took {(time.perf_counter() - t0) / 60:.1f} min.")
    return text
