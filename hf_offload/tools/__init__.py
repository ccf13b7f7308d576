"""The tools around the product: the `hf-offload` command (demo, estimate, bench), the memory
simulator behind `estimate`, the determinism helpers for `--compare`, and the benchmarks.

They only measure or show; training never imports them. They use the product through its
public names and `hf_offload.internal`."""
