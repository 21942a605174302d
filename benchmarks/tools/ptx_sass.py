"""SASS of a PTX file built elsewhere (CuTe DSL's kept PTX: `cute_bwd_sm90.py --compile` writes it
to /tmp/cute_bwd_dump), assembled for sm_90a by the ptxas that ships with triton, so that a CuTe
DSL kernel's innermost wgmma loop can be counted as the Gluon kernels' are
(`bwd_sm90_compile.py --sass`).

    python benchmarks/tools/ptx_sass.py /tmp/cute_bwd_dump/*.ptx

Triton's ptxas may read an older PTX ISA than the one CuTe DSL writes; the header's `.version`
is lowered to the newest it accepts when no newer feature is used (ptxas reports the first one
otherwise). Prints the loop's length, its opcodes (most first) and the registers / spills
ptxas reports.
"""
from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from benchmarks.tools.compile import triton_tool  # noqa: E402
from benchmarks.tools.sass import main_loop, parse, sass_of_cubin  # noqa: E402


def assemble(ptx: str, arch: str = "sm_90a") -> tuple[str, str]:
    """(cuobjdump -sass text, ptxas -v report) of PTX source; the `.version` lowered once if
    this ptxas names a newer one than it supports."""
    with tempfile.TemporaryDirectory() as d:
        src, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        for _ in range(2):
            with open(src, "w") as f:
                f.write(ptx)
            r = subprocess.run([triton_tool("ptxas"), f"-arch={arch}", "-O3", "-v", src, "-o",
                                cubin], capture_output=True, text=True)
            m = re.search(r"Unsupported \.version (\S+); current version is '(\S+)'", r.stderr)
            if r.returncode == 0 or not m:
                break
            ptx = re.sub(r"^\.version\s+\S+", f".version {m.group(2)}", ptx, count=1, flags=re.M)
        if r.returncode != 0:
            raise RuntimeError(r.stderr.strip())
        with open(cubin, "rb") as f:
            return sass_of_cubin(f.read()), r.stderr


def main():
    for path in sys.argv[1:]:
        sass, report = assemble(open(path).read())
        loop = main_loop(parse(sass))
        ops = collections.Counter(op.split(".")[0] for _, op, _ in loop)
        usage = " ".join(re.findall(r"Used \d+ registers|\d+ bytes spill stores", report))
        print(f"{os.path.basename(path)[:60]}: {usage}")
        print(f"  innermost wgmma loop: {len(loop)} SASS (every branch of it)")
        print("  " + " ".join(f"{o}:{n}" for o, n in ops.most_common(24)))


if __name__ == "__main__":
    main()
