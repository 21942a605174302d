"""`flamia bench`: forward and forward+backward timings, TFLOP/s, speedups against the fastest
bf16 baseline measured in the same process, peak memory and accuracy; terminal table, JSON,
Markdown and a PNG chart. See benchmarks/README.md.

    python -m flamia.bench --dry-run
    python -m flamia.bench --quick --out DIR
"""
from __future__ import annotations


def main(argv=None) -> int:
    """Run the benchmark command line; returns the exit status (0 ok, 1 no GPU, 2 bad usage)."""
    from .run import main as _main
    return _main(argv)


__all__ = ["main"]
