"""The disk store's start-up scan: its index built from the files' headers alone (no tensor
data is read), removing on the way what a crash or a hostile hand left: temp files, planted
symlinks, files that are corrupt, foreign or named for something else, and orphans (page and
tail files no manifest references; a tail file that a longer one or a full page continues holds
no entry's tail). Entries and keyed arrays files (``arrays``) are indexed in the order of
their mtimes (a touch sets it), so recency survives a restart; then the store is brought within
its budget, which may have shrunk since the last run.
"""

from __future__ import annotations

import logging
import os
import re

from kv_cache.errors import FormatError
from kv_cache.tiers.disk import atomic_fs as afs
from kv_cache.tiers.disk import file_format as fmt
from kv_cache.tiers.disk import framing
from kv_cache.tiers.disk.arrays import ArrayFiles
from kv_cache.tiers.disk.index import FileInfo, StoreIndex, entry_name, token_array

log = logging.getLogger("kv_cache.tiers.disk.store")

PAGE_NAME = re.compile(r"([0-9a-f]{64})\.safetensors")
ENTRY_NAME = PAGE_NAME
_HEX2 = re.compile(r"[0-9a-f]{2}")


def build(index: StoreIndex) -> None:
    """Index pages, tails, entries and keyed arrays from their headers only; remove temp, bad
    and orphan files (a tail file that a longer one or a full page continues holds no entry's
    tail: an orphan)."""
    _index_pages(index, index.dirs.pages_fd, fmt.PAGE_FORMAT, "page")
    _index_pages(index, index.dirs.tails_fd, fmt.TAIL_FORMAT, "tail")
    found = []
    for f in _scan(index, index.dirs.entries_fd):
        if ENTRY_NAME.fullmatch(f.name):
            got = _index_file(index, index.dirs.entries_fd, f.name, lambda hdr: (
                fmt.parse_entry(index.geo, hdr), hdr.digest), "manifest")
            if got is None:
                continue
            (info, digest), size, mtime = got
            if entry_name(info.key) != f.name:
                index.bad_file(FormatError("named for another key"), index.dirs.entries_fd,
                               f.name, "manifest")
                continue
            found.append((mtime, f.name, info, size, digest))
    found += [(mtime, name, None, size, None) for mtime, name, size in ArrayFiles(index).scan()]
    for mtime, name, info, size, digest in sorted(found, key=lambda x: (x[0], x[1])):
        if info is None:  # a keyed arrays file: evicted in recency order with the entries
            index.add_arrays(name, size)
        else:
            index.add_entry(info.key, name, info, size, head_sum=digest)
        index.clock = max(index.clock, mtime)
    index.gc(list(index.pages))  # orphans: pages no manifest references
    while index.nbytes > index.max_bytes and index.evict_one(()):
        pass  # the budget may have shrunk since the last run


def _index_pages(index: StoreIndex, base_fd: int, kind: str, what: str) -> None:
    for sub in _scan(index, base_fd):
        if not (_HEX2.fullmatch(sub.name) and sub.is_dir(follow_symlinks=False)):
            continue
        try:
            sub_fd = afs.open_dir(sub.name, base_fd, create=False)
        except OSError:
            continue
        try:
            for f in _scan(index, sub_fd):
                m = PAGE_NAME.fullmatch(f.name)
                if m and m.group(1)[:2] == sub.name:
                    h = bytes.fromhex(m.group(1))
                    got = _index_file(index, sub_fd, f.name, lambda hdr: (fmt.parse_page(
                        index.geo, hdr, h, kind), hdr.digest), what)
                    if got is not None:
                        (info, digest), size, _ = got
                        index.file_landed(h, size, FileInfo(
                            info.parent, token_array(info.tokens), info.group,
                            kind == fmt.TAIL_FORMAT, info.checksum, digest, info.extras))
        finally:
            os.close(sub_fd)


def _scan(index: StoreIndex, dir_fd: int):
    """A directory's entries; temp files and planted symlinks are removed on the way."""
    try:
        items = list(os.scandir(dir_fd))
    except OSError as e:
        log.warning("disk store: cannot list a directory: %s", e)
        return []
    out = []
    for f in items:
        if f.name.startswith(afs.TMP_PREFIX):
            index.counts.temp_files_removed += afs.unlink(dir_fd, f.name)
        elif f.is_symlink() and (PAGE_NAME.fullmatch(f.name) or _HEX2.fullmatch(f.name)):
            log.warning("disk store: symlink %s planted in the store; removed", f.name[:16])
            index.counts.corrupt_files_removed += afs.unlink(dir_fd, f.name)
        else:
            out.append(f)
    return out


def _index_file(index: StoreIndex, dir_fd: int, name: str, parse, what: str):
    try:
        fd, size = afs.open_regular(name, dir_fd)
        try:
            hdr = framing.read_header(fd, size)
            mtime = os.fstat(fd).st_mtime_ns
        finally:
            os.close(fd)
        return parse(hdr), size, mtime
    except (FormatError, OSError) as err:
        index.bad_file(err, dir_fd, name, what)
        return None
