"""Benchmark tooling for wanspec (WAN emulation, sweeps). Not imported by the runtime packages."""
