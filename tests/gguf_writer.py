"""A small stand-in for llama.cpp's ``convert_hf_to_gguf.py``: Hugging Face
folders (Qwen3.5 / Qwen3.5-MoE targets, z-lab DFlash drafts) to GGUF files.

Written from the converter's own description of what it does to these
models (the Qwen3.5 text classes: the Qwen3-Next tensor rules, the V-head
reorder base and the MTP mixin; the DFlash draft class) and using gguf-py's
``GGUFWriter`` / ``SpecialVocab`` as the converter does. It imports nothing
from ``mlx_dflash``: the loader is tested against files made without it.

Also here: K-quant block encoders (Q4_K, Q6_K; ``gguf.quants`` only decodes
them), checked against ``gguf.quants.dequantize`` by the tests.
"""

import glob
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, RopeScalingType, SpecialVocab, TokenType
from gguf.quants import quantize

# --- K-quant encoders ------------------------------------------------------------


def _f16(x):
    return np.asarray(x, np.float16).view(np.uint8)


def encode_q4_k(x: np.ndarray) -> np.ndarray:
    """Rows of floats (cols % 256 == 0) -> Q4_K blocks (144 bytes per 256 values):
    8 sub-blocks of 32 with 6-bit scales and mins under fp16 super-scales."""
    sub = x.reshape(-1, 8, 32).astype(np.float32)
    mn = np.minimum(sub.min(2), 0.0)
    scale = (sub.max(2) - mn) / 15.0
    d = np.maximum(scale.max(1) / 63.0, 1e-12)
    dmin = np.maximum((-mn).max(1) / 63.0, 1e-12)
    sc = np.clip(np.round(scale / d[:, None]), 0, 63).astype(np.int32)
    m = np.clip(np.round(-mn / dmin[:, None]), 0, 63).astype(np.int32)
    d16, dmin16 = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    step = (d16[:, None] * sc)[:, :, None]
    safe = np.where(step > 0, step, 1.0)
    q = np.where(step > 0, np.clip(np.round((sub + (dmin16[:, None] * m)[:, :, None]) / safe), 0, 15), 0)
    q = q.astype(np.uint8)
    scales = np.zeros((len(sub), 12), np.uint8)
    scales[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(len(sub), 128)  # sub-blocks 2i, 2i+1 share 32 bytes
    out = np.concatenate([_f16(d)[:, None].reshape(-1, 2), _f16(dmin).reshape(-1, 2), scales, qs], axis=1)
    return out.reshape(x.shape[0], -1)


def encode_q6_k(x: np.ndarray) -> np.ndarray:
    """Rows of floats (cols % 256 == 0) -> Q6_K blocks (210 bytes per 256 values):
    16 sub-blocks of 16 with int8 scales under an fp16 super-scale."""
    sub = x.reshape(-1, 16, 16).astype(np.float32)
    scale = np.abs(sub).max(2) / 31.0
    d = np.maximum(scale.max(1) / 127.0, 1e-12)
    sc = np.clip(np.round(scale / d[:, None]), -128, 127).astype(np.int32)
    step = (d.astype(np.float16).astype(np.float32)[:, None] * sc)[:, :, None]
    safe = np.where(step != 0, step, 1.0)
    q = np.where(step != 0, np.clip(np.round(sub / safe), -32, 31) + 32, 32).astype(np.uint8).reshape(-1, 2, 4, 32)
    # two halves of 128 values; quarter k of a half holds values [32k, 32k + 32)
    q1, q2, q3, q4 = q[:, :, 0], q[:, :, 1], q[:, :, 2], q[:, :, 3]
    ql = np.concatenate([(q1 & 0xF) | ((q3 & 0xF) << 4), (q2 & 0xF) | ((q4 & 0xF) << 4)], axis=2)
    qh = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6)
    n = len(sub)
    out = np.concatenate(
        [ql.reshape(n, 128), qh.reshape(n, 64), sc.astype(np.int8).view(np.uint8), _f16(d).reshape(n, 2)], axis=1
    )
    return out.reshape(x.shape[0], -1)


def encode_nvfp4(x: np.ndarray) -> np.ndarray:
    """Rows of floats (cols % 64 == 0) -> NVFP4 blocks (36 bytes per 64 values),
    as ggml's reference quantizer writes them (gguf-py reads but does not write
    them): per 16 values an unsigned e4m3 scale of max|x| / 6 (gguf-py's own
    rounding to it) and the nearest e2m1 value's code, a run of 16 codes kept
    as 8 bytes of low nibbles (values 0-7) and high nibbles (values 8-15)."""
    from gguf.quants import NVFP4

    sub = x.reshape(-1, 4, 16).astype(np.float32)
    code = NVFP4.fp32_to_ue4m3(np.abs(sub).max(2) / 6.0)
    scale = NVFP4.ue4m3_to_fp32(code)[..., None] * 2  # its table is e2m1 doubled, its scale halved
    values = np.array(NVFP4.kvalues, np.float32) / 2
    idx = np.abs(scale[..., None] * values - sub[..., None]).argmin(-1).astype(np.uint8)
    qs = idx[..., :8] | (idx[..., 8:] << 4)
    return np.concatenate([code.reshape(-1, 4), qs.reshape(-1, 32)], axis=1).reshape(x.shape[0], -1)


def _add(w: GGUFWriter, name: str, arr: np.ndarray, q) -> None:
    """Add one tensor in type ``q``; vectors and rows that do not fill a block stay F32."""
    block = {Q.Q4_K: 256, Q.Q6_K: 256, Q.NVFP4: 64, Q.F16: 1, Q.BF16: 1, Q.F32: 1, Q.F64: 1, Q.I32: 1}.get(q, 32)
    if arr.ndim < 2 or arr.shape[-1] % block:
        q = Q.F32
    if q == Q.F32:
        w.add_tensor(name, arr.astype(np.float32))
    elif q == Q.F16:
        w.add_tensor(name, arr.astype(np.float16))
    elif q == Q.F64:
        w.add_tensor(name, arr.astype(np.float64))
    elif q == Q.I32:  # a type a broken converter might write: integers where weights belong
        w.add_tensor(name, np.round(arr * 1000).astype(np.int32))
    elif q in (Q.Q4_K, Q.Q6_K, Q.NVFP4):
        enc = {Q.Q4_K: encode_q4_k, Q.Q6_K: encode_q6_k, Q.NVFP4: encode_nvfp4}[q]
        w.add_tensor(name, enc(arr.reshape(-1, arr.shape[-1])).reshape(*arr.shape[:-1], -1), raw_dtype=q)
    else:
        w.add_tensor(name, quantize(arr.astype(np.float32), q), raw_dtype=q)


def _read_folder(folder: Path) -> dict:
    weights = {}
    for f in sorted(glob.glob(str(folder / "*.safetensors"))):
        for k, v in mx.load(f).items():
            weights[k] = np.array(v.astype(mx.float32))
    return weights


# --- vocabulary, as the converter's byte-level BPE path writes it ------------------


def _write_vocab(w: GGUFWriter, tok_dir: Path, vocab_size: int, pre: str, extra_ids=None) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    reverse = {i: t for t, i in tok.get_vocab().items()}
    added = tok.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:  # the converter pads the vocabulary up to the model's size
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
        elif i in added:
            tokens.append(reverse[i])
            types.append(TokenType.CONTROL if added[i].special else TokenType.USER_DEFINED)
        else:
            tokens.append(reverse[i])
            types.append(TokenType.NORMAL)
    w.add_tokenizer_model("gpt2")
    if pre is not None:  # None: a file from before the converter wrote the key
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    SpecialVocab(tok_dir, load_merges=True, n_vocab=len(tokens)).add_to_gguf(w)
    for key, i in (extra_ids or {}).items():  # eot / eom where a model names them
        w.add_uint32(f"tokenizer.ggml.{key}_token_id", i)


# --- Qwen3.5 targets ---------------------------------------------------------------

_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
# The MTP block's own tensors, renamed as the converter's MTP mixin does (then
# they follow the same rules as every other tensor: "...norm.weight" gets + 1).
_MTP_RENAME = {
    "fc.weight": "eh_proj.weight",
    "pre_fc_norm_embedding.weight": "enorm.weight",
    "pre_fc_norm_hidden.weight": "hnorm.weight",
    "norm.weight": "shared_head.norm.weight",
}
_LAYER_NAMES.update(
    {
        "eh_proj.weight": "nextn.eh_proj.weight",
        "enorm.weight": "nextn.enorm.weight",
        "hnorm.weight": "nextn.hnorm.weight",
        "shared_head.norm.weight": "nextn.shared_head_norm.weight",
    }
)


def _grouped_to_tiled(x: np.ndarray, axis: int, n_k: int, per_k: int, head_dim: int) -> np.ndarray:
    """Value heads along ``axis`` from grouped [k][j] to tiled [j][k] order
    (the converter's reorder for ggml's broadcast over key heads)."""
    shape = x.shape
    x = x.reshape(shape[:axis] + (n_k, per_k, head_dim) + shape[axis + 1 :])
    return np.swapaxes(x, axis, axis + 1).reshape(shape)


def _layer(bid: int, sub: str, arr: np.ndarray):
    if sub == "mlp.experts.gate_up_proj":  # [E, 2 ff, H]: gate rows first
        ff = arr.shape[-2] // 2
        yield bid, "mlp.experts.gate_proj", arr[..., :ff, :]
        yield bid, "mlp.experts.up_proj", arr[..., ff:, :]
    else:
        yield bid, sub, arr


def _tensors(weights: dict, n_main: int, keep_mtp: bool):
    """Yield (block index or None, name within the block, array) in the
    converter's naming: MTP tensors renumbered as blocks after the main ones."""
    for name, arr in weights.items():
        if name.startswith("model.visual."):
            continue
        name = name.replace("model.language_model.", "model.", 1)
        if name.startswith("mtp."):
            if not keep_mtp:
                continue
            rest = name[len("mtp.") :]
            if rest.startswith("layers."):
                _, k, sub = rest.split(".", 2)
                yield from _layer(n_main + int(k), sub, arr)
            else:
                yield n_main, _MTP_RENAME[rest], arr
        elif name.startswith("model.layers."):
            _, _, i, sub = name.split(".", 3)
            yield from _layer(int(i), sub, arr)
        else:
            yield None, name, arr


def convert_hf_to_gguf(
    hf_dir,
    out_path,
    qtype=lambda name, arr: Q.F32,
    *,
    pre: str = "qwen35",
    mtp: bool = True,
    fuse_gate_up: bool = False,
    skip=(),
    arch=None,
    extra_ids=None,
    tokenizer: bool = True,
    split_max_tensors: int = 0,
    small_first_shard: bool = False,
):
    """Convert an HF-format Qwen3.5 folder to GGUF the way llama.cpp's converter does.

    ``qtype(gguf_name, array)`` picks each tensor's type (F32 default; vectors stay F32);
    ``skip`` drops tensors by GGUF name (to make broken files); ``mtp=False`` is the
    converter's ``--no-mtp``. ``split_max_tensors`` / ``small_first_shard`` are the
    converter's ``--split-max-tensors`` / ``--no-tensor-first-split``: a split GGUF,
    written by gguf-py's writer as PREFIX-0000i-of-0000N.gguf beside ``out_path``
    (returned: the first part).
    """
    hf_dir = Path(hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    t = {**config, **config.get("text_config", {})}
    moe = bool(t.get("num_experts"))
    arch = arch or ("qwen35moe" if moe else "qwen35")
    n_main = t["num_hidden_layers"]
    n_mtp = t.get("mtp_num_hidden_layers", 0) if mtp else 0
    n_k, n_v = t["linear_num_key_heads"], t["linear_num_value_heads"]
    dk, dv = t["linear_key_head_dim"], t["linear_value_head_dim"]
    per_k = n_v // n_k
    rope = t.get("rope_parameters") or {}

    w = GGUFWriter(str(out_path), arch, split_max_tensors=split_max_tensors, small_first_shard=small_first_shard)
    w.add_block_count(n_main + n_mtp)
    w.add_context_length(t["max_position_embeddings"])
    w.add_embedding_length(t["hidden_size"])
    w.add_feed_forward_length(t["intermediate_size"])
    w.add_head_count(t["num_attention_heads"])
    w.add_head_count_kv(t["num_key_value_heads"])
    w.add_rope_freq_base(rope.get("rope_theta", t.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in ("linear", "yarn"):  # as llama.cpp's converter writes a rope_scaling config
        w.add_rope_scaling_type(RopeScalingType.YARN if kind == "yarn" else RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
        if "original_max_position_embeddings" in rope:
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_layer_norm_rms_eps(t["rms_norm_eps"])
    w.add_key_length(t["head_dim"])
    w.add_value_length(t["head_dim"])
    w.add_file_type(0)
    if moe:
        w.add_expert_count(t["num_experts"])
        w.add_expert_used_count(t["num_experts_per_tok"])
        w.add_expert_feed_forward_length(t["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(t["shared_expert_intermediate_size"])
    w.add_ssm_conv_kernel(t["linear_conv_kernel_dim"])
    w.add_ssm_state_size(dk)
    w.add_ssm_group_count(n_k)
    w.add_ssm_time_step_rank(n_v)
    w.add_ssm_inner_size(dv * n_v)
    w.add_full_attention_interval(t.get("full_attention_interval", 4))
    w.add_rope_dimension_count(int(t["head_dim"] * rope.get("partial_rotary_factor", 0.25)))
    w.add_rope_dimension_sections(list(rope.get("mrope_section", [11, 11, 10])) + [0])
    if n_mtp:
        w.add_nextn_predict_layers(n_mtp)
    if tokenizer:
        _write_vocab(w, hf_dir, t["vocab_size"], pre, extra_ids)

    weights = _read_folder(hf_dir)
    fused = {}
    for bid, sub, arr in _tensors(weights, n_main, n_mtp > 0):
        # 1. value heads to tiled order, when there are more value than key heads
        if n_k != n_v and sub.startswith("linear_attn."):
            if sub == "linear_attn.in_proj_qkv.weight":
                qk = 2 * n_k * dk
                arr = np.concatenate([arr[:qk], _grouped_to_tiled(arr[qk:], 0, n_k, per_k, dv)], 0)
            elif sub == "linear_attn.in_proj_z.weight":
                arr = _grouped_to_tiled(arr, 0, n_k, per_k, dv)
            elif sub in ("linear_attn.in_proj_a.weight", "linear_attn.in_proj_b.weight"):
                arr = _grouped_to_tiled(arr, 0, n_k, per_k, 1)
            elif sub in ("linear_attn.A_log", "linear_attn.dt_bias"):
                arr = _grouped_to_tiled(arr, 0, n_k, per_k, 1)
            elif sub == "linear_attn.conv1d.weight":
                arr = arr.squeeze()
                qk = 2 * n_k * dk
                arr = np.concatenate([arr[:qk], _grouped_to_tiled(arr[qk:], 0, n_k, per_k, dv)], 0)
            elif sub == "linear_attn.out_proj.weight":
                arr = _grouped_to_tiled(arr, 1, n_k, per_k, dv)
        # 2. the Qwen3-Next rules
        if sub.endswith("A_log"):
            arr = -np.exp(arr)
        elif "conv1d" in sub:
            arr = arr.squeeze()
        elif sub.endswith("norm.weight") and sub != "linear_attn.norm.weight":
            arr = arr + 1.0  # zero-centred gammas stored as 1 + w
        # 3. names
        if bid is None:
            gname = {
                "model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight",
            }[sub]
        elif sub in ("mlp.experts.gate_proj", "mlp.experts.up_proj"):
            gname = f"blk.{bid}.ffn_{sub.split('.')[-1][:-5]}_exps.weight"
            if fuse_gate_up:
                fused.setdefault(bid, {})[sub] = arr
                if len(fused[bid]) < 2:
                    continue
                parts = fused.pop(bid)
                arr = np.concatenate([parts["mlp.experts.gate_proj"], parts["mlp.experts.up_proj"]], axis=1)
                gname = f"blk.{bid}.ffn_gate_up_exps.weight"
        else:
            gname = f"blk.{bid}." + _LAYER_NAMES[sub]
        if gname in skip:
            continue
        _add(w, gname, arr, qtype(gname, arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    parts = sorted(Path(out_path).parent.glob(Path(out_path).stem + "-00001-of-*.gguf"))
    return parts[0] if split_max_tensors and parts else Path(out_path)


# --- DFlash drafts -----------------------------------------------------------------

_DRAFT_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def convert_draft_to_gguf(draft_dir, target_dir, out_path, *, qtype=Q.F16, drop_keys=(), tokenizer=True):
    """A z-lab DFlash draft folder to GGUF as llama.cpp's DFlash converter writes it:
    arch ``dflash``, Qwen3 block names, ``fc`` and ``enc.output_norm`` (the
    hidden norm), and ``dflash.{target_layers, target_hidden_size, block_size,
    mask_token_id}``; ``drop_keys`` leaves some of those out."""
    draft_dir, target_dir = Path(draft_dir), Path(target_dir)
    d = json.loads((draft_dir / "config.json").read_text())
    tcfg = json.loads((target_dir / "config.json").read_text())
    tcfg = {**tcfg, **tcfg.get("text_config", {})}
    dc = d.get("dflash_config") or {}
    arch = "dflash"
    w = GGUFWriter(str(out_path), arch)
    w.add_block_count(d["num_hidden_layers"])
    w.add_context_length(d.get("max_position_embeddings", 40960))
    w.add_embedding_length(d["hidden_size"])
    w.add_feed_forward_length(d["intermediate_size"])
    w.add_head_count(d["num_attention_heads"])
    w.add_head_count_kv(d["num_key_value_heads"])
    w.add_rope_freq_base(d.get("rope_theta", 1000000.0))
    w.add_layer_norm_rms_eps(d["rms_norm_eps"])
    w.add_key_length(d["head_dim"])
    w.add_value_length(d["head_dim"])
    keys = {
        "target_layers": lambda: w.add_array(f"{arch}.target_layers", [int(i) for i in dc["target_layer_ids"]]),
        "target_hidden_size": lambda: w.add_uint32(f"{arch}.target_hidden_size", tcfg["hidden_size"]),
        "block_size": lambda: w.add_uint32(f"{arch}.block_size", int(d.get("block_size", 16))),
        "mask_token_id": lambda: w.add_uint32(f"{arch}.mask_token_id", int(dc["mask_token_id"])),
    }
    for k, add in keys.items():
        if k not in drop_keys:
            add()
    if d.get("layer_types"):  # sliding-window layers: the window and which layers use it
        w.add_sliding_window(int(d["sliding_window"]))
        w.add_sliding_window_pattern([t == "sliding_attention" for t in d["layer_types"]])
    if tokenizer:
        _write_vocab(w, target_dir, tcfg["vocab_size"], "qwen35")
    for name, arr in _read_folder(draft_dir).items():
        if name.startswith("layers."):
            _, i, sub = name.split(".", 2)
            gname = f"blk.{i}." + _DRAFT_NAMES[sub]
        else:
            gname = {
                "fc.weight": "fc.weight",
                "hidden_norm.weight": "enc.output_norm.weight",
                "norm.weight": "output_norm.weight",
            }[name]
        _add(w, gname, arr, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(out_path)
