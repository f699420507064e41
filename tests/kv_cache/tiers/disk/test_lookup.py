"""Finding a prompt's cache on disk by its content (``kv_cache.tiers.disk.lookup``): after a
restart, a prompt whose message ids the store does not hold (or that has none) reuses the
longest prefix that the store's page and tail files hold, verified by tokens, reading no file to
find it and only the files it uses to restore it; for a model with recurrent state, the longest
entry the prompt contains whole."""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from kv_cache.tiers.disk.store import DiskStore
from kv_cache.pages.hashing import chain_hashes, root_hash
from kv_cache.manager import CacheManager
from kv_cache.pages.pool import PagePool
from kv_cache.model.spec_reader import spec_of_model
from tests.kv_cache.test_manager import pool_for, run, store_for
from tests.kv_cache.model.test_sequence_groups import PROMPT, greedy
from tests.kv_cache.model.test_sequence_groups import run as run_chunks
from harness.tiny_families import make_tiny_family_model
from harness.tiny_model import make_tiny_model

USERS = [list(range(10, 20)), list(range(30, 37))]  # with the answers: 10+6, 23+4 tokens


@pytest.fixture(scope="module")
def model():
    return make_tiny_model(seed=3)


def save_chat(m: CacheManager, model, users, answer_lens, runner) -> list[int]:
    """A chat saved under message ids (prompt ``u<i>``, answer ``a<i>``); its tokens."""
    seq = m.new_sequence()
    for i, (user, n) in enumerate(zip(users, answer_lens)):
        logits = runner(model, seq, user)
        m.save(f"u{i}", seq)
        greedy(model, seq.layers, logits, n, seq)
        m.save(f"a{i}", seq)
    tokens = list(seq.tokens)
    seq.close()
    m.close()
    return tokens


def answer_matches_uncached(model, seq, prompt, start, runner, n=8) -> bool:
    """Greedy from the restored ``seq`` (holding ``prompt[:start]``) equals greedy uncached."""
    got = greedy(model, seq.layers, runner(model, seq, prompt[start:]), n)[0]
    ref = make_prompt_cache(model)
    want = greedy(model, ref, model(mx.array([prompt]), cache=ref)[0, -1], n)[0]
    seq.close()
    return got == want


def opened(monkeypatch) -> list[str]:
    """Names of the files opened from now on."""
    names = []
    real = os.open
    monkeypatch.setattr(os, "open", lambda path, *a, **k: names.append(os.fsdecode(path))
                        or real(path, *a, **k))
    return names


def files(root: Path, kind: str) -> set[str]:
    return {p.name for p in (root / kind).rglob("*.safetensors")}


def restarted(model, root) -> CacheManager:
    """A manager with a new pool on the store in ``root`` (as after a restart)."""
    pool = pool_for(model)
    return CacheManager(pool, store_for(pool, root))


@pytest.fixture
def history(model, tmp_path) -> list[int]:
    return save_chat(restarted(model, tmp_path), model, USERS, [6, 4], run)


def page_names(tokens, n) -> list[str]:
    """The file names of the first ``n`` pages of ``tokens`` (the tiny pools' chain)."""
    return [h.hex() + ".safetensors" for h in chain_hashes(root_hash("tiny"), tokens, 4)[:n]]


def diverged(history, cut) -> list[int]:
    """``history[:cut]`` and three tokens, the first not ``history[cut]``."""
    first = 3 if cut >= len(history) or history[cut] != 3 else 4
    return history[:cut] + [first, 5, 6]


@pytest.mark.parametrize("keys", [[], ["not-stored", "nor-this"]], ids=["no-ids", "unknown-ids"])
def test_a_restarted_chat_without_known_ids_reuses_its_history_up_to_the_tail(
        model, tmp_path, history, monkeypatch, keys):
    assert len(history) == 27  # 6 full pages of 4 and a tail of 3 (the answer's tail file)
    prompt = history + [5, 6, 7]
    m = restarted(model, tmp_path)
    names = opened(monkeypatch)
    found = m.find(prompt, keys)
    assert (found.tokens, found.source) == (27, "disk-prefix") and names == []
    seq, match = m.start(prompt, keys)
    monkeypatch.undo()
    assert (match.tokens, match.source) == (27, "disk-prefix")
    used = [n for n in names if n.endswith(".safetensors")]
    assert sorted(used) == sorted(page_names(history, 6) + list(files(tmp_path, "tails")))
    assert not set(used) & files(tmp_path, "entries")  # no manifest read
    assert m.stats.disk_hits == 1 and m.stats.tokens_from_disk == 27
    assert answer_matches_uncached(model, seq, prompt, 27, run)
    m.close()


def test_a_prompt_that_diverges_mid_history_reuses_up_to_the_divergence(
        model, tmp_path, history, monkeypatch):
    prompt = diverged(history, 13)  # 3 full pages, then 1 token of the fourth
    m = restarted(model, tmp_path)
    names = opened(monkeypatch)
    seq, match = m.start(prompt, [])
    monkeypatch.undo()
    assert (match.tokens, match.source) == (13, "disk-prefix")
    # The fourth page's file holds the partial page: its first position is used.
    assert sorted(n for n in names if n.endswith(".safetensors")) == sorted(
        page_names(history, 4))
    assert answer_matches_uncached(model, seq, prompt, 13, run)
    m.close()


def test_a_known_id_stays_the_fast_path(model, tmp_path, history, monkeypatch):
    m = restarted(model, tmp_path)
    monkeypatch.setattr(m.store, "find_prefix", lambda *a: pytest.fail("looked up by content"))
    seq, match = m.start(history + [5], ["a1"])
    assert (match.tokens, match.source) == (27, "disk:a1")
    seq.close()
    m.close()


def flip_last_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("which", ["page", "tail"])
def test_a_corrupt_file_on_the_content_path_is_a_miss_and_removed(model, tmp_path, history,
                                                                  which):
    if which == "page":
        path = next((tmp_path / "pages").rglob(page_names(history, 3)[2]))
        want = 8  # the pages before it
    else:
        (path,) = (tmp_path / "tails").rglob("*.safetensors")
        want = 24  # the full pages
    flip_last_byte(path)
    prompt = history + [5, 6, 7]
    m = restarted(model, tmp_path)
    seq, match = m.start(prompt, [])
    assert match.tokens == want and not path.exists()
    assert m.store.stats().corrupt_files_removed == 1
    assert answer_matches_uncached(model, seq, prompt, want, run)
    m.close()


def test_the_in_memory_chat_takes_its_tail_from_disk_too(model, tmp_path):
    """While running, the pool's prefix index gives the full pages; the disk adds the tail."""
    pool = pool_for(model)
    m = CacheManager(pool, store_for(pool, tmp_path), max_resident=0)
    seq = m.new_sequence()
    run(model, seq, list(range(40, 50)))
    m.save("answer", seq)
    seq.close()
    m.sync()
    prompt = list(range(40, 50)) + [1, 2]
    seq, match = m.start(prompt, [])
    assert (match.tokens, match.source) == (10, "disk-prefix")
    assert m.stats.pages_read_from_disk == 0  # the full pages came from memory
    assert answer_matches_uncached(model, seq, prompt, 10, run)
    m.close()


# -- cache families: a sliding window, a recurrent state ------------------------------------------

FP = 8  # pages are half a window


def family_run(model, seq, tokens):
    return run_chunks(model, seq.layers, tokens, seq=seq)[-1]


def family_manager(model, family, root) -> CacheManager:
    spec = spec_of_model(model, family)
    pool = PagePool(spec=spec, page_size=FP, max_bytes=64 << 20, fingerprint="m")
    return CacheManager(pool, DiskStore(root, fingerprint="m", spec=spec, page_size=FP,
                                        max_bytes=1 << 28))


@pytest.fixture(scope="module", params=["gemma3_text", "qwen3_5"])
def family_chat(request, tmp_path_factory):
    family = request.param
    model = make_tiny_family_model(family)
    root = tmp_path_factory.mktemp(family)
    users = [PROMPT, [7, 8, 9, 10, 11, 12, 13, 14, 15]]
    tokens = save_chat(family_manager(model, family, root), model, users, [12, 5], family_run)
    assert len(tokens) == 126  # u0 100, a0 112, u1 121, a1 126
    return family, model, root, tokens


@pytest.mark.parametrize("cut, sliding, state", [
    (126, 126, 126),  # the whole history: up to the answer's tail (the state's entry end)
    (123, 123, 121),  # inside the last answer: the state resumes at the prompt's entry
    (121, 121, 121),  # at the last prompt's end, mid-page: that shorter entry's partial page
    (112, 112, 112),  # at the first answer's end: an earlier entry below a longer one
    (100, 100, 100),  # at the first prompt's end: its window pages are on disk
    (50, 0, 0),  # early on: no window pages there on disk, no entry ends there
])
def test_families_reuse_by_content_where_windows_and_states_allow(family_chat, cut, sliding,
                                                                  state):
    family, model, root, history = family_chat
    prompt = diverged(history, cut)
    m = family_manager(model, family, root)
    seq, match = m.start(prompt, [])
    want = state if family == "qwen3_5" else sliding
    assert match.tokens == want
    if want:
        assert match.source == ("disk-prefix" if family != "qwen3_5" else
                                {126: "disk:a1", 121: "disk:u1", 112: "disk:a0",
                                  100: "disk:u0"}[want])
    assert answer_matches_uncached(model, seq, prompt, want, family_run)
    m.close()


# -- through the server -------------------------------------------------------------------------


def test_a_restarted_server_reuses_a_chat_without_message_ids(tiny_lm, tmp_path):
    # The server's modules are imported here: the library's tests above do not need them.
    from harness.server_utils import running_server
    from tests.test_persistence import TURNS, ask, config

    messages = []
    with running_server([tiny_lm], config(tmp_path)) as url:
        for text in TURNS[:2]:
            messages.append({"role": "user", "content": text})
            answer = ask(url, tiny_lm.name, messages)[0]
            messages.append({"role": "assistant", "content": answer})
    turn2, turn3 = messages[:3], messages + [{"role": "user", "content": TURNS[2]}]
    with running_server([tiny_lm], config(tmp_path)) as url:  # a restart, same folder
        again, _, usage = ask(url, tiny_lm.name, turn2)
        cold, _, _ = ask(url, tiny_lm.name, turn2, use_cache=False)
    assert again == cold == messages[3]["content"]
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1
    with running_server([tiny_lm], config(tmp_path)) as url:  # and the next turn
        warm, _, usage3 = ask(url, tiny_lm.name, turn3)
        cold, _, _ = ask(url, tiny_lm.name, turn3, use_cache=False)
    assert warm == cold
    assert usage3.prompt_tokens_details.cached_tokens >= usage.prompt_tokens
