"""Benchmark scenarios in virtual time: traces, the built-in workloads, the driver around kvgate's own
decision core and the simulated nodes, and the report."""
