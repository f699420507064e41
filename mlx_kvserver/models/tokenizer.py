"""A model's tokenizer for chat: its chat template, end tokens, streaming decode and the prompt
encoder that tokenizes only a history's new pieces (``chat/encode.py``)."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable
from typing import Any

from ..chat.encode import PieceEncoder

log = logging.getLogger("mlx_kvserver.models")

_END_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
                "<|end_of_text|>", "<|endoftext|>", "</s>")
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}")


class StreamDecoder:
    """Incremental detokenizer: text appears as soon as it is complete UTF-8.

    Decodes a sliding window of the recent tokens and emits only the growth past what the same
    window decoded to before (so leading-space and byte-fallback rules match a full decode);
    the concatenation of all ``add`` results and ``flush`` equals ``decode`` of all the ids.
    """

    def __init__(self, decode: Any) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = self._read = 0  # window start; end of the part already emitted

    def add(self, token_id: int) -> str:
        """Feed one token id; return the new text ('' while a character is incomplete)."""
        self._ids.append(int(token_id))
        before = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        if len(text) > len(before) and not text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return text[len(before):]
        return ""

    def flush(self) -> str:
        """Return whatever is held back (an incomplete character decodes to U+FFFD)."""
        before = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return text[len(before):]


class ChatTokenizer:
    """A Hugging Face tokenizer with the chat-serving surface the server needs."""

    def __init__(self, tokenizer: Any, *, eos_token_ids: Iterable[int] = (),
                 chat_template: str | None = None) -> None:
        self.hf = tokenizer
        tpl = chat_template or tokenizer.chat_template
        if isinstance(tpl, dict):
            tpl = tpl.get("default") or next(iter(tpl.values()))
        if not tpl:
            log.warning("tokenizer has no chat template; using ChatML")
        self.chat_template: str = tpl or CHATML_TEMPLATE
        vocab = tokenizer.get_vocab()
        ids = {int(i) for i in eos_token_ids}
        if tokenizer.eos_token_id is not None:
            ids.add(int(tokenizer.eos_token_id))
        # NOTE: in gpt-oss's Harmony format <|end|> ends one message of a turn (its reasoning
        # before its answer); the turn ends at <|return|> or <|call|>, which its config lists
        harmony = "<|return|>" in vocab and "<|channel|>" in self.chat_template
        ids.update(vocab[m] for m in _END_MARKERS if m in vocab and m in self.chat_template
                   and not (harmony and m == "<|end|>"))
        self.eos_token_ids: set[int] = ids
        self.vocab_size = len(vocab)
        self.pieces = PieceEncoder(tokenizer)  # a history's pieces tokenized once

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; no BOS/EOS added (the chat template carries them)."""
        ids = self.pieces.encode(text)
        return ids if ids is not None else list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (special tokens dropped by default)."""
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens,
                              clean_up_tokenization_spaces=False)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text for ``messages`` (``{"role", "content"}``; other keys are ignored)."""
        msgs = [{"role": m["role"], "content": m.get("content") or ""} for m in messages]
        out = self.hf.apply_chat_template(msgs, chat_template=self.chat_template, tokenize=False,
                                          add_generation_prompt=add_generation_prompt)
        return out if isinstance(out, str) else str(out)

    def stream_decoder(self, skip_special_tokens: bool = True) -> StreamDecoder:
        """A fresh :class:`StreamDecoder` for one generated sequence."""
        if skip_special_tokens:
            return StreamDecoder(self.decode)
        return StreamDecoder(lambda ids: self.decode(ids, skip_special_tokens=False))

    def content_digest(self) -> str:
        """sha256 of the vocabulary, merges, added tokens and pre/post-processing rules."""
        backend = getattr(self.hf, "backend_tokenizer", None)
        blob = backend.to_str() if backend is not None else json.dumps(
            sorted(self.hf.get_vocab().items()))
        return hashlib.sha256(blob.encode()).hexdigest()
