"""Reading the dynamic symbols of a shared library, and writing tiny x86-64 ones, in Python.

:func:`forwarder` writes the shared object that lets MLX call a BLAS whose symbols carry a prefix
(``cblas_sgemm`` -> ``scipy_cblas_sgemm``): each exported name is a 10-byte stub,
``endbr64; jmp *slot(%rip)``, and each slot is filled by the dynamic loader at load time
(``R_X86_64_GLOB_DAT``) with the address of the prefixed name in the library named by
``DT_NEEDED``. A tail jump leaves every register and the stack as the caller set them, so the
stub is right for any signature (Fortran's hidden string lengths included). The same writer takes
raw machine code for a name (:func:`shared_object`'s ``code``), which the tests use to make
stand-in BLAS libraries that misbehave in chosen ways.

The output has what glibc's loader needs (two ``PT_LOAD`` segments, R+X and R+W, never W+X;
``PT_DYNAMIC``; ``PT_GNU_STACK``, non-executable; a SysV ``DT_HASH``) and section headers, so
``nm -D``, ``readelf`` and :func:`dynamic_symbols` read it like any library. It is deterministic:
the same arguments give the same bytes.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from pathlib import Path

EM_X86_64 = 62
PAGE = 0x1000
ENDBR64 = b"\xf3\x0f\x1e\xfa"
_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_PHDR = struct.Struct("<IIQQQQQQ")
_SHDR = struct.Struct("<IIQQQQIIQQ")
_SYM = struct.Struct("<IBBHQQ")
_RELA = struct.Struct("<QQq")
_DYN = struct.Struct("<qQ")
# Section types, dynamic tags, flags.
SHT_PROGBITS, SHT_STRTAB, SHT_RELA, SHT_HASH, SHT_DYNAMIC, SHT_DYNSYM = 1, 3, 4, 5, 6, 11
DT_NEEDED, DT_HASH, DT_STRTAB, DT_SYMTAB, DT_RELA, DT_RELASZ, DT_RELAENT = 1, 4, 5, 6, 7, 8, 9
DT_STRSZ, DT_SYMENT, DT_SONAME = 10, 11, 14
STB_GLOBAL_FUNC = 0x12
R_X86_64_GLOB_DAT = 6


class ElfError(ValueError):
    """Not an ELF file this module can read."""


def dynamic_symbols(path: str | Path) -> tuple[int, set[str], set[str]]:
    """``(e_machine, defined, undefined)``: the global and weak names of a 64-bit little-endian
    ELF file's dynamic symbol table. Reads the file; runs nothing from it."""
    with open(path, "rb") as f:
        data = f.read(_EHDR.size)
        if len(data) < _EHDR.size or data[:6] != b"\x7fELF\x02\x01":
            raise ElfError(f"{path}: not a 64-bit little-endian ELF file")
        hdr = _EHDR.unpack(data)
        machine, shoff, shentsize, shnum = hdr[2], hdr[6], hdr[11], hdr[12]
        f.seek(shoff)
        raw = f.read(shentsize * shnum)
        sections = [_SHDR.unpack_from(raw, i * shentsize) for i in range(shnum)]
        defined: set[str] = set()
        undefined: set[str] = set()
        for sh in sections:
            if sh[1] != SHT_DYNSYM:
                continue
            strtab = sections[sh[6]]
            f.seek(strtab[4])
            names = f.read(strtab[5])
            f.seek(sh[4])
            syms = f.read(sh[5])
            for off in range(0, len(syms) - _SYM.size + 1, _SYM.size):
                st_name, info, _, shndx, _, _ = _SYM.unpack_from(syms, off)
                if info >> 4 not in (1, 2) or not st_name:  # GLOBAL or WEAK only
                    continue
                name = names[st_name:names.index(b"\0", st_name)].decode("ascii", "replace")
                (defined if shndx else undefined).add(name)
    return machine, defined, undefined


def _elf_hash(name: bytes) -> int:
    h = 0
    for c in name:
        h = ((h << 4) + c) & 0xFFFFFFFF
        g = h & 0xF0000000
        if g:
            h ^= g >> 24
        h &= ~g & 0xFFFFFFFF
    return h


class _Strings:
    def __init__(self) -> None:
        self.data = bytearray(b"\0")
        self.offsets: dict[str, int] = {}

    def add(self, s: str) -> int:
        if s not in self.offsets:
            self.offsets[s] = len(self.data)
            self.data += s.encode() + b"\0"
        return self.offsets[s]


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


def shared_object(soname: str, needed: Sequence[str] = (), forwards: Mapping[str, str] = {},
                  code: Mapping[str, bytes] = {}) -> bytes:
    """An x86-64 shared object exporting ``forwards`` (name -> target name, found in ``needed``
    or anywhere in the process) and ``code`` (name -> raw machine code) as functions."""
    targets = list(dict.fromkeys(forwards.values()))
    exported = [*forwards, *code]
    if len(set(exported)) != len(exported):
        raise ValueError("a name is both forwarded and given code")
    dynstr = _Strings()
    for s in (soname, *needed, *targets, *exported):
        dynstr.add(s)
    undef_index = {t: 1 + i for i, t in enumerate(targets)}
    names = [""] + targets + exported

    # Segment 1 (R+X): headers, hash, dynsym, dynstr, rela, text. Segment 2 (R+W): dynamic, got.
    phnum = 4
    off = _EHDR.size + phnum * _PHDR.size
    hash_off = _align(off, 8)
    nsyms = len(names)
    hash_size = 4 * (2 + nsyms + nsyms)
    dynsym_off = _align(hash_off + hash_size, 8)
    dynstr_off = dynsym_off + nsyms * _SYM.size
    rela_off = _align(dynstr_off + len(dynstr.data), 8)
    rela_size = len(forwards) * _RELA.size
    text_off = _align(rela_off + rela_size, 16)
    text = bytearray()
    stub_at: dict[str, int] = {}
    for name in exported:
        text += b"\xcc" * (_align(len(text), 16) - len(text))
        stub_at[name] = text_off + len(text)
        text += b"\0" * 10 if name in forwards else code[name]
    end1 = text_off + len(text)
    dyn_off = _align(end1, PAGE)
    dyn: list[tuple[int, int]] = [(DT_NEEDED, dynstr.add(n)) for n in needed]
    dyn += [(DT_SONAME, dynstr.add(soname)), (DT_HASH, hash_off), (DT_STRTAB, dynstr_off),
            (DT_SYMTAB, dynsym_off), (DT_STRSZ, len(dynstr.data)), (DT_SYMENT, _SYM.size)]
    if forwards:
        dyn += [(DT_RELA, rela_off), (DT_RELASZ, rela_size), (DT_RELAENT, _RELA.size)]
    dyn.append((0, 0))
    got_off = dyn_off + len(dyn) * _DYN.size
    end2 = got_off + 8 * len(forwards)

    rela = bytearray()
    for i, (name, target) in enumerate(forwards.items()):
        slot = got_off + 8 * i
        stub = stub_at[name]
        jmp = b"\xff\x25" + struct.pack("<i", slot - (stub + 10))  # jmp *slot(%rip)
        text[stub - text_off:stub - text_off + 10] = ENDBR64 + jmp
        rela += _RELA.pack(slot, undef_index[target] << 32 | R_X86_64_GLOB_DAT, 0)
    text_shndx = 5
    dynsym = bytearray(_SYM.size)
    for name in names[1:]:
        if name in stub_at:
            dynsym += _SYM.pack(dynstr.add(name), STB_GLOBAL_FUNC, 0, text_shndx, stub_at[name],
                                10 if name in forwards else len(code[name]))
        else:
            dynsym += _SYM.pack(dynstr.add(name), STB_GLOBAL_FUNC, 0, 0, 0, 0)
    buckets, chains = [0] * nsyms, [0] * nsyms
    for i, name in enumerate(names[1:], 1):
        b = _elf_hash(name.encode()) % nsyms
        chains[i], buckets[b] = buckets[b], i
    hashtab = struct.pack(f"<{2 + 2 * nsyms}I", nsyms, nsyms, *buckets, *chains)

    out = bytearray(end2)
    out[hash_off:hash_off + hash_size] = hashtab
    out[dynsym_off:dynstr_off] = dynsym
    out[dynstr_off:dynstr_off + len(dynstr.data)] = dynstr.data
    out[rela_off:rela_off + rela_size] = rela
    out[text_off:end1] = text
    out[dyn_off:got_off] = b"".join(_DYN.pack(t, v) for t, v in dyn)
    phdrs = [_PHDR.pack(1, 5, 0, 0, 0, end1, end1, PAGE),  # PT_LOAD R+X
             _PHDR.pack(1, 6, dyn_off, dyn_off, dyn_off, end2 - dyn_off, end2 - dyn_off, PAGE),
             _PHDR.pack(2, 6, dyn_off, dyn_off, dyn_off, got_off - dyn_off, got_off - dyn_off,
                        8),  # PT_DYNAMIC
             _PHDR.pack(0x6474E551, 6, 0, 0, 0, 0, 0, 16)]  # PT_GNU_STACK, not executable
    out[_EHDR.size:_EHDR.size + phnum * _PHDR.size] = b"".join(phdrs)

    shstr = _Strings()
    sections = [  # (name, type, flags, offset, size, link, info, align, entsize)
        (".hash", SHT_HASH, 2, hash_off, hash_size, 2, 0, 8, 4),
        (".dynsym", SHT_DYNSYM, 2, dynsym_off, nsyms * _SYM.size, 3, 1, 8, _SYM.size),
        (".dynstr", SHT_STRTAB, 2, dynstr_off, len(dynstr.data), 0, 0, 1, 0),
        (".rela.dyn", SHT_RELA, 2, rela_off, rela_size, 2, 0, 8, _RELA.size),
        (".text", SHT_PROGBITS, 6, text_off, len(text), 0, 0, 16, 0),
        (".dynamic", SHT_DYNAMIC, 3, dyn_off, got_off - dyn_off, 3, 0, 8, _DYN.size),
        (".got", SHT_PROGBITS, 3, got_off, end2 - got_off, 0, 0, 8, 8),
    ]
    shdrs = [_SHDR.pack(0, 0, 0, 0, 0, 0, 0, 0, 0, 0)]
    for name, typ, flags, o, size, link, info, align, entsize in sections:
        shdrs.append(_SHDR.pack(shstr.add(name), typ, flags, o, o, size, link, info, align,
                                entsize))
    shstrtab_name = shstr.add(".shstrtab")
    shstr_off = len(out)
    out += shstr.data
    shdrs.append(_SHDR.pack(shstrtab_name, SHT_STRTAB, 0, 0, shstr_off, len(shstr.data), 0, 0,
                            1, 0))
    out += b"\0" * (_align(len(out), 8) - len(out))
    shoff = len(out)
    out += b"".join(shdrs)
    ident = b"\x7fELF\x02\x01\x01" + b"\0" * 9
    out[:_EHDR.size] = _EHDR.pack(ident, 3, EM_X86_64, 1, 0, _EHDR.size, shoff, 0, _EHDR.size,
                                  _PHDR.size, phnum, _SHDR.size, len(shdrs), len(shdrs) - 1)
    return bytes(out)


def forwarder(target: str | Path, forwards: Mapping[str, str], soname: str) -> bytes:
    """A shared object that loads ``target`` (by absolute path) and exports each key of
    ``forwards`` as a jump to the target's symbol of the value's name."""
    return shared_object(soname, [str(Path(target).resolve())], forwards)
