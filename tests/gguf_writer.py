"""Write tiny qwen35 / qwen35moe GGUF files from a reference model, the way
llama.cpp's converter lays them out (SPEC §7), plus K-quant block encoders.

The K-quant encoders follow the ggml block formats (QK_K = 256); the tests
check them against ``gguf.quants.dequantize``.
"""

import json
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import quantize
from mlx.utils import tree_flatten

from mlx_dflash.loading.gguf import _heads, tensor_map, tiled_to_grouped


def _f16(x):
    return np.asarray(x, np.float16).view(np.uint8)


def encode_q4_k(x: np.ndarray) -> np.ndarray:
    """Rows of floats (cols % 256 == 0) -> Q4_K blocks (144 bytes per 256 values)."""
    rows = x.reshape(-1, 256).astype(np.float32)
    out = []
    for b in rows:
        sub = b.reshape(8, 32)
        mn = np.minimum(sub.min(1), 0.0)
        scale = (sub.max(1) - mn) / 15.0
        d = max(scale.max() / 63.0, 1e-12)
        dmin = max((-mn).max() / 63.0, 1e-12)
        sc = np.clip(np.round(scale / d), 0, 63).astype(np.int32)
        m = np.clip(np.round(-mn / dmin), 0, 63).astype(np.int32)
        q = np.zeros((8, 32), np.int32)
        for j in range(8):
            step = d * sc[j]
            q[j] = np.clip(np.round((sub[j] + dmin * m[j]) / step), 0, 15) if step > 0 else 0
        scales = np.zeros(12, np.uint8)
        for j in range(4):
            scales[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6)
            scales[j + 4] = (m[j] & 63) | ((m[j + 4] >> 4) << 6)
            scales[j + 8] = (sc[j + 4] & 0xF) | ((m[j + 4] & 0xF) << 4)
        qs = np.zeros(128, np.uint8)
        for i in range(4):
            qs[32 * i : 32 * i + 32] = q[2 * i] | (q[2 * i + 1] << 4)
        out.append(np.concatenate([_f16([d]), _f16([dmin]), scales, qs]))
    return np.stack(out).reshape(x.shape[0], -1)


def encode_q6_k(x: np.ndarray) -> np.ndarray:
    """Rows of floats (cols % 256 == 0) -> Q6_K blocks (210 bytes per 256 values)."""
    rows = x.reshape(-1, 256).astype(np.float32)
    out = []
    for b in rows:
        sub = b.reshape(16, 16)
        scale = np.abs(sub).max(1) / 31.0
        d = max(np.abs(scale).max() / 127.0, 1e-12)
        sc = np.clip(np.round(scale / d), -128, 127).astype(np.int32)
        q = np.zeros(256, np.int32)
        for j in range(16):
            step = d * sc[j]
            q[16 * j : 16 * j + 16] = np.clip(np.round(sub[j] / step), -32, 31) + 32 if step else 32
        ql = np.zeros(128, np.uint8)
        qh = np.zeros(64, np.uint8)
        for h in range(2):  # two halves of 128 values
            v = q[128 * h : 128 * h + 128]
            for l in range(32):
                q1, q2, q3, q4 = v[l], v[l + 32], v[l + 64], v[l + 96]
                ql[64 * h + l] = (q1 & 0xF) | ((q3 & 0xF) << 4)
                ql[64 * h + l + 32] = (q2 & 0xF) | ((q4 & 0xF) << 4)
                qh[32 * h + l] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6)
        out.append(np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), _f16([d])]))
    return np.stack(out).reshape(x.shape[0], -1)


def grouped_to_tiled(Hk, Hv):
    return np.argsort(tiled_to_grouped(Hk, Hv))


def inverse_transform(kind, w, cfg):
    t = cfg["text_config"]
    Hk, Hv = t["linear_num_key_heads"], t["linear_num_value_heads"]
    idx = grouped_to_tiled(Hk, Hv)
    kd = Hk * t["linear_key_head_dim"]
    if kind == "":
        return w
    if kind == "row":
        return w.reshape(-1)
    if kind == "a_log":
        return -np.exp(w)
    if kind == "head_rows":
        return _heads(w, idx, 0)
    if kind == "head_rows1":
        return w[idx]
    if kind == "qkv_rows":
        return np.concatenate([w[: 2 * kd], _heads(w[2 * kd:], idx, 0)], 0)
    if kind == "conv":
        w = w[:, :, 0]
        return np.concatenate([w[: 2 * kd], _heads(w[2 * kd:], idx, 0)], 0)
    if kind == "head_cols":
        return _heads(w, idx, 1)
    raise ValueError(kind)


def write_gguf(model, cfg, path, qtype=lambda name, w: Q.F32, tokenizer_dir=None, arch=None,
               skip=(), extra=None):
    """Write ``model`` (an mlx-lm qwen3_5 model) as a llama.cpp-style GGUF."""
    t = cfg["text_config"]
    moe = bool(t.get("num_experts"))
    arch = arch or ("qwen35moe" if moe else "qwen35")
    w = GGUFWriter(str(path), arch)
    w.add_block_count(t["num_hidden_layers"])
    w.add_embedding_length(t["hidden_size"])
    w.add_feed_forward_length(t["intermediate_size"])
    w.add_head_count(t["num_attention_heads"])
    w.add_head_count_kv(t["num_key_value_heads"])
    w.add_key_length(t["head_dim"])
    w.add_value_length(t["head_dim"])
    w.add_layer_norm_rms_eps(t["rms_norm_eps"])
    w.add_context_length(t["max_position_embeddings"])
    rp = t["rope_parameters"]
    w.add_rope_freq_base(rp["rope_theta"])
    w.add_rope_dimension_count(int(t["head_dim"] * rp["partial_rotary_factor"]))
    w.add_ssm_conv_kernel(t["linear_conv_kernel_dim"])
    w.add_ssm_state_size(t["linear_key_head_dim"])
    w.add_ssm_group_count(t["linear_num_key_heads"])
    w.add_ssm_time_step_rank(t["linear_num_value_heads"])
    w.add_ssm_inner_size(t["linear_num_value_heads"] * t["linear_value_head_dim"])
    w.add_full_attention_interval(t["full_attention_interval"])
    if moe:
        w.add_expert_count(t["num_experts"])
        w.add_expert_used_count(t["num_experts_per_tok"])
        w.add_expert_feed_forward_length(t["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(t["shared_expert_intermediate_size"])
    if tokenizer_dir is not None:
        write_tokenizer_metadata(w, tokenizer_dir)
    for k, v in (extra or {}).items():
        w.add_string(k, v)
    params = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    for gname, (pname, kind) in tensor_map(cfg).items():
        if gname in skip:
            continue
        arr = inverse_transform(kind, params[pname].astype(np.float32), cfg)
        q = qtype(gname, arr)
        block = {Q.Q4_K: 256, Q.Q6_K: 256, Q.F16: 1, Q.F32: 1}.get(q, 32)
        if arr.shape[-1] % block:
            q = Q.F32  # as llama.cpp does for tensors whose rows do not fill a block
        if arr.ndim == 1 or q == Q.F32:
            w.add_tensor(gname, arr.astype(np.float32))
        elif q == Q.F16:
            w.add_tensor(gname, arr.astype(np.float16))
        elif q == Q.Q4_K:
            w.add_tensor(gname, encode_q4_k(arr.reshape(-1, arr.shape[-1])).reshape(*arr.shape[:-1], -1),
                         raw_dtype=Q.Q4_K)
        elif q == Q.Q6_K:
            w.add_tensor(gname, encode_q6_k(arr.reshape(-1, arr.shape[-1])).reshape(*arr.shape[:-1], -1),
                         raw_dtype=Q.Q6_K)
        else:
            w.add_tensor(gname, quantize(arr, q), raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def write_tokenizer_metadata(w, tokenizer_dir):
    """tokenizer.ggml.* from an HF tokenizer.json (byte-level BPE), as llama.cpp writes them."""
    tj = json.loads((Path(tokenizer_dir) / "tokenizer.json").read_text())
    tc = json.loads((Path(tokenizer_dir) / "tokenizer_config.json").read_text())
    vocab = tj["model"]["vocab"]
    tokens = [None] * len(vocab)
    for tok, i in vocab.items():
        tokens[i] = tok
    special = {a["content"] for a in tj.get("added_tokens", []) if a.get("special")}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_eos_token_id(vocab[tc["eos_token"]])
    if tc.get("chat_template"):
        w.add_chat_template(tc["chat_template"])


def write_draft_gguf(draft, dcfg, path, qtype=Q.F16, arch="dflash-draft"):
    """A DFlash draft GGUF with the names llama.cpp-style draft converters use."""
    from mlx_dflash.loading.gguf import _DRAFT_GLOBAL, _DRAFT_LAYER

    w = GGUFWriter(str(path), arch)
    w.add_block_count(dcfg["num_hidden_layers"])
    w.add_embedding_length(dcfg["hidden_size"])
    w.add_feed_forward_length(dcfg["intermediate_size"])
    w.add_head_count(dcfg["num_attention_heads"])
    w.add_head_count_kv(dcfg["num_key_value_heads"])
    w.add_key_length(dcfg["head_dim"])
    w.add_layer_norm_rms_eps(dcfg["rms_norm_eps"])
    w.add_rope_freq_base(dcfg["rope_theta"])
    w.add_uint32(f"{arch}.dflash.block_size", dcfg["block_size"])
    w.add_array(f"{arch}.dflash.target_layer_ids", dcfg["dflash_config"]["target_layer_ids"])
    w.add_uint32(f"{arch}.dflash.mask_token_id", dcfg["dflash_config"]["mask_token_id"])
    params = {k: np.array(v.astype(__import__("mlx.core").core.float32)) for k, v in tree_flatten(draft.parameters())}
    names = {k: v[0] for k, v in _DRAFT_GLOBAL.items()}
    for i in range(dcfg["num_hidden_layers"]):
        for ours, theirs in _DRAFT_LAYER.items():
            names[f"layers.{i}.{ours}"] = f"blk.{i}.{theirs[0]}"
    for ours, theirs in names.items():
        arr = params[ours]
        if arr.ndim == 1 or qtype == Q.F32:
            w.add_tensor(theirs, arr.astype(np.float32))
        elif qtype == Q.F16:
            w.add_tensor(theirs, arr.astype(np.float16))
        else:
            w.add_tensor(theirs, quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
