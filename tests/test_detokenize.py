"""Streamed text equals the tokenizer's decoding of the tokens, a piece at a time."""

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

import mlx_dflash
from mlx_dflash.detokenize import Detokenizer

TEXT = (
    "def f(x):\n    return x  # héllo wörld ✓ 日本語 😀\n"
    "class Foo(object):\n    def __init__(self, a):\n        self.a = a\n"
) * 3


def streamed(tok, ids):
    d = Detokenizer(tok)
    pieces = []
    for t in ids:
        d.add_token(t)
        pieces.append(d.last_segment)
    d.finalize()
    pieces.append(d.last_segment)
    assert "".join(pieces) == d.text
    return pieces


@pytest.fixture(scope="module")
def engine():
    return mlx_dflash.load()


def test_byte_level_text_keeps_its_leading_space_and_whole_characters(engine):
    """mlx-lm's BPE detokenizer dropped the first token's leading space: a
    completion of "class Foo(object):\\n    def" read "__init__(self" and
    prompt + text was no longer the document."""
    tok = engine.tokenizer
    rnd = random.Random(0)
    ids = tok.encode(TEXT, add_special_tokens=False)
    for _ in range(40):
        a = rnd.randrange(len(ids))
        part = ids[a : a + rnd.randrange(1, 40)]
        pieces = streamed(tok, part)
        assert "".join(pieces) == tok.decode(part)
        # A piece never ends inside a character the next token completes.
        assert all("\ufffd" not in p for p in pieces[:-1]) or "\ufffd" in tok.decode(part)
    assert "".join(streamed(tok, tok.encode(" __init__", add_special_tokens=False))) == " __init__"


def test_sentencepiece_style_text_equals_its_decoding(tmp_path):
    """A Metaspace tokenizer decodes a text's first word without its marker
    space and later words with it: each piece is decoded in the context of
    the tokens before it, so the stream still equals the whole decoding."""
    t = Tokenizer(models.BPE(unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Metaspace()
    t.decoder = decoders.Metaspace()
    t.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"], show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=t)
    ids = tok.encode("class Foo: the a self return", add_special_tokens=False)
    # A word alone decodes without its marker space, after another word with it.
    i = next(i for i in range(1, len(ids)) if tok.convert_ids_to_tokens(ids[i]).startswith("▁") and ids[i] != ids[0])
    word = tok.decode(ids[i : i + 1])
    assert word[0] != " " and tok.decode(ids[: i + 1]).endswith(" " + word)
    for a in range(len(ids)):
        for b in range(a + 1, len(ids) + 1):
            assert "".join(streamed(tok, ids[a:b])) == tok.decode(ids[a:b])


def test_generated_text_is_the_decoding_of_its_tokens(engine):
    prompt = "class Foo(object):\n    def"
    r = mlx_dflash.generate(engine, prompt, max_tokens=8, baseline=True)
    assert r.text == engine.tokenizer.decode(r.tokens) and r.text.startswith(" ")
    pieces = [x.text for x in mlx_dflash.stream_generate(engine, prompt, max_tokens=8)]
    assert "".join(pieces) == r.text
    (b,) = mlx_dflash.batch_generate(engine, [prompt], max_tokens=8)
    assert b.text == r.text
