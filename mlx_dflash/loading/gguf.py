"""GGUF (llama.cpp) targets: ``qwen35`` / ``qwen35moe`` (SPEC §7).

Tensors are decoded one at a time with ``gguf.quants.dequantize`` (``mx.load``
mis-decodes K-quants and drops tensors after MXFP4) and stored the MLX way:
4-bit affine for 4-bit (and lower) sources, 8-bit for 5/6/8-bit sources,
float for float sources; ``keep_precision`` stores every tensor as float, a
``bits`` map overrides per source type. At most one decoded fp32 tensor is
alive beyond the final weights.

llama.cpp conventions undone here (see SPEC §7): ``ssm_a = -exp(A_log)``,
``dt_bias`` stored as ``ssm_dt.bias``, conv1d squeezed to [C, K], norms other
than ``ssm_norm`` already shifted by +1 (the MLX form), and the DeltaNet value
heads in *tiled* order (head t belongs to key head t % Hk), put back in the
grouped order the forward uses.
"""

import json
import tempfile
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import DFlashError

ARCHS = {"qwen35": "qwen3_5", "qwen35moe": "qwen3_5_moe"}
QWEN2_PRETOKENIZE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def is_gguf(path) -> bool:
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == b"GGUF"


def open_gguf(path):
    from gguf import GGUFReader

    p = Path(path).expanduser()
    if not p.exists():
        raise DFlashError(f"model path does not exist: {p}")
    try:
        return GGUFReader(str(p))
    except Exception as e:  # truncated / corrupt / unknown enum values
        raise DFlashError(f"cannot read GGUF file {p} (truncated or corrupt?): {type(e).__name__}: {e}") from None


def field(reader, key: str, default=None):
    f = reader.get_field(key)
    if f is None:
        return default
    return f.contents()


def _req(reader, key: str):
    v = field(reader, key)
    if v is None:
        raise DFlashError(f"GGUF metadata is missing {key!r}")
    return v


def _first(v):
    if isinstance(v, (list, tuple)):
        nz = [x for x in v if x]
        return nz[0] if nz else v[0]
    return v


def gguf_config(reader) -> dict:
    """An HF-style config.json dict from the GGUF metadata."""
    arch = field(reader, "general.architecture")
    if arch not in ARCHS:
        raise DFlashError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(ARCHS)} (Qwen3.5/3.6)")
    a = arch
    tensors = {t.name: t for t in reader.tensors}
    H = int(_req(reader, f"{a}.embedding_length"))
    n_layers = int(_req(reader, f"{a}.block_count"))
    nh = int(_first(_req(reader, f"{a}.attention.head_count")))
    nkv = int(_first(_req(reader, f"{a}.attention.head_count_kv")))
    D = int(field(reader, f"{a}.attention.key_length", H // nh))
    rope_dims = int(field(reader, f"{a}.rope.dimension_count", D // 4))
    Hk = int(_req(reader, f"{a}.ssm.group_count"))
    Hv = int(_req(reader, f"{a}.ssm.time_step_rank"))
    inner = int(_req(reader, f"{a}.ssm.inner_size"))
    Dk = int(_req(reader, f"{a}.ssm.state_size"))
    tokens = field(reader, "tokenizer.ggml.tokens")
    vocab = int(tensors["token_embd.weight"].shape[-1]) if "token_embd.weight" in tensors else len(tokens or [])
    interval = int(field(reader, f"{a}.full_attention_interval", 4))
    text = {
        "model_type": ARCHS[arch] + "_text",
        "hidden_size": H,
        "num_hidden_layers": n_layers,
        "num_attention_heads": nh,
        "num_key_value_heads": nkv,
        "head_dim": D,
        "intermediate_size": int(field(reader, f"{a}.feed_forward_length", 0) or 0),
        "vocab_size": vocab,
        "rms_norm_eps": float(field(reader, f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(field(reader, f"{a}.context_length", 262144)),
        "full_attention_interval": interval,
        "linear_conv_kernel_dim": int(field(reader, f"{a}.ssm.conv_kernel", 4)),
        "linear_key_head_dim": Dk,
        "linear_value_head_dim": inner // Hv,
        "linear_num_key_heads": Hk,
        "linear_num_value_heads": Hv,
        "tie_word_embeddings": "output.weight" not in tensors,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": float(field(reader, f"{a}.rope.freq_base", 10000000.0)),
            "partial_rotary_factor": rope_dims / D,
        },
    }
    if arch == "qwen35moe":
        text.update(
            num_experts=int(_req(reader, f"{a}.expert_count")),
            num_experts_per_tok=int(_req(reader, f"{a}.expert_used_count")),
            moe_intermediate_size=int(_req(reader, f"{a}.expert_feed_forward_length")),
            shared_expert_intermediate_size=int(field(reader, f"{a}.expert_shared_feed_forward_length", 0) or 0),
            norm_topk_prob=True,
        )
    eos = field(reader, "tokenizer.ggml.eos_token_id")
    cfg = {"model_type": ARCHS[arch], "text_config": text, "tie_word_embeddings": text["tie_word_embeddings"]}
    if eos is not None:
        cfg["eos_token_id"] = text["eos_token_id"] = int(eos)
    return cfg


# --- tensor names and layout ----------------------------------------------------------

def tensor_map(cfg: dict) -> Dict[str, Tuple[str, str]]:
    """GGUF tensor name -> (MLX parameter path, transform kind)."""
    t = cfg["text_config"]
    moe = bool(t.get("num_experts"))
    m = {
        "token_embd.weight": ("language_model.model.embed_tokens.weight", ""),
        "output_norm.weight": ("language_model.model.norm.weight", ""),
    }
    if not t["tie_word_embeddings"]:
        m["output.weight"] = ("language_model.lm_head.weight", "")
    for i in range(t["num_hidden_layers"]):
        b, p = f"blk.{i}.", f"language_model.model.layers.{i}."
        m[b + "attn_norm.weight"] = (p + "input_layernorm.weight", "")
        m[b + "post_attention_norm.weight"] = (p + "post_attention_layernorm.weight", "")
        if (i + 1) % t["full_attention_interval"] == 0:
            a = p + "self_attn."
            for g, n in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"),
                         ("attn_output", "o_proj"), ("attn_q_norm", "q_norm"), ("attn_k_norm", "k_norm")):
                m[b + g + ".weight"] = (a + n + ".weight", "")
        else:
            a = p + "linear_attn."
            m[b + "attn_qkv.weight"] = (a + "in_proj_qkv.weight", "qkv_rows")
            m[b + "attn_gate.weight"] = (a + "in_proj_z.weight", "head_rows")
            m[b + "ssm_beta.weight"] = (a + "in_proj_b.weight", "head_rows1")
            m[b + "ssm_alpha.weight"] = (a + "in_proj_a.weight", "head_rows1")
            m[b + "ssm_a"] = (a + "A_log", "a_log")
            m[b + "ssm_dt.bias"] = (a + "dt_bias", "head_rows1")
            m[b + "ssm_conv1d.weight"] = (a + "conv1d.weight", "conv")
            m[b + "ssm_norm.weight"] = (a + "norm.weight", "")
            m[b + "ssm_out.weight"] = (a + "out_proj.weight", "head_cols")
        f = p + "mlp."
        if moe:
            m[b + "ffn_gate_inp.weight"] = (f + "gate.weight", "")
            for g, n in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
                m[b + f"ffn_{g}_exps.weight"] = (f + f"switch_mlp.{n}.weight", "")
                m[b + f"ffn_{g}_shexp.weight"] = (f + f"shared_expert.{n}.weight", "")
            m[b + "ffn_gate_inp_shexp.weight"] = (f + "shared_expert_gate.weight", "row")
        else:
            for g, n in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
                m[b + f"ffn_{g}.weight"] = (f + f"{n}.weight", "")
    return m


def tiled_to_grouped(Hk: int, Hv: int) -> np.ndarray:
    """idx such that grouped[h] = tiled[idx[h]] (value head h of key head h // r)."""
    r = Hv // Hk
    h = np.arange(Hv)
    return (h % r) * Hk + h // r


def _heads(x: np.ndarray, idx: np.ndarray, axis: int) -> np.ndarray:
    Hv = len(idx)
    shape = x.shape
    x = x.reshape(shape[:axis] + (Hv, shape[axis] // Hv) + shape[axis + 1:])
    return np.take(x, idx, axis=axis).reshape(shape)


def transform(kind: str, w: np.ndarray, cfg: dict) -> np.ndarray:
    """GGUF layout (after un-reversing ggml's dims) -> MLX layout."""
    t = cfg["text_config"]
    Hk, Hv = t["linear_num_key_heads"], t["linear_num_value_heads"]
    idx = tiled_to_grouped(Hk, Hv)
    key_dim = Hk * t["linear_key_head_dim"]
    if kind == "":
        return w
    if kind == "row":
        return w.reshape(1, -1)
    if kind == "a_log":
        return np.log(-w.reshape(-1))
    if kind in ("head_rows", "head_rows1"):
        return _heads(w, idx, 0) if kind == "head_rows" else w.reshape(Hv, *w.shape[1:])[idx]
    if kind == "qkv_rows":
        return np.concatenate([w[: 2 * key_dim], _heads(w[2 * key_dim:], idx, 0)], axis=0)
    if kind == "conv":
        w = w.reshape(w.shape[0], -1)  # [C, K]
        w = np.concatenate([w[: 2 * key_dim], _heads(w[2 * key_dim:], idx, 0)], axis=0)
        return w[:, :, None]
    if kind == "head_cols":
        return _heads(w, idx, 1)
    raise ValueError(kind)


# --- quantization choice ---------------------------------------------------------------

def default_bits(type_name: str) -> Optional[int]:
    """MLX bits for a GGUF tensor type: None = keep it as float."""
    if type_name in ("F32", "F16", "BF16", "F64"):
        return None
    if type_name.startswith(("Q5", "Q6", "Q8")):
        return 8
    return 4  # Q4_*, Q2_K, Q3_K, IQ*, MXFP4, TQ*


def _group_size(in_dim: int) -> Optional[int]:
    for gs in (64, 32):
        if in_dim % gs == 0:
            return gs
    return None


def load_gguf_target(path, *, keep_precision: bool = False, bits: Optional[Dict[str, int]] = None,
                     dtype=None, progress: Optional[Callable[[int, int, int], None]] = None,
                     only: Optional[Callable[[str], bool]] = None):
    """Load a GGUF target; returns (Target, config dict with an MLX ``quantization`` block).

    ``only(parameter name)``: decode just those tensors (a pipeline stage's
    share); the other parameters stay lazy placeholders, never evaluated."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    from ..models.qwen35 import Target

    reader = open_gguf(path)
    cfg = gguf_config(reader)
    names = tensor_map(cfg)
    tensors = {t.name: t for t in reader.tensors}
    unknown = sorted(set(tensors) - set(names))
    if unknown:
        raise DFlashError(f"GGUF {path}: unknown tensors {unknown[:5]} (not a {cfg['model_type']} layout?)")
    missing = sorted(set(names) - set(tensors))
    if missing:
        raise DFlashError(f"GGUF {path}: missing tensors {missing[:5]}")

    model_cls, args_cls = _get_classes(cfg)
    model = model_cls(args_cls.from_dict(json.loads(json.dumps(cfg))))  # lazy random init, never evaluated
    mods = dict(model.named_modules())
    plan, qconf = {}, {}
    for gname, (pname, kind) in names.items():
        tname = tensors[gname].tensor_type.name
        b = None if keep_precision else (bits or {}).get(tname, default_bits(tname))
        mod_path = pname.rsplit(".", 1)[0]
        mod = mods.get(mod_path)
        quantizable = pname.endswith(".weight") and hasattr(mod, "to_quantized")
        gs = _group_size(int(tensors[gname].shape[0])) if quantizable else None
        if b is not None and quantizable and gs is not None:
            plan[gname] = (b, gs)
            qconf[mod_path] = {"group_size": gs, "bits": b}
        elif quantizable:
            qconf[mod_path] = False
    if plan:
        nn.quantize(model, class_predicate=lambda p, m: qconf.get(p, False))
    float_dtype = dtype
    total = len(names)
    done_bytes = 0
    for n, (gname, (pname, kind)) in enumerate(names.items(), 1):
        t = tensors[gname]
        if only is not None and not only(pname):
            continue
        try:
            w = dequantize(t.data, t.tensor_type)
        except (NotImplementedError, ValueError, KeyError) as e:
            raise DFlashError(f"GGUF {path}: cannot decode tensor {gname} of type {t.tensor_type.name}: {e}") from None
        w = transform(kind, np.asarray(w, dtype=np.float32), cfg)
        expect_shape = tuple(int(d) for d in reversed(t.shape))
        arr = mx.array(w)
        del w
        if gname in plan:
            b, gs = plan[gname]
            q, s, z = mx.quantize(arr, group_size=gs, bits=b)
            base = pname.rsplit(".", 1)[0]
            updates = [(pname, q), (base + ".scales", s), (base + ".biases", z)]
        else:
            src = t.tensor_type.name
            target_dtype = float_dtype or {"F16": mx.float16, "BF16": mx.bfloat16}.get(src, mx.float32)
            if pname.endswith(("A_log", "dt_bias")) or "norm" in pname:
                target_dtype = mx.float32  # small, precision-sensitive
            updates = [(pname, arr.astype(target_dtype))]
        model.load_weights(updates, strict=False)
        mx.eval([u for _, u in updates])
        del arr, updates
        mx.clear_cache()  # return the decode's temporaries, so peak memory stays one tensor deep
        done_bytes += int(t.n_bytes)
        if progress:
            progress(n, total, done_bytes)
    # Everything the model has must have come from the file.
    loaded_paths = {p for p, _ in names.values()}
    for k, _ in tree_flatten(model.parameters()):
        base = k.rsplit(".", 1)[0]
        if only is not None and not only(k if k in loaded_paths else base + ".weight"):
            continue
        if k not in loaded_paths and not (k.endswith((".scales", ".biases")) and base + ".weight" in loaded_paths):
            raise DFlashError(f"GGUF {path}: no tensor for parameter {k}")
    model.eval()
    out_cfg = json.loads(json.dumps(cfg))
    if plan:
        from collections import Counter

        bits_, gs_ = Counter(plan.values()).most_common(1)[0][0]  # the default; the rest are per-layer
        out_cfg["quantization"] = {"group_size": gs_, "bits": bits_, **qconf}
    return Target(model, out_cfg), out_cfg


# --- tokenizer ---------------------------------------------------------------------

def write_tokenizer(reader, out_dir) -> Path:
    """tokenizer.json + tokenizer_config.json (chat template) from tokenizer.ggml.*"""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    model_kind = field(reader, "tokenizer.ggml.model")
    if model_kind != "gpt2":
        raise DFlashError(f"unsupported GGUF tokenizer model {model_kind!r} (only byte-level BPE 'gpt2')")
    tokens = list(field(reader, "tokenizer.ggml.tokens") or [])
    merges = list(field(reader, "tokenizer.ggml.merges") or [])
    types = list(field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens))
    pre = field(reader, "tokenizer.ggml.pre", "default")
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    if pre in ("gpt2", "default"):
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:  # qwen2 / qwen35 and friends: Qwen's split regex, then bytes
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()
    specials = [tokens[i] for i, ty in enumerate(types) if ty in (3, 4)]  # CONTROL, USER_DEFINED
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))

    def tok_of(key):
        i = field(reader, key)
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": tok_of("tokenizer.ggml.eos_token_id"),
        "bos_token": tok_of("tokenizer.ggml.bos_token_id"),
        "pad_token": tok_of("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(field(reader, "tokenizer.ggml.add_bos_token", False)),
        "model_max_length": 1000000,
    }
    tmpl = field(reader, "tokenizer.chat_template")
    if tmpl:
        cfg["chat_template"] = tmpl
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    return out


def tokenizer_dir_for(path) -> Path:
    """A folder holding the GGUF's tokenizer files (made once per process)."""
    d = Path(tempfile.mkdtemp(prefix="mlx_dflash_gguf_tok_"))
    return write_tokenizer(open_gguf(path), d)


# --- drafts ----------------------------------------------------------------------------

# Draft converters disagree on a few names; accept each spelling seen.
_DRAFT_GLOBAL = {
    "fc.weight": ("dflash_fc.weight", "dflash.fc.weight", "fc.weight"),
    "hidden_norm.weight": ("dflash_hidden_norm.weight", "dflash.hidden_norm.weight", "hidden_norm.weight"),
    "norm.weight": ("output_norm.weight", "norm.weight"),
}
_DRAFT_LAYER = {
    "input_layernorm.weight": ("attn_norm.weight",),
    "post_attention_layernorm.weight": ("ffn_norm.weight", "post_attention_norm.weight"),
    "self_attn.q_proj.weight": ("attn_q.weight",),
    "self_attn.k_proj.weight": ("attn_k.weight",),
    "self_attn.v_proj.weight": ("attn_v.weight",),
    "self_attn.o_proj.weight": ("attn_output.weight",),
    "self_attn.q_norm.weight": ("attn_q_norm.weight",),
    "self_attn.k_norm.weight": ("attn_k_norm.weight",),
    "mlp.gate_proj.weight": ("ffn_gate.weight",),
    "mlp.up_proj.weight": ("ffn_up.weight",),
    "mlp.down_proj.weight": ("ffn_down.weight",),
}
_IGNORED_DRAFT = ("token_embd.weight", "output.weight")  # some converters keep the target's vocab tensors


def gguf_draft_config(reader) -> dict:
    """A z-lab-style draft config.json dict from GGUF draft metadata."""
    arch = field(reader, "general.architecture") or ""
    if "dflash" not in arch:
        raise DFlashError(f"not a DFlash draft GGUF: architecture {arch!r}")
    a = arch

    def get(key, default=None):
        return field(reader, f"{a}.{key}", default)

    ids = get("dflash.target_layer_ids", get("target_layers"))
    if ids is None:
        raise DFlashError(f"draft GGUF has no {a}.dflash.target_layer_ids")
    H = int(get("embedding_length") or 0)
    nh = int(_first(get("attention.head_count") or 0))
    if not H or not nh:
        raise DFlashError("draft GGUF is missing embedding_length or attention.head_count")
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "hidden_size": H,
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": nh,
        "num_key_value_heads": int(_first(get("attention.head_count_kv", nh))),
        "head_dim": int(get("attention.key_length", H // nh)),
        "intermediate_size": int(get("feed_forward_length")),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 1000000.0)),
        "max_position_embeddings": int(get("context_length", 40960)),
        "block_size": int(get("dflash.block_size", 16)),
        "dflash_config": {"mask_token_id": get("dflash.mask_token_id"),
                          "target_layer_ids": [int(i) for i in ids]},
    }
    sw = get("attention.sliding_window")
    if sw:
        cfg["sliding_window"] = int(sw)
    return cfg


def load_gguf_draft(path, target, *, dtype=None):
    """Read a DFlash draft GGUF (F16/BF16/F32/Q8_0/...): returns (config dict,
    weights dict under z-lab names, as float arrays)."""
    from gguf.quants import dequantize

    reader = open_gguf(path)
    cfg = gguf_draft_config(reader)
    if cfg["dflash_config"]["mask_token_id"] is None:
        cfg["dflash_config"]["mask_token_id"] = field(reader, "tokenizer.ggml.mask_token_id")
    tensors = {t.name: t for t in reader.tensors}
    wanted = dict(_DRAFT_GLOBAL)
    for i in range(cfg["num_hidden_layers"]):
        for ours, theirs in _DRAFT_LAYER.items():
            wanted[f"layers.{i}.{ours}"] = tuple(f"blk.{i}.{n}" for n in theirs)
    weights, used = {}, set()
    for ours, names in wanted.items():
        name = next((n for n in names if n in tensors), None)
        if name is None:
            raise DFlashError(f"draft GGUF {path}: missing tensor {names[0]}")
        t = tensors[name]
        w = dequantize(t.data, t.tensor_type)
        src = {"F16": mx.float16, "BF16": mx.bfloat16}.get(t.tensor_type.name,
                                                            mx.float32 if t.tensor_type.name == "F32" else mx.float16)
        weights[ours] = mx.array(np.asarray(w, np.float32)).astype(dtype or src)
        used.add(name)
    extra = sorted(set(tensors) - used - set(_IGNORED_DRAFT))
    if extra:
        raise DFlashError(f"draft GGUF {path}: unknown tensors {extra[:5]}")
    return cfg, weights
