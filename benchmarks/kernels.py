"""Speed and memory of kernels/ against naive PyTorch, TRL and Liger; prints markdown tables.

    python benchmarks/kernels.py                      # CPU table, then the GPU tables if CUDA is there
    python benchmarks/kernels.py --part cpu --cpu-repeats 5 --entropy
    python benchmarks/kernels.py --part small                # per-call cost at the embedded model's size
    python benchmarks/kernels.py --part gpu --gpu-tokens 4096 16384
    python benchmarks/kernels.py --part gpu --gpu-dry-run   # the GPU code path on CPU, tiny shapes

CPU (float32, one forward+backward of sum(g * logp) with random per-token g, as a policy-gradient
loss has): `linear_token_logprobs` -- its PyTorch backend (kernels/torch_ref.py: the tiled online
log-sum-exp in torch ops; Triton runs only on CUDA tensors) -- against naive (`F.linear` + `log_softmax` + `gather`) and TRL's
`ChunkedLogProbFunction` (vocab chunk 32,768, as TRL's trainer uses it) when trl is installed.
Each method runs in its own process. Peak memory is the resident-set high-water mark above the
level after the inputs were allocated (reset through /proc/self/clear_refs), so it counts every
temporary and the gradients (of which weight.grad is V x H floats, the same for all methods).

GPU (bfloat16): `token_logprobs` and `linear_token_logprobs` (the latter twice: `kernels` is its default
path of torch matmul tiles, `kernels (fused)` its KERNELS_LINEAR=fused kernel), forward only (how old/ref log-probs
are computed) and forward+backward, against PyTorch eager, torch.compile, TRL's kernels and
Liger's (a row saying "not installed" when they do not import). Like with like: TRL's
token kernel always computes the entropy too, so it appears only in the entropy rows (--entropy);
Liger has no entropy output, so it appears only in the rows without. ms is a median over CUDA-event timings; GB/s counts the logits read
(and, in backward, read again and written) over the measured device-to-device copy bandwidth;
TFLOP/s counts 2NVH per forward and 6NVH per forward+backward (the model's FLOPs, whatever a
method recomputes); memory is the peak allocated above the inputs.
"""

import dataclasses
import gc
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from unittest import mock

import torch
import torch.nn.functional as F
import tyro

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import kernels  # noqa: E402

TRL_CHUNK = 32_768  # trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE in trl 1.16


@dataclass
class Args:
    part: Literal["all", "cpu", "small", "gpu"] = "all"
    """which tables to print: cpu = the N=2048 table and the small-shape one; the GPU ones only
    where CUDA is available (or with --gpu-dry-run)"""
    entropy: bool = False
    """also time the with_entropy=True variants (what grpo.py calls)"""
    cpu_tokens: int = 2048
    """N of the CPU table"""
    cpu_hidden: int = 896
    """H of the CPU table (Qwen2.5-0.5B)"""
    cpu_vocab: int = 151_936
    """V of the CPU table (Qwen2 tokenizer)"""
    cpu_repeats: int = 3
    """forward+backward passes per CPU method; the table shows their median"""
    cpu_threads: int = 0
    """torch threads in each CPU worker (0: torch's default)"""
    cpu_methods: tuple[str, ...] = ("naive", "kernels", "trl")
    """methods of the CPU table (trl is left out when it does not import)"""
    small_shape: tuple[int, int, int] = (512, 128, 40)
    """N, H, V of the small-shape CPU table (the embedded model's size)"""
    small_repeats: int = 200
    """calls per row of the small-shape table"""
    small_threads: int = 1
    """torch threads for the small-shape table (at this size a second thread only adds waiting)"""
    gpu_tokens: tuple[int, ...] = (4096, 16384)
    """N values of the GPU tables"""
    gpu_vocab: tuple[int, ...] = (32_000, 151_936)
    """V values of the GPU tables"""
    gpu_hidden: tuple[int, ...] = (896, 3584)
    """H values of the fused-linear GPU table"""
    gpu_repeats: int = 10
    """timed calls per GPU cell (after 2 warm-up calls); the table shows their median"""
    gpu_dry_run: bool = False
    """run the GPU code path on CPU (Triton interpreter, tiny shapes, no memory numbers): checks the script only"""


# ---------------------------------------------------------------- CPU: one process per method


def naive_logprobs(hidden, weight, targets, with_entropy=False):
    """The unfused baseline: the full [N, V] logits, their log-softmax, then a gather."""
    logp_all = torch.log_softmax(F.linear(hidden, weight).float(), dim=-1)
    logp = logp_all.gather(-1, targets[:, None])[:, 0]
    return (logp, -(logp_all.exp() * logp_all).sum(-1)) if with_entropy else logp


def trl_logprobs(hidden, weight, targets, with_entropy=False):
    from trl.kernels import ChunkedLogProbFunction

    logp, entropy, *_ = ChunkedLogProbFunction.apply(
        hidden, weight, None, targets, 1.0, TRL_CHUNK, None, 1.0, ("entropy",) if with_entropy else ()
    )
    return (logp, entropy) if with_entropy else logp


def ours_logprobs(hidden, weight, targets, with_entropy=False):
    return kernels.linear_token_logprobs(hidden, weight, targets, with_entropy=with_entropy)


def ours_fused_logprobs(hidden, weight, targets, with_entropy=False):
    """KERNELS_LINEAR=fused: the matmul and the log-sum-exp in one Triton kernel (CUDA or the interpreter only)."""
    with mock.patch.dict(os.environ, KERNELS_LINEAR="fused"):
        return ours_logprobs(hidden, weight, targets, with_entropy)


LINEAR_METHODS = {"naive": naive_logprobs, "kernels": ours_logprobs, "trl": trl_logprobs}


def policy_gradient_loss(out, g):
    """sum(g * logp) (+ sum(g * entropy)): per-token upstream gradients, as in a real loss."""
    return (out[0] * g).sum() + (out[1] * g.flip(0)).sum() if isinstance(out, tuple) else (out * g).sum()


def _proc_status_mb(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(key)


def cpu_worker(spec: dict) -> dict:
    """Runs in a child process: time `repeats` forward+backward passes, measure the RSS peak."""
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    os.environ["KERNELS_BACKEND"] = "torch"
    fn = LINEAR_METHODS[spec["method"]]
    gen = torch.Generator().manual_seed(0)
    n, h, v = spec["n"], spec["h"], spec["v"]
    hidden = torch.randn(n, h, generator=gen).requires_grad_()
    weight = (torch.randn(v, h, generator=gen) * 0.02).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=gen)
    g = torch.randn(n, generator=gen)
    fn(hidden[:2], weight, targets[:2], spec["entropy"])  # imports and first-call setup, outside the timing
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    baseline = _proc_status_mb("VmRSS")
    times, cpu_times = [], []
    for _ in range(spec["repeats"]):
        start, cpu_start = time.perf_counter(), _cpu_seconds()
        grads = torch.autograd.grad(policy_gradient_loss(fn(hidden, weight, targets, spec["entropy"]), g), (hidden, weight))
        times.append(time.perf_counter() - start)
        cpu_times.append(_cpu_seconds() - cpu_start)
        del grads
    return {"times": times, "cpu_times": cpu_times, "peak_mb": _proc_status_mb("VmHWM") - baseline}


def _cpu_seconds() -> float:
    """User + system CPU time of this process, all threads: less sensitive than wall time to other
    processes competing for the cores (though not to shared caches and memory bandwidth)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def trl_status() -> str:
    try:
        import trl
        import trl.kernels

        trl.kernels.ChunkedLogProbFunction  # the class the benchmark calls: AttributeError in a trl without it
    except Exception as error:  # not installed, or installed against other torch/transformers
        return f"unavailable ({type(error).__name__}: {error})"
    return trl.__version__


def cpu_table(args: Args) -> None:
    trl = trl_status()
    methods = [m for m in args.cpu_methods if m != "trl" or not trl.startswith("unavailable")]
    variants = [False, True] if args.entropy else [False]
    print(f"\n### CPU: linear_token_logprobs forward+backward, N={args.cpu_tokens}, H={args.cpu_hidden}, "
          f"V={args.cpu_vocab}, float32 (`kernels` = its PyTorch backend: Triton runs on CUDA only)\n")
    print(f"torch {torch.__version__}, {torch.get_num_threads() if not args.cpu_threads else args.cpu_threads} threads, "
          f"{os.cpu_count()} CPUs, trl {trl}; median of {args.cpu_repeats} passes, each method in its own process\n")
    print("| method | entropy | wall s (median) | wall s (min) | vs naive | CPU s (median) | vs naive | peak extra MB | vs naive |")
    print("|---|---|---|---|---|---|---|---|---|")
    for with_entropy in variants:
        results = {}
        for method in methods:
            spec = dict(method=method, n=args.cpu_tokens, h=args.cpu_hidden, v=args.cpu_vocab,
                        repeats=args.cpu_repeats, threads=args.cpu_threads, entropy=with_entropy)
            child = subprocess.run([sys.executable, __file__, "_cpu_worker", json.dumps(spec)], capture_output=True, text=True)
            if child.returncode != 0:
                print(f"| {method} | {with_entropy} | failed: {child.stderr.strip().splitlines()[-1:]} | | | | | | |")
                continue
            results[method] = json.loads(child.stdout.strip().splitlines()[-1])
        base = results.get("naive")
        for method, r in results.items():
            t, cpu = statistics.median(r["times"]), statistics.median(r["cpu_times"])
            ratio_t = f"{t / statistics.median(base['times']):.2f}x" if base else "-"
            ratio_cpu = f"{cpu / statistics.median(base['cpu_times']):.2f}x" if base else "-"
            ratio_m = f"{r['peak_mb'] / base['peak_mb']:.0%}" if base else "-"
            label = f"`{method}`" + (f" (chunk {TRL_CHUNK})" if method == "trl" else "")
            print(f"| {label} | {with_entropy} | {t:.2f} | {min(r['times']):.2f} | {ratio_t} | {cpu:.1f} | {ratio_cpu} | "
                  f"{r['peak_mb']:.0f} | {ratio_m} |")


def small_table(args: Args) -> None:
    """Per-call cost at a tiny shape, in this process: small inputs skip the tiles (plain formula)."""
    os.environ["KERNELS_BACKEND"] = "torch"
    torch.set_num_threads(args.small_threads)
    n, h, v = args.small_shape
    gen = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(n, h, generator=gen).requires_grad_(), torch.randn(v, h, generator=gen).requires_grad_()
    targets, g = torch.randint(0, v, (n,), generator=gen), torch.randn(n, generator=gen)
    tiled = dataclasses.replace(kernels.torch_ref.TORCH_OPS, plain_elements=0)
    methods = {"naive": (naive_logprobs, None), "kernels": (ours_logprobs, None), "kernels, tiles forced": (ours_logprobs, tiled)}
    print(f"\n### CPU, small shape: forward+backward, N={n}, H={h}, V={v}, float32, {torch.get_num_threads()} threads\n")
    print("| method | entropy | median ms | vs naive |")
    print("|---|---|---|---|")
    for with_entropy in (False, True):
        base = None
        for label, (fn, ops) in methods.items():
            default_ops = kernels.torch_ref.TORCH_OPS
            kernels.torch_ref.TORCH_OPS = ops or default_ops
            try:
                step = lambda: torch.autograd.grad(policy_gradient_loss(fn(hidden, weight, targets, with_entropy), g), (hidden, weight))  # noqa: E731
                for _ in range(10):
                    step()
                times = []
                for _ in range(args.small_repeats):
                    start = time.perf_counter()
                    step()
                    times.append((time.perf_counter() - start) * 1e3)
            finally:
                kernels.torch_ref.TORCH_OPS = default_ops
            ms = statistics.median(times)
            base = base or ms
            print(f"| `{label}` | {with_entropy} | {ms:.3f} | {ms / base:.2f}x |")


# ---------------------------------------------------------------- GPU: one process, CUDA events


class Clock:
    """Median milliseconds of a callable: CUDA events on a GPU, perf_counter elsewhere (dry run)."""

    def __init__(self, device: torch.device, repeats: int):
        self.device, self.repeats = device, repeats

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def ms(self, fn) -> float:
        for _ in range(2):
            fn()
        self.sync()
        times = []
        for _ in range(self.repeats):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def peak_mb(self, fn) -> float | None:
        if self.device.type != "cuda":
            return None
        gc.collect()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20

    def copy_gb_per_s(self) -> float:
        n = 2**28 if self.device.type == "cuda" else 2**22
        src = torch.empty(n, dtype=torch.bfloat16, device=self.device)
        dst = torch.empty_like(src)
        return 2 * src.numel() * src.element_size() / (self.ms(lambda: dst.copy_(src)) * 1e-3) / 1e9


def eager_token(logits, targets):
    logp_all = torch.log_softmax(logits.float(), dim=-1)
    return logp_all.gather(-1, targets[:, None])[:, 0]


def eager_token_entropy(logits, targets):
    logp_all = torch.log_softmax(logits.float(), dim=-1)
    return logp_all.gather(-1, targets[:, None])[:, 0], -(logp_all.exp() * logp_all).sum(-1)


NOT_INSTALLED = None  # a method entry that prints a "not installed" row


def token_methods(with_entropy: bool) -> dict:
    """label -> fn(logits, targets) returning the log-probs (and the entropy when with_entropy),
    or NOT_INSTALLED. Only methods that compute what the row asks for are listed."""
    ours = lambda x, t: kernels.token_logprobs(x, t, with_entropy=with_entropy)  # noqa: E731
    eager = eager_token_entropy if with_entropy else eager_token
    methods = {"kernels": ours, "eager": eager, "torch.compile": torch.compile(eager)}
    if with_entropy:  # TRL's kernel always computes both: it belongs in the entropy rows only
        try:
            from trl.kernels import selective_log_softmax_and_entropy

            methods["trl"] = lambda x, t: selective_log_softmax_and_entropy(x, t)
        except Exception:
            methods["trl"] = NOT_INSTALLED
    else:  # Liger has no entropy output
        try:
            from liger_kernel.transformers import LigerCrossEntropyLoss

            liger = LigerCrossEntropyLoss(reduction="none")
            methods["liger CE"] = lambda x, t: -liger(x, t)  # in place: its forward overwrites x with the gradient
        except Exception:
            methods["liger CE"] = NOT_INSTALLED
    return methods


def linear_methods(with_entropy: bool) -> dict:
    """label -> fn(hidden, weight, targets, with_entropy), or NOT_INSTALLED (see token_methods)."""
    methods = {"kernels": ours_logprobs, "kernels (fused)": ours_fused_logprobs, "eager": naive_logprobs,
               "torch.compile": torch.compile(naive_logprobs)}
    methods["trl"] = trl_logprobs if not trl_status().startswith("unavailable") else NOT_INSTALLED
    if not with_entropy:
        try:
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

            # Liger returns a loss, not log-probs, and computes its gradients during forward: a sum
            # loss (its only cheap mode) is what is timed, so its forward-only row includes that work
            liger = LigerFusedLinearCrossEntropyLoss(reduction="sum")
            methods["liger FLCE (sum loss)"] = lambda h, w, t, with_entropy=False: -liger(w, h, t)
        except Exception:
            methods["liger FLCE (sum loss)"] = NOT_INSTALLED
    return methods



def _cell(clock: Clock, run) -> tuple[float | None, float | None, str]:
    try:
        return clock.ms(run), clock.peak_mb(run), ""
    except torch.cuda.OutOfMemoryError:
        return None, None, "OOM"
    except Exception as error:  # one broken third-party method must not end the table
        return None, None, f"{type(error).__name__}: {str(error)[:60]}"
    finally:
        gc.collect()
        if clock.device.type == "cuda":
            torch.cuda.empty_cache()


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def gpu_tables(args: Args) -> None:
    dry = args.gpu_dry_run
    if not dry and not torch.cuda.is_available():
        print("\n### GPU: skipped (no CUDA device)")
        return
    device = torch.device("cpu" if dry else "cuda")
    if dry:
        os.environ["TRITON_INTERPRET"] = "1"
    clock = Clock(device, 1 if dry else args.gpu_repeats)
    tokens, vocabs, hiddens = ((7,), (97,), (16,)) if dry else (args.gpu_tokens, args.gpu_vocab, args.gpu_hidden)
    dtype = torch.bfloat16
    bandwidth = clock.copy_gb_per_s()
    name = torch.cuda.get_device_name() if not dry else "CPU dry run (numbers meaningless)"
    print(f"\n### GPU: {name}, torch {torch.__version__}, bfloat16, copy bandwidth {bandwidth:.0f} GB/s\n")
    gen = torch.Generator(device=device).manual_seed(0)

    variants = (False, True) if args.entropy else (False,)
    print("#### token_logprobs (logits [N, V] -> log-probs)\n")
    print("| N | V | method | entropy | pass | ms | GB/s | % of copy | peak extra MB | note |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n, v in itertools.product(tokens, vocabs):
        logits = torch.randn(n, v, device=device, generator=gen).to(dtype)
        targets = torch.randint(0, v, (n,), device=device, generator=gen)
        g = torch.randn(n, device=device, generator=gen)
        for with_entropy in variants:
            for (label, fn), backward in itertools.product(token_methods(with_entropy).items(), (False, True)):
                if fn is NOT_INSTALLED:
                    if not backward:
                        print(f"| {n} | {v} | {label} | {with_entropy} | - | - | - | - | - | not installed |")
                    continue
                x = logits.clone().requires_grad_(backward)

                def run():
                    if backward:
                        torch.autograd.grad(policy_gradient_loss(fn(x, targets), g), x)
                    else:
                        with torch.no_grad():
                            fn(x, targets)

                ms, mb, note = _cell(clock, run)
                moved = (3 if backward else 1) * n * v * logits.element_size()
                gbs = None if ms is None else moved / (ms * 1e-3) / 1e9
                print(f"| {n} | {v} | {label} | {with_entropy} | {'fwd+bwd' if backward else 'fwd'} | {_fmt(ms, '.2f')} | "
                      f"{_fmt(gbs, '.0f')} | {_fmt(None if gbs is None else gbs / bandwidth, '.0%')} | {_fmt(mb, '.0f')} | {note} |")
        del logits

    print("\n#### linear_token_logprobs (hidden [N, H], weight [V, H] -> log-probs)\n")
    print("| N | H | V | method | entropy | pass | ms | TFLOP/s | peak extra MB | note |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n, h, v in itertools.product(tokens, hiddens, vocabs):
        hidden = torch.randn(n, h, device=device, generator=gen).to(dtype)
        weight = (torch.randn(v, h, device=device, generator=gen) * 0.02).to(dtype)
        targets = torch.randint(0, v, (n,), device=device, generator=gen)
        g = torch.randn(n, device=device, generator=gen)
        for with_entropy, backward in itertools.product(variants, (False, True)):
            for label, fn in linear_methods(with_entropy).items():
                if fn is NOT_INSTALLED:
                    if not backward:
                        print(f"| {n} | {h} | {v} | {label} | {with_entropy} | - | - | - | - | not installed |")
                    continue
                hx, wx = hidden.clone().requires_grad_(backward), weight.clone().requires_grad_(backward)

                def run():
                    if backward:
                        torch.autograd.grad(policy_gradient_loss(fn(hx, wx, targets, with_entropy), g), (hx, wx))
                    else:
                        with torch.no_grad():
                            fn(hx, wx, targets, with_entropy)

                ms, mb, note = _cell(clock, run)
                flops = (6 if backward else 2) * n * v * h
                tflops = None if ms is None else flops / (ms * 1e-3) / 1e12
                print(f"| {n} | {h} | {v} | {label} | {with_entropy} | {'fwd+bwd' if backward else 'fwd'} | "
                      f"{_fmt(ms, '.2f')} | {_fmt(tflops, '.1f')} | {_fmt(mb, '.0f')} | {note} |")
        del hidden, weight


def main(args: Args) -> None:
    if args.part in ("all", "cpu"):
        cpu_table(args)
    if args.part in ("all", "cpu", "small"):
        small_table(args)
    if args.part in ("all", "gpu"):
        gpu_tables(args)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "_cpu_worker":
        print(json.dumps(cpu_worker(json.loads(sys.argv[2]))))
    else:
        main(tyro.cli(Args))
