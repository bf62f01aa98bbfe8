"""mlx-dflash: lossless DFlash speculative decoding of Qwen3.5/3.6 on MLX."""

from .api import (
    Engine,
    GenerationResponse,
    GenerationResult,
    generate,
    load,
    stream_generate,
)
from .batch import BatchDecoder, batch_generate
from .config import GenerationConfig
from .decode import GenerationStats, generate_tokens
from .errors import DFlashError
from .prefix import PrefixCache
from .sampling import Sampler
from .session import ChatSession
from .train import TrainConfig, train_draft

__all__ = [
    "BatchDecoder",
    "batch_generate",
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
