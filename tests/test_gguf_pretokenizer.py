"""``tokenizer.ggml.pre`` as llama.cpp names it (src/llama-vocab.cpp): GGUFs
written by the converter stand-in (tests/gguf_writer.py) from Hugging Face
folders whose tokenizer uses that split load, and tokenize as transformers
does with the folder's own tokenizer."""

import json
from pathlib import Path

import pytest
from gguf_writer import convert_hf_to_gguf
from support.reference import reference_greedy
from test_gguf import add_mtp, mlx_lm_model

import mlx_dflash
from mlx_dflash.cli import main
from mlx_dflash.errors import DFlashError
from mlx_dflash.loading import load_tokenizer
from mlx_dflash.loading.gguf import open_gguf, write_tokenizer
from tools import tiny

# The split patterns as the models' tokenizer.json files write them (GPT-2's
# is ByteLevel's built-in regex, so it has no pattern here).
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's regex list for LLAMA_VOCAB_PRE_TYPE_DEFAULT (no model ships it;
# the reference is a tokenizer.json that splits by it the way llama.cpp does).
DEFAULT_SPLITS = (
    r"[\p{P}\$\+<=>\^~\|]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
)

CORPUS = (
    "def tokenize(text: str) -> list[int]:\n    return [ord(c) for c in text]  # 42\n\n"
    "class Foo(Bar):\n\tdef __init__(self, x=1_000):\n\t\tself.x = x ** 2\r\n"
    "I'm sure they'll say it's fine; we've seen what you'd do. DON'T WON'T Isn't\n"
    "Prices: $12.99, 1,000,000.25, 3.14159, 2024-12-01, 0x1F, 007, 123456789.\n"
    "नमस्ते दुनिया, हिन्दी में लिखा गया पाठ। Crème brûlée, naïve café résumé; "
    "中文字符测试，日本語のテキスト。한국어 문장. Emoji 🙂👍🏽🇫🇷 done!!! ... ?? <=> ~|^ `x`\n"
    "    indented    text   with   runs\n\n\n   of spaces  \t\t and tabs\n"
) * 4

TEXTS = [
    "def f(x_1):\n    return x_1 ** 2  # square\n\n\tif a != b: pass\r\n",
    "I'm sure they'll say it's fine; IT'S WE'VE/we've, you'd DON'T I'M 'tis O'Sullivan O'DONNELL o'clock",
    "12345678 1,000,000.25 3.14159 007 x86_64 2024-12-01 ١٢٣ १२३",
    "नमस्ते दुनिया; café cafe\u0301 re\u0301sume\u0301 中文字符，日本語。한국어 🙂👍🏽🇫🇷",
    "a   b\t\t c \n\n\n  d    \n   leading and trailing   ",
    "x  \n  y \u00a0 nbsp\u3000ideographic\u2003em \r\n\r\n",
    "Hello!!! ... ?? $+<=>^~| `~` {[()]} @#%&* <|im_end|> after",
]


def hf_tokenizer(path: Path, kind: str) -> Path:
    """A byte-level BPE tokenizer built the way such a model's tokenizer.json
    is, trained tiny, saved with transformers' ``save_pretrained``."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Trained on coarse pieces (words with their punctuation, whitespace runs)
    # of text that includes the test texts, so merges span the boundaries where
    # splits differ: a split other than the tokenizer's own gives other ids.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r" ?\S+|\s+"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        special_tokens=tiny.SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([CORPUS, "".join(TEXTS) * 3, tiny._CORPUS], trainer=trainer)
    if kind == "gpt2":  # GPT-2's tokenizer.json: no normalizer, ByteLevel with its own regex
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        splits = {"qwen2": [QWEN2_SPLIT], "qwen2-plain": [QWEN2_SPLIT], "qwen35": [QWEN35_SPLIT]}
        splits = splits.get(kind, DEFAULT_SPLITS)
        if kind in ("qwen2", "qwen35"):  # Qwen2's and Qwen3.5's tokenizer.json declare NFC
            tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=tiny.CHAT_TEMPLATE
    )
    fast.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Per reference tokenizer kind: a tiny HF model folder holding it, and
    the tokenizer's own folder."""
    out = {}
    cfg = tiny.target_config(vocab_size=768)
    model = tiny.build_target(cfg, seed=2)
    # qwen2-plain: Qwen2's split without Qwen's NFC, as the other models
    # that share the split (StableLM2, Hunyuan, ...) tokenize
    for kind in ("gpt2", "qwen2", "qwen2-plain", "qwen35", "default"):
        root = tmp_path_factory.mktemp(kind)
        tok = hf_tokenizer(root / "tok", kind)
        out[kind] = tiny.save_hf(model, cfg, root / "hf", tokenizer_dir=tok), tok
    return out


def reference(tok_dir):
    """transformers' load of the tokenizer folder. (Not of the model folder:
    transformers 5 builds a qwen3_5 model's tokenizer with Qwen3.5's own split
    whatever its tokenizer.json says.)"""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tok_dir))


def encode_all(tok, texts=TEXTS):
    return [tok.encode(s, add_special_tokens=False) for s in texts]


def test_gpt2_gguf_loads_and_tokenizes_as_transformers(folders, tmp_path, capsys):
    # llama.cpp's converter writes pre "gpt-2" for GPT-2-like BPE tokenizers;
    # refused before ("supported: gpt2, ...").
    hf, tok = folders["gpt2"]
    path = convert_hf_to_gguf(hf, tmp_path / "m.gguf", pre="gpt-2")
    eng = mlx_dflash.load(path)
    ref = reference(tok)
    want = encode_all(ref)
    assert encode_all(eng.tokenizer) == want
    assert [eng.tokenizer.decode(ids) for ids in want] == [ref.decode(ids) for ids in want]
    # The merges matter: the texts do not fall apart into single bytes.
    assert sum(map(len, want)) < 0.6 * sum(len(s.encode()) for s in TEXTS)
    assert "warning" not in capsys.readouterr().err


# A few names of each group llama.cpp maps to the GPT-2, Qwen2 and Qwen3.5
# regexes, "default", and the key missing (None), with the folder whose
# tokenizer splits that way.
CASES = [
    ("phi-2", "gpt2"),
    ("jina-v2-code", "gpt2"),
    ("a.x-4.0", "gpt2"),
    ("modern-bert", "gpt2"),
    ("gigachat", "gpt2"),
    ("mpt", "gpt2"),
    ("olmo", "gpt2"),
    ("qwen2", "qwen2"),
    ("deepseek-r1-qwen", "qwen2"),
    ("megrez", "qwen2-plain"),
    ("stablelm2", "qwen2-plain"),
    ("qwen35", "qwen35"),
    ("default", "default"),
    (None, "default"),
    ("", "default"),  # an empty key: llama.cpp warns and takes its default split, as for a missing one
]


@pytest.mark.parametrize("pre, kind", CASES, ids=[str(p) for p, _ in CASES])
def test_each_group_splits_as_its_tokenizer(folders, tmp_path, capsys, pre, kind):
    hf, tok_dir = folders[kind]
    path = convert_hf_to_gguf(hf, tmp_path / "m.gguf", pre=pre)
    tok = load_tokenizer(write_tokenizer(open_gguf(path), tmp_path / "tok"))
    assert encode_all(tok) == encode_all(reference(tok_dir))
    warned = "warning: the GGUF has no tokenizer.ggml.pre; using llama.cpp's 'default' split"
    assert (warned in capsys.readouterr().err) == (not pre)


def test_groups_differ_where_their_splits_do(folders, tmp_path):
    # Loading one group's vocabulary with another group's name gives other
    # ids on these texts: each name picks its own split, not a shared one.
    hf, tok_dir = folders["qwen35"]
    got = {}
    for pre in ("gpt-2", "qwen2", "qwen35", "default"):
        path = convert_hf_to_gguf(hf, tmp_path / f"{pre}.gguf", pre=pre)
        got[pre] = encode_all(load_tokenizer(write_tokenizer(open_gguf(path), tmp_path / pre)))
    assert got["qwen35"] == encode_all(reference(tok_dir))
    assert len({json.dumps(v) for v in got.values()}) == 4


@pytest.mark.parametrize(
    "pre, kind",
    [
        ("gpt-2", "gpt2"),
        ("mpt", "gpt2"),
        ("qwen2", "qwen2"),
        ("hunyuan", "qwen2-plain"),
        ("qwen35", "qwen35"),
        ("default", "default"),
        (None, "default"),
    ],
    ids=str,
)
def test_split_equals_llama_cpp(folders, tmp_path, pre, kind):
    # llama.cpp's own tokenizer on the same file. It normalizes no BPE text
    # and we add Qwen's NFC, so the texts are given in NFC.
    import unicodedata

    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    path = convert_hf_to_gguf(folders[kind][0], tmp_path / "m.gguf", pre=pre)
    tok = load_tokenizer(write_tokenizer(open_gguf(path), tmp_path / "tok"))
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    texts = [unicodedata.normalize("NFC", s) for s in TEXTS]
    assert encode_all(tok, texts) == [llm.tokenize(s.encode(), add_bos=False, special=True) for s in texts]


def test_gpt2_gguf_with_mtp_block_decodes_as_without(folders, tmp_path):
    # The converter keeps Qwen3.5's MTP block by default (blk.N.nextn.*): the
    # file still loads and greedy-decodes as the same model converted without it.
    cfg = tiny.target_config(vocab_size=768)
    tok_dir = folders["gpt2"][1]
    hf = tiny.save_hf(tiny.build_target(cfg, seed=9), cfg, tmp_path / "hf", tokenizer_dir=tok_dir)
    add_mtp(hf)
    with_mtp = convert_hf_to_gguf(hf, tmp_path / "mtp.gguf", pre="gpt-2")
    without = convert_hf_to_gguf(hf, tmp_path / "plain.gguf", pre="gpt-2", mtp=False)
    n = cfg["text_config"]["num_hidden_layers"]
    assert any(t.name == f"blk.{n}.nextn.eh_proj.weight" for t in open_gguf(with_mtp).tensors)
    prompt = "def f(x):\n    return x ** 2  # it's 12345"
    a = mlx_dflash.generate(mlx_dflash.load(with_mtp), prompt, max_tokens=24)
    b = mlx_dflash.generate(mlx_dflash.load(without), prompt, max_tokens=24)
    assert a.tokens == b.tokens
    # ... and as mlx-lm's load of the HF folder, fed transformers' ids (up to
    # the end-of-generation token, where the engine stops).
    ids = reference(tok_dir).encode(prompt, add_special_tokens=False)
    ref = reference_greedy(mlx_lm_model(hf), ids, 24)
    assert a.tokens == ref[: len(a.tokens)] and len(a.tokens) >= 4
    assert len(a.tokens) == 24 or a.stats.finish_reason == "stop"


@pytest.mark.parametrize("pre", ["qwen9000", "gpt2", "llama3"])
def test_unknown_pre_name_is_one_error(folders, tmp_path, capsys, pre):
    # "gpt2" is the tokenizer *model* name, which llama.cpp refuses as a pre
    # name; "llama3" is a name llama.cpp knows, with a split not written here.
    path = convert_hf_to_gguf(folders["gpt2"][0], tmp_path / "m.gguf", pre=pre)
    with pytest.raises(
        DFlashError,
        match=rf"unknown GGUF pre-tokenizer type '{pre}' \(tokenizer\.ggml\.pre\): "
        r"supported are the \d+ llama\.cpp names that use its GPT-2, Qwen2, "
        r"Qwen3\.5 or default split",
    ):
        write_tokenizer(open_gguf(path), tmp_path / "tok")
    # The CLI: one error line, exit 2 (test_gguf.py runs it as a process too).
    with pytest.raises(SystemExit) as e:
        main(["generate", "hi", "--model", str(path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and f"'{pre}'" in lines[0] and "GPT-2, Qwen2, Qwen3.5 or default" in lines[0], err
    assert "Traceback" not in err
