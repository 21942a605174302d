"""H200-only tests (kernels at realistic sizes). Not collected by default: `pytest tests/gpu`."""
