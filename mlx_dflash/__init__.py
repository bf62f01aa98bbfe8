"""mlx-dflash: lossless DFlash speculative decoding of Qwen3.5/3.6 on MLX."""

from .api import (
    Engine,
    GenerationResponse,
    GenerationResult,
    generate,
    load,
    stream_generate,
)
from .config import GenerationConfig
from .sampling import Sampler
from .train import TrainConfig, train_draft
from .decode import GenerationStats, generate_tokens
from .errors import DFlashError
from .prefix import PrefixCache
from .session import ChatSession

__all__ = [
    "ChatSession",
    "DFlashError",
    "Engine",
    "GenerationConfig",
    "GenerationResponse",
    "GenerationResult",
    "GenerationStats",
    "generate",
    "generate_tokens",
    "load",
    "PrefixCache",
    "Sampler",
    "TrainConfig",
    "train_draft",
    "stream_generate",
]
__version__ = "0.1.0"
