"""Benchmark and test tooling for wanspec (WAN emulation, sweeps, a probe client, the overhead
tool, a verifier with padded forwards). Not imported by the product packages and not in the wheel:
run it from the repository root (``python -m bench ...``)."""
