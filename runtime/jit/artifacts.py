"""What a compiled kernel is made of: facts read from its PTX and its cubin, without a GPU.

The cubin's `.nv.info` attributes give registers and stack frame per kernel (the numbers
`ptxas -v` prints); the PTX gives the widths of global loads and stores, which conversions were
emitted, and whether any local memory (spills, dynamic register indexing) is used.
"""

from __future__ import annotations

import re
import struct
from collections import Counter

EIATTR_FRAME_SIZE = 0x11
EIATTR_MIN_STACK_SIZE = 0x12
EIATTR_REGCOUNT = 0x2F
EIFMT_SVAL = 0x04

_GLOBAL_ACCESS = re.compile(r"^\s*(?:@%p\d+\s+)?(ld|st)\.global((?:\.[a-z0-9:]+)*)\s", re.M)


def _elf_sections(data: bytes):
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise ValueError("not an ELF64 cubin")
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    raw = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    strtab_off = raw[shstrndx][4]

    def cstr(base: int, off: int) -> str:
        end = data.index(b"\0", base + off)
        return data[base + off : end].decode()

    return [(cstr(strtab_off, s[0]), s) for s in raw]


def _symbol_names(data: bytes, sections) -> dict[int, str]:
    symtab = next((s for name, s in sections if name == ".symtab"), None)
    names: dict[int, str] = {}
    if symtab is not None:
        strtab = sections[symtab[6]][1]
        for i in range(symtab[5] // 24):
            st_name = struct.unpack_from("<I", data, symtab[4] + 24 * i)[0]
            end = data.index(b"\0", strtab[4] + st_name)
            names[i] = data[strtab[4] + st_name : end].decode()
    return names


def kernel_symbols(data: bytes) -> dict[str, int]:
    """{Kernel method: its symbol's index} of the kernels in a cubin (nvdisasm -fun takes the index)."""
    return {
        kernel_method(name): i
        for i, name in _symbol_names(data, _elf_sections(data)).items()
        if name.startswith("kernel_cutlass_")
    }


def cubin_resources(data: bytes) -> dict:
    """{'registers', 'frame_bytes', 'min_stack_bytes', 'local_sections'} of the kernels in a cubin (the
    most of any of them) and 'kernel_registers', each kernel's registers (a kv-only module has two: its
    plain kernel and the compressed writers' scan kernel)."""
    sections = _elf_sections(data)
    names = _symbol_names(data, sections)
    found = {"registers": 0, "frame_bytes": 0, "min_stack_bytes": 0}
    per_kernel: dict[str, int] = {}
    for name, s in sections:
        if not name.startswith(".nv.info"):
            continue
        blob = data[s[4] : s[4] + s[5]]
        i = 0
        while i + 4 <= len(blob):
            fmt, attr = blob[i], blob[i + 1]
            if fmt == EIFMT_SVAL:
                size = struct.unpack_from("<H", blob, i + 2)[0]
                val = blob[i + 4 : i + 4 + size]
                i += 4 + size
                if attr in (EIATTR_REGCOUNT, EIATTR_FRAME_SIZE, EIATTR_MIN_STACK_SIZE) and size == 8:
                    sym, value = struct.unpack("<II", val)
                    if not names.get(sym, "kernel").startswith("kernel"):
                        continue
                    key = {EIATTR_REGCOUNT: "registers", EIATTR_FRAME_SIZE: "frame_bytes"}.get(
                        attr, "min_stack_bytes"
                    )
                    found[key] = max(found[key], value)
                    if key == "registers":
                        per_kernel[kernel_method(names[sym])] = value
            else:
                i += 4
    found["local_sections"] = sum(1 for name, _ in sections if name.startswith(".nv.local"))
    found["kernel_registers"] = dict(sorted(per_kernel.items()))
    return found


def kernel_method(symbol: str) -> str:
    """The Kernel method a kernel symbol was compiled from: the DSL names it
    kernel_cutlass_<method>_<module and argument tags>."""
    m = re.match(r"kernel_cutlass_(kernel|scan_kernel)_", symbol)
    return m[1] if m else symbol


def ptx_facts(ptx: str) -> dict:
    """Global access widths and the instructions the tests assert on."""
    widths: Counter = Counter()
    for kind, mods in _GLOBAL_ACCESS.findall(ptx):
        parts = mods.split(".")
        vec = next((p for p in parts if p.startswith("v") and p[1:].isdigit()), "v1")
        elem = next((p for p in reversed(parts) if re.fullmatch(r"[bsuf](8|16|32|64)", p)), "b32")
        bits = int(vec[1:]) * int(elem[1:])
        hint = ".nc" if "nc" in parts else ".cs" if "cs" in parts else ""
        widths[f"{kind}{hint}.{bits}"] += 1
    return {
        "global_access_bits": dict(sorted(widths.items())),
        "max_load_bits": max((int(k.rsplit(".", 1)[1]) for k in widths if k.startswith("ld")), default=0),
        "max_store_bits": max((int(k.rsplit(".", 1)[1]) for k in widths if k.startswith("st")), default=0),
        "cvt_ue8m0x2": len(re.findall(r"cvt\.rp\.satfinite\.ue8m0x2\.f32", ptx)),
        "cvt_e2m1x2": len(re.findall(r"cvt\.rn\.satfinite\.e2m1x2\.f32", ptx)),
        "cvt_e4m3x2": len(re.findall(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx)),
        "local_memory": bool(re.search(r"\.local\b|ld\.local|st\.local", ptx)),
        "griddepcontrol": len(re.findall(r"griddepcontrol\.", ptx)),
        "mul_wide_s64_or_64bit_mad": len(re.findall(r"(mul|mad)\.(lo|wide)\.[su]64", ptx)),
    }
