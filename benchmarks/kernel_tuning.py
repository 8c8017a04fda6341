"""Tile and launch settings of kernels/ on a CUDA GPU: prints the timings that chose TRITON_OPS, FUSED_LINEAR and
_launch.

    python benchmarks/kernel_tuning.py            # needs CUDA; bfloat16, Qwen2's vocabulary

linear_token_logprobs forward+backward at N = 16,384, H = 896 and 3,584, V = 151,936 for several matmul tiles
(TRITON_OPS.tile_elements x max_rows), with TRL's chunked log-prob as the anchor measured in the same run; the same,
forward and forward+backward, for the fused-linear kernel (KERNELS_LINEAR=fused) at several FUSED_LINEAR settings;
token_logprobs forward and forward+backward at N = 16,384, V = 151,936 for several BLOCK x num_warps of the
row kernels. Medians of 10 timed calls (CUDA events) after 2 warm-ups, on fresh random inputs.
"""
import dataclasses
import importlib.util
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernels  # noqa: E402


def load_kernels_benchmark():
    """benchmarks/kernels.py as a module (its name would clash with the kernels package): its Clock and TRL call."""
    spec = importlib.util.spec_from_file_location("kernels_benchmark", Path(__file__).with_name("kernels.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernel_tuning.py needs a CUDA GPU")
    bench = load_kernels_benchmark()
    median_ms = bench.Clock(torch.device("cuda"), repeats=10).ms  # CUDA events, 2 warm-ups, median of 10
    module = kernels._triton_module(False)
    base_ops, base_launch, base_fused = module.TRITON_OPS, module._launch, module.FUSED_LINEAR
    gen = torch.Generator(device="cuda").manual_seed(0)
    n, vocab = 16_384, 151_936
    targets = torch.randint(0, vocab, (n,), device="cuda", generator=gen)
    g = torch.randn(n, device="cuda", generator=gen)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bfloat16, N {n}, V {vocab}\n")
    fused_rows = ["| H | BLOCK_N | BLOCK_V | BLOCK_H | SPLITS | num_warps | num_stages | fwd ms | fwd+bwd ms "
                  "| vs TRL chunked |", "|---|---|---|---|---|---|---|---|---|---|"]
    print("| H | tile_elements | max_rows | fwd+bwd ms | vs TRL chunked |")
    print("|---|---|---|---|---|")
    for h in (896, 3584):
        hidden = torch.randn(n, h, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
        weight = (torch.randn(vocab, h, device="cuda", generator=gen) * 0.02).to(torch.bfloat16).requires_grad_()
        step = lambda f: torch.autograd.grad((f() * g).sum(), (hidden, weight))  # noqa: E731
        try:
            # benchmarks/kernels.py's TRL call (its chunk of 32,768, as TRL's trainer uses it)
            trl_ms = median_ms(lambda: step(lambda: bench.trl_logprobs(hidden, weight, targets)))
        except Exception as e:  # noqa: BLE001
            print(f"(TRL not timed: {type(e).__name__}: {e})")
            trl_ms = float("nan")
        print(f"| {h} | TRL chunked | - | {trl_ms:.2f} | 1.00x |")
        for tile, rows in ((1 << 26, 4096), (1 << 26, 8192), (1 << 27, 8192), (1 << 27, 16384), (1 << 25, 2048),
                           (1 << 28, 16384), (1 << 26, 16384)):
            module.TRITON_OPS = dataclasses.replace(base_ops, tile_elements=tile, max_rows=rows)
            ms = median_ms(lambda: step(lambda: kernels.linear_token_logprobs(hidden, weight, targets)))
            print(f"| {h} | 2^{tile.bit_length() - 1} | {rows} | {ms:.2f} | {trl_ms / ms:.2f}x |", flush=True)
        module.TRITON_OPS = base_ops
        fused = lambda: bench.ours_fused_logprobs(hidden, weight, targets)  # noqa: E731
        for cfg in ((128, 128, 64, 8, 8, 3), (64, 128, 64, 8, 4, 3), (128, 64, 64, 8, 4, 3), (64, 256, 64, 8, 8, 3),
                    (128, 256, 64, 8, 8, 3), (128, 128, 32, 8, 8, 4), (128, 128, 64, 4, 8, 3), (128, 128, 64, 16, 8, 3),
                    (128, 128, 64, 8, 4, 4)):
            module.FUSED_LINEAR = dict(zip(("BLOCK_N", "BLOCK_V", "BLOCK_H", "SPLITS", "num_warps", "num_stages"), cfg))
            with torch.no_grad():
                fwd = median_ms(fused)
            ms = median_ms(lambda: step(fused))
            fused_rows.append(f"| {h} | {' | '.join(map(str, cfg))} | {fwd:.2f} | {ms:.2f} | {trl_ms / ms:.2f}x |")
        module.FUSED_LINEAR = base_fused
        del hidden, weight
    print("", *fused_rows, sep="\n", flush=True)

    logits = torch.randn(n, vocab, device="cuda", generator=gen).to(torch.bfloat16)
    x = logits.clone().requires_grad_()
    copy = torch.empty_like(logits)
    copy_ms = median_ms(lambda: copy.copy_(logits))
    print(f"\ncopy: {2 * logits.numel() * 2 / copy_ms / 1e6:.0f} GB/s\n")
    print("| BLOCK | num_warps | fwd ms | fwd % of copy | fwd+bwd ms | fwd+bwd % of copy |")
    print("|---|---|---|---|---|---|")
    for block, warps in ((1024, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 8), (8192, 16), (16384, 16)):
        module._launch = lambda n_cols, b=block, w=warps: dict(BLOCK=b, num_warps=w)
        with torch.no_grad():
            fwd = median_ms(lambda: kernels.token_logprobs(logits, targets))
        both = median_ms(lambda: torch.autograd.grad((kernels.token_logprobs(x, targets) * g).sum(), x))
        print(f"| {block} | {warps} | {fwd:.2f} | {copy_ms / 2 / fwd:.0%} | {both:.2f} | {copy_ms * 1.5 / both:.0%} |",
              flush=True)
    module._launch = base_launch


if __name__ == "__main__":
    main()
