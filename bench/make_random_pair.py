"""Build the embedded default pair: a seeded random Qwen3.5 target + DFlash draft.

    python bench/make_random_pair.py [OUT_DIR]   (default: mlx_dflash/default_model)

Deterministic (fixed seeds, fixed tokenizer corpus). A trained pair replaces it
later; a random draft accepts little, so this pair shows the machinery, not speed.
"""

import shutil
import sys
from pathlib import Path

from mlx_dflash import tiny


def main(out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    # Tokenizer corpus: a few standard-library sources, present on every machine.
    import inspect, json as _json, textwrap, functools
    corpus = "\n".join(inspect.getsource(m) for m in (_json, textwrap, functools))
    tok_dir = tiny.build_tokenizer(out / "target", vocab_size=1024, corpus=corpus)
    cfg = tiny.target_config(
        vocab_size=1024, hidden_size=128, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, intermediate_size=384,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
        linear_value_head_dim=32, full_attention_interval=4,
    )
    cfg["eos_token_id"] = cfg["text_config"]["eos_token_id"] = 2  # <|im_end|>
    target = tiny.build_target(cfg, seed=1234)
    tiny.save_mlx(target, cfg, out / "target", tokenizer_dir=tok_dir)
    dcfg = tiny.draft_config(cfg, num_hidden_layers=2, block_size=16, mask_token_id=3,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                             intermediate_size=384)
    draft = tiny.build_draft(dcfg, seed=4321)
    tiny.save_draft(draft, dcfg, out / "draft")
    print(f"wrote {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "mlx_dflash" / "default_model")
