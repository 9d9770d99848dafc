"""Reading a kernel module's SASS on the CPU: the nvdisasm to use, the cubin inside a cached
kernel.so or compiled again with line info, its instructions (with their source lines and labels)
and the class of each. attn_prologue.lab.sass counts them.

Disassembly needs `nvdisasm`: `$ATTN_PROLOGUE_NVDISASM`, then PATH, /usr/local/cuda/bin, the
`nvidia-cuda-nvdisasm` wheel (the test extra installs it: 5 MB) and the copy inside the `triton` wheel;
without one `SassToolMissing` says where it was looked for.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import re
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

from .. import env
from ..errors import AttnPrologueError
from ..jit import artifacts, compiler
from ..jit.kernel_cache import KernelCache, KernelKey
from ..launch import LaunchConfig

ENV_NVDISASM = "ATTN_PROLOGUE_NVDISASM"
EM_CUDA = 190


class SassToolMissing(AttnPrologueError, FileNotFoundError):
    """No nvdisasm to disassemble a cubin with."""


class SassError(AttnPrologueError, RuntimeError):
    """A cubin whose SASS this module cannot count (a loop, an indirect branch, a changed template)."""


# ---- tools and cubins ---------------------------------------------------------------------------------
def nvdisasm_candidates() -> list[Path]:
    out = []
    if env.get(ENV_NVDISASM) is not None:
        out.append(env.get(ENV_NVDISASM))
    if shutil.which("nvdisasm"):
        out.append(Path(shutil.which("nvdisasm")))
    out.append(Path("/usr/local/cuda/bin/nvdisasm"))
    nvidia = importlib.util.find_spec("nvidia")  # a namespace package: the CUDA component wheels
    for root in (nvidia.submodule_search_locations or []) if nvidia is not None else []:
        out.append(Path(root) / "cu13" / "bin" / "nvdisasm")  # nvidia-cuda-nvdisasm
    spec = importlib.util.find_spec("triton")
    if spec is not None and spec.origin:
        out.append(Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "nvdisasm")
    return out


@functools.cache
def nvdisasm() -> Path:
    for p in nvdisasm_candidates():
        if p.is_file() and os.access(p, os.X_OK):
            return p
    tried = ", ".join(str(p) for p in nvdisasm_candidates())
    raise SassToolMissing(
        f"no nvdisasm found (looked at {tried}): `pip install nvidia-cuda-nvdisasm` (5 MB), install CUDA's, "
        f"or set {ENV_NVDISASM}"
    )


def tool_versions() -> dict:
    """nvdisasm's path and release line, or the reason there is none."""
    try:
        tool = nvdisasm()
    except SassToolMissing as exc:
        return {"nvdisasm": None, "missing": str(exc)}
    out = subprocess.run([str(tool), "--version"], capture_output=True, text=True).stdout
    release = next((ln.strip() for ln in out.splitlines() if "release" in ln), out.strip())
    return {"nvdisasm": str(tool), "nvdisasm_release": release}


def embedded_cubin(so: bytes) -> bytes:
    """The device ELF (e_machine EM_CUDA) inside a kernel.so, cut at its last section or header."""
    i = so.find(b"\x7fELF\x02", 1)
    while i >= 0 and struct.unpack_from("<H", so, i + 18)[0] != EM_CUDA:
        i = so.find(b"\x7fELF\x02", i + 1)
    if i < 0:
        raise SassError("no embedded cubin (EM_CUDA ELF) in the shared object")
    phoff, shoff = struct.unpack_from("<QQ", so, i + 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", so, i + 0x36)
    end = max(shoff + shentsize * shnum, phoff + phentsize * phnum)
    for k in range(shnum):
        header = i + shoff + k * shentsize
        if struct.unpack_from("<I", so, header + 4)[0] != 8:  # SHT_NOBITS occupies no file bytes
            off, size = struct.unpack_from("<QQ", so, header + 0x18)
            end = max(end, off + size)
    return so[i : i + end]


def cached_cubin(cache: KernelCache, key: KernelKey) -> bytes | None:
    """The cubin of a complete, trusted cache entry, or None."""
    if cache.read_meta(key) is None:
        return None
    return embedded_cubin((cache.entry_dir(key) / "kernel.so").read_bytes())


def line_info_cubin(variant: str, config: LaunchConfig, target: str) -> bytes:
    """The module compiled as compile_entry compiles it, plus --generate-line-info."""
    import cutlass.cute as cute

    compiler.preload_runtime()
    mod = compiler.load_module(variant)
    with tempfile.TemporaryDirectory(prefix="attn-prologue-sass-") as dump:
        options = f"--gpu-arch {target} --enable-tvm-ffi --keep-ptx --keep-cubin --dump-dir {dump} --generate-line-info"
        compiled = cute.compile(
            mod.Kernel(config), *mod.fake_arguments(config), options=options, no_jit_engine=True
        )
        return compiled.artifacts.CUBIN


# ---- disassembly --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Instruction:
    address: int
    predicate: str  # "" or e.g. "@!P1"
    opcode: str  # with modifiers: "LDG.E.128.CONSTANT"
    operands: str
    function: str  # "main" or a subroutine's name
    line: tuple[str, int] | None  # (source file, line) where line info is present

    @property
    def base(self) -> str:
        return self.opcode.split(".")[0]

    @property
    def text(self) -> str:
        return f"{self.predicate} {self.opcode} {self.operands}".strip()


_INSTR = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
_LINE = re.compile(r'^\s*//## File "([^"]+)", line (\d+)')
_LABEL = re.compile(r"^([.$][\w.$]+):\s*$")


def disassemble(cubin: bytes, kernel: str = "kernel") -> tuple[list[Instruction], dict[str, int]]:
    """The instructions of one kernel's text section (the Kernel method `kernel` compiled: a kv-only
    module also has `scan_kernel`) and the address of every label."""
    tool = nvdisasm()
    try:
        symbols = artifacts.kernel_symbols(cubin)
    except (ValueError, struct.error, IndexError) as e:
        raise SassError(f"not a cubin nvdisasm can read: {e}") from e
    if kernel not in symbols:
        raise SassError(f"no kernel compiled from Kernel.{kernel} in this cubin (it has {sorted(symbols)})")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        args = [str(tool), "-c", "-g", "-fun", str(symbols[kernel]), f.name]
        proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SassError(f"nvdisasm failed: {proc.stderr.strip()[:500]}")
    instrs: list[Instruction] = []
    labels: dict[str, int] = {}
    pending: list[str] = []
    function, line = "main", None
    for raw in proc.stdout.splitlines():
        if m := _LINE.match(raw):
            line = (m[1], int(m[2]))
        elif m := _LABEL.match(raw):
            pending.append(m[1])
            if m[1].startswith("$"):
                function = m[1]
        elif m := _INSTR.match(raw):
            addr = int(m[1], 16)
            for name in pending:
                labels[name] = addr
            pending = []
            pred = (m[2] or "").strip()
            instrs.append(Instruction(addr, pred, m[3], m[4].strip(), function, line))
    return instrs, labels


# ---- instruction classes ------------------------------------------------------------------------------
CLASSES = {
    "memory": r"LDG|STG|LD|ST|LDS|STS|LDL|STL|ATOMG|ATOM|ATOMS|RED|REDG|LDGSTS|CCTL",
    "constant": r"LDC|ULDC",
    "fp32": r"FADD|FMUL|FFMA|FMNMX|FSETP|FSEL|FCHK|FSET|FSWZADD|FMUL32I|FADD32I|FFMA32I|MUFU",
    "conversion": r"F2F|F2I|I2F|F2FP|I2I|FRND|F2IP|I2FP",
    "shuffle": r"SHFL",
    "branch": r"BRA|BRX|JMP|JMX|EXIT|CALL|RET|BSSY|BSYNC|WARPSYNC|BREAK|PREEXIT|YIELD|NOP",
}
_CLASS_RE = {name: re.compile(rf"^(?:{pattern})$") for name, pattern in CLASSES.items()}


def instruction_class(base: str) -> str:
    """memory, constant, fp32, conversion, shuffle, branch, or integer (integer/logic/move, uniform
    datapath, votes and predicates: everything else)."""
    return next((name for name, rx in _CLASS_RE.items() if rx.match(base)), "integer")
