from .hf import load_draft, load_target, load_tokenizer, read_config

__all__ = ["load_draft", "load_target", "load_tokenizer", "read_config"]
