"""GGUF (llama.cpp) targets ``qwen35`` / ``qwen35moe`` and DFlash drafts.

Tensors are read one at a time (``mx.load`` mis-decodes K-quants and drops
tensors after MXFP4). Quantized ones are rebuilt from their raw blocks as
MLX affine codes in groups of 32 that hold the file's values exactly where
such a form exists (Q8_0, Q4_0/1, Q5_0/1, Q4_K, Q5_K, Q3_K, IQ4_*; MXFP4 and
NVFP4 as MLX's own mxfp4 / nvfp4 modes),
else in the nearest 8-bit form (Q6_K, Q2_K, IQ1-3); float tensors stay
float; ``keep_precision`` stores every tensor as float, a ``bits`` map
requantizes a source type. At most one decoded tensor is alive beyond the
final weights.

llama.cpp's converter (``convert_hf_to_gguf.py``, the Qwen3.5 text classes)
changes the Hugging Face tensors in ways undone here (docs/gguf.md):

- ``A_log`` is stored as ``ssm_a = -exp(A_log)``; ``dt_bias`` as ``ssm_dt.bias``;
- conv1d ``[C, 1, K]`` is squeezed to ``[C, K]``;
- every ``*norm.weight`` except the DeltaNet output norm (``ssm_norm``) is
  stored as ``1 + w`` (the form MLX-format folders use too);
- when there are more value heads than key heads (Hv = r * Hk), every
  per-value-head tensor (v rows of ``attn_qkv``, v channels of
  ``ssm_conv1d``, rows of ``attn_gate``, ``ssm_alpha``, ``ssm_beta``,
  ``ssm_a``, ``ssm_dt``, input columns of ``ssm_out``) is moved from grouped
  order (value head ``k * r + j`` belongs to key head ``k``) to tiled order
  (position ``j * Hk + k``);
- MoE experts are stacked into ``[E, out, in]`` tensors (``ffn_{gate,up,down}_exps``,
  or ``ffn_gate_up_exps`` with gate rows first when fused);
- multi-token-prediction layers (``mtp.*``) are appended as extra blocks,
  counted in ``block_count`` and named in ``nextn_predict_layers``.
  DFlash does not use them: they are checked and skipped.
"""

import atexit
import json
import math
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import DFlashError, UnreadableFile

ARCHS = {"qwen35": "qwen3_5", "qwen35moe": "qwen3_5_moe"}

# ``tokenizer.ggml.pre`` -> split rule -> regexes, after llama.cpp's
# src/llama-vocab.cpp (the name -> LLAMA_VOCAB_PRE_TYPE_* chain, then the
# type -> regex list switch). A rule's regexes apply in turn, each cutting every
# piece into its matches and the text between them (a Split "isolated" each).
# Listed: every name whose type uses one of the rules below; other types
# (llama3, deepseek, gpt-4o, ...) have rules not written here.
PRE_SPLITS = {
    # GPT-2's pattern. HF's ByteLevel regex adds a final "|\s+"; it changes no
    # split, since any whitespace this one leaves unmatched stays a piece anyway.
    "gpt2": (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",),
    # Qwen2's and Qwen3.5's tokenizer.json patterns (llama.cpp spells the
    # case-insensitive contractions out); qwen35 keeps combining marks (\p{M})
    # with letters, so Devanagari vowel signs stay in their word.
    "qwen2": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "qwen35": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    # llama.cpp's fallback for a BPE vocabulary: punctuation runs, GPT-2's
    # pattern, digit runs, then digits in threes.
    "default": (
        r"[\p{P}\$\+<=>\^~\|]+",
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
        r"\p{N}+",
        r"[0-9][0-9][0-9]",
    ),
}
# llama.cpp normalizes no BPE text; Qwen2's and Qwen3.5's tokenizer.json
# declare NFC (GPT-2's declares nothing), so their names (and DeepSeek's
# R1 distills of Qwen, which keep Qwen's tokenizer) add it. Keyed by name,
# not by split: the others that share Qwen2's split (StableLM2, Hunyuan,
# Grok-2, ...) are not Qwen's tokenizer and get none, as in llama.cpp.
NFC_NAMES = {"qwen2", "qwen35", "deepseek-r1-qwen"}
PRE_TOKENIZERS = {
    **dict.fromkeys(
        (
            "gpt-2",
            "phi-2",
            "jina-es",
            "jina-de",
            "gigachat",
            "jina-v2-es",
            "jina-v2-de",
            "a.x-4.0",
            "mellum",
            "modern-bert",
            "jina-v1-en",
            "jina-v2-code",
            "roberta-bpe",
            "exaone4",
            # types of their own that use GPT-2's regex
            "mpt",
            "olmo",
            "jais",
            "trillion",
            "granite-docling",
        ),
        "gpt2",
    ),
    **dict.fromkeys(
        (
            "qwen2",
            "deepseek-r1-qwen",
            "kormo",
            "f2llmv2",
            "megrez",
            # types of their own that use Qwen2's regex
            "stablelm2",
            "hunyuan",
            "solar-open",
            "grok-2",
        ),
        "qwen2",
    ),
    "qwen35": "qwen35",
    "default": "default",  # also what llama.cpp uses when the key is missing
}
# "gpt2" is the tokenizer *model* name; llama.cpp refuses it as a pre name and
# no converter writes it, so it is not listed.
# llama.cpp's end-of-generation set (llama-vocab.cpp, ``special_eog_ids``):
# the fill-in-the-middle pad, repo and file-separator tokens (by their key,
# else by text), the tokens below by text, and the eos/eot/eom ids the
# metadata names (an eot missing from it is found by text first).
EOG_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
)
EOT_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<end_of_utterance>",
)
FIM_EOG_TEXTS = {  # key suffix -> the texts llama.cpp recognises it by when the key is absent
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}


def is_gguf(path) -> bool:
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == b"GGUF"


# A part of a split GGUF, named as llama.cpp's gguf-split and gguf-py's writer name them.
SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def split_parts(name: str) -> Optional[List[str]]:
    """Every part's name, first to last, of the split GGUF whose part is
    named ``name`` (a file name or a path in a repo); None for another name."""
    m = SPLIT_NAME.match(name)
    if m is None:
        return None
    n = int(m["count"])
    return [f"{m['prefix']}-{i + 1:05d}-of-{n:05d}.gguf" for i in range(n)]


class SplitGGUF:
    """The parts of a split GGUF read as one file: the metadata is the first
    part's (the others hold only the split keys), the tensors are every
    part's, in part order, as llama.cpp loads them."""

    def __init__(self, readers, files: List[Path]):
        self.parts, self.files = readers, files
        self.fields = readers[0].fields
        self.tensors = [t for r in readers for t in r.tensors]

    def get_field(self, key: str):
        return self.parts[0].get_field(key)


def _read_one(p: Path):
    from gguf import GGUFReader

    if not p.exists():
        raise DFlashError(f"model path does not exist: {p}")
    if p.is_dir():
        raise DFlashError(f"{p} is a folder, not a GGUF file")
    try:
        reader = GGUFReader(str(p))
    except Exception as e:  # truncated / corrupt / unknown enum values
        raise DFlashError(f"cannot read GGUF file {p} (truncated or corrupt?): {type(e).__name__}: {e}") from None
    if reader.byte_order == "S":  # gguf-py swaps the header, not the quantized blocks' scales: NaN weights
        raise DFlashError(
            f"{p} is a GGUF of the other byte order (big-endian); llama.cpp refuses it too: "
            f"convert it with `gguf-convert-endian {p.name} little`"
        )
    return reader


def open_gguf(path):
    """A GGUF file's reader; for any part of a split GGUF (``split.count`` > 1),
    a :class:`SplitGGUF` of all its parts, found beside it by their names."""
    p = Path(path).expanduser()
    reader = _read_one(p)
    count = int(field(reader, "split.count", 1))
    if count <= 1:
        return reader
    no = int(field(reader, "split.no", 0))
    names = split_parts(p.name)
    if names is None or len(names) != count:
        raise DFlashError(
            f"{p} is part {no + 1} of a split GGUF of {count} parts, but its name is not llama.cpp's "
            f"PREFIX-{no + 1:05d}-of-{count:05d}.gguf, so the other parts cannot be found: rename the parts "
            "as gguf-split names them"
        )
    files = [p.with_name(n) for n in names]
    missing = [f.name for f in files if not f.exists()]
    if missing:
        raise DFlashError(f"split GGUF {files[0]}: missing part(s) {', '.join(missing)} (expected beside {p.name})")
    readers = [reader if i == no else _read_one(f) for i, f in enumerate(files)]
    for i, (r, f) in enumerate(zip(readers, files)):
        if int(field(r, "split.no", -1)) != i or int(field(r, "split.count", 0)) != count:
            raise DFlashError(
                f"split GGUF: {f.name} says it is part {int(field(r, 'split.no', -1)) + 1} of "
                f"{field(r, 'split.count')}, not part {i + 1} of {count} (parts of different files mixed?)"
            )
    want = field(readers[0], "split.tensors.count")
    for r, f in zip(readers[1:], files[1:]):
        if field(r, "split.tensors.count") != want:
            raise DFlashError(
                f"split GGUF: {f.name} belongs to a split of {field(r, 'split.tensors.count')} tensors, "
                f"{files[0].name} to one of {want} (parts of different files mixed?)"
            )
    split = SplitGGUF(readers, files)
    if want is not None and int(want) != len(split.tensors):
        raise DFlashError(
            f"split GGUF {files[0]}: the parts hold {len(split.tensors)} tensors, the first part says {want}"
        )
    seen: Dict[str, str] = {}
    for r, f in zip(readers, files):
        for t in r.tensors:
            if t.name in seen:
                raise DFlashError(f"split GGUF: tensor {t.name} is in both {seen[t.name]} and {f.name}")
            seen[t.name] = f.name
    return split


def gguf_files(reader, path) -> List[Path]:
    """The files ``reader`` (from :func:`open_gguf` of ``path``) reads."""
    return list(getattr(reader, "files", [Path(path).expanduser()]))


def gguf_sizes(path) -> Dict[str, int]:
    """Tensor name -> bytes in the file (from its header, no data read)."""
    return {t.name: int(t.n_bytes) for t in open_gguf(path).tensors}


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


def eog_token_ids(reader) -> List[int]:
    """Every id generation stops on, as llama.cpp builds its end-of-generation
    set (see ``EOG_TEXTS``), with its two exceptions: ``<|end|>`` is not one
    where ``<|return|>`` and ``<|call|>`` (or ``<|calls|>`` and
    ``<|flush|>``) are, nor ``</s>`` where ``<|tool_response>`` is."""
    tokens = list(field(reader, "tokenizer.ggml.tokens") or [])
    by_text = {t: i for i, t in enumerate(tokens) if isinstance(t, str)}

    def named(key, texts=()):
        i = field(reader, f"tokenizer.ggml.{key}_token_id")
        if i is not None and 0 <= int(i) < len(tokens):
            return int(i)
        return next((by_text[t] for t in texts if t in by_text), None)

    ids = [named(key, texts) for key, texts in FIM_EOG_TEXTS.items()]
    ids += [by_text[t] for t in EOG_TEXTS if t in by_text]
    ids += [named("eos"), named("eot", EOT_TEXTS), named("eom", ("<|eom_id|>",))]
    eog = list(dict.fromkeys(i for i in ids if i is not None))
    texts = {tokens[i] for i in eog}
    calls = "<|call|>" in texts or "<|calls|>" in texts
    if calls and ("<|return|>" in texts or "<|flush|>" in texts):
        eog = [i for i in eog if tokens[i] != "<|end|>"]
    if "<|tool_response>" in texts:
        eog = [i for i in eog if tokens[i] != "</s>"]
    return eog


def gguf_config(reader) -> dict:
    """An HF-style config.json dict from the GGUF metadata (one DFlashError
    for a value of the wrong kind or out of range, naming its key)."""
    arch = field(reader, "general.architecture")
    if arch not in ARCHS:
        if is_gguf_draft(reader):
            raise DFlashError("this GGUF is a DFlash draft, not a target model: give it as the draft (--draft)")
        raise DFlashError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(ARCHS)} (Qwen3.5/3.6)")
    try:
        return _gguf_config(reader, arch)
    except (ValueError, TypeError, OverflowError) as e:  # a string where a count belongs, say
        raise DFlashError(f"GGUF {arch} metadata holds a value that is not usable: {e}") from None


def _count(reader, key: str, default=None) -> int:
    """A positive integer metadata value (per-layer arrays: the first non-zero)."""
    v = _first(_req(reader, key) if default is None else field(reader, key, default))
    try:
        n = int(v)
    except (TypeError, ValueError):
        raise DFlashError(f"GGUF metadata {key} must be a positive integer, got {v!r}") from None
    if n < 1:
        raise DFlashError(f"GGUF metadata {key} must be a positive integer, got {n}")
    return n


def _number(reader, key: str, default: float) -> float:
    """A positive finite number metadata value (one DFlashError naming ``key``)."""
    v = _first(field(reader, key, default))
    try:
        x = float(v)
    except (TypeError, ValueError):
        raise DFlashError(f"GGUF metadata {key} must be a positive number, got {v!r}") from None
    if not math.isfinite(x) or x <= 0:
        raise DFlashError(f"GGUF metadata {key} must be a positive number, got {v!r}")
    return x


def _rope(reader, a: str, D: int, rope_dims: int) -> dict:
    """rope_parameters as the HF config has them: theta (llama.cpp's default
    10000 when the key is missing) and the scaling llama.cpp's converter
    writes for a rope_scaling config (linear or YaRN)."""
    rp = {
        "rope_type": "default",
        "rope_theta": _number(reader, f"{a}.rope.freq_base", 10000.0),
        "partial_rotary_factor": rope_dims / D,
    }
    kind = field(reader, f"{a}.rope.scaling.type")
    if kind in (None, "", "none"):
        return rp
    if kind not in ("linear", "yarn"):
        raise DFlashError(f"GGUF {a}.rope.scaling.type {kind!r} is not supported (none, linear, yarn)")
    _req(reader, f"{a}.rope.scaling.factor")
    rp.update(rope_type=kind, factor=_number(reader, f"{a}.rope.scaling.factor", None))
    if field(reader, f"{a}.rope.scaling.original_context_length"):
        rp["original_max_position_embeddings"] = _count(reader, f"{a}.rope.scaling.original_context_length")
    for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        if field(reader, f"{a}.rope.scaling.{key}") is not None:
            rp[name] = _number(reader, f"{a}.rope.scaling.{key}", None)
    return rp


def _gguf_config(reader, arch: str) -> dict:
    a = arch
    tensors = {t.name: t for t in reader.tensors}
    H = _count(reader, f"{a}.embedding_length")
    n_blocks = _count(reader, f"{a}.block_count")
    n_mtp = field(reader, f"{a}.nextn_predict_layers", 0) or 0
    if isinstance(n_mtp, bool) or not isinstance(n_mtp, int):
        raise DFlashError(f"GGUF metadata {a}.nextn_predict_layers must be an integer, got {n_mtp!r}")
    if not 0 <= n_mtp < n_blocks:
        raise DFlashError(f"GGUF {a}.nextn_predict_layers = {n_mtp} does not fit block_count {n_blocks}")
    n_layers = n_blocks - n_mtp  # the MTP blocks come last
    nh = _count(reader, f"{a}.attention.head_count")
    nkv = _count(reader, f"{a}.attention.head_count_kv")
    D = _count(reader, f"{a}.attention.key_length", H // nh)
    rope_dims = _count(reader, f"{a}.rope.dimension_count", max(D // 4, 1))
    Hk = _count(reader, f"{a}.ssm.group_count")
    Hv = _count(reader, f"{a}.ssm.time_step_rank")
    if Hv % Hk:
        raise DFlashError(f"GGUF {a}.ssm.time_step_rank {Hv} is not a multiple of ssm.group_count {Hk}")
    inner = _count(reader, f"{a}.ssm.inner_size")
    Dk = _count(reader, f"{a}.ssm.state_size")
    tokens = field(reader, "tokenizer.ggml.tokens")
    vocab = int(tensors["token_embd.weight"].shape[-1]) if "token_embd.weight" in tensors else len(tokens or [])
    interval = _count(reader, f"{a}.full_attention_interval", 4)
    ffn = field(reader, f"{a}.feed_forward_length")
    if not ffn and "blk.0.ffn_up.weight" in tensors:  # a dense file without the key: the tensor says it
        ffn = int(tensors["blk.0.ffn_up.weight"].shape[-1])
    text = {
        "model_type": ARCHS[arch] + "_text",
        "hidden_size": H,
        "num_hidden_layers": n_layers,
        "num_attention_heads": nh,
        "num_key_value_heads": nkv,
        "head_dim": D,
        "intermediate_size": int(_first(ffn) or 0),
        "vocab_size": vocab,
        "rms_norm_eps": _number(reader, f"{a}.attention.layer_norm_rms_epsilon", 1e-6),
        "max_position_embeddings": _count(reader, f"{a}.context_length", 262144),
        "full_attention_interval": interval,
        "linear_conv_kernel_dim": _count(reader, f"{a}.ssm.conv_kernel", 4),
        "linear_key_head_dim": Dk,
        "linear_value_head_dim": inner // Hv,
        "linear_num_key_heads": Hk,
        "linear_num_value_heads": Hv,
        "tie_word_embeddings": "output.weight" not in tensors,
        "rope_parameters": _rope(reader, a, D, rope_dims),
    }
    if n_mtp:
        text["mtp_num_hidden_layers"] = n_mtp  # as in the HF config; skipped at load, like mlx-lm does
    if arch == "qwen35moe":
        text.update(
            num_experts=_count(reader, f"{a}.expert_count"),
            num_experts_per_tok=_count(reader, f"{a}.expert_used_count"),
            moe_intermediate_size=_count(reader, f"{a}.expert_feed_forward_length"),
            shared_expert_intermediate_size=int(field(reader, f"{a}.expert_shared_feed_forward_length", 0) or 0),
            norm_topk_prob=True,
        )
    cfg = {"model_type": ARCHS[arch], "text_config": text, "tie_word_embeddings": text["tie_word_embeddings"]}
    eog = eog_token_ids(reader)
    if eog:
        cfg["eos_token_id"] = text["eos_token_id"] = eog if len(eog) > 1 else eog[0]
    return cfg


# --- tensor names and layout ----------------------------------------------------------


def _attention_layer_names(b: str, p: str, moe: bool) -> Dict[str, Tuple[str, str]]:
    a = p + "self_attn."
    m = {
        b + "attn_norm.weight": (p + "input_layernorm.weight", ""),
        b + "post_attention_norm.weight": (p + "post_attention_layernorm.weight", ""),
    }
    for g, n in (
        ("attn_q", "q_proj"),
        ("attn_k", "k_proj"),
        ("attn_v", "v_proj"),
        ("attn_output", "o_proj"),
        ("attn_q_norm", "q_norm"),
        ("attn_k_norm", "k_norm"),
    ):
        m[b + g + ".weight"] = (a + n + ".weight", "")
    m.update(_ffn_names(b, p, moe))
    return m


def _ffn_names(b: str, p: str, moe: bool) -> Dict[str, Tuple[str, str]]:
    f = p + "mlp."
    m = {}
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


def tensor_map(cfg: dict) -> Dict[str, Tuple[str, str]]:
    """GGUF tensor name -> (MLX parameter path, transform kind), main layers only."""
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
        if (i + 1) % t["full_attention_interval"] == 0:
            m.update(_attention_layer_names(b, p, moe))
            continue
        a = p + "linear_attn."
        m[b + "attn_norm.weight"] = (p + "input_layernorm.weight", "")
        m[b + "post_attention_norm.weight"] = (p + "post_attention_layernorm.weight", "")
        m[b + "attn_qkv.weight"] = (a + "in_proj_qkv.weight", "qkv_rows")
        m[b + "attn_gate.weight"] = (a + "in_proj_z.weight", "head_rows")
        m[b + "ssm_beta.weight"] = (a + "in_proj_b.weight", "head_rows")
        m[b + "ssm_alpha.weight"] = (a + "in_proj_a.weight", "head_rows")
        m[b + "ssm_a"] = (a + "A_log", "a_log")
        m[b + "ssm_dt.bias"] = (a + "dt_bias", "head_rows")
        m[b + "ssm_conv1d.weight"] = (a + "conv1d.weight", "conv")
        m[b + "ssm_norm.weight"] = (a + "norm.weight", "")
        m[b + "ssm_out.weight"] = (a + "out_proj.weight", "head_cols")
        m.update(_ffn_names(b, p, moe))
    return m


def _fuse_gate_up(names: Dict[str, Tuple[str, str]], tensors) -> Dict[str, Tuple[str, str]]:
    """Files converted with --fuse-gate-up-exps hold one ``ffn_gate_up_exps`` per layer."""
    out = {}
    for g, v in names.items():
        if g.endswith("ffn_gate_exps.weight"):
            fused = g.replace("ffn_gate_exps", "ffn_gate_up_exps")
            if fused in tensors:
                out[fused] = (v[0].replace("gate_proj.weight", "gate_up_proj"), "gate_up")
                continue
        if g.endswith("ffn_up_exps.weight") and g.replace("ffn_up_exps", "ffn_gate_up_exps") in tensors:
            continue
        out[g] = v
    return out


def mtp_tensor_names(cfg: dict, n_mtp: int) -> Tuple[Dict[int, List[str]], Tuple[str, ...]]:
    """Per MTP block: the tensor names the converter writes (required), and optional ones."""
    t = cfg["text_config"]
    moe = bool(t.get("num_experts"))
    req = {}
    for j in range(t["num_hidden_layers"], t["num_hidden_layers"] + n_mtp):
        b = f"blk.{j}."
        names = list(_attention_layer_names(b, "", moe))
        names += [b + f"nextn.{n}.weight" for n in ("eh_proj", "enorm", "hnorm", "shared_head_norm")]
        req[j] = names
    return req, ("nextn.embed_tokens.weight", "nextn.shared_head_head.weight")


def _check_mtp(path, cfg: dict, tensors) -> List[str]:
    """The MTP blocks' tensor names, after checking that each block is complete."""
    n_mtp = int(cfg["text_config"].get("mtp_num_hidden_layers", 0))
    req, optional = mtp_tensor_names(cfg, n_mtp)
    names = []
    for j, want in req.items():
        fused = f"blk.{j}.ffn_gate_up_exps.weight"
        split = ("ffn_gate_exps.weight", "ffn_up_exps.weight")
        missing = [n for n in want if n not in tensors and not (fused in tensors and n.endswith(split))]
        if missing:
            raise DFlashError(
                f"GGUF {path}: MTP block blk.{j} (counted in nextn_predict_layers = {n_mtp}) is missing "
                f"{missing[:4]}: a truncated or incompletely converted MTP layer"
            )
        block = [n for n in tensors if n.startswith(f"blk.{j}.")]
        allowed = set(want) | {f"blk.{j}.{o}" for o in optional} | {fused}
        unknown = [n for n in block if n not in allowed]
        if unknown:
            raise DFlashError(f"GGUF {path}: unknown tensors {unknown[:4]} in MTP block blk.{j}")
        names += block
    return names


def tiled_to_grouped(Hk: int, Hv: int) -> np.ndarray:
    """idx such that grouped[h] = tiled[idx[h]]: grouped head h = k * r + j
    (value head j of key head k) sits at tiled position j * Hk + k."""
    r = Hv // Hk
    h = np.arange(Hv)
    return (h % r) * Hk + h // r


def _heads(x: np.ndarray, idx: np.ndarray, axis: int) -> np.ndarray:
    Hv = len(idx)
    shape = x.shape
    x = x.reshape(shape[:axis] + (Hv, shape[axis] // Hv) + shape[axis + 1 :])
    return np.take(x, idx, axis=axis).reshape(shape)


def transform(kind: str, w: np.ndarray, cfg: dict) -> np.ndarray:
    """GGUF layout (numpy order, as ``dequantize`` returns it) -> MLX layout."""
    t = cfg["text_config"]
    Hk, Hv = t["linear_num_key_heads"], t["linear_num_value_heads"]
    idx = tiled_to_grouped(Hk, Hv)
    key_dim = Hk * t["linear_key_head_dim"]
    if kind == "":
        return w
    if kind == "row":
        return w.reshape(1, -1)
    if kind == "a_log":  # ssm_a = -exp(A_log), in tiled order
        return np.log(-_heads(w.reshape(-1), idx, 0))
    if kind == "head_rows":  # rows grouped per value head (one row each for alpha, beta, dt)
        return _heads(w, idx, 0)
    if kind == "qkv_rows":  # q and k rows are per key head: only the v rows move
        return np.concatenate([w[: 2 * key_dim], _heads(w[2 * key_dim :], idx, 0)], axis=0)
    if kind == "conv":  # [C, K] -> [C, K, 1]; v channels move like the v rows
        w = w.reshape(w.shape[0], -1)
        w = np.concatenate([w[: 2 * key_dim], _heads(w[2 * key_dim :], idx, 0)], axis=0)
        return w[:, :, None]
    if kind == "head_cols":
        return _heads(w, idx, 1)
    if kind == "gate_up":  # [E, 2 * ff, H], gate rows first -> two [E, ff, H]
        return w
    raise ValueError(kind)


# --- quantized tensors as the file holds them ----------------------------------------
#
# Each GGUF block type is rebuilt, from the raw blocks, as MLX affine codes
# w = scale * k + bias per group of 32 (docs/gguf.md, "Quantized weights"):
# exactly where such a form exists, else as the nearest 8-bit form.

GROUP = 32  # every GGUF block and K-quant sub-block pair covers 32 values of a row (NVFP4: 16 per scale)
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
FP16_SCALED = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")  # the file's fp16 d (and m) are the MLX scales
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int32)
_NATIVE_BITS = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q4_K": 4, "Q5_K": 5, "MXFP4": 4, "NVFP4": 4}
FP4_MODES = {"MXFP4": "mxfp4", "NVFP4": "nvfp4"}  # MLX's own modes: the file's scales and e2m1 codes as they are


def group_of(type_name: str) -> int:
    """Values per scale of a type's MLX form: 16 for NVFP4 (a scale per 16), else 32."""
    return 16 if type_name == "NVFP4" else GROUP


def default_bits(type_name: str) -> Optional[int]:
    """MLX bits of a GGUF type's own form: None = float; 8 for types with no
    exact affine form of fewer bits (Q6_K, Q3_K, Q2_K, IQ*, ...)."""
    if type_name in FLOAT_TYPES:
        return None
    return _NATIVE_BITS.get(type_name, 8)


def mlx_form(type_name: str) -> str:
    """How a GGUF type loads, in words (for ``info``)."""
    b = default_bits(type_name)
    if b is None:
        return "float"
    if type_name in FP4_MODES:
        return f"{FP4_MODES[type_name]}/{group_of(type_name)}, exact"
    if type_name in FP16_SCALED:
        return f"{b}-bit/32, exact"
    if type_name in _NATIVE_BITS or type_name in ("Q3_K", "IQ4_NL", "IQ4_XS"):
        return f"{b}-bit/32, exact with float32 scales"
    return f"{b}-bit/32 float32 scales, nearest (not exact)"


def _f16(b: np.ndarray) -> np.ndarray:
    """Little-endian fp16 fields (2 bytes per row) -> float32 [n, 1]."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml's 4-bit runs: each run of bytes holds values [0, n) in low nibbles, [n, 2n) in high."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _k_scales(s: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes -> eight 6-bit scales and eight 6-bit mins."""
    a, b, c = s[:, 0:4].astype(np.int32), s[:, 4:8].astype(np.int32), s[:, 8:12].astype(np.int32)
    sc = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=1)
    m = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=1)
    return sc, m


def _lattice(v: np.ndarray, d: np.ndarray, unit: Optional[np.ndarray] = None):
    """Values d * v (v integer per element, d per row of ``v``) as 8-bit
    groups of 32: exact where a group's values lie on a grid of at most 256
    steps of d * t; else on a grid of step d * ``unit`` (per group) that holds
    the values of the group's coarser sub-block exactly, or else on 255 equal
    steps between the group's exact ends."""
    g = v.reshape(-1, GROUP).astype(np.int64)
    dd = np.repeat(d.reshape(-1), v.shape[1] // GROUP).astype(np.float64)
    lo, hi = g.min(1), g.max(1)
    diff = g - lo[:, None]
    t = np.gcd.reduce(diff, axis=1)
    t = np.where(t == 0, 1, t)
    exact = (hi - lo) // t <= 255
    step = np.where(exact, t, np.maximum(hi - lo, 1) / 255.0)
    origin = lo.astype(np.float64)
    if unit is not None:
        u = np.maximum(unit.reshape(-1), 1e-9)
        o = np.floor(lo / u) * u
        fits = ~exact & ((hi - o) / u <= 255.5)
        step, origin = np.where(fits, u, step), np.where(fits, o, origin)
    k = np.clip(np.rint((g - origin[:, None]) / step[:, None]), 0, 255)
    return k.astype(np.uint8), (dd * step).astype(np.float32), (dd * origin).astype(np.float32)


def _codes(t) -> Tuple[np.ndarray, np.ndarray, np.ndarray, str]:
    """A quantized GGUF tensor -> (codes uint8 [..., n], scales [..., n / 32],
    biases [..., n / 32] (float32; None for mxfp4), mode), in numpy order."""
    from gguf.constants import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[t.tensor_type]
    raw = np.asarray(t.data).view(np.uint8)
    rows, n = raw.shape[:-1], int(t.shape[0])  # ggml's ne0: the row length
    blk = raw.reshape(-1, size)
    step = max(1, (1 << 22) // block)  # blocks per slice: bounded temporaries on large tensors
    parts = [_decode_blocks(t.tensor_type, blk[i : i + step]) for i in range(0, len(blk), step)]
    k, s = (np.concatenate([p[j] for p in parts]) for j in (0, 1))
    z = None if parts[0][2] is None else np.concatenate([p[2] for p in parts])
    s = s.reshape(rows + (n // group_of(t.tensor_type.name),))
    return k.reshape(rows + (n,)), s, (None if z is None else z.reshape(s.shape)), parts[0][3]


def _decode_blocks(qtype, blk: np.ndarray):
    """Raw blocks [nb, bytes] of one type -> flat (codes, scales, biases, mode)."""
    name = qtype.name

    def out(k, s, z, mode="affine"):
        return k.reshape(-1), s.reshape(-1), (None if z is None else z.reshape(-1)), mode

    if name == "Q8_0":
        d = _f16(blk[:, :2])
        return out((blk[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8), d, -128 * d)
    if name in ("Q4_0", "Q4_1"):
        d = _f16(blk[:, :2])
        z = -8 * d if name == "Q4_0" else _f16(blk[:, 2:4])
        return out(_nibbles(blk[:, 2 if name == "Q4_0" else 4 :]), d, z)
    if name in ("Q5_0", "Q5_1"):
        o = 2 if name == "Q5_0" else 4
        d = _f16(blk[:, :2])
        z = -16 * d if name == "Q5_0" else _f16(blk[:, 2:4])
        high = np.unpackbits(blk[:, o : o + 4], axis=1, bitorder="little")
        return out(_nibbles(blk[:, o + 4 :]) | (high << 4), d, z)
    if name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(blk[:, :2]), _f16(blk[:, 2:4])
        sc, m = _k_scales(blk[:, 4:16])
        qs = blk[:, 16:144] if name == "Q4_K" else blk[:, 48:176]
        k = _nibbles(qs.reshape(-1, 4, 32)).reshape(-1, 8, 32)  # sub-blocks 2i, 2i+1 share 32 bytes
        if name == "Q5_K":  # bit j of byte i: value i of sub-block j
            k = k | (((blk[:, 16:48, None] >> np.arange(8, dtype=np.uint8)) & 1).transpose(0, 2, 1) << 4)
        # products of an fp16 and a 6-bit integer: exact in float32, not in half types
        return out(k, (d * sc).astype(np.float32), (-dmin * m).astype(np.float32))
    if name in ("Q6_K", "Q3_K", "IQ4_NL", "IQ4_XS"):
        if name == "Q6_K":  # 16 sub-blocks of 16, int8 scales: v = sc * (q - 32)
            ql, qh = blk[:, :128].reshape(-1, 2, 64), blk[:, 128:192].reshape(-1, 2, 1, 32)
            lo = _nibbles(ql).reshape(-1, 2, 4, 32)
            hi = (qh >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)) & 3
            q = (lo | (hi << 4)).reshape(-1, 16, 16).astype(np.int32) - 32
            sc = blk[:, 192:208].view(np.int8).astype(np.int32)
            v, d = q * sc[:, :, None], _f16(blk[:, 208:210])
            unit = np.abs(sc).reshape(-1, 8, 2).max(2) / 4.0  # the coarser sub-block of each pair, exact
            return out(*_lattice(v.reshape(len(blk), -1), d, unit))
        elif name == "Q3_K":  # 16 sub-blocks of 16, 6-bit scales: v = (sc - 32) * q, q in [-4, 3]
            ql = (blk[:, 32:96].reshape(-1, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)) & 3
            hm = (blk[:, None, :32] >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
            q = ql.reshape(-1, 256).astype(np.int32) - 4 * (1 - hm.reshape(-1, 256).astype(np.int32))
            s = blk[:, 96:108]
            low = _nibbles(s[:, :8])
            high = (s[:, None, 8:12] >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 4, 1)) & 3
            sc = (low | (high.reshape(-1, 16) << 4)).astype(np.int32) - 32
            v, d = q.reshape(-1, 16, 16) * sc[:, :, None], _f16(blk[:, 108:110])
        elif name == "IQ4_NL":  # a 16-entry integer codebook times fp16 d
            v, d = IQ4_VALUES[_nibbles(blk[:, 2:])], _f16(blk[:, :2])
        else:  # IQ4_XS: the codebook under 6-bit sub-block scales
            d = _f16(blk[:, :2])
            sh = np.ascontiguousarray(blk[:, 2:4]).view(np.uint16).astype(np.int32)
            sl = _nibbles(blk[:, 4:8]).reshape(-1, 2, 4).transpose(0, 2, 1).reshape(-1, 8).astype(np.int32)
            ls = (sl | (((sh >> (2 * np.arange(8))) & 3) << 4)) - 32
            v = IQ4_VALUES[_nibbles(blk[:, 8:].reshape(-1, 8, 16))] * ls[:, :, None]
        return out(*_lattice(v.reshape(len(blk), -1), d))
    if name == "MXFP4":  # e8m0 scale and e2m1 codes: MLX's mxfp4 as it is
        return out(_nibbles(blk[:, 1:]), blk[:, :1].copy(), None, "mxfp4")
    if name == "NVFP4":  # per 64 values four ue4m3 scales and 16-value runs of e2m1 codes: MLX's nvfp4
        x = blk[:, :4]
        if (x == 0xFF).any():  # ggml's encoder stops at 0x7E; 0xFF would read 480, past e4m3's largest
            raise ValueError("an NVFP4 scale byte of 0xFF (480) has no e4m3 form")
        # llama.cpp reads the byte unsigned (bit 7 ignored) and 0x7F as 0, where e4m3 has a sign and a NaN.
        s = np.where(x == 0x7F, 0, x & 0x7F).astype(np.uint8)
        return out(_nibbles(blk[:, 4:].reshape(-1, 4, 8)), s, None, "nvfp4")
    # Q2_K, IQ1-IQ3, TQ*: the exact decode, rounded to 8 bits per group of 32
    from gguf.quants import dequantize

    w = np.asarray(dequantize(blk, qtype), np.float32).reshape(-1, GROUP).astype(np.float64)
    lo, hi = w.min(1), w.max(1)
    step = np.where(hi > lo, (hi - lo) / 255.0, 1.0)
    k = np.rint((w - lo[:, None]) / step[:, None])
    return out(k.astype(np.uint8), step.astype(np.float32), lo.astype(np.float32))


def pack(k: np.ndarray, bits: int) -> np.ndarray:
    """Codes -> MLX's packing: a little-endian bit stream of ``bits``-bit
    values in uint32 words along the row."""
    shape = k.shape
    if bits in (2, 4, 8):  # whole values per byte: pack bytes, read them as words
        per = 8 // bits
        b = k.reshape(-1, per).astype(np.uint8)
        byte = b[:, 0].copy()
        for i in range(1, per):
            byte |= b[:, i] << np.uint8(bits * i)
        return byte.view(np.uint32).reshape(shape[:-1] + (shape[-1] * bits // 32,))
    flat = k.reshape(-1, GROUP)
    out = np.empty((len(flat), bits), np.uint32)
    for i in range(0, len(flat), 1 << 16):  # bounded temporaries
        c = flat[i : i + (1 << 16)]
        b = (c[:, :, None] >> np.arange(bits, dtype=np.uint8)) & 1
        out[i : i + len(c)] = np.packbits(b.reshape(len(c), -1), axis=1, bitorder="little").view(np.uint32)
    return out.reshape(shape[:-1] + (shape[-1] * bits // 32,))


def _group_size(in_dim: int) -> Optional[int]:
    for gs in (64, 32):
        if in_dim % gs == 0:
            return gs
    return None


def default_dtype(reader):
    """The model's float type: float32 when a quantized type's scales need it
    to be exact (K-quants, and the 8-bit forms of types without an exact one:
    quantized_matmul's output follows its scales); else as an mlx-lm
    conversion keeps it: the file's half type (BF16 or F16) when its matrices
    are stored as floats, float16 for Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/MXFP4 files
    (fp16 block scales), float32 for an all-F32 file."""
    from collections import Counter

    mats = [t.tensor_type.name for t in reader.tensors if len(t.shape) >= 2]
    if any(n not in FLOAT_TYPES + FP16_SCALED + tuple(FP4_MODES) for n in mats):
        return mx.float32
    halves = Counter(n for n in mats if n in ("F16", "BF16"))
    if halves:
        return mx.bfloat16 if halves.most_common(1)[0][0] == "BF16" else mx.float16
    if any(n not in ("F32", "F64") for n in mats):
        return mx.float16
    return mx.float32


def _progress_bar(files: List[Path], total_bytes: int):
    from tqdm import tqdm

    name = files[0].name + (f" (+{len(files) - 1} parts)" if len(files) > 1 else "")
    return tqdm(
        total=total_bytes,
        unit="B",
        unit_scale=True,
        desc=f"decoding {name}",
        leave=False,
        dynamic_ncols=True,
    )


def _as_file(t, kind: str, cfg: dict, pns: List[str], plan: dict, dt) -> list:
    """(parameter, array) updates for a tensor kept in the file's own form:
    codes, scales and biases moved like the weight's rows (or head columns),
    scales in the model's float type where that holds them exactly, else
    float32 (mxfp4's uint8 scales as they are)."""
    k, s, z, _ = _codes(t)
    k, s = transform(kind, k, cfg), transform(kind, s, cfg)
    z = None if z is None else transform(kind, z, cfg)
    sdt = None if z is None else mx.float32
    if z is not None and dt != mx.float32:
        if all(bool(mx.all(mx.array(a).astype(dt).astype(mx.float32) == mx.array(a))) for a in (s, z)):
            sdt = dt
    split = (lambda a: np.split(a, 2, axis=1)) if kind == "gate_up" else (lambda a: [a])
    updates = []
    for pn, kk, sc, zz in zip(pns, split(k), split(s), [None] * len(pns) if z is None else split(z)):
        base = pn.rsplit(".", 1)[0]
        sc = mx.array(sc) if zz is None else mx.array(sc).astype(sdt)
        updates += [(pn, mx.array(pack(kk, plan[pn][0]))), (base + ".scales", sc)]
        if zz is not None:
            updates.append((base + ".biases", mx.array(zz).astype(sdt)))
    return updates


def load_gguf_target(
    path,
    *,
    keep_precision: bool = False,
    bits: Optional[Dict[str, int]] = None,
    dtype=None,
    progress=None,
    only: Optional[Callable[[str], bool]] = None,
):
    """Load a GGUF target; returns (Target, config dict with an MLX ``quantization`` block).

    ``dtype`` (default :func:`default_dtype`) is the float type of unquantized
    weights, and of quantization scales where it holds them exactly (else
    they are float32); ``A_log`` stays float32 as in mlx-lm. ``bits`` maps a
    GGUF type to other MLX bits (requantized); ``keep_precision`` keeps floats.
    ``progress``: True for a tqdm bar on stderr, or a callable
    ``(tensors_done, tensors_total, bytes_done)``. MTP blocks are checked and skipped.
    ``only(parameter name)``: decode just those tensors (a pipeline stage's
    share); the other parameters stay lazy placeholders, never evaluated.
    """
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    from ..models.qwen35 import Target

    reader = open_gguf(path)
    cfg, tensors, names, mtp = check_gguf_target(reader, path)
    dt = dtype or default_dtype(reader)
    held = sorted({t.tensor_type.name for t in tensors.values()})
    absent = sorted(set(bits or ()) - set(held))
    if absent:
        raise DFlashError(
            f"GGUF {path} has no {', '.join(absent)} tensors to requantize (its types: {', '.join(held)})"
        )

    parts = _parts
    model_cls, args_cls = _get_classes(cfg)
    model = model_cls(args_cls.from_dict(json.loads(json.dumps(cfg))))  # lazy random init, never evaluated
    mods = dict(model.named_modules())
    t_cfg = cfg["text_config"]
    plan, qconf, native = {}, {}, {}
    asked, linear = set(), set()  # types of ``bits`` requantized as asked; types of linear weights
    for gname, (pname, kind) in names.items():
        tname = tensors[gname].tensor_type.name
        own = default_bits(tname)
        b = None if keep_precision else (bits or {}).get(tname, own)
        # the file's own form where asked for (the default), else requantized
        as_file = b is not None and b == own
        if as_file and kind == "head_cols" and t_cfg["linear_value_head_dim"] % group_of(tname):
            b = as_file = None  # the head reorder would split its column groups: exact as float
        native[gname] = bool(as_file)
        for pn in parts(pname, kind):
            mod_path = pn.rsplit(".", 1)[0]
            quantizable = pn.endswith(".weight") and hasattr(mods.get(mod_path), "to_quantized")
            if quantizable:
                linear.add(tname)
            gs = group_of(tname) if as_file else _group_size(int(tensors[gname].shape[0]))
            if b is not None and quantizable and gs is not None:
                mode = FP4_MODES.get(tname, "affine") if as_file else "affine"
                plan[pn] = (b, gs, mode)
                qconf[mod_path] = {"group_size": gs, "bits": b, **({"mode": mode} if mode != "affine" else {})}
                asked.add(tname)
    idle = sorted(set(bits or ()) - asked)
    if idle and not keep_precision:  # a --bits that would change nothing is a mistake, not a no-op
        t = idle[0]
        held_t = sorted(g for g in names if tensors[g].tensor_type.name == t)
        if not held_t:
            why = "tensors of the MTP blocks, which are skipped"
        elif t in linear:
            why = (
                "linear weights that cannot be stored so (rows that no group of 64 or 32 divides, "
                "or heads reordered across the groups)"
            )
        else:
            why = "norms, biases, convolutions or other tensors that are no linear layer's weight and stay float"
        shown = f" ({', '.join(held_t[:3])}{', ...' if len(held_t) > 3 else ''})" if held_t else ""
        raise DFlashError(
            f"GGUF {path}: --bits {t}={bits[t]} matches no layer that can be quantized: its {t} tensors{shown} "
            f"are {why} (the types of its linear weights: {', '.join(sorted(linear)) or 'none'})"
        )
    if plan:
        nn.quantize(model, class_predicate=lambda p, m: qconf.get(p, False))
    # The shapes the metadata gives every parameter (placeholders, never
    # evaluated): a tensor of another shape is a file whose metadata and
    # tensors disagree (llama.cpp refuses it), not one to load as it comes.
    shapes = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    total = len(names)
    bar = (
        _progress_bar(gguf_files(reader, path), sum(int(tensors[g].n_bytes) for g in names))
        if progress is True
        else None
    )
    done_bytes = 0
    try:
        for n, (gname, (pname, kind)) in enumerate(names.items(), 1):
            t = tensors[gname]
            if only is not None and not only(pname):
                continue
            pns = parts(pname, kind)
            updates = []
            if all(pn in plan for pn in pns) and native[gname]:
                try:
                    updates = _as_file(t, kind, cfg, pns, plan, dt)
                except (NotImplementedError, ValueError, KeyError) as e:
                    raise DFlashError(
                        f"GGUF {path}: cannot decode tensor {gname} of type {t.tensor_type.name}: {e}"
                    ) from None
            else:
                w = _decode(t, f"GGUF {path}")
                try:  # per-head reorders reshape by the metadata's head counts
                    w = transform(kind, np.asarray(w, dtype=np.float32), cfg)
                except ValueError as e:
                    raise DFlashError(
                        f"GGUF {path}: tensor {gname} of shape {list(w.shape)} does not fit the file's metadata "
                        f"({e}): metadata and tensors disagree (a head count, head size or state size?)"
                    ) from None
                arrs = np.split(w, 2, axis=1) if kind == "gate_up" else [w]
                del w
                for pn, x in zip(pns, arrs):
                    arr = mx.array(x)
                    if pn in plan:  # requantized as asked (--bits): from the float32 decode, scales then cast
                        b, gs, _ = plan[pn]
                        q, sc, z = mx.quantize(arr, group_size=gs, bits=b)
                        base = pn.rsplit(".", 1)[0]
                        updates += [(pn, q), (base + ".scales", sc.astype(dt)), (base + ".biases", z.astype(dt))]
                    else:  # mlx-lm keeps A_log in float32 (its cast_predicate) and casts the rest
                        updates.append((pn, arr.astype(mx.float32 if pn.endswith("A_log") else dt)))
                del arrs
            for pn, arr in updates:
                if pn in shapes and tuple(arr.shape) != shapes[pn]:
                    raise DFlashError(
                        f"GGUF {path}: tensor {gname} gives {pn} the shape {list(arr.shape)}, but the file's "
                        f"metadata makes it {list(shapes[pn])}: metadata and tensors disagree (a head count, "
                        "head size, state size, feed-forward or vocabulary size?)"
                    )
            model.load_weights(updates, strict=False)
            mx.eval([u for _, u in updates])
            del updates
            mx.clear_cache()  # return the decode's temporaries, so peak memory stays one tensor deep
            done_bytes += int(t.n_bytes)
            if bar is not None:
                bar.update(int(t.n_bytes))
            elif callable(progress):
                progress(n, total, done_bytes)
    finally:
        if bar is not None:
            bar.close()
    if mtp and progress is True:
        import sys

        nbytes = sum(int(tensors[g].n_bytes) for g in mtp)
        n_mtp = cfg["text_config"]["mtp_num_hidden_layers"]
        sys.stderr.write(
            f"note: skipped the GGUF's {n_mtp} MTP (nextn) block(s), {len(mtp)} tensors, "
            f"{nbytes / 1e6:.1f} MB: DFlash does not use them\n"
        )
    # Everything the model has must have come from the file.
    loaded_paths = {pn for pname, kind in names.values() for pn in parts(pname, kind)}
    for k, _ in tree_flatten(model.parameters()):
        base = k.rsplit(".", 1)[0]
        if k not in loaded_paths and not (k.endswith((".scales", ".biases")) and base + ".weight" in loaded_paths):
            raise DFlashError(f"GGUF {path}: no tensor for parameter {k}")
    model.eval()
    out_cfg = json.loads(json.dumps(cfg))
    out_cfg["torch_dtype"] = str(dt).split(".")[-1]  # what mlx-lm reads back as the model's float type
    if plan:
        from collections import Counter

        bits_, gs_, mode_ = Counter(plan.values()).most_common(1)[0][0]  # the default; the rest are per-layer
        per_layer = {
            k: {"mode": "affine", **v}
            for k, v in qconf.items()
            if (v["bits"], v["group_size"], v.get("mode", "affine")) != (bits_, gs_, mode_)
        }
        out_cfg["quantization"] = {"group_size": gs_, "bits": bits_, "mode": mode_, **per_layer}
        out_cfg["quantization_config"] = out_cfg["quantization"]
    return Target(model, out_cfg), out_cfg


def _parts(pname: str, kind: str) -> List[str]:
    """The parameters one GGUF tensor fills (a fused gate/up: two)."""
    if kind == "gate_up":
        return [pname.replace("gate_up_proj", "gate_proj.weight"), pname.replace("gate_up_proj", "up_proj.weight")]
    return [pname]


def check_gguf_target(reader, path):
    """A target GGUF's tensors against its metadata, from the header alone
    (``info`` and the loader, before any tensor is decoded): none missing,
    none unknown, each the shape (reordered ones: the size) the metadata
    gives. Returns (config, tensors by name, name map, MTP tensor names)."""
    from mlx.utils import tree_flatten

    cfg = gguf_config(reader)
    tensors = {t.name: t for t in reader.tensors}
    names = _fuse_gate_up(tensor_map(cfg), tensors)
    mtp = _check_mtp(path, cfg, tensors)
    unknown = sorted(set(tensors) - set(names) - set(mtp))
    if unknown:
        raise DFlashError(f"GGUF {path}: unknown tensors {unknown[:5]} (not a {cfg['model_type']} layout?)")
    missing = sorted(set(names) - set(tensors))
    if missing:
        raise DFlashError(f"GGUF {path}: missing tensors {missing[:5]}")
    for name in names:  # (the MTP layers are skipped at load)
        kind = tensors[name].tensor_type.name
        if not decodable(kind):
            raise DFlashError(f"GGUF {path}: tensor {name} is of type {kind}, which this loader cannot decode")
    shapes = {k: tuple(v.shape) for k, v in tree_flatten(lazy_target(cfg).model.parameters())}
    why = "metadata and tensors disagree (a head count, head size, state size, feed-forward or vocabulary size?)"
    for gname, (pname, kind) in names.items():
        held = tuple(int(x) for x in reversed(tensors[gname].shape))  # GGUF lists dimensions innermost first
        want = [shapes[pn] for pn in _parts(pname, kind) if pn in shapes]
        if kind == "" and len(want) == 1 and held != want[0]:
            raise DFlashError(
                f"GGUF {path}: tensor {gname} gives {pname} the shape {list(held)}, but the file's "
                f"metadata makes it {list(want[0])}: {why}"
            )
        if want and math.prod(held) != sum(math.prod(w) for w in want):
            raise DFlashError(
                f"GGUF {path}: tensor {gname} holds {math.prod(held)} values, but the file's metadata makes "
                f"{pname} {' + '.join(str(math.prod(w)) for w in want)}: {why}"
            )
    return cfg, tensors, names, mtp


def decodable(type_name: str) -> bool:
    """Whether :func:`_decode` takes a tensor type: the floats, and every
    block type gguf-py dequantizes (not its integer types, nor the ones it
    names but has no decoder for)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import _type_traits

    if type_name in ("F32", "F16", "F64"):
        return True
    kind = getattr(GGMLQuantizationType, type_name, None)
    return kind is not None and kind in _type_traits


def _decode(t, where: str) -> np.ndarray:
    """A tensor's values as floats: gguf-py's dequantize, and F64 (which it
    does not take) as the file holds it; one DFlashError naming ``where``
    and the tensor for a type or block it cannot decode."""
    from gguf.quants import dequantize

    try:
        if t.tensor_type.name == "F64":
            return np.asarray(t.data, dtype=np.float64).reshape([int(x) for x in reversed(t.shape)])
        return dequantize(t.data, t.tensor_type)
    except (NotImplementedError, ValueError, KeyError) as e:
        raise DFlashError(f"{where}: cannot decode tensor {t.name} of type {t.tensor_type.name}: {e}") from None


def lazy_target(cfg: dict):
    """A Target with the file's shapes and unread (never evaluated) weights,
    for checks that need only shapes (``info --draft``)."""
    from mlx_lm.utils import _get_classes

    from ..models.qwen35 import Target

    model_cls, args_cls = _get_classes(cfg)
    return Target(model_cls(args_cls.from_dict(json.loads(json.dumps(cfg)))), cfg)


# --- tokenizer ---------------------------------------------------------------------


def build_tokenizer(reader):
    """A ``tokenizers.Tokenizer`` from tokenizer.ggml.* (byte-level BPE), with
    the split llama.cpp uses for ``tokenizer.ggml.pre``, for Qwen's names the
    NFC normalizer Qwen's tokenizer.json declares, and the BOS / EOS the file
    says to add."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    model_kind = field(reader, "tokenizer.ggml.model")
    if model_kind != "gpt2":
        raise DFlashError(f"unsupported GGUF tokenizer model {model_kind!r} (only byte-level BPE 'gpt2')")
    pre = field(reader, "tokenizer.ggml.pre")
    if pre is None or pre == "":  # as llama.cpp (missing or empty): the default split, with a warning
        import sys

        sys.stderr.write(
            "warning: the GGUF has no tokenizer.ggml.pre; using llama.cpp's 'default' split, "
            "which llama.cpp warns degrades generation (regenerate the file)\n"
        )
        pre = "default"
    if pre not in PRE_TOKENIZERS:
        raise DFlashError(
            f"unknown GGUF pre-tokenizer type {pre!r} (tokenizer.ggml.pre): supported are the "
            f"{len(PRE_TOKENIZERS)} llama.cpp names that use its GPT-2, Qwen2, Qwen3.5 or default "
            f"split (docs/gguf.md)"
        )
    rule = PRE_TOKENIZERS[pre]
    tokens = list(field(reader, "tokenizer.ggml.tokens") or [])
    merges = list(field(reader, "tokenizer.ggml.merges") or [])
    # Without them every text encoded to [] or byte by byte, silently; llama.cpp refuses such a file.
    if not tokens or not all(isinstance(t, str) for t in tokens):
        raise DFlashError("tokenizer.ggml.tokens is missing or not a list of strings")
    if not merges or not all(isinstance(m, str) and " " in m for m in merges):
        raise DFlashError("tokenizer.ggml.merges is missing or not a list of 'A B' pairs (a BPE needs them)")
    types = list(field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens))
    if len(types) != len(tokens):  # llama.cpp refuses it too (an index out of its bounds)
        raise DFlashError(
            f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens (a damaged file?)"
        )
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    try:
        tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    except Exception as e:  # a merge of a token not in the vocabulary, say
        raise DFlashError(f"its tokenizer cannot be built: {' '.join(str(e).split())}") from None
    if pre in NFC_NAMES:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_SPLITS[rule]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    # CONTROL tokens are special (skipped when decoding); USER_DEFINED ones
    # (Qwen's <think>, <tool_call>, ...) are matched whole but decoded as text.
    tok.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i, ty in enumerate(types) if ty == 3]
    )
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i, ty in enumerate(types) if ty == 4])
    # add_bos_token / add_eos_token: llama.cpp puts them around a text it
    # tokenizes with its special tokens, as this post-processor does.
    ends = {}  # "bos" / "eos" -> (its text, its id), where the file says to add it
    for key in ("bos", "eos"):
        i = field(reader, f"tokenizer.ggml.{key}_token_id")
        if field(reader, f"tokenizer.ggml.add_{key}_token", False) and i is not None and 0 <= int(i) < len(tokens):
            ends[key] = (tokens[int(i)], int(i))
    if ends:
        from tokenizers import processors

        bos, eos = ([ends[k][0]] if k in ends else [] for k in ("bos", "eos"))
        tok.post_processor = processors.TemplateProcessing(
            single=bos + ["$A"] + eos, pair=bos + ["$A"] + eos + ["$B"], special_tokens=list(ends.values())
        )
    return tok


def write_tokenizer(reader, out_dir) -> Path:
    """tokenizer.json + tokenizer_config.json (chat template) from tokenizer.ggml.*"""
    tok = build_tokenizer(reader)
    tokens = list(field(reader, "tokenizer.ggml.tokens") or [])
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


_TOKENIZER_DIRS: Dict[Tuple[str, int], Path] = {}


def tokenizer_dir_for(path) -> Path:
    """A folder holding the GGUF's tokenizer files: made once per file and
    process, and removed when the process ends."""
    p = Path(path).expanduser()  # not resolved: a split's parts are found beside the name given (hub links)
    key = (str(p.absolute()), p.stat().st_mtime_ns) if p.is_file() else None
    d = _TOKENIZER_DIRS.get(key)
    if d is not None and d.exists():
        return d
    reader = open_gguf(p)  # also the error for a path that is not a GGUF file
    if not _TOKENIZER_DIRS:
        atexit.register(lambda: [shutil.rmtree(x, ignore_errors=True) for x in _TOKENIZER_DIRS.values()])
    d = Path(tempfile.mkdtemp(prefix="mlx_dflash_gguf_tok_"))
    try:
        out = write_tokenizer(reader, d)
    except DFlashError as e:
        shutil.rmtree(d, ignore_errors=True)
        raise DFlashError(f"GGUF {p}: {e}") from None
    _TOKENIZER_DIRS[key] = d  # once whole: a failed build is not found again as an empty folder
    return out


# --- drafts ----------------------------------------------------------------------------

# llama.cpp's DFlash converter writes arch ``dflash`` with ``fc``, ``enc.output_norm``
# (the draft's hidden_norm) and Qwen3 block names; other draft converters use
# ``dflash_fc`` / ``dflash_hidden_norm``. Accept each spelling seen.
_DRAFT_GLOBAL = {
    "fc.weight": ("fc.weight", "dflash_fc.weight", "dflash.fc.weight"),
    "hidden_norm.weight": (
        "enc.output_norm.weight",
        "dflash_hidden_norm.weight",
        "dflash.hidden_norm.weight",
        "hidden_norm.weight",
    ),
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
# DFlash keys: llama.cpp's spelling first (the one named in errors), then others seen.
_DRAFT_KEYS = {
    "target_layer_ids": ("target_layers", "dflash.target_layer_ids"),
    "block_size": ("block_size", "dflash.block_size"),
    "mask_token_id": ("mask_token_id", "dflash.mask_token_id"),
}


def is_gguf_draft(reader) -> bool:
    return "dflash" in (field(reader, "general.architecture") or "")


def gguf_draft_config(reader) -> dict:
    """A z-lab-style draft config.json dict from GGUF draft metadata."""
    arch = field(reader, "general.architecture") or ""
    if "dflash" not in arch:
        raise DFlashError(f"not a DFlash draft GGUF: architecture {arch!r}")
    a = arch

    def get(key, default=None):
        return field(reader, f"{a}.{key}", default)

    def dflash_key(name):
        for k in _DRAFT_KEYS[name]:
            v = get(k)
            if v is not None:
                return v
        if name == "mask_token_id" and field(reader, "tokenizer.ggml.mask_token_id") is not None:
            return field(reader, "tokenizer.ggml.mask_token_id")
        raise DFlashError(
            f"draft GGUF is missing {a}.{_DRAFT_KEYS[name][0]} "
            f"(the DFlash {name.replace('_', ' ')}; also looked for "
            f"{', '.join(a + '.' + k for k in _DRAFT_KEYS[name][1:])})"
        )

    ids = dflash_key("target_layer_ids")
    H = int(get("embedding_length") or 0)
    nh = int(_first(get("attention.head_count") or 0))
    if not H:
        raise DFlashError(f"draft GGUF is missing {a}.embedding_length")
    if not nh:
        raise DFlashError(f"draft GGUF is missing {a}.attention.head_count")
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "hidden_size": H,
        "num_hidden_layers": int(_req(reader, f"{a}.block_count")),
        "num_attention_heads": nh,
        "num_key_value_heads": int(_first(get("attention.head_count_kv", nh))),
        "head_dim": int(get("attention.key_length", H // nh)),
        "intermediate_size": int(_req(reader, f"{a}.feed_forward_length")),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 1000000.0)),
        "max_position_embeddings": int(get("context_length", 40960)),
        "block_size": int(dflash_key("block_size")),
        "dflash_config": {"mask_token_id": int(dflash_key("mask_token_id")), "target_layer_ids": [int(i) for i in ids]},
    }
    ths = get("target_hidden_size")
    if ths is not None:
        cfg["target_hidden_size"] = int(ths)
    sw = int(get("attention.sliding_window") or 0)
    if sw > 0:  # as llama.cpp: a window needs the per-layer pattern (true = sliding layer)
        pattern = get("attention.sliding_window_pattern")
        if pattern is None:
            raise DFlashError(
                f"draft GGUF has {a}.attention.sliding_window = {sw} but no "
                f"{a}.attention.sliding_window_pattern (which layers slide)"
            )
        n = cfg["num_hidden_layers"]
        if isinstance(pattern, (list, tuple)):
            slides = [bool(x) for x in pattern]
        else:  # every n-th layer is full attention
            slides = [(i + 1) % int(pattern) != 0 for i in range(n)]
        if len(slides) != n:
            raise DFlashError(
                f"draft GGUF {a}.attention.sliding_window_pattern has {len(slides)} entries for {n} layers"
            )
        cfg["sliding_window"] = sw
        cfg["layer_types"] = ["sliding_attention" if x else "full_attention" for x in slides]
    return cfg


def load_gguf_draft(path, target, *, dtype=None):
    """Read a DFlash draft GGUF (F16/BF16/F32/Q8_0/...): returns (config dict,
    weights dict under z-lab names, as float arrays)."""

    reader = open_gguf(path)
    cfg = gguf_draft_config(reader)
    tensors = {t.name: t for t in reader.tensors}
    weights = {}
    for ours, name in check_gguf_draft(reader, cfg, path, target.hidden_size).items():
        t = tensors[name]
        w = _decode(t, f"draft GGUF {path}")
        src = {"F16": mx.float16, "BF16": mx.bfloat16}.get(
            t.tensor_type.name, mx.float32 if t.tensor_type.name == "F32" else mx.float16
        )
        weights[ours] = mx.array(np.asarray(w, np.float32)).astype(dtype or src)
    return cfg, weights


def check_gguf_draft(reader, cfg: dict, path, hidden_size: int) -> Dict[str, str]:
    """A draft GGUF's fit to a target of ``hidden_size`` and its tensor names,
    from the header alone (checked before a target is decoded); returns
    z-lab name -> the GGUF tensor that holds it."""
    ths = cfg.get("target_hidden_size")
    if ths is not None and ths != hidden_size:
        raise DFlashError(
            f"draft {path}: {field(reader, 'general.architecture')}.target_hidden_size {ths} "
            f"!= target hidden_size {hidden_size}"
        )
    tensors = {t.name for t in reader.tensors}
    wanted = dict(_DRAFT_GLOBAL)
    for i in range(cfg["num_hidden_layers"]):
        for ours, theirs in _DRAFT_LAYER.items():
            wanted[f"layers.{i}.{ours}"] = tuple(f"blk.{i}.{n}" for n in theirs)
    found = {}
    for ours, names in wanted.items():
        name = next((n for n in names if n in tensors), None)
        if name is None:
            raise UnreadableFile(f"draft GGUF {path}: missing tensor {names[0]}")
        found[ours] = name
    extra = sorted(tensors - set(found.values()) - set(_IGNORED_DRAFT))
    if extra:
        raise UnreadableFile(f"draft GGUF {path}: unknown tensors {extra[:5]}")
    return found
