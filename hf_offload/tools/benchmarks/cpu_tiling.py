"""What sequence tiling costs in step time on the CPU, with one torch thread and with two.

    python -m hf_offload.tools.benchmarks.cpu_tiling [--seq-lens 1024 4096] [--threads 1 2] [--rounds 7] [--busy N]

Tiling runs each per-token part of a layer (MLP, norms, projections), attention's heads and the
loss head a slice at a time, so a step issues many smaller matmuls instead of a few large ones. On
a GPU each slice's matmuls stay large (docs/longest_context.md predicts 1.05-1.10x); on the CPU,
where the tests, the examples and the docs' recipes run, a slice of a tiny model is a small matmul
and its cost is the question. This benchmark trains a tiny Llama (random weights, made-up tokens)
one forward, backward and SGD step at a time, untiled and tiled alternately on twin models with
the same weights, and prints per length and thread count the median step time of each and their
ratio, all measured in the same run. `--threads` sets `torch.set_num_threads` for each
measurement (torch's default on this machine is the number of cores).

The slices are hidden_size tokens (tiling's default on the CPU: 256 here), so 1,024 tokens make
4 slices per part and 4,096 make 16.

`--busy N` keeps N other processes spinning on the CPU while it measures: a shared machine, where
another job holds a core that one of torch's threads needs.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import statistics
import time

import torch

import hf_offload


def tiny_llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
        vocab_size=4096, max_position_embeddings=16384, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    return model.train()


def step(model, ids: torch.Tensor, optimizer) -> float:
    started = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - started


def measure(seq_len: int, threads: int, rounds: int) -> dict:
    torch.set_num_threads(threads)
    untiled, tiled = tiny_llama(0), tiny_llama(0)
    hf_offload.enable_sequence_tiling(tiled)
    ids = torch.randint(0, untiled.config.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(1))
    optimizers = {id(m): torch.optim.SGD(m.parameters(), lr=1e-6) for m in (untiled, tiled)}
    times = {"untiled": [], "tiled": []}
    for round_ in range(rounds + 1):  # the first round warms both up
        for name, model in (("untiled", untiled), ("tiled", tiled)):
            seconds = step(model, ids, optimizers[id(model)])
            if round_:
                times[name].append(seconds)
    untiled_s, tiled_s = statistics.median(times["untiled"]), statistics.median(times["tiled"])
    return {
        "seq_len": seq_len,
        "threads": threads,
        "untiled_s": untiled_s,
        "tiled_s": tiled_s,
        "ratio": tiled_s / untiled_s,
        "spread": {name: (min(values), max(values)) for name, values in times.items()},
    }


def _spin() -> None:
    while True:
        pass


@contextlib.contextmanager
def busy(processes: int):
    """`processes` other processes each holding a core, for as long as the block runs."""
    spinners = [multiprocessing.get_context("spawn").Process(target=_spin, daemon=True) for _ in range(processes)]
    for spinner in spinners:
        spinner.start()
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.terminate()
            spinner.join()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--busy", type=int, default=0, help="other processes spinning on the CPU meanwhile")
    args = parser.parse_args(argv)
    default_threads = torch.get_num_threads()
    print(f"torch {torch.__version__}, default threads {default_threads}; medians of {args.rounds} steps each; "
          f"{args.busy} other processes spinning")  # fmt: skip
    print("| tokens | threads | untiled s | tiled s | tiled / untiled | range untiled | range tiled |")
    print("|---|---|---|---|---|---|---|")
    try:
        with busy(args.busy):
            for seq_len in args.seq_lens:
                for threads in args.threads:
                    r = measure(seq_len, threads, args.rounds)
                    (ul, uh), (tl, th) = r["spread"]["untiled"], r["spread"]["tiled"]
                    print(
                        f"| {seq_len:,} | {threads} | {r['untiled_s']:.3f} | {r['tiled_s']:.3f} | {r['ratio']:.2f}x "
                        f"| {ul:.3f}-{uh:.3f} | {tl:.3f}-{th:.3f} |",
                        flush=True,
                    )
    finally:
        torch.set_num_threads(default_threads)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
