"""The SASS of a compiled kernel and its main loop, on a CPU-only machine (triton's bundled
cuobjdump): how many instructions a warp issues per tile, and whether register spills reach the
loop (spills outside it, in the prologue or epilogue, cost little; inside, every tile pays).
Used by benchmarks/sass_loop.py and the sm_90a compile tests."""
from __future__ import annotations

import os
import re
import subprocess
import tempfile

from .compile import triton_tool

LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def sass_of(kernel) -> str:
    """cuobjdump -sass of a compiled kernel's cubin."""
    return sass_of_cubin(kernel.asm["cubin"])


def sass_of_cubin(cubin: bytes) -> str:
    """cuobjdump -sass of a cubin's bytes."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([triton_tool("cuobjdump"), "-sass", path],
                              capture_output=True, text=True, check=True).stdout


def parse(sass: str):
    """[(address, opcode with modifiers, operands)] in program order."""
    return [(int(m.group(1), 16), m.group(3), m.group(4)) for m in LINE.finditer(sass)]


def main_loop(instrs):
    """The instructions of the innermost loop that issues wgmmas: the shortest span [target,
    branch] of a backward branch holding a GMMA and no EXIT (ptxas puts an mbarrier wait's retry
    path after the kernel's EXIT and branches back into the loop from there: not a loop).
    Conditional code inside the loop (the masked tiles' predicates, the tail zeroing) is counted
    too: an upper bound on a tile's stream."""
    best = None
    for addr, op, args in instrs:
        t = re.search(r"0x([0-9a-f]+)", args) if op.startswith("BRA") else None
        if not t or int(t.group(1), 16) >= addr:
            continue
        span = [x for x in instrs if int(t.group(1), 16) <= x[0] <= addr]
        if any(x[1].startswith("EXIT") for x in span):
            continue
        if any("GMMA" in x[1] for x in span) and (best is None or len(span) < len(best)):
            best = span
    return best or []


def common_path(loop):
    """The loop's instructions minus those a forward branch inside it can skip (the masked
    tiles' predicates, the tail zeroing, the once-per-program paths): what every tile issues.
    This is the per-tile count benchmarks/NOTES.md quotes as "common path"."""
    if not loop:
        return []
    hi = loop[-1][0]
    skipped = set()
    for addr, op, args in loop:
        t = re.search(r"0x([0-9a-f]+)", args) if op.startswith("BRA") else None
        if t and addr < int(t.group(1), 16) <= hi:
            skipped.update(x[0] for x in loop if addr < x[0] < int(t.group(1), 16))
    return [x for x in loop if x[0] not in skipped]


def predicated(sass: str) -> set:
    """Addresses of the instructions that carry a predicate (@P0, @!UP1, ...)."""
    return {int(m.group(1), 16) for m in LINE.finditer(sass) if m.group(2)}


def loop_paths(loop, conditional: set) -> list:
    """Every path through one iteration of `loop` (main_loop's instructions): at a conditional
    forward branch inside the loop (its address in `conditional`, predicated()) both ways, an
    unconditional one followed, a branch out of the loop (an mbarrier wait's retry path) not
    taken. Each path is the list of instructions a warp issues, the shortest usually the plain
    tile (unmasked, no edge), the others its masked and edge variants."""
    if not loop:
        return []
    index = {x[0]: i for i, x in enumerate(loop)}
    lo, hi = loop[0][0], loop[-1][0]
    paths = []

    def walk(i, path):
        while i < len(loop):
            addr, op, args = loop[i]
            path = path + [loop[i]]
            t = re.search(r"0x([0-9a-f]+)", args) if op.startswith("BRA") else None
            if t and i < len(loop) - 1 and addr < int(t.group(1), 16) <= hi:
                walk(index[int(t.group(1), 16)], path)
                if addr not in conditional:
                    return
            i += 1
        paths.append(path)

    walk(0, [])
    return paths


def describe_paths(sass: str) -> str:
    """One line per distinct path through the main loop of `sass` (loop_paths), shortest first:
    its length and its MUFU, GMMA, BAR (bar.sync / bar.arrive) and SHFL counts."""
    loop = main_loop(parse(sass))
    rows = set()
    for path in loop_paths(loop, predicated(sass)):
        n = {k: sum(op.startswith(k) or k == "GMMA" and k in op for _, op, _ in path)
             for k in ("MUFU", "GMMA", "BAR", "SHFL")}
        rows.add((len(path),) + tuple(n.values()))
    return "\n".join(f"  path {n:5d} SASS: MUFU {m}, GMMA {g}, BAR {b}, SHFL {sh}"
                     for n, m, g, b, sh in sorted(rows))


def by_source_line(kernel, instrs) -> dict:
    """{"file.py:line": Counter(opcode)} for the given instructions (e.g. a loop's common path),
    from the line table ptxas keeps in the cubin (`nvdisasm -g`; triton compiles with line
    info). Inlined helpers are attributed to their own lines."""
    import collections
    want = {a for a, _, _ in instrs}
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        text = subprocess.run([triton_tool("nvdisasm"), "-g", "-c", path],
                              capture_output=True, text=True, check=True).stdout
    out: dict = collections.defaultdict(collections.Counter)
    where = "?"
    for line in text.splitlines():
        m = re.search(r'//## File ".*?([^/"]+)", line (\d+)', line)
        if m:
            where = f"{m.group(1)}:{m.group(2)}"
            continue
        m = LINE.search(line)
        if m and int(m.group(1), 16) in want:
            out[where][m.group(3).split(".")[0]] += 1
    return dict(out)


def local_memory_ops(instrs) -> int:
    """Local-memory (spill) loads and stores among the instructions."""
    return sum(1 for _, op, _ in instrs if op.startswith(("LDL", "STL")))
