"""Measurements behind the defaults, the GPU commands and the CPU-overhead benchmark, each run as
`python -m hf_offload.tools.benchmarks.NAME`."""
