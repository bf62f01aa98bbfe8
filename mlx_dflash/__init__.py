"""mlx-dflash: lossless DFlash speculative decoding of Qwen3.5/3.6 on MLX."""

import importlib

# The public names, imported on first use: ``import mlx_dflash`` (and so the
# command line's start, and its Ctrl-C) does not wait for MLX, mlx-lm and
# transformers to load until something needs them.
_EXPORTS = {
    "Engine": "api",
    "GenerationResponse": "api",
    "GenerationResult": "api",
    "generate": "api",
    "load": "api",
    "stream_generate": "api",
    "BatchDecoder": "batch",
    "batch_generate": "batch",
    "GenerationConfig": "config",
    "GenerationStats": "decode",
    "generate_tokens": "decode",
    "DFlashError": "errors",
    "PrefixCache": "prefix",
    "Sampler": "sampling",
    "ChatSession": "session",
    "TrainConfig": "train",
    "train_draft": "train",
}
__all__ = sorted(_EXPORTS, key=str.lower)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    else:  # a submodule (mlx_dflash.api, ...), as an eager package would have it
        try:
            value = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
