"""Loading safetensors folders: HF-format and MLX-format targets, z-lab drafts.

Targets go through mlx-lm's own loader (sanitize: HF names, zero-centred
norms, conv layout, fused MoE experts; quantized checkpoints with per-layer
overrides). This module adds the checks that turn bad input into one clear
:class:`DFlashError`.
"""

import glob
import json
import math
import numbers
import re
import struct
from pathlib import Path
from typing import Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path

from ..errors import DFlashError, UnreadableFile, is_count, is_int
from ..models.draft import V2_FIELDS, DFlashDraft, DraftConfig
from ..models.qwen35 import SUPPORTED_MODEL_TYPES, Target

_TEXT_TYPES = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}


def _folder(path, what: str) -> Path:
    p = Path(path).expanduser()
    if not p.exists():
        raise DFlashError(f"{what} path does not exist: {p}")
    if not p.is_dir():
        if p.suffix.lower() == ".gguf":  # a .gguf that reached here failed the magic-bytes check
            raise DFlashError(f"{what} file is not a GGUF file (it does not start with the bytes 'GGUF'): {p}")
        raise DFlashError(f"{what} path is a file, not a model folder (a folder with config.json) or a .gguf file: {p}")
    return p


def read_config(path, what: str = "model") -> dict:
    p = _folder(path, what)
    cfg_file = p / "config.json"
    if not cfg_file.exists():
        raise DFlashError(f"{what} folder has no config.json (not a model folder?): {p}")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise DFlashError(f"cannot read {cfg_file}: {e}") from None
    if not isinstance(cfg, dict):
        raise DFlashError(f"{cfg_file} holds a JSON {type(cfg).__name__}, not an object of config fields")
    if not isinstance(cfg.get("model_type", ""), str):
        raise DFlashError(f"{cfg_file}: model_type must be a string, got {cfg['model_type']!r}")
    return cfg


def check_shards(p: Path, what: str) -> None:
    """That every shard a ``*.safetensors.index.json`` of folder ``p`` names
    (its ``weight_map``, as transformers and mlx-lm write it) is there: one
    error naming the missing files, where mlx-lm's load (which reads whatever
    shards are present) says only "Missing N parameters". An index that
    cannot be read is left alone: the loaders never read it."""
    missing, indexes = set(), []
    for index in sorted(p.glob("*.safetensors.index.json")):
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except (OSError, ValueError, AttributeError):
            continue
        gone = {f for f in weight_map.values() if isinstance(f, str)} if isinstance(weight_map, dict) else set()
        gone = {f for f in gone if not (p / f).is_file()}
        if gone:
            missing |= gone
            indexes.append(index.name)
    if missing:
        names = sorted(missing)
        raise UnreadableFile(
            f"{what} folder {p} is incomplete: {' and '.join(indexes)} names {len(names)} weight file(s) "
            "that are not there: "
            + ", ".join(names[:8])
            + (f" and {len(names) - 8} more" if len(names) > 8 else "")
            + " (an interrupted download? fetch the folder again)"
        )


def _weight_files(p: Path, what: str):
    files = sorted(glob.glob(str(p / "*.safetensors")))
    if not files:
        raise UnreadableFile(f"{what} folder has no .safetensors weights: {p}")
    check_shards(p, what)
    return files


def _cast(module: nn.Module, dtype) -> None:
    """Floating parameters to ``dtype``, but those the model's
    ``cast_predicate`` keeps (Qwen3.5's ``A_log`` stays float32), as
    ``mlx_lm.convert --dtype`` casts them."""
    if dtype is None:
        return
    keep = getattr(module, "cast_predicate", lambda _: True)
    module.update(
        tree_map_with_path(
            lambda k, x: x.astype(dtype) if keep(k) and mx.issubdtype(x.dtype, mx.floating) else x,
            module.parameters(),
        )
    )


_COUNTS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "full_attention_interval",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)
# The fields every published config has, without which mlx-lm builds a model of its defaults' shape.
_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
_MOE_COUNTS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")  # 0 in some dense configs


def _check_counts(cfg: dict, where: Path) -> None:
    """The shape fields of a target's config (or its text_config) as positive
    integers, one error naming the file and field (mlx-lm's own error names
    neither: "'str' object cannot be interpreted as an integer")."""
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    for k in _REQUIRED:
        if text.get(k) is None:
            raise DFlashError(
                f"{where}: {k} is missing{' from text_config' if text is not cfg else ''} (mlx-lm would take a "
                "default, which the weights do not have)"
            )
    eps = text.get("rms_norm_eps")
    if eps is not None and not (
        isinstance(eps, numbers.Real) and not isinstance(eps, bool) and math.isfinite(eps) and eps > 0
    ):
        raise DFlashError(f"{where}: rms_norm_eps must be a positive number, got {eps!r}")
    for k in _COUNTS + _MOE_COUNTS:
        v, least = text.get(k), 0 if k in _MOE_COUNTS else 1
        if v is not None and not is_count(v, least):
            raise DFlashError(
                f"{where}: {k} must be {'an integer >= 0' if least == 0 else 'a positive integer'}, got {v!r}"
            )


def _check_eos(cfg: dict, where: Path) -> None:
    """A config's ``eos_token_id`` (top level or in text_config) as a token id
    (an integer >= 0) or a list of them, else one error naming the field, the
    file and the value (mlx-lm's tokenizer took a string as the set of its
    characters, and a float failed as "not iterable", blamed on the tokenizer)."""
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    for name, c in (("eos_token_id", cfg), ("text_config.eos_token_id", text)):
        v = c.get("eos_token_id")
        if v is None:
            continue
        ids = v if isinstance(v, list) else [v]
        # An id past the vocabulary is let be: it is never sampled, so it ends nothing
        # (a config whose vocabulary was cut down for a test keeps its published ids).
        bad = [i for i in ids if not is_count(i, 0)]
        if bad:
            raise DFlashError(
                f"{where}: {name} must be a token id (an integer >= 0) or a list of them, got {v!r}"
                + (f" ({bad[0]!r} is not one)" if isinstance(v, list) else "")
            )


def load_target(path, dtype=None, lazy: bool = False) -> Target:
    """Load a Qwen3.5/3.6 target from an HF- or MLX-format folder.

    ``lazy`` leaves weights unread until used (``info`` counts shapes only).
    """
    from mlx_lm.utils import load_model

    p = _folder(path, "model")
    cfg = read_config(p, "model")
    mt = cfg.get("model_type")
    override = None
    if mt in _TEXT_TYPES:
        override = {"model_type": _TEXT_TYPES[mt]}
        mt = _TEXT_TYPES[mt]
    if is_draft_config(cfg):
        raise DFlashError(f"{p} is a DFlash draft, not a target model: give it as the draft (--draft)")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise DFlashError(
            f"unsupported model_type {mt!r} in {p / 'config.json'}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    _check_counts(cfg, p / "config.json")
    _check_eos(cfg, p / "config.json")
    gen = p / "generation_config.json"  # mlx-lm's load_config takes its eos_token_id over config.json's
    if gen.is_file():
        try:
            gen_cfg = json.loads(gen.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise DFlashError(f"cannot read {gen}: {e}") from None
        _check_eos(gen_cfg if isinstance(gen_cfg, dict) else {}, gen)
    _weight_files(p, "model")
    try:
        model, config = load_model(p, lazy=lazy, model_config=override)
    except DFlashError:
        raise
    except Exception as e:  # mlx-lm raises ValueError/KeyError/OSError for bad folders
        msg = " ".join(str(e).split())
        if len(msg) > 400:  # its "Missing N parameters" lists every one of them
            msg = msg[:400] + f" ... ({len(msg) - 400} more characters)"
        raise DFlashError(f"cannot load model from {p}: {type(e).__name__}: {msg}") from None
    _cast(model, dtype)
    if dtype is not None and not lazy:
        mx.eval(model.parameters())
    return Target(model, config)


def safetensors_header(f: Path) -> Tuple[dict, int]:
    """A safetensors file's header (tensor name -> dtype, shape, data_offsets)
    and the offset its data starts at, read without the data; ValueError
    (or OSError) for a file that has none."""
    with open(f, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ValueError("no header")
        (n,) = struct.unpack("<Q", head)
        if n > Path(f).stat().st_size:
            raise ValueError(f"a header of {n} bytes in a file of {Path(f).stat().st_size}")
        return json.loads(fh.read(n)), 8 + n


def safetensors_sizes(folder) -> Dict[str, int]:
    """Tensor name -> bytes, from the headers of a folder's safetensors files (no data read)."""
    sizes = {}
    check_shards(Path(folder).expanduser(), "model")  # a plan of the shards that are there would mislead
    for f in sorted(Path(folder).expanduser().glob("*.safetensors")):
        try:
            header, _ = safetensors_header(f)
            for k, v in header.items():
                if k != "__metadata__":
                    a, b = v["data_offsets"]
                    sizes[k] = b - a
        except (OSError, ValueError, TypeError, KeyError, struct.error) as e:
            raise DFlashError(f"cannot read the safetensors header of {f} (truncated or corrupt?): {e}") from None
    return sizes


def load_tokenizer(path, eos_token_ids=None):
    """mlx-lm's TokenizerWrapper (chat template, streaming detokenizer) for a folder."""
    from mlx_lm.utils import load_tokenizer as _load

    p = _folder(path, "tokenizer")
    if not (p / "tokenizer.json").exists() and not (p / "tokenizer.model").exists():
        raise DFlashError(f"no tokenizer.json or tokenizer.model in {p}")
    try:
        return _load(p, eos_token_ids=eos_token_ids)
    except Exception as e:
        raise DFlashError(f"cannot load tokenizer from {p}: {type(e).__name__}: {e}") from None


def draft_vocab_ids(spec, vocab_size: Optional[int], keep=()) -> Optional[list]:
    """The token ids a draft restricted with ``draft_vocab`` proposes among
    (None: every token). ``spec``: a count N (the N lowest ids: byte-level
    BPE vocabularies such as Qwen's number tokens in merge order, which
    follows their frequency in the tokenizer's corpus), a file of ids (a
    JSON list, or ids separated by spaces, commas or lines; e.g. the most
    frequent tokens of your own texts), or a sequence of ids. ``keep`` (the
    tokenizer's added tokens: end of turn, think and tool markers) is added.
    ``vocab_size`` None: the form alone is checked (before a model loads)."""
    what = "draft_vocab (--draft-vocab)"
    if spec is None:
        return None
    if isinstance(spec, str) and re.fullmatch(r"[+-]?[0-9]+", spec.strip()):
        spec = int(spec)
    if is_int(spec):
        if spec < 1:
            raise DFlashError(f"{what} must keep at least 1 token, got {spec}")
        if vocab_size is None:
            return None  # the form is right; the count is checked against the model's vocabulary
        if spec > vocab_size:
            raise DFlashError(f"{what} keeps {spec} tokens, but the vocabulary has {vocab_size}")
        ids = set(range(int(spec)))
    elif isinstance(spec, (str, Path)):
        f = Path(spec).expanduser()
        try:
            text = f.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise DFlashError(f"{what}: cannot read {f}: {e.strerror if isinstance(e, OSError) else e}") from None
        try:
            raw = (
                json.loads(text) if text.lstrip().startswith("[") else [int(x) for x in text.replace(",", " ").split()]
            )
        except ValueError:
            raw = None
        if not isinstance(raw, list) or not raw or not all(is_int(x) for x in raw):
            raise DFlashError(f"{what}: {f} is not a list of token ids (a JSON list of integers, or integers)")
        ids = set(raw)
    elif isinstance(spec, (list, tuple, set, range)) and spec and all(is_int(i) for i in spec):
        ids = {int(i) for i in spec}
    else:
        raise DFlashError(f"{what} must be a token count, a file of token ids or a list of ids, got {spec!r}")
    bad = sorted(i for i in ids if i < 0 or (vocab_size is not None and i >= vocab_size))
    if bad:
        raise DFlashError(
            f"{what}: token ids {bad[:5]} outside the vocabulary" + (f" (0..{vocab_size - 1})" if vocab_size else "")
        )
    if vocab_size is None:
        return sorted(ids)
    ids |= {int(i) for i in keep if 0 <= int(i) < vocab_size}
    return None if len(ids) == vocab_size else sorted(ids)


def validate_draft(cfg: DraftConfig, target: Target, where: str) -> None:
    """Raise DFlashError naming the first field where draft and target disagree."""
    if cfg.hidden_size != target.hidden_size:
        raise DFlashError(
            f"draft {where}: hidden_size {cfg.hidden_size} != target hidden_size "
            f"{target.hidden_size} (the draft shares the target's embedding and lm_head)"
        )
    if cfg.vocab_size is not None and cfg.vocab_size != target.vocab_size:
        raise DFlashError(f"draft {where}: vocab_size {cfg.vocab_size} != target vocab_size {target.vocab_size}")
    if cfg.num_target_layers is not None and cfg.num_target_layers != target.num_layers:
        raise DFlashError(
            f"draft {where}: num_target_layers {cfg.num_target_layers} != target's "
            f"{target.num_layers} layers (draft trained for another model?)"
        )
    if not cfg.target_layer_ids:
        raise DFlashError(f"draft {where}: no dflash_config.target_layer_ids and no num_target_layers")
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < target.num_layers]
    if bad:
        raise DFlashError(f"draft {where}: target_layer_ids {bad} out of range for a {target.num_layers}-layer target")
    if cfg.mask_token_id is None:
        raise DFlashError(f"draft {where}: dflash_config.mask_token_id is missing")
    if not 0 <= cfg.mask_token_id < target.vocab_size:
        raise DFlashError(
            f"draft {where}: mask_token_id {cfg.mask_token_id} outside the target vocab (0..{target.vocab_size - 1})"
        )
    if cfg.block_size < 2:
        raise DFlashError(f"draft {where}: block_size {cfg.block_size} < 2")
    if cfg.is_v2:
        validate_v2(cfg, where, target.vocab_size)


def validate_v2(cfg: DraftConfig, where: str, vocab_size: Optional[int] = None) -> None:
    """A DFlash 2 config names its convolution and selector sizes; never run it as v1.
    ``vocab_size``: the target's, where the draft's config names none."""
    missing = [k for k in V2_FIELDS if getattr(cfg, k) is None]
    if missing:
        raise DFlashError(
            f"DFlash 2 draft {where}: dflash_config lacks {', '.join(missing)} "
            "(architectures says DFlash2DraftModel; its convolutions and candidate selector need them)"
        )
    if cfg.conv_kernel_size < 1 or cfg.selector_rank < 1 or cfg.selector_top_k < 1:
        raise DFlashError(
            f"DFlash 2 draft {where}: conv_kernel_size, selector_rank and selector_top_k must be positive, "
            f"got {cfg.conv_kernel_size}, {cfg.selector_rank}, {cfg.selector_top_k}"
        )
    if cfg.conv_group_size < 1 or cfg.hidden_size % cfg.conv_group_size:
        raise DFlashError(
            f"DFlash 2 draft {where}: conv_group_size {cfg.conv_group_size} does not divide "
            f"hidden_size {cfg.hidden_size}"
        )
    vocab = cfg.vocab_size if cfg.vocab_size is not None else vocab_size
    if vocab is not None and cfg.selector_top_k > vocab:
        raise DFlashError(f"DFlash 2 draft {where}: selector_top_k {cfg.selector_top_k} exceeds the vocab")


def whole_safetensors(f) -> dict:
    """A safetensors file's tensor entries (name -> dtype, shape,
    data_offsets), from its header, checked to hold the data the header
    places; ValueError (or OSError) for a file cut short or without one."""
    header, start = safetensors_header(Path(f))
    try:
        tensors = {k: v for k, v in header.items() if k != "__metadata__"}
        end = start + max((v["data_offsets"][1] for v in tensors.values()), default=0)
    except (AttributeError, TypeError, KeyError, IndexError) as e:
        raise ValueError(f"a malformed header ({e})") from None
    size = Path(f).stat().st_size
    if end > size:
        raise ValueError(
            f"its header places data up to byte {end} of a {size}-byte file (truncated: an interrupted download?)"
        )
    return tensors


def draft_weight_names(path) -> set:
    """The tensor names of a draft folder's weights, from the safetensors
    headers alone; one UnreadableFile for no weights, a missing shard, or a
    file cut short of the data its header promises."""
    p = _folder(path, "draft")
    names = set()
    for f in _weight_files(p, "draft"):
        try:
            names |= set(whole_safetensors(f))
        except (OSError, ValueError, struct.error) as e:
            raise UnreadableFile(f"cannot read draft weights {f}: {e}") from None
    return names


def z_lab_names(weights: dict) -> dict:
    """A draft's weights under z-lab's names: a ``model.`` prefix dropped, and
    embedding / lm_head copies a converter kept left out (drafts borrow the target's)."""
    weights = {k[len("model.") :] if k.startswith("model.") else k: v for k, v in weights.items()}
    return {k: v for k, v in weights.items() if not k.startswith(("embed_tokens.", "lm_head."))}


def check_draft_names(cfg: DraftConfig, names, path) -> None:
    """That a draft's weight names (z-lab's, a ``model.`` prefix allowed) are
    the ones its config builds: one UnreadableFile naming the difference."""
    names = set(z_lab_names(dict.fromkeys(names)))
    expected = {k for k, _ in tree_flatten(DFlashDraft(cfg).parameters())}
    missing, extra = sorted(expected - names), sorted(names - expected)
    if missing or extra:
        raise UnreadableFile(
            f"draft {path}: weight names do not match a {cfg.kind} draft with this config"
            + (f"; missing {missing[:5]}" if missing else "")
            + (f"; unexpected {extra[:5]}" if extra else "")
        )


def read_draft(path):
    """A z-lab draft folder's config dict, weights and the place errors name."""
    p = _folder(path, "draft")
    raw = read_config(p, "draft")
    weights = {}
    for f in _weight_files(p, "draft"):
        try:
            weights.update(mx.load(f))
        except Exception as e:
            raise UnreadableFile(f"cannot read draft weights {f}: {e}") from None
    return raw, weights, str(p / "config.json")


def is_draft_config(cfg) -> bool:
    """Whether a config.json's dict is a DFlash draft's (v1 or DFlash 2)."""
    archs = cfg.get("architectures") if isinstance(cfg, dict) else None
    return isinstance(cfg, dict) and (
        "dflash_config" in cfg or bool({"DFlashDraftModel", "DFlash2DraftModel"} & set(archs or []))
    )


def draft_config(raw: dict, where: str):
    """A DraftConfig from a draft's config dict; one DFlashError naming ``where``
    for a target model's config (given where a draft goes) or a field missing
    or of the wrong kind."""
    if not is_draft_config(raw) and raw.get("model_type") in SUPPORTED_MODEL_TYPES:
        raise DFlashError(
            f"draft {where} is a target model (model_type {raw['model_type']!r}), not a DFlash draft; "
            "give the draft's folder"
        )
    try:
        cfg = DraftConfig.from_dict(raw)
    except KeyError as e:
        raise DFlashError(f"draft {where}: missing field {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise DFlashError(f"draft {where}: bad field value: {e}") from None
    if cfg.is_v2:  # what needs no target: bad input wherever the draft is read (info said "rank None")
        validate_v2(cfg, where)
    return cfg


def build_draft(
    raw: dict,
    weights: dict,
    target: Target,
    *,
    path: Path,
    where: str,
    quantize_bits: Optional[int] = None,
    group_size: int = 64,
    dtype=None,
) -> DFlashDraft:
    """A DFlash v1 or DFlash 2 draft from its config dict and weights (read
    from a folder or a draft GGUF), checked against ``target`` and bound to it.

    ``quantize_bits`` (4 or 8) quantizes the draft's linear layers at load.
    """
    cfg = draft_config(raw, where)
    if cfg.vocab_size is None:
        cfg.vocab_size = target.vocab_size  # the selector's codebooks span the target vocab
    validate_draft(cfg, target, where)
    weights = z_lab_names(weights)
    fc = weights.get("fc.weight")
    want = len(cfg.target_layer_ids) * target.hidden_size
    if fc is not None and fc.shape[-1] != want:
        raise DFlashError(
            f"draft {path}: fc.weight takes {fc.shape[-1]} inputs but "
            f"{len(cfg.target_layer_ids)} target layers x hidden {target.hidden_size} = {want}"
        )
    check_draft_names(cfg, weights, path)
    draft = DFlashDraft(cfg)
    try:
        draft.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise DFlashError(f"draft {path}: {e}") from None
    _cast(draft, dtype)
    if quantize_bits is not None:
        if quantize_bits not in (4, 8):
            raise DFlashError(f"draft quantization (--draft-quantize) must be 4 or 8 bits, got {quantize_bits}")
        nn.quantize(
            draft,
            group_size=group_size,
            bits=quantize_bits,
            class_predicate=lambda _, m: isinstance(m, nn.Linear) and m.weight.shape[-1] % group_size == 0,
        )
    mx.eval(draft.parameters())
    draft.eval()
    return draft.bind(target)
