"""Development tooling shared by tests/ and benchmarks/, never imported by the library:

- compile: build the real sm_90a binaries of any kernel launch on a CPU-only machine (no GPU),
  registers / spills / shared memory / wgmma serialization from the bundled ptxas, PTX
  instruction counts, zero-filled operands of the real shapes for such builds.
- sass: the SASS of a compiled kernel and its main loop (the instruction stream per tile).
- operands: the bf16 kernel layout of the reference emulation's saved operands (tests of the
  split backward kernels).
"""
