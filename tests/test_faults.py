"""Faults: a server killed with SIGKILL mid-save, 50 times over; a full disk; a read-only cache.

Nothing may be lost but cache: after every kill the server starts, no temp file survives
start-up, the store is within its byte budget and every answer equals the no-cache answer. When
the disk refuses writes the server keeps answering (from memory) and says so in its log and in
``/v1/kv_cache/stats`` (``disk_save_failures``; ``disk_enabled`` false if the store cannot open).
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import stat
import threading
import time
from pathlib import Path

import httpx

import kv_cache.tiers.disk.dirs
import kv_cache.tiers.disk.store
from kv_cache.tiers.disk import atomic_fs
from mlx_kvserver.config import ServerConfig
from harness.server_procs import HTTP, Server
from harness.server_utils import running_server
from tests.test_load import disk_file_bytes

KILLS = 50
BUDGET_BYTES = 256 << 10


def ask(url: str, messages: list, use_cache: bool = True, timeout: float = 60):
    r = HTTP.post(f"{url}/v1/chat/completions", timeout=timeout, json={
        "messages": messages, "temperature": 0, "use_kv_cache": use_cache})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["message"]["content"], body["message_id"]


def stats_of(url: str) -> dict:
    (s,) = HTTP.get(f"{url}/v1/kv_cache/stats", timeout=30).json()["models"].values()
    return s


def temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.startswith(atomic_fs.TMP_PREFIX)]


# -- SIGKILL during saves --------------------------------------------------------------------------


def test_sigkill_at_random_points_during_saves_fifty_times(tiny_model_dir, tmp_path):
    cache = tmp_path / "kv"
    server = Server(tiny_model_dir, cache, tmp_path / "server.log", "--page-size", "4",
                    "--max-tokens", "12", "--max-kv-size-gb", str(BUDGET_BYTES / 2**30),
                    warm=True)  # forked with the imports done: 51 starts, ~2-3 s less each
    rng = random.Random(1234)
    history: list[dict] = []
    pending = None  # (messages, answer, message_id) of the request the last kill cut
    figures = {"kills": 0, "answered_before_kill": 0, "torn_writes_seen": 0,
               "temp_files_removed_at_start": 0, "exact_answers": 0, "evictions": 0,
               "conversations": 1}
    turn = 0
    for cycle in range(KILLS + 1):
        server.start()
        root_dirs = [p for p in cache.iterdir()] if cache.exists() else []
        assert not temp_files(cache), f"cycle {cycle}: temp files survived start-up"
        s = stats_of(server.url)
        assert s["disk_enabled"], server.log_text()[-2000:]
        assert s["disk"]["bytes_on_disk"] <= s["disk"]["budget"] == BUDGET_BYTES
        assert disk_file_bytes(cache) <= BUDGET_BYTES
        figures["temp_files_removed_at_start"] += s["disk"]["temp_files_removed"]
        assert len(root_dirs) <= 1
        if pending is not None:
            messages, content, mid = pending
            if content is not None:  # answered (with the cache) before the kill: was it exact?
                assert ask(server.url, messages, use_cache=False)[0] == content
                figures["exact_answers"] += 1
                history = messages + [{"role": "assistant", "content": content,
                                       "message_id": mid}]
            else:
                history = messages  # the same user message (and message_id) goes again
        if cycle == KILLS:
            break
        # One verified turn: with the cache as the kills left it, equal to without.
        if not history or history[-1]["role"] == "assistant":
            turn += 1
            history = history + [{"role": "user", "content": f"Turn {turn}: and then?",
                                  "message_id": f"u{turn}"}]
        warm, mid = ask(server.url, history)
        assert warm == ask(server.url, history, use_cache=False)[0], f"cycle {cycle}"
        figures["exact_answers"] += 1
        figures["evictions"] += stats_of(server.url)["disk"]["evictions"]
        history = history + [{"role": "assistant", "content": warm, "message_id": mid}]
        if len(history) > 16:  # a new conversation; the old one stays on disk until evicted
            history = [{"role": "system", "content": f"Conversation {cycle}."}]
            figures["conversations"] += 1
        # The next turn, killed at a random point: while it runs, while its entries are
        # written (after the answer), or the moment a temp file shows up in the store.
        turn += 1
        messages = history + [{"role": "user", "content": f"Turn {turn}: tell me more.",
                               "message_id": f"u{turn}"}]
        got: dict = {}

        def send(got: dict = got, messages: list = messages) -> None:
            try:
                got["answer"] = ask(server.url, messages, timeout=30)
            except (httpx.HTTPError, AssertionError):
                pass

        sender = threading.Thread(target=send)
        sender.start()
        how = cycle % 3
        if how == 0:
            time.sleep(rng.uniform(0, 0.15))
        elif how == 1:
            sender.join(timeout=30)
            time.sleep(rng.uniform(0, 0.02))
        else:
            entries = next(iter(cache.iterdir())) / "entries"
            deadline = time.monotonic() + 2
            while time.monotonic() < deadline and not any(
                    n.startswith(atomic_fs.TMP_PREFIX) for n in os.listdir(entries)):
                pass
        server.kill()
        sender.join(timeout=30)
        figures["kills"] += 1
        figures["torn_writes_seen"] += bool(temp_files(cache))
        answer = got.get("answer")
        figures["answered_before_kill"] += answer is not None
        pending = (messages, *(answer if answer is not None else (None, None)))
    server.stop()
    print(f"\nkill test: {json.dumps(figures)}")
    assert figures["kills"] == KILLS
    assert figures["torn_writes_seen"] >= 1  # some kills really landed in the middle of a save
    assert figures["temp_files_removed_at_start"] >= figures["torn_writes_seen"]
    assert figures["evictions"] > 0  # the budget was small enough to matter


# -- full disk, read-only disk (in-process, the store's writes made to fail) -----------------------


class OsWith:
    """The ``os`` module with some functions replaced (for one module's view of ``os``)."""

    def __init__(self, **replaced):
        self.__dict__.update(replaced)

    def __getattr__(self, name):
        return getattr(os, name)


def refuse(code: int):
    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code))
    return fail


def config(cache: Path) -> ServerConfig:
    return ServerConfig(max_tokens=6, page_size=8, kv_cache_dir=cache)


def turns(url: str, tag: str, n: int, history: list | None = None) -> tuple[list, int]:
    """``n`` more turns, each checked against the no-cache answer; returns the history and the
    cached prompt tokens of the last turn."""
    history = list(history or [])
    cached = 0
    for i in range(n):
        history.append({"role": "user", "content": f"{tag} question {i}?",
                        "message_id": f"{tag}-{i}"})
        r = httpx.post(f"{url}/chat/completions", timeout=60,
                       json={"messages": history, "temperature": 0})
        cold = httpx.post(f"{url}/chat/completions", timeout=60,
                          json={"messages": history, "temperature": 0, "use_kv_cache": False})
        assert r.status_code == cold.status_code == 200, r.text
        msg = r.json()["choices"][0]["message"]
        assert msg["content"] == cold.json()["choices"][0]["message"]["content"]
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        history.append({"role": "assistant", "content": msg["content"],
                        "message_id": msg["message_id"]})
    return history, cached


def model_stats(url: str) -> dict:
    (s,) = httpx.get(f"{url}/kv_cache/stats", timeout=30).json()["models"].values()
    return s


def test_full_disk_keeps_answering_and_counts_failed_saves(tiny_lm, tmp_path, monkeypatch,
                                                           caplog):
    with running_server([tiny_lm], config(tmp_path / "kv")) as url:
        history, _ = turns(url, "full", 2)
        saved = model_stats(url)["disk_saves"]
        files = sorted((tmp_path / "kv").rglob("*.safetensors"))
        monkeypatch.setattr(atomic_fs, "os", OsWith(write=refuse(errno.ENOSPC)))
        history, cached = turns(url, "full", 3, history)
        s = model_stats(url)
        assert cached > 0  # the memory cache still serves
        assert s["disk_enabled"] and s["disk_saves"] == saved
        assert s["disk_save_failures"] >= 3 and s["disk"]["errors"] >= 3
        assert "No space left on device" in caplog.text
        assert sorted((tmp_path / "kv").rglob("*.safetensors")) == files  # nothing half-written
        assert not temp_files(tmp_path / "kv")
        monkeypatch.undo()  # space again: saving resumes
        turns(url, "full", 1, history)
        assert model_stats(url)["disk_saves"] > saved


def read_only(monkeypatch) -> None:
    """Every write, create, rename, delete and timestamp change of the store fails: EROFS."""
    rofs = refuse(errno.EROFS)
    real_open = os.open

    def open_(path, flags, *args, **kwargs):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            rofs()
        return real_open(path, flags, *args, **kwargs)

    fake = OsWith(open=open_, write=rofs, mkdir=rofs, replace=rofs, unlink=rofs, utime=rofs,
                  rename=rofs)
    monkeypatch.setattr(atomic_fs, "os", fake)
    monkeypatch.setattr(kv_cache.tiers.disk.store, "os", fake)
    monkeypatch.setattr(kv_cache.tiers.disk.dirs, "os", fake)
    real_mkdir = Path.mkdir

    def mkdir(self, mode=0o777, parents=False, exist_ok=False):
        if not (exist_ok and self.is_dir()):  # like Linux: EEXIST is checked before EROFS
            rofs()
        real_mkdir(self, mode, parents, exist_ok)

    monkeypatch.setattr(Path, "mkdir", mkdir)


def test_read_only_cache_still_serves_what_it_holds_and_counts_failed_saves(
        tiny_lm, tmp_path, monkeypatch, caplog):
    with running_server([tiny_lm], config(tmp_path / "kv")) as url:
        history, _ = turns(url, "ro", 2)
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "kv").rglob("*")}
    read_only(monkeypatch)
    with running_server([tiny_lm], config(tmp_path / "kv")) as url:  # opens read-only
        history, cached = turns(url, "ro", 2, history)
        s = model_stats(url)
    assert s["disk_enabled"] and s["disk_hits"] >= 1 and cached > 0  # read from disk
    assert s["disk_saves"] == 0 and s["disk_save_failures"] >= 2
    assert "Read-only file system" in caplog.text
    monkeypatch.undo()
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "kv").rglob("*")} == before


def test_a_cache_dir_that_cannot_be_created_disables_the_disk_tier(tiny_lm, tmp_path,
                                                                   monkeypatch, caplog):
    read_only(monkeypatch)
    with running_server([tiny_lm], config(tmp_path / "kv")) as url:
        _, cached = turns(url, "nodisk", 3)
        s = model_stats(url)
    assert s["disk_enabled"] is False and s["disk"] is None and cached > 0
    assert "disk cache for" in caplog.text and "disabled" in caplog.text
    assert not (tmp_path / "kv").exists()


def test_a_prompt_larger_than_the_ram_budget_is_still_answered(tiny_lm, tmp_path):
    """Out of pages is a cache miss, never an error: one prompt needs more pages than the pool
    has (no entry is kept), with n > 1 too (the choices recompute the prompt)."""
    from harness.server_utils import make_engine
    from tests.test_load import assert_cache_at_rest

    page_bytes = tiny_lm.num_layers * 2 * tiny_lm.num_kv_heads * 8 * tiny_lm.head_dim * 4
    cfg = ServerConfig(max_tokens=5, page_size=8, kv_cache_dir=tmp_path / "kv",
                       max_kv_ram_gb=3 * page_bytes / 2**30)
    engine = make_engine([tiny_lm], cfg)
    messages = [{"role": "user", "content": "hello there " * 20, "message_id": "big"}]
    with running_server([tiny_lm], cfg, engine=engine) as url:
        answers = {}
        for n, stream, use in [(1, False, False), (1, False, True), (2, False, True),
                               (3, True, True), (2, False, False)]:
            r = httpx.post(f"{url}/chat/completions", timeout=60, json={
                "messages": messages, "n": n, "stream": stream, "use_kv_cache": use,
                "temperature": 0})
            assert r.status_code == 200, r.text
            if stream:
                assert "error" not in r.text and r.text.rstrip().endswith("data: [DONE]")
                texts = ["".join(json.loads(ln[6:])["choices"][0]["delta"].get("content") or ""
                                 for ln in r.text.splitlines()
                                 if ln.startswith("data: {") and '"index": %d' % i in ln)
                         for i in range(n)]
            else:
                texts = [c["message"]["content"] for c in r.json()["choices"]]
            answers[(n, stream, use)] = texts
        assert_cache_at_rest(engine)
    want = answers[(1, False, False)][0]
    assert all(t == want for texts in answers.values() for t in texts), answers


# -- the same, for real: a process that file permissions bind -------------------------------------


def without_privileges() -> tuple[list[str], object, str]:
    """(command prefix, preexec_fn, what) that run a process bound by file permissions: as is
    for a non-root user; for root, with CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH and CAP_FOWNER
    dropped from its bounding set (by ``setpriv``, else ``prctl`` in the child), so that a
    ``chmod`` really stops its writes. Another uid would not do here: the interpreter may live
    in a home directory only root can enter."""
    if os.geteuid() != 0:
        return [], None, "a non-root user"
    caps = "dac_override,dac_read_search,fowner"
    setpriv = shutil.which("setpriv")
    if setpriv:
        bounding = ",".join("-" + c for c in caps.split(","))
        return [setpriv, f"--bounding-set={bounding}", "--"], None, f"root without {caps}"
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def drop() -> None:
        for cap in (1, 2, 3):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER
            if prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
                raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")
    return [], drop, f"root without {caps}"


def effective_caps(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def test_real_read_only_dirs_for_an_unprivileged_process(tiny_model_dir, tmp_path):
    prefix, preexec, what = without_privileges()
    locked, cache = tmp_path / "locked", tmp_path / "cache"
    short = ("--max-tokens", "12")  # not the default 512: ~2 s an answer on two cores
    locked.mkdir()
    cache.mkdir()
    try:
        # 1. A cache directory the server may not write: no store, answers all the same.
        locked.chmod(0o555)
        a = Server(tiny_model_dir, locked, tmp_path / "a.log", *short, prefix=prefix,
                   preexec=preexec)
        a.start()
        try:
            assert effective_caps(a.proc.pid) & 0b1110 == 0, what  # no DAC override
            history = []
            for i in range(2):
                history.append({"role": "user", "content": f"Q{i}?", "message_id": f"a{i}"})
                warm, mid = ask(a.url, history)
                assert warm == ask(a.url, history, use_cache=False)[0]
                history.append({"role": "assistant", "content": warm, "message_id": mid})
            s = stats_of(a.url)
        finally:
            a.stop()
        assert s["disk_enabled"] is False and s["hits"] >= 1, s
        assert "disk cache for" in a.log_text() and "Permission denied" in a.log_text()
        assert list(locked.iterdir()) == []
        # 2. A store that opened fine, then its directories turn read-only under it.
        b = Server(tiny_model_dir, cache, tmp_path / "b.log", *short, prefix=prefix,
                   preexec=preexec)
        b.start()
        try:
            history = [{"role": "user", "content": "First?", "message_id": "b0"}]
            warm, mid = ask(b.url, history)
            history.append({"role": "assistant", "content": warm, "message_id": mid})
            assert stats_of(b.url)["disk_saves"] >= 2
            for d in [cache, *(p for p in cache.rglob("*") if p.is_dir())]:
                d.chmod(0o555)
            for i in range(2):
                history.append({"role": "user", "content": f"Then {i}?",
                                "message_id": f"b{i + 1}"})
                warm, mid = ask(b.url, history)
                assert warm == ask(b.url, history, use_cache=False)[0]
                history.append({"role": "assistant", "content": warm, "message_id": mid})
            s = stats_of(b.url)
        finally:
            b.stop()
        assert s["disk_enabled"] and s["disk_save_failures"] >= 2 and s["disk_saves"] >= 2, s
        assert "could not save" in b.log_text() and "Permission denied" in b.log_text()
        assert not temp_files(cache)
    finally:
        for d in [tmp_path, *(p for p in tmp_path.rglob("*") if p.is_dir())]:
            d.chmod(stat.S_IRWXU)
