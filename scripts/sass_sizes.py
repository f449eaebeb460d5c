#!/usr/bin/env python3
"""SASS size of each function of a built mega-kernel (a .cubin from the kernel cache), without a GPU.

    python3 scripts/sass_sizes.py $MPK_CACHE_DIR/kernels/mk_b1_t512_aot_u16_p64-<hash>.cubin --match attention

Why: the batch-1 attention and prologue bodies run once a layer per SM and are fetched cold, and changes that
added straight-line code to them ran slower even where they removed memory round trips (docs/PERF.md v0.19). This
says how many instructions each non-inlined function holds, and how many of them are local-memory traffic (LDL /
STL: register saves at a body's entry, spills, the trig functions' large-argument tables), double-precision
arithmetic (DMUL: those tables' reduction) and calls, so a change's code cost can be read before device time.
Disassembles with nvdisasm (CUDA's bin/, or the nvidia-cuda-nvdisasm wheel: ``--nvdisasm PATH``).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

INSTRUCTION_BYTES = 16  # every sm_90 SASS instruction
COUNTED = ("LDL", "STL", "DMUL", "CALL")  # opcodes reported per function (see the module docstring)

_LABEL = re.compile(r"^\s*(?:\$[A-Za-z_]\w*\$)?([A-Za-z_$][\w$]*):\s*$")
_INSTR = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


@dataclass
class Function:
    """One function of the disassembly: its (mangled) name, instruction count and counts of COUNTED opcodes."""

    name: str
    instructions: int = 0
    ops: dict = field(default_factory=dict)

    @property
    def bytes(self) -> int:
        """Code size."""
        return self.instructions * INSTRUCTION_BYTES


def parse(text: str) -> list[Function]:
    """Functions of an ``nvdisasm -c`` listing in their order: a function starts at a label that is not a local
    one (``.L_x_N``); local labels and directives inside it are skipped."""
    out: list[Function] = []
    for line in text.splitlines():
        m = _LABEL.match(line)
        if m and not m.group(1).startswith(".L"):
            out.append(Function(m.group(1)))
            continue
        m = _INSTR.search(line)
        if m and out:
            f = out[-1]
            f.instructions += 1
            if m.group(1) in COUNTED:
                f.ops[m.group(1)] = f.ops.get(m.group(1), 0) + 1
    return out


def find_nvdisasm(given: str | None) -> str:
    """nvdisasm: ``given``, else on PATH, else the nvidia-cuda-nvdisasm wheel's copy; an error says how to get one."""
    if given:
        return given
    on_path = shutil.which("nvdisasm")
    if on_path:
        return on_path
    for base in map(Path, sys.path):
        for cand in sorted(base.glob("nvidia/cu*/bin/nvdisasm")):
            return str(cand)
    raise SystemExit("sass_sizes.py: nvdisasm not found: expected it on PATH (CUDA's bin/) or from "
                     "`pip install nvidia-cuda-nvdisasm`; or pass --nvdisasm PATH")


def demangle(names: list[str]) -> list[str]:
    """C++ names through c++filt when it is there (else as they are)."""
    tool = shutil.which("c++filt")
    if not tool:
        return names
    res = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True, check=False)
    out = res.stdout.splitlines()
    return out if res.returncode == 0 and len(out) == len(names) else names


def report(funcs: list[Function], match: str | None, top: int) -> str:
    """The table: the ``top`` largest functions whose demangled name matches ``match``, and a total line."""
    names = demangle([f.name for f in funcs])
    rows = [(f, n) for f, n in zip(funcs, names) if match is None or re.search(match, n)]
    rows.sort(key=lambda r: -r[0].instructions)
    lines = [f"{'instr':>8} {'KB':>7} " + " ".join(f"{op:>5}" for op in COUNTED) + "  function"]
    for f, n in rows[:top]:
        lines.append(f"{f.instructions:>8} {f.bytes / 1024:>7.1f} " + " ".join(f"{f.ops.get(op, 0):>5}" for op in COUNTED)
                     + f"  {n[:120]}")
    total = sum(f.instructions for f, _ in rows)
    lines.append(f"{total:>8} {total * INSTRUCTION_BYTES / 1024:>7.1f}  in {len(rows)} function(s)"
                 + (f" matching {match!r}" if match else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cubin", help="a kernel binary, e.g. from $MPK_CACHE_DIR/kernels/")
    ap.add_argument("--match", help="only functions whose demangled name matches this regular expression")
    ap.add_argument("--top", type=int, default=30, help="rows to print (default 30)")
    ap.add_argument("--nvdisasm", help="the nvdisasm to use")
    a = ap.parse_args(argv)
    if not Path(a.cubin).is_file():
        raise SystemExit(f"sass_sizes.py: {a.cubin}: no such file (expected a .cubin, e.g. from "
                         "$MPK_CACHE_DIR/kernels/ after scripts/prebuild_kernels.py)")
    res = subprocess.run([find_nvdisasm(a.nvdisasm), "-c", a.cubin], capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise SystemExit(f"sass_sizes.py: nvdisasm failed on {a.cubin}: {res.stderr.strip()[-400:]}")
    print(report(parse(res.stdout), a.match, a.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
