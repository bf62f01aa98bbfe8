"""``mlx-dflash info``: what a model folder holds and whether a draft fits it."""

from pathlib import Path
from typing import Optional

from .errors import DFlashError
from .loading.hf import read_config


def _size_on_disk(p: Path) -> int:
    return sum(f.stat().st_size for f in p.glob("*.safetensors"))


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GB"


def _params(module) -> int:
    from mlx_lm.utils import get_total_parameters

    return get_total_parameters(module)


def describe(path, draft: Optional[Path] = None) -> str:
    from .loading.hf import load_draft, load_target
    from .models.draft import DraftConfig

    p = Path(path).expanduser()
    cfg = read_config(p)
    lines = [f"path: {p}"]
    if "dflash_config" in cfg or "DFlashDraftModel" in (cfg.get("architectures") or []):
        d = DraftConfig.from_dict(cfg)
        lines += [
            "kind: DFlash v1 draft",
            f"layers: {d.num_hidden_layers} "
            f"({', '.join(d.layer_types) if d.layer_types else 'all full attention'})",
            f"hidden: {d.hidden_size}, heads {d.num_attention_heads}/{d.num_key_value_heads} x {d.head_dim}",
            f"block size: {d.block_size}, mask token: {d.mask_token_id}",
            f"target layer ids: {d.target_layer_ids} (for a {d.num_target_layers}-layer target)",
            f"size on disk: {_fmt_bytes(_size_on_disk(p))}",
        ]
        if draft is not None:
            raise DFlashError("--draft goes with a target folder, not a draft folder")
        return "\n".join(lines)

    target = load_target(p, lazy=True)
    a = target.args
    n_lin = sum(target.is_linear)
    q = target.config.get("quantization")
    if q:
        overrides = sum(1 for k, v in q.items() if isinstance(v, dict))
        quant = f"{q.get('bits')}-bit {q.get('mode', 'affine')}, group {q.get('group_size')}"
        if overrides:
            quant += f" ({overrides} per-layer overrides)"
    else:
        quant = "none"
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
        try:
            d = load_draft(draft, target)
            lines.append(f"draft {draft}: fits (block size {d.block_size}, target layers {d.target_layer_ids})")
        except DFlashError as e:
            lines.append(f"draft {draft}: does NOT fit: {e}")
    return "\n".join(lines)
