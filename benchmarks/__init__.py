"""Benchmark and development scripts (run as files: python benchmarks/<script>.py); their shared
tooling is the `benchmarks.tools` package, which the tests import too."""
