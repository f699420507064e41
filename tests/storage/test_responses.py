"""The response store: round trips in memory and on disk, hostile ids, bad files, the caps."""

from __future__ import annotations

import json
import os

import pytest

from mlx_kvserver.chat.conversation import Message, Reasoning, Text, ToolCall, ToolResult
from mlx_kvserver.storage.responses import (ResponseStore, file_name, message_from_json,
                                            message_to_json)

RECORD = {"response": {"id": "resp_1", "output": []}, "history": []}


@pytest.mark.parametrize("disk", [False, True])
def test_round_trip_and_delete(tmp_path, disk):
    store = ResponseStore(tmp_path / "r" if disk else None)
    assert store.get("resp_1") is None
    assert store.put("resp_1", RECORD)
    assert store.get("resp_1") == RECORD
    assert store.delete("resp_1") and store.get("resp_1") is None
    assert not store.delete("resp_1")


def test_disk_records_survive_a_new_store(tmp_path):
    ResponseStore(tmp_path).put("resp_a", RECORD)
    again = ResponseStore(tmp_path)
    assert again.get("resp_a") == RECORD and len(again) == 1


def test_messages_round_trip_through_json():
    m = Message("assistant", [Reasoning("hmm"), Text("hi"), ToolCall("c1", "ns.f", '{"a": 1}')],
                "resp_x")
    t = Message("tool", [ToolResult("c1", "out", name="ns.f", is_error=True)])
    for msg in (m, t, Message("user")):
        assert message_from_json(json.loads(json.dumps(message_to_json(msg)))) == msg
    for bad in ({}, {"role": "user", "parts": [{"type": "image"}]},
                {"role": "user", "parts": [{"type": "text", "text": 3}]}, None, []):
        with pytest.raises(ValueError):
            message_from_json(bad)


def test_a_message_s_images_are_kept_with_their_pixels():
    """A follow-up by ``previous_response_id`` reads the same pictures: each stored image comes
    back with its pixels, and one whose pixels are not those it was stored as is refused."""
    from mlx_kvserver.chat.images import decode_image
    from tests.chat.pictures import file_of, picture

    image = decode_image(file_of(picture()), "test")
    msg = Message("user", [Text("what is this?"), image], "u1")
    stored = json.loads(json.dumps(message_to_json(msg)))
    back = message_from_json(stored)
    assert back == msg and back.parts[1].rgb == image.rgb
    other = decode_image(file_of(picture().rotate(90, expand=True)), "test")
    forged = dict(stored, parts=[stored["parts"][0], dict(stored["parts"][1],
                                 png=message_to_json(Message("user", [other]))["parts"][0]["png"])])
    for bad in (forged, dict(stored, parts=[dict(stored["parts"][1], png="not base64!")])):
        with pytest.raises(ValueError):
            message_from_json(bad)


@pytest.mark.parametrize("rid", ["../../etc/passwd", "/abs/path", "a/b", "..", ".", "\x00x",
                                 "x" * 5000, "é🙂", "\ud800"])
def test_hostile_ids_never_become_paths(tmp_path, rid):
    root = tmp_path / "store"
    store = ResponseStore(root)
    assert store.put(rid, RECORD)
    assert store.get(rid) == RECORD
    names = os.listdir(root)
    assert names == [file_name(rid)] and len(names[0]) == 64 + len(".json")
    assert sorted(os.listdir(tmp_path)) == ["store"]  # nothing written outside the folder


def test_corrupt_truncated_or_foreign_file_is_a_miss_and_removed(tmp_path):
    store = ResponseStore(tmp_path)
    for i, damage in enumerate([b"{not json", b"", b'{"format": 1, "id": "other", "record": {}}',
                                b'{"format": 99, "id": "r%d", "record": {}}', b"[1, 2]"]):
        rid = f"r{i}"
        store.put(rid, RECORD)
        (tmp_path / file_name(rid)).write_bytes(damage.replace(b"%d", str(i).encode()))
        assert store.get(rid) is None
        assert not (tmp_path / file_name(rid)).exists()
    assert len(store) == 0


def test_temp_files_left_by_a_crash_are_removed_and_symlinks_not_followed(tmp_path):
    root = tmp_path / "store"
    root.mkdir()
    (root / ".tmp.123.abc.x.json").write_text("half")
    target = tmp_path / "secret.json"
    target.write_text(json.dumps({"format": 1, "id": "resp_s", "record": RECORD}))
    os.symlink(target, root / file_name("resp_s"))
    store = ResponseStore(root)
    assert not (root / ".tmp.123.abc.x.json").exists()
    assert store.get("resp_s") is None  # a link is not a record of ours
    store.put("resp_s", {"response": {}, "history": []})
    assert json.loads(target.read_text())["record"] == RECORD  # replaced, not written through


def test_write_is_atomic_a_failed_write_leaves_the_old_record(tmp_path, monkeypatch):
    store = ResponseStore(tmp_path)
    store.put("r", RECORD)
    from mlx_kvserver.storage import files

    def boom(*a, **k):  # the new file's flush to the disk fails: after its bytes, before rename
        raise OSError("disk full")
    monkeypatch.setattr(files, "_flush", boom)
    assert not store.put("r", {"response": {"id": "new"}, "history": []})
    monkeypatch.undo()
    assert store.get("r") == RECORD
    assert [n for n in os.listdir(tmp_path) if n.startswith(".tmp")] == []


@pytest.mark.parametrize("disk", [False, True])
def test_entry_cap_drops_the_oldest_first(tmp_path, disk):
    store = ResponseStore(tmp_path if disk else None, max_entries=3)
    for i in range(5):
        store.put(f"r{i}", RECORD)
    assert [store.get(f"r{i}") is not None for i in range(5)] == [False, False, True, True, True]
    assert len(store) == 3
    store.put("r2", RECORD)  # rewritten: now the newest
    store.put("r5", RECORD)
    assert store.get("r3") is None and store.get("r2") == RECORD
    if disk:
        assert len(os.listdir(tmp_path)) == 3
        # NOTE: on reopening, age is the files' mtime; writes within one clock tick tie, so
        # the order is set here as the writes made it
        for age, rid in enumerate(["r4", "r2", "r5"]):
            os.utime(tmp_path / file_name(rid), ns=(10**18 + age, 10**18 + age))
        assert ResponseStore(tmp_path, max_entries=2).get("r4") is None  # the cap on reopening


def test_byte_cap(tmp_path):
    big = {"response": {}, "history": [], "pad": "x" * 400}
    store = ResponseStore(tmp_path, max_bytes=1000)
    for i in range(4):
        assert store.put(f"r{i}", big)
    assert sum(f.stat().st_size for f in tmp_path.iterdir()) <= 1000
    assert store.get("r3") is not None and store.get("r0") is None
    assert not store.put("huge", {"pad": "x" * 2000})  # larger than the whole store
    assert store.get("huge") is None


def test_the_folder_is_made_when_the_first_record_is_kept(tmp_path):
    root = tmp_path / "kv" / "responses"
    (tmp_path / "kv").mkdir()
    store = ResponseStore(root)
    assert not root.exists() and store.get("resp_1") is None and not store.delete("resp_1")
    assert store.put("resp_1", {"a": 1}) and root.is_dir()
    assert ResponseStore(root).get("resp_1") == {"a": 1}
