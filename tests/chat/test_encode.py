"""Tokenizing rendered prompts piece by piece (mlx_kvserver/chat/encode.py): the same ids as
tokenizing the whole text, for every template family, with earlier pieces reused."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from mlx_kvserver.chat.conversation import Conversation, Message, Reasoning, Text, Tool, ToolCall
from mlx_kvserver.chat.conversation import ToolResult
from mlx_kvserver.chat.encode import PieceEncoder, piece_splitter
from mlx_kvserver.chat.formats import detect
from mlx_kvserver.chat.render import render
from tests.chat.templates import FAMILIES, make_chat_tokenizer

TOOL = Tool("read_file", "Read a file", {"type": "object", "properties": {
    "path": {"type": "string"}}, "required": ["path"]})


def whole(tok, text: str) -> list[int]:
    return list(tok.hf.encode(text, add_special_tokens=False))


def history(turns: int) -> list[Message]:
    msgs = [Message("system", [Text("You are a coding agent. Be brief.\n" * 20)]),
            Message("user", [Text("Fix the failing test in src/app.py")])]
    for i in range(turns):
        msgs.append(Message("assistant", [Reasoning(f"I should look at file {i}."),
                                          Text(f"Reading file {i}."),
                                          ToolCall(f"call_{i}", "read_file",
                                                   f'{{"path": "src/m{i}.py"}}')]))
        msgs.append(Message("tool", [ToolResult(f"call_{i}",
                                                f"def f{i}(x):\n    return x + {i}\n" * 5)]))
    return msgs


@pytest.mark.parametrize("family", FAMILIES)
def test_an_agent_history_tokenizes_as_a_whole_text_does(family):
    tok = make_chat_tokenizer(family)
    assert tok.pieces.active, f"{family}: its added tokens are plain strings"
    fmt = detect(tok)
    for turns in range(4):
        text = render(tok, fmt, Conversation(messages=history(turns), tools=[TOOL])).text
        assert tok.encode(text) == whole(tok, text)


def test_the_next_turn_tokenizes_only_its_new_pieces():
    tok = make_chat_tokenizer("qwen3")
    fmt = detect(tok)
    first = render(tok, fmt, Conversation(messages=history(2), tools=[TOOL])).text
    tok.encode(first)
    misses, hits = tok.pieces.misses, tok.pieces.hits
    nxt = render(tok, fmt, Conversation(messages=history(3), tools=[TOOL])).text
    assert tok.encode(nxt) == whole(tok, nxt)
    pieces = {p for p in piece_splitter(tok.hf).split(nxt)[0::2] if p}  # distinct texts
    new = tok.pieces.misses - misses
    assert 0 < new <= 6, "only the new turn's pieces (and the generation prompt's) are new"
    assert tok.pieces.hits - hits == len(pieces) - new  # the rest came from the first turn
    assert len(pieces) - new > 10


def test_a_small_budget_keeps_the_newest_pieces_and_the_ids_right():
    tok = make_chat_tokenizer("qwen25")
    enc = PieceEncoder(tok.hf, budget_chars=300)
    fmt = detect(tok)
    for turns in range(4):
        text = render(tok, fmt, Conversation(messages=history(turns))).text
        assert enc.encode(text) == whole(tok, text)
        assert enc.chars <= 300
        assert enc.chars == sum(map(len, enc.pieces))


def _metaspace_first() -> PreTrainedTokenizerFast:
    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tk.decoder = decoders.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"],
                                  show_progress=False)
    tk.train_from_iterator(["a b c hello world def return x y"] * 20, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>")


def test_a_tokenizer_that_treats_its_first_piece_apart_is_tokenized_whole():
    hf = _metaspace_first()
    text = "<s>a b</s>a<s> hello"
    pieces = [hf.backend_tokenizer.encode(p, add_special_tokens=False).ids
              for p in ("a b", "a", " hello")]
    assert pieces[1] != hf.backend_tokenizer.encode("<s>a", add_special_tokens=False).ids[1:], \
        "this tokenizer's pieces alone are not its whole text's pieces (what the probe finds)"
    assert piece_splitter(hf) is None
    enc = PieceEncoder(hf)
    assert not enc.active and enc.encode(text) is None


def test_added_tokens_that_strip_spaces_turn_the_pieces_off():
    tok = make_chat_tokenizer("qwen25")
    tok.hf.add_tokens([AddedToken("<mark>", lstrip=True, normalized=False)])
    assert piece_splitter(tok.hf) is None


MARKS = ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.sampled_from(MARKS), st.text(min_size=0, max_size=12),
                          st.sampled_from([" ", "\n", "  ", "<", "|", "im_end", "<|im_"])),
                max_size=12))
def test_any_text_tokenizes_as_a_whole(parts):
    tok = _QWEN3
    text = "".join(parts)
    assert tok.encode(text) == whole(tok, text)


_QWEN3 = make_chat_tokenizer("qwen3")
