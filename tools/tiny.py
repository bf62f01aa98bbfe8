"""Small random Qwen3.5 targets, DFlash drafts and BPE tokenizers in real on-disk formats.

Used by the tests, by ``bench/`` and to build the embedded default pair; no hub
access anywhere. Everything is seeded and deterministic.
"""

import copy
import json
from pathlib import Path
from typing import Dict, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# For a completion (base) model: the turns' text concatenated, the system
# message as a leading comment line, so a chat-templated prompt is still code.
COMPLETION_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '# ' + message['content'] + '\\n' }}"
    "{% else %}{{ message['content'] }}{% endif %}"
    "{% endfor %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]

_CORPUS = """
def fibonacci(n):
    \"\"\"Return the n-th Fibonacci number.\"\"\"
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop()

Beautiful is better than ugly. Explicit is better than implicit.
Simple is better than complex. Complex is better than complicated.
Flat is better than nested. Sparse is better than dense. Readability counts.
The quick brown fox jumps over the lazy dog while the system prints results.
import os, sys, json
for i, line in enumerate(open(path)):
    if line.strip() and not line.startswith('#'):
        print(i, line.rstrip())
"""


def target_config(
    *,
    moe: bool = False,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_hidden_layers: int = 4,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    linear_num_key_heads: int = 2,
    linear_num_value_heads: int = 4,
    linear_key_head_dim: int = 16,
    linear_value_head_dim: int = 16,
    full_attention_interval: int = 2,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int = 32,
    shared_expert_intermediate_size: int = 48,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 4096,
) -> dict:
    """An HF-style Qwen3.5 config.json dict (text params nested in text_config)."""
    text = {
        "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate_size,
        "rms_norm_eps": 1e-6,
        "full_attention_interval": full_attention_interval,
        "layer_types": [
            "full_attention" if (i + 1) % full_attention_interval == 0 else "linear_attention"
            for i in range(num_hidden_layers)
        ],
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": linear_key_head_dim,
        "linear_value_head_dim": linear_value_head_dim,
        "linear_num_key_heads": linear_num_key_heads,
        "linear_num_value_heads": linear_num_value_heads,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": tie_word_embeddings,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [1, 1, 0],
        },
        "eos_token_id": 2,
    }
    if moe:
        text.update(
            num_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok,
            moe_intermediate_size=moe_intermediate_size,
            shared_expert_intermediate_size=shared_expert_intermediate_size,
            norm_topk_prob=True,
        )
    return {
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
        "text_config": text,
        "tie_word_embeddings": tie_word_embeddings,
        "eos_token_id": 2,
    }


def scaled_target_config(hidden: int, layers: int, vocab_size: int) -> dict:
    """A target at a real model's width: 128-wide heads (hidden // 128 query
    heads, a quarter as many KV heads), every 4th layer attention (bench/)."""
    heads = hidden // 128
    return target_config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(heads // 4, 1),
        head_dim=128,
        intermediate_size=hidden * 3,
        linear_num_key_heads=max(heads // 2, 1),
        linear_num_value_heads=heads,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        full_attention_interval=4,
    )


def _perturb_norms(model: nn.Module, seed: int) -> None:
    """Random norm weights near 1, so the norm conventions are exercised."""
    key = mx.random.key(seed)
    updates = []
    for name, p in tree_flatten(model.parameters()):
        if name.endswith("norm.weight"):
            key, sub = mx.random.split(key)
            updates.append((name, 1.0 + 0.2 * mx.random.normal(p.shape, key=sub)))
    model.load_weights(updates, strict=False)


def build_target(config: dict, seed: int = 0, dtype=mx.float32):
    """An mlx-lm Qwen3.5 model (the reference) with seeded random weights."""
    from mlx_lm.utils import _get_classes

    mx.random.seed(seed)
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(copy.deepcopy(config)))
    _perturb_norms(model, seed + 1)
    model.update(tree_map(lambda p: p.astype(dtype), model.parameters()))
    mx.eval(model.parameters())
    model.eval()
    return model


def hf_weights(model) -> Dict[str, mx.array]:
    """The model's weights under raw Hugging Face names and conventions:
    ``model.language_model.*``, zero-centred norms, conv1d [C, 1, K], MoE
    experts fused as ``experts.gate_up_proj`` / ``experts.down_proj``."""
    out = {}
    shift = (
        ".input_layernorm.weight",
        ".post_attention_layernorm.weight",
        "model.norm.weight",
        ".q_norm.weight",
        ".k_norm.weight",
    )
    flat = dict(tree_flatten(model.parameters()))
    for name, w in flat.items():
        hf = name.replace("language_model.model.", "model.language_model.")
        hf = hf.replace("language_model.lm_head", "lm_head")
        if any(name.endswith(s) for s in shift):
            w = w - 1.0
        if "conv1d.weight" in name:
            w = w.moveaxis(1, 2)  # [C, K, 1] -> [C, 1, K]
        if ".switch_mlp." in name:
            continue
        out[hf] = w
    for name in flat:
        if name.endswith("switch_mlp.gate_proj.weight"):
            pre = name[: -len("switch_mlp.gate_proj.weight")]
            hf_pre = pre.replace("language_model.model.", "model.language_model.")
            gate = flat[name]
            up = flat[pre + "switch_mlp.up_proj.weight"]
            out[hf_pre + "experts.gate_up_proj"] = mx.concatenate([gate, up], axis=-2)
            out[hf_pre + "experts.down_proj"] = flat[pre + "switch_mlp.down_proj.weight"]
    return out


def save_hf(model, config: dict, path, tokenizer_dir: Optional[Path] = None) -> Path:
    """Write an HF-format folder (raw names, zero-centred norms)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), hf_weights(model), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    if tokenizer_dir is not None:
        copy_tokenizer(tokenizer_dir, path)
    return path


def save_mlx(model, config: dict, path, tokenizer_dir: Optional[Path] = None, quantize: Optional[dict] = None) -> Path:
    """Write an MLX-format folder with mlx-lm's own save; optionally quantized
    (``quantize={"bits": 4, "group_size": 32}``) the way ``mlx_lm.convert`` does."""
    from mlx_lm.utils import quantize_model, save_config, save_model

    path = Path(path)
    config = copy.deepcopy(config)
    if quantize is not None:
        model = copy.deepcopy(model)
        model, config = quantize_model(
            model,
            config,
            group_size=quantize.get("group_size", 64),
            bits=quantize.get("bits", 4),
        )
    save_model(path, model)
    save_config(config, path / "config.json")
    if tokenizer_dir is not None:
        copy_tokenizer(tokenizer_dir, path)
    return path


def build_tokenizer(
    path, vocab_size: int = 512, corpus: Optional[str] = None, chat_template: str = CHAT_TEMPLATE
) -> Path:
    """Train a byte-level BPE tokenizer and write tokenizer.json +
    tokenizer_config.json (with a ChatML template) to ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([corpus or _CORPUS], trainer=trainer)
    tok.save(str(path / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "chat_template": chat_template,
        "model_max_length": 1000000,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    return path


def copy_tokenizer(src, dst) -> None:
    import shutil

    if Path(src).resolve() == Path(dst).resolve():
        return
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(src) / name, Path(dst) / name)


def draft_config(
    target_cfg: dict,
    *,
    num_hidden_layers: int = 2,
    block_size: int = 16,
    target_layer_ids=None,
    mask_token_id: int = 3,
    layer_types=None,
    sliding_window: Optional[int] = None,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
) -> dict:
    """A z-lab-style DFlash v1 config.json dict for ``target_cfg``."""
    text = target_cfg.get("text_config", target_cfg)
    n_target = text["num_hidden_layers"]
    if target_layer_ids is None:
        from mlx_dflash.models.draft import default_target_layer_ids

        target_layer_ids = default_target_layer_ids(n_target, num_hidden_layers)
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": text["hidden_size"],
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate_size,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": text.get("max_position_embeddings", 4096),
        "vocab_size": text["vocab_size"],
        "num_target_layers": n_target,
        "block_size": block_size,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids)},
    }
    if layer_types is not None:
        cfg["layer_types"] = list(layer_types)
        cfg["sliding_window"] = sliding_window
    return cfg


def build_draft(config: dict, seed: int = 0, dtype=mx.float32):
    """A DFlash draft with seeded random weights (unbound: no embedding/lm_head)."""
    from mlx_dflash.models.draft import DFlashDraft, DraftConfig

    mx.random.seed(seed)
    draft = DFlashDraft(DraftConfig.from_dict(config))
    _perturb_norms(draft, seed + 1)
    draft.update(tree_map(lambda p: p.astype(dtype), draft.parameters()))
    mx.eval(draft.parameters())
    return draft


def save_draft(draft, config: dict, path) -> Path:
    """Write a z-lab-format draft folder (config.json + model.safetensors)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(draft.parameters())))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path
