"""Multi-turn chat on one engine, each turn restoring the previous one from a prefix cache."""

from typing import Iterator, List, Optional

from .api import (
    Engine,
    GenerationResponse,
    GenerationResult,
    check_engine,
    check_template_args,
    render_chat,
    stream_generate,
)
from .config import GenerationConfig
from .errors import DFlashError, check_text
from .prefix import PrefixCache


class ChatSession:
    """A conversation kept through the tokenizer's chat template.

    Each turn's prompt extends the token ids of the previous prompt and reply
    (as ``mlx_lm.chat`` does: the reply is not re-tokenized), so the previous
    turn's end-of-generation snapshot matches; when the template renders the
    history differently (e.g. it drops earlier thinking), the whole
    conversation is re-encoded and the previous prompt's stable-boundary
    snapshot matches instead. ``prefix_cache`` defaults to a new
    :class:`PrefixCache` with the default budget; ``chat_template_config``:
    extra template arguments (e.g. ``{"enable_thinking": False}``).
    """

    def __init__(
        self,
        engine: Engine,
        system: Optional[str] = None,
        prefix_cache: Optional[PrefixCache] = None,
        chat_template_config: Optional[dict] = None,
    ):
        check_engine(engine, prefix_cache)
        check_template_args(system, chat_template_config)
        if getattr(engine.tokenizer, "chat_template", None) is None:
            raise DFlashError("this model's tokenizer has no chat template; a chat needs one")
        self.engine = engine
        self.system = system
        self.prefix_cache = prefix_cache if prefix_cache is not None else PrefixCache()
        self.chat_template_config = dict(chat_template_config or {})
        self.reset()

    def reset(self) -> None:
        """Forget the conversation (the system message stays; snapshots stay cached)."""
        self.messages: List[dict] = [{"role": "system", "content": self.system}] if self.system else []
        self._ids: List[int] = []  # prompt + reply token ids of the last turn
        self.stats = None

    def _prompt(self, text: str) -> List[int]:
        tok = self.engine.tokenizer
        msgs = self.messages + [{"role": "user", "content": text}]
        full = render_chat(tok, msgs, add_generation_prompt=True, tokenize=False, **self.chat_template_config)
        tries = [self._ids] if self._ids else []
        if tries and self._ids[-1] in tok.eos_token_ids:
            # A reply that ended at an EOS: a template that writes no end marker
            # renders the history without it, so also try the ids without it.
            tries.append(self._ids[:-1])
        for ids in tries:
            prev = tok.decode(ids)
            if full.startswith(prev):
                return ids + list(tok.encode(full[len(prev) :], add_special_tokens=False))
        return list(tok.encode(full, add_special_tokens=False))

    def stream(self, text: str, config: Optional[GenerationConfig] = None, **kwargs) -> Iterator[GenerationResponse]:
        """Send a user message; yield the reply as it is generated. Takes a
        :class:`GenerationConfig` and/or the keyword arguments of :func:`mlx_dflash.stream_generate`."""
        if not isinstance(text, str):
            raise DFlashError(f"a message must be text, got {type(text).__name__}")
        if not text.strip():
            raise DFlashError("empty message: give some text")
        for k in ("chat_template", "system", "prefix_cache", "chat_template_config"):
            if k in kwargs:
                raise DFlashError(f"{k} is set by the chat session")
        check_text(text, "the message")
        ids = self._prompt(text)
        reply, started = [], False
        try:
            for r in stream_generate(
                self.engine,
                ids,
                config,
                prefix_cache=self.prefix_cache,
                chat_template_config=self.chat_template_config,
                **kwargs,
            ):
                started = True
                reply.extend(r.tokens)
                self.stats = r.stats
                yield r
        finally:
            # A reply cut short still belongs to the conversation. Its text is
            # decoded from the ids in one go, so the next turn's rendering
            # starts with exactly the decoded ids (checked in _prompt). A
            # turn refused before its first token (past the context) does not.
            if started:
                eos = set(self.engine.tokenizer.eos_token_ids)
                content = self.engine.tokenizer.decode([t for t in reply if t not in eos])
                self.messages += [{"role": "user", "content": text}, {"role": "assistant", "content": content}]
                self._ids = ids + reply

    def send(self, text: str, config: Optional[GenerationConfig] = None, **kwargs) -> GenerationResult:
        """Send a user message; return the whole reply."""
        tokens, pieces, stats = [], [], None
        for r in self.stream(text, config, **kwargs):
            tokens.extend(r.tokens)
            pieces.append(r.text)
            stats = r.stats
        return GenerationResult("".join(pieces), tokens, stats)
