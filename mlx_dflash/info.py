"""``mlx-dflash info``: what a model folder holds and whether a draft fits it."""

from collections import Counter
from pathlib import Path
from typing import List, Optional, Tuple

from .errors import DFlashError, UnreadableFile
from .loading.hf import is_draft_config, read_config


def _size_on_disk(p: Path) -> int:
    return sum(f.stat().st_size for f in p.glob("*.safetensors"))


def _fmt_bytes(n: float) -> str:
    # Decimal units, as the stage plan and the memory figures elsewhere give them.
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} GB"


def _params(module) -> int:
    from mlx_lm.utils import get_total_parameters

    return get_total_parameters(module)


def describe(path, draft: Optional[Path] = None) -> Tuple[str, Optional[bool]]:
    """The report on ``path``, and whether ``draft`` fits it (None without one)."""
    from .loading import load_target, read_draft_config

    p = Path(path).expanduser()
    from .loading.gguf import is_gguf

    if is_gguf(p):
        return describe_gguf(p, draft)
    cfg = read_config(p)
    lines = [f"path: {p}"]
    if is_draft_config(cfg):
        d, _ = read_draft_config(p)  # a field of the wrong kind: one error naming it
        lines += [
            f"kind: {d.kind} draft",
            f"layers: {d.num_hidden_layers} ({', '.join(d.layer_types) if d.layer_types else 'all full attention'})",
            f"hidden: {d.hidden_size}, heads {d.num_attention_heads}/{d.num_key_value_heads} x {d.head_dim}",
            f"block size: {d.block_size}, mask token: {d.mask_token_id}",
            f"target layer ids: {d.target_layer_ids} (for a {d.num_target_layers}-layer target)",
            f"size on disk: {_fmt_bytes(_size_on_disk(p))}",
        ]
        if d.is_v2:
            lines.insert(
                -1,
                f"selector: top-{d.selector_top_k}, rank {d.selector_rank}; block convolutions: "
                f"{d.conv_kernel_size} taps, groups of {d.conv_group_size} channels",
            )
        if draft is not None:
            raise DFlashError("--draft goes with a target folder, not a draft folder")
        return "\n".join(lines), None

    target = load_target(p, lazy=True)
    a = target.args
    n_lin = sum(target.is_linear)
    # What the modules hold (a recipe such as mlx_lm.convert's mixed_3_6 overrides
    # the config's default bits on every layer), most common first.
    held = Counter(
        (m.bits, getattr(m, "mode", "affine"), m.group_size)
        for _, m in target.model.named_modules()
        if hasattr(m, "bits") and hasattr(m, "group_size")
    )
    quant = (
        "; ".join(f"{b}-bit {mode}, group {g} ({n} layers)" for (b, mode, g), n in held.most_common())
        if held
        else "none"
    )
    moe = f", MoE {a.num_experts} experts top-{a.num_experts_per_tok}" if a.num_experts else ""
    lines += [
        f"architecture: {target.config.get('model_type')}{moe}",
        f"layers: {target.num_layers} ({n_lin} Gated DeltaNet + {target.num_layers - n_lin} full attention, "
        f"interval {a.full_attention_interval})",
        f"hidden: {a.hidden_size}, attention heads {a.num_attention_heads}/{a.num_key_value_heads} x {a.head_dim}, "
        f"DeltaNet heads {a.linear_num_key_heads}/{a.linear_num_value_heads} x "
        f"{a.linear_key_head_dim}/{a.linear_value_head_dim}",
        f"vocab: {a.vocab_size}, context: {a.max_position_embeddings}",
        f"quantization: {quant}",
        f"parameters: {_params(target.model) / 1e6:.2f} M",
        f"size on disk: {_fmt_bytes(_size_on_disk(p))}",
    ]
    if draft is not None:
        return _with_fit(lines, draft, target, p)
    return "\n".join(lines), None


def _with_fit(lines, draft: Path, target, model: Path) -> Tuple[str, bool]:
    """The report ``lines`` ending in whether ``draft`` fits ``target``; a draft
    that cannot be read at all (missing, a split GGUF's part gone, no config)
    is an error, not a misfit."""
    from .loading import load_draft, read_draft_config

    p = Path(draft).expanduser()
    read_draft_config(p)  # a draft that cannot be read, or a config of the wrong kind: bad input (exit 2)
    try:
        d = load_draft(p, target)
    except UnreadableFile:
        raise  # a corrupt file is bad input (exit 2), not a draft that does not fit (exit 1)
    except DFlashError as e:
        return "\n".join(lines + [f"draft {draft}: does NOT fit: {e}"]), False
    fit = f"draft {draft}: fits ({d.config.kind}, block size {d.block_size}, target layers {d.target_layer_ids})"
    return "\n".join(lines + [fit] + _head_share(model, p, target)), True


def _head_share(model: Path, draft: Path, target) -> List[str]:
    """What a draft forward reads, from the files' tensor sizes: the draft's
    own weights and the target's head, which it borrows and computes for
    every slot of a block (on a large vocabulary most of it: --draft-vocab)."""
    from .distributed.plan import costs_from_sizes
    from .loading import tensor_sizes

    c = costs_from_sizes(tensor_sizes(model), target.num_layers)
    head = c.embed if target.args.tie_word_embeddings else c.head
    own = sum(n for k, n in tensor_sizes(draft).items() if "embed_tokens" not in k and "lm_head" not in k)
    if not head or not own:
        return []
    return [
        f"a draft forward reads: its own weights {_fmt_bytes(own)} and the target's head {_fmt_bytes(head)} "
        f"({head / (head + own):.0%}; --draft-vocab N reads N of its {target.vocab_size} rows)"
    ]


def describe_gguf(p: Path, draft: Optional[Path] = None) -> Tuple[str, Optional[bool]]:
    from collections import Counter

    from .loading.gguf import (
        check_gguf_target,
        default_dtype,
        eog_token_ids,
        field,
        gguf_draft_config,
        gguf_files,
        is_gguf_draft,
        lazy_target,
        mlx_form,
        open_gguf,
        tokenizer_dir_for,
    )

    reader = open_gguf(p)
    files = gguf_files(reader, p)
    types = Counter()
    sizes = Counter()
    for ten in reader.tensors:
        types[ten.tensor_type.name] += 1
        sizes[ten.tensor_type.name] += int(ten.n_bytes)
    n_params = sum(int(ten.n_elements) for ten in reader.tensors)
    head = [
        f"path: {p}",
        f"format: GGUF v{field(reader, 'GGUF.version', '?')}, architecture {field(reader, 'general.architecture')}",
    ]
    tail = [
        f"parameters: {n_params / 1e6:.2f} M; tensors: {len(reader.tensors)}",
        "tensor types: " + ", ".join(f"{k} x{v} ({_fmt_bytes(sizes[k])})" for k, v in sorted(types.items())),
        f"size on disk: {_fmt_bytes(sum(f.stat().st_size for f in files))}"
        + (f" in {len(files)} parts ({files[0].name} ...)" if len(files) > 1 else ""),
    ]
    if is_gguf_draft(reader):
        d = gguf_draft_config(reader)
        if draft is not None:
            raise DFlashError("--draft goes with a target, not a draft GGUF")
        return "\n".join(
            head
            + [
                "kind: DFlash v1 draft",
                f"layers: {d['num_hidden_layers']}, hidden {d['hidden_size']}, heads "
                f"{d['num_attention_heads']}/{d['num_key_value_heads']} x {d['head_dim']}",
                f"block size: {d['block_size']}, mask token: {d['dflash_config']['mask_token_id']}",
                f"target layer ids: {d['dflash_config']['target_layer_ids']}",
            ]
            + tail
        ), None
    cfg, *_ = check_gguf_target(reader, p)  # what the loader refuses, info does too: from the header
    tokenizer_dir_for(p)  # and its tokenizer (a pre-tokenizer llama.cpp does not know, merges missing)
    t = cfg["text_config"]
    n_lin = sum(1 for i in range(t["num_hidden_layers"]) if (i + 1) % t["full_attention_interval"])
    moe = f", MoE {t['num_experts']} experts top-{t['num_experts_per_tok']}" if t.get("num_experts") else ""
    n_mtp = t.get("mtp_num_hidden_layers", 0)
    lines = (
        head
        + [
            f"model: {cfg['model_type']}{moe}",
            f"layers: {t['num_hidden_layers']} ({n_lin} Gated DeltaNet + {t['num_hidden_layers'] - n_lin} full attention)"
            + (f" + {n_mtp} MTP (nextn) block(s), skipped at load: DFlash does not use them" if n_mtp else ""),
            f"hidden: {t['hidden_size']}, vocab {t['vocab_size']}, context {t['max_position_embeddings']}",
            f"DeltaNet heads: {t['linear_num_key_heads']} key / {t['linear_num_value_heads']} value",
            f"loads as: {str(default_dtype(reader)).split('.')[-1]} (unquantized weights, scales, activations)",
            "quantized as: "
            + (
                "; ".join(f"{k} -> {mlx_form(k)}" for k in sorted(types) if mlx_form(k) != "float")
                or "none (float file)"
            ),
            f"tokenizer: {field(reader, 'tokenizer.ggml.model')}, {len(field(reader, 'tokenizer.ggml.tokens') or [])} "
            f"tokens, pre-tokenizer {field(reader, 'tokenizer.ggml.pre')}, stops on ids {eog_token_ids(reader)}",
        ]
        + tail
    )
    if draft is not None:
        return _with_fit(lines, draft, lazy_target(cfg), p)
    return "\n".join(lines), None
