"""Loading, dispatched on format in this one place: a GGUF file goes to
:mod:`.gguf`, a folder (HF or MLX format) to :mod:`.hf`; drafts come as
either. Hub ids are resolved to local paths first (:func:`.hub.resolve`,
called by ``api.load``, the engine factory)."""

import json
import os
from pathlib import Path
from typing import Callable, Dict, Optional

import mlx.core as mx

from ..errors import DFlashError
from .gguf import gguf_config, gguf_sizes, is_gguf, load_gguf_draft, load_gguf_target, open_gguf, tokenizer_dir_for
from .hf import (
    build_draft,
    draft_config,
    draft_vocab_ids,
    draft_weight_names,
    is_draft_config,
    read_config,
    read_draft,
    safetensors_sizes,
)
from .hf import load_target as load_folder_target
from .hf import load_tokenizer as load_folder_tokenizer

__all__ = [
    "apply_adapters",
    "check_adapter_files",
    "check_adapter_fit",
    "load_draft",
    "draft_vocab_ids",
    "load_target",
    "load_tokenizer",
    "read_config",
    "tensor_sizes",
    "text_config",
    "tokenizer_folder",
]


def load_target(
    path,
    dtype=None,
    lazy: bool = False,
    *,
    only: Optional[Callable[[str], bool]] = None,
    progress=None,
    adapter_path=None,
):
    """A Qwen3.5/3.6 target from a folder or a llama.cpp GGUF file.

    ``lazy`` (folders): weights stay unread until used. ``only(parameter
    name)`` (GGUF): decode just those tensors, the rest stay lazy placeholders
    (a pipeline stage's share; give a folder ``lazy`` for the same).
    ``progress``: a GGUF's decode progress (see :func:`.gguf.load_gguf_target`).
    ``adapter_path``: fine-tuning adapters applied on top (:func:`apply_adapters`).
    """
    if is_gguf(path):
        target, _ = load_gguf_target(path, dtype=dtype, only=only, progress=progress)
    else:
        target = load_folder_target(path, dtype=dtype, lazy=lazy)
    if adapter_path is None:
        return target
    from ..models.qwen35 import Target

    apply_adapters(target.model, adapter_path)
    return Target(target.model, target.config)  # a fresh wrapper: it holds the modules it calls


ADAPTER_FILES = ("adapter_config.json", "adapters.safetensors")
FINE_TUNE_TYPES = ("lora", "dora", "full")


def check_adapter_files(path) -> Path:
    """The adapter folder ``path`` as mlx-lm's lora trainer writes it, its
    config read and checked (one clear error otherwise): done before a
    target loads, so a typo costs no load."""
    if not isinstance(path, (str, os.PathLike)):
        raise DFlashError(f"adapter_path must be a folder path, got {type(path).__name__}")
    p = Path(path).expanduser()
    if not p.exists():
        raise DFlashError(f"adapter path does not exist: {p}")
    if not p.is_dir():
        raise DFlashError(f"adapter path is not a folder (mlx-lm's lora writes {' and '.join(ADAPTER_FILES)}): {p}")
    missing = [f for f in ADAPTER_FILES if not (p / f).is_file()]
    if missing:
        raise DFlashError(f"adapter folder {p} has no {' or '.join(missing)} (not an mlx-lm adapter folder?)")
    try:
        cfg = json.loads((p / ADAPTER_FILES[0]).read_text())
    except (OSError, ValueError) as e:
        raise DFlashError(f"cannot read {p / ADAPTER_FILES[0]}: {e}") from None
    kind = cfg.get("fine_tune_type", "lora") if isinstance(cfg, dict) else None
    if kind not in FINE_TUNE_TYPES:
        raise DFlashError(f"{p / ADAPTER_FILES[0]}: fine_tune_type {kind!r} is not one of {', '.join(FINE_TUNE_TYPES)}")
    if kind != "full":
        lp = cfg.get("lora_parameters")
        if not isinstance(cfg.get("num_layers"), int) or not isinstance(lp, dict):
            raise DFlashError(f"{p / ADAPTER_FILES[0]}: a {kind} adapter needs num_layers and lora_parameters")
        absent = [k for k in ("rank", "scale", "dropout") if k not in lp]  # what mlx-lm's load_adapters reads
        if absent:
            raise DFlashError(f"{p / ADAPTER_FILES[0]}: lora_parameters lacks {', '.join(absent)}")
    return p


def _adapter_config(p: Path) -> dict:
    return json.loads((p / ADAPTER_FILES[0]).read_text())  # read and checked by check_adapter_files


def dora_expert_layers(model, adapter_cfg: dict) -> list:
    """The mixture-of-experts layers (SwitchLinear) of ``model`` that mlx-lm's
    ``load_adapters`` would turn into DoRA layers for this adapter config: it
    has no DoRA form for them ("SwitchLinear doesn't support DoRA yet"). The
    layers picked as it picks them: ``lora_parameters.keys`` (default: every
    linear, expert and embedding layer) of the last ``num_layers`` blocks,
    and keys that name a module by its full path."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    if adapter_cfg.get("fine_tune_type", "lora") != "dora":
        return []
    experts = (SwitchLinear, QuantizedSwitchLinear)
    keys = adapter_cfg["lora_parameters"].get("keys")
    blocks = list(enumerate(model.layers))[-max(adapter_cfg["num_layers"], 0) :]
    found = [
        f"layers.{i}.{k}"
        for i, layer in blocks
        for k, m in layer.named_modules()
        if isinstance(m, experts) and (keys is None or k in keys)
    ]
    if keys is not None:
        found += [k for k, m in model.named_modules() if isinstance(m, experts) and k in keys]
    return found


def _refuse_dora_experts(p: Path, found: list) -> None:
    if found:
        shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise DFlashError(
            f"{p / ADAPTER_FILES[0]}: a DoRA adapter (fine_tune_type 'dora') cannot apply to this MoE target: "
            f"it would adapt the target's mixture-of-experts layers ({shown}), and mlx-lm has no DoRA form of "
            "expert layers; use a LoRA adapter, or a DoRA one whose lora_parameters.keys leave out the experts"
        )


def check_adapter_fit(path, model) -> Path:
    """The adapter folder ``path`` checked (:func:`check_adapter_files`) and,
    a DoRA adapter that would adapt the expert layers of the MoE target at
    ``model``, refused from the configs and shapes before the target's weights
    are read (:func:`apply_adapters` refuses it too, for callers that load first)."""
    p = check_adapter_files(path)
    cfg = _adapter_config(p)
    if cfg.get("fine_tune_type", "lora") != "dora" or not (text_config(model).get("num_experts") or 0):
        return p
    from .gguf import lazy_target

    shapes = lazy_target(gguf_config(open_gguf(model))) if is_gguf(model) else load_folder_target(model, lazy=True)
    _refuse_dora_experts(p, dora_expert_layers(shapes.model, cfg))
    return p


def apply_adapters(model, path) -> None:
    """Apply mlx-lm fine-tuning adapters (LoRA, DoRA or full, as ``mlx_lm.lora``
    saves them) to an mlx-lm model in place, by mlx-lm's own ``load_adapters``:
    the adapted layers compute what they compute under ``mlx_lm.load(...,
    adapter_path=...)``, unfused."""
    from mlx_lm.tuner.utils import load_adapters

    p = check_adapter_files(path)
    try:  # a damaged file is that, not a misfit
        mx.load(str(p / ADAPTER_FILES[1]))
    except Exception as e:
        raise DFlashError(f"cannot read {p / ADAPTER_FILES[1]}: {' '.join(str(e).split())}") from None
    _refuse_dora_experts(p, dora_expert_layers(model, _adapter_config(p)))
    try:
        load_adapters(model, str(p))
    except Exception as e:  # mlx-lm raises ValueError/KeyError for adapters of another model
        msg = " ".join(str(e).split())
        raise DFlashError(f"adapters {p} do not fit this model: {type(e).__name__}: {msg}") from None
    model.eval()


def tokenizer_folder(path) -> Path:
    """The folder holding a model's tokenizer files (a GGUF's are written out once)."""
    return tokenizer_dir_for(path) if is_gguf(path) else Path(path)


def load_tokenizer(path, eos_token_ids=None):
    """The tokenizer of a model folder, or the one a GGUF file carries."""
    return load_folder_tokenizer(tokenizer_folder(path), eos_token_ids=eos_token_ids)


def check_draft_files(path) -> None:
    """That a draft's files can be read, from their headers alone: checked
    before a target's weights are decoded (minutes on a large GGUF) so that
    a draft missing a part or its config fails first."""
    p = Path(path).expanduser()
    if is_gguf(p):
        open_gguf(p)
    else:
        read_config(p, "draft")
        draft_weight_names(p)


def check_draft_fit(draft, model) -> None:
    """That ``draft`` can be read and fits the target at ``model``, from
    headers and configs alone: checked before the target's weights are read
    (minutes of decoding on a large GGUF), so a draft for another model, or
    one missing a part, a tensor or a file's end, fails first. What needs
    the weights' values (their shapes) is checked when the draft loads."""
    from .gguf import check_gguf_draft, gguf_draft_config, lazy_target
    from .hf import check_draft_names, validate_draft

    cfg, where = read_draft_config(draft)
    shapes = lazy_target(gguf_config(open_gguf(model))) if is_gguf(model) else load_folder_target(model, lazy=True)
    if cfg.vocab_size is None:
        cfg.vocab_size = shapes.vocab_size  # as build_draft sets it
    validate_draft(cfg, shapes, where)
    p = Path(draft).expanduser()
    if is_gguf(p):
        reader = open_gguf(p)
        check_gguf_draft(reader, gguf_draft_config(reader), p, shapes.hidden_size)
    else:
        check_draft_names(cfg, draft_weight_names(p), p)


def is_draft_path(path) -> bool:
    """Whether the folder ``path`` holds a DFlash draft (by its config.json)."""
    f = Path(path).expanduser() / "config.json"
    try:
        return f.is_file() and is_draft_config(json.loads(f.read_text()))
    except (OSError, ValueError):
        return False


def read_draft_config(draft):
    """A draft's DraftConfig from its config.json or GGUF metadata, and the
    place errors name; one DFlashError for a file missing or a field missing
    or of the wrong kind (bad input, not a misfit)."""
    from .gguf import gguf_draft_config

    check_draft_files(draft)
    p = Path(draft).expanduser()
    raw, where = (gguf_draft_config(open_gguf(p)), str(p)) if is_gguf(p) else (read_config(p, "draft"), str(p))
    return draft_config(raw, where), where


def load_draft(path, target, *, quantize_bits: Optional[int] = None, group_size: int = 64, dtype=None):
    """A DFlash v1 or DFlash 2 draft (z-lab folder; v1 also as a draft GGUF
    file), bound to ``target``; ``quantize_bits`` (4 or 8) quantizes it at load."""
    p = Path(path).expanduser()
    if is_gguf(p):
        raw, weights = load_gguf_draft(p, target, dtype=dtype)
        where = str(p)
    else:
        raw, weights, where = read_draft(p)
    return build_draft(
        raw, weights, target, path=p, where=where, quantize_bits=quantize_bits, group_size=group_size, dtype=dtype
    )


def tensor_sizes(path) -> Dict[str, int]:
    """Tensor name -> bytes of a folder or GGUF file, from headers alone ({} for neither)."""
    p = Path(path).expanduser()
    if is_gguf(p):
        return gguf_sizes(p)
    return safetensors_sizes(p) if p.is_dir() else {}


def text_config(path) -> dict:
    """A target's text config (``num_hidden_layers``, ...) without loading it."""
    if is_gguf(path):
        return gguf_config(open_gguf(path))["text_config"]
    raw = read_config(path, "model")
    return raw.get("text_config", raw)
