"""kernels/: values and gradients of both backends against float64 references and hand-computed numbers.

The Triton backend runs in Triton's CPU interpreter. triton.jit decides compiled vs interpreted when
the kernel module is imported, so kernels/__init__.py loads that module once per mode with
TRITON_INTERPRET set accordingly: these tests only need TRITON_INTERPRET=1 at call time (set with
monkeypatch, so it never leaks into other test files), whatever was imported before. The
interpreter is slow, so the Triton shapes are tiny and odd (rows 7 or 37, vocab 97, 131 or 301).
"""
import dataclasses
import itertools
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels
from kernels import clipped_policy_loss, linear_token_logprobs, token_logprobs, torch_ref

NEEDS_TRITON = pytest.mark.skipif(not kernels._triton_imports(), reason="triton is not installed")
BACKENDS = ["torch", pytest.param("triton", marks=NEEDS_TRITON)]
# plain: the textbook formula under autograd (PyTorch backend, small inputs); one: a single tile;
# many: tiles shrunk until the row-chunk and vocab-tile loops run several times
BACKEND_TILES = [("torch", "plain"), ("torch", "one"), ("torch", "many"),
                 pytest.param("triton", "one", marks=NEEDS_TRITON), pytest.param("triton", "many", marks=NEEDS_TRITON)]
# fused: linear_token_logprobs' matmul and log-sum-exp in one Triton kernel (KERNELS_LINEAR=fused)
LINEAR_TILES = [*BACKEND_TILES, pytest.param("triton", "fused", marks=NEEDS_TRITON)]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv("KERNELS_BACKEND", request.param)
    if request.param == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    return request.param


def set_tiles(monkeypatch, backend: str, tiles: str, **small_tiles) -> None:
    """Route the call through the plain formula, one tile, the tile sizes in small_tiles, or the fused-linear kernel
    with blocks of 16 rows x 32 vocab x 16 hidden in 3 vocab splits, its backward in vocab chunks of small_tiles'
    tile_elements."""
    if tiles == "plain":
        return
    module, name = (torch_ref, "TORCH_OPS") if backend == "torch" else (kernels._triton_module(True), "TRITON_OPS")
    ops = dataclasses.replace(getattr(module, name), plain_elements=0, **(small_tiles if tiles != "one" else {}))
    monkeypatch.setattr(module, name, ops)
    if tiles == "fused":
        monkeypatch.setenv("KERNELS_LINEAR", "fused")
        small_blocks = dict(BLOCK_N=16, BLOCK_V=32, BLOCK_H=16, SPLITS=3)
        monkeypatch.setattr(module, "FUSED_LINEAR", dict(module.FUSED_LINEAR, **small_blocks))
        monkeypatch.delattr(torch_ref, "LinearTokenLogprobs")  # the tiled path must not run instead


def reference_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    """float64 log softmax(logits / T)[targets] and entropy. logits [..., V] -> [...], [...]."""
    logp_all = torch.log_softmax(logits.double() / temperature, dim=-1)
    return logp_all.gather(-1, targets[..., None])[..., 0], -(logp_all.exp() * logp_all).sum(-1)


def backward_pair(logp, entropy, weights):
    """A loss that uses both outputs with distinct per-token weights, so both gradients are checked."""
    return (logp * weights).sum() + (entropy * weights.flip(-1)).sum()


def tolerances(dtype):
    # values are float32 in both cases; gradients come back in the input's dtype
    return dict(atol=1e-5, rtol=1e-5), (dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-2, rtol=1.6e-2))


def assert_matches_reference(got, want, grads, want_grads, dtype):
    value_tol, grad_tol = tolerances(dtype)
    for g, w in zip(got, want):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g.double(), w, **value_tol)
    assert (got[0] <= 0).all() and all((entropy >= 0).all() for entropy in got[1:])
    for g, w in zip(grads, want_grads):
        assert g.dtype == dtype
        torch.testing.assert_close(g.double(), w.to(dtype).double(), **grad_tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "shape, temperature, extreme", [((7, 97), 0.7, False), ((2, 3, 131), 1.0, True), ((5, 131), 1.3, True)]
)
@pytest.mark.parametrize("backend, tiles", BACKEND_TILES, indirect=["backend"])
def test_token_logprobs_matches_float64(backend, monkeypatch, dtype, shape, temperature, extreme, tiles):
    set_tiles(monkeypatch, backend, tiles, chunk_elements=2 * shape[-1])
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(shape, generator=gen) * 3
    if extreme:  # +-1e4 logits: the online max and masked tails must not overflow or give NaN
        logits.view(-1)[:: 7] = 1e4
        logits.view(-1)[3:: 11] = -1e4
    logits = logits.to(dtype).requires_grad_()
    targets = torch.randint(0, shape[-1], shape[:-1], generator=gen)
    weights = torch.randn(shape[:-1], generator=gen)
    logp, entropy = token_logprobs(logits, targets, temperature=temperature, with_entropy=True)
    (grad,) = torch.autograd.grad(backward_pair(logp, entropy, weights), logits)
    logits64 = logits.detach().double().requires_grad_()
    want = reference_logprobs(logits64, targets, temperature)
    (want_grad,) = torch.autograd.grad(backward_pair(*want, weights), logits64)
    assert_matches_reference((logp, entropy), want, [grad], [want_grad], dtype)


@pytest.mark.parametrize("with_entropy", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend, tiles", LINEAR_TILES, indirect=["backend"])
def test_linear_token_logprobs_matches_float64(backend, monkeypatch, dtype, tiles, with_entropy):
    # N = 37, V = 301, H = 40. many: 16-row x 64-column tiles, so 3 row blocks and 5 vocab tiles, the last ones
    # partial; fused: 3 row blocks x 10 vocab tiles x 3 hidden steps, all partial at the end; backward in 10 chunks
    set_tiles(monkeypatch, backend, tiles, tile_elements=1024, max_rows=16)
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(37, 40, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(301, 40, generator=gen) * 0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, 301, (74,), generator=gen)[::2]  # strided ids: the kernels must not read them in place
    weights = torch.randn(37, generator=gen)
    out = linear_token_logprobs(hidden, weight, targets, temperature=0.7, with_entropy=with_entropy)
    out = out if with_entropy else (out,)
    loss = lambda out: backward_pair(*out, weights) if with_entropy else (out[0] * weights).sum()  # noqa: E731
    grads = torch.autograd.grad(loss(out), (hidden, weight))
    hidden64, weight64 = (x.detach().double().requires_grad_() for x in (hidden, weight))
    want = reference_logprobs(hidden64 @ weight64.T, targets, 0.7)
    want_grads = torch.autograd.grad(loss(want), (hidden64, weight64))
    assert_matches_reference(out, want, grads, want_grads, dtype)


@pytest.mark.parametrize("head", [{"bias": True}, {"logit_scale": 0.0625}, {"softcap": 3.0},
                                  {"bias": True, "logit_scale": 2.0, "softcap": 5.0}])
@pytest.mark.parametrize("backend, tiles", LINEAR_TILES, indirect=["backend"])
def test_linear_token_logprobs_with_a_bias_a_logit_scale_or_soft_capping(backend, monkeypatch, tiles, head):
    """The heads that are not a plain matmul, against their float64 logits: (hidden @ W.T + b) * scale, then
    c * tanh(logits / c) (Gemma 2's final soft-capping), values and the gradients of hidden, weight and bias."""
    set_tiles(monkeypatch, backend, tiles, tile_elements=96, max_rows=3)
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 4, 16, generator=gen).requires_grad_()
    weight = torch.randn(131, 16, generator=gen).requires_grad_()
    bias = (torch.randn(131, generator=gen) * 2).requires_grad_() if head.get("bias") else None
    targets, weights = torch.randint(0, 131, (2, 4), generator=gen), torch.randn(2, 4, generator=gen)
    kw = {"bias": bias, "logit_scale": head.get("logit_scale"), "softcap": head.get("softcap")}
    logp, entropy = linear_token_logprobs(hidden, weight, targets, temperature=0.7, with_entropy=True, **kw)
    leaves = [x for x in (hidden, weight, bias) if x is not None]
    grads = torch.autograd.grad(backward_pair(logp, entropy, weights), leaves)
    leaves64 = [x.detach().double().requires_grad_() for x in leaves]
    logits = leaves64[0] @ leaves64[1].T + (leaves64[2] if bias is not None else 0)
    logits = logits * kw["logit_scale"] if kw["logit_scale"] else logits
    logits = kw["softcap"] * torch.tanh(logits / kw["softcap"]) if kw["softcap"] else logits
    want = reference_logprobs(logits, targets, 0.7)
    want_grads = torch.autograd.grad(backward_pair(*want, weights), leaves64)
    assert_matches_reference((logp, entropy), want, grads, want_grads, torch.float32)
    plain = linear_token_logprobs(hidden, weight, targets, temperature=0.7)
    assert (plain - logp).abs().max() > 1e-2  # each head does change the log-probs


@pytest.mark.parametrize("backend, tiles", [("torch", "many"), *LINEAR_TILES[-2:]], indirect=["backend"])
def test_frozen_lm_head_gets_no_gradient(backend, monkeypatch, tiles):
    set_tiles(monkeypatch, backend, tiles, tile_elements=96, max_rows=3)
    gen = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(5, 8, generator=gen, requires_grad=True), torch.randn(97, 8, generator=gen)
    targets = torch.randint(0, 97, (5,), generator=gen)
    linear_token_logprobs(hidden, weight, targets).sum().backward()
    hidden64 = hidden.detach().double().requires_grad_()
    reference_logprobs(hidden64 @ weight.double().T, targets, 1.0)[0].sum().backward()
    assert weight.grad is None
    torch.testing.assert_close(hidden.grad.double(), hidden64.grad, atol=2e-5, rtol=1e-4)


def test_tiles_never_exceed_the_budget(monkeypatch):
    """The PyTorch path holds one tile of logits (and its gradient) at a time, never [N, V]."""
    monkeypatch.setenv("KERNELS_BACKEND", "torch")
    seen = []

    def record(op):
        def wrapped(x, *args):
            seen.append(x.numel())
            return op(x, *args)
        return wrapped

    ops = torch_ref.TileOps(record(torch_ref.fold_tile), record(torch_ref.grad_tile), 100, 100, 4, plain_elements=0)
    monkeypatch.setattr(torch_ref, "TORCH_OPS", ops)
    hidden, weight = torch.randn(9, 8, requires_grad=True), torch.randn(37, 8, requires_grad=True)
    linear_token_logprobs(hidden, weight, torch.randint(0, 37, (9,))).sum().backward()
    token_logprobs(torch.randn(9, 37, requires_grad=True), torch.randint(0, 37, (9,))).sum().backward()
    assert max(seen) <= 100 and len(seen) > 4


@pytest.mark.parametrize("with_entropy", [False, True])
def test_torch_path_at_qwen_vocab(monkeypatch, with_entropy):
    """Both log-prob functions at Qwen2's 151,936 vocab (several vocab tiles, the last one partial)."""
    monkeypatch.setenv("KERNELS_BACKEND", "torch")
    gen = torch.Generator().manual_seed(2)
    vocab = 151_936
    hidden = torch.randn(64, 16, generator=gen, requires_grad=True)
    weight = (torch.randn(vocab, 16, generator=gen) * 0.3).requires_grad_()
    targets = torch.randint(0, vocab, (64,), generator=gen)
    weights = torch.randn(64, generator=gen)
    hidden64, weight64 = (x.detach().double().requires_grad_() for x in (hidden, weight))
    want = reference_logprobs(hidden64 @ weight64.T, targets, 1.0)
    want_loss = backward_pair(*want, weights) if with_entropy else (want[0] * weights).sum()
    want_grads = torch.autograd.grad(want_loss, (hidden64, weight64))

    out = linear_token_logprobs(hidden, weight, targets, with_entropy=with_entropy)
    loss = backward_pair(*out, weights) if with_entropy else (out * weights).sum()
    for got, want_grad in zip(torch.autograd.grad(loss, (hidden, weight)), want_grads):
        torch.testing.assert_close(got.double(), want_grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close((out[0] if with_entropy else out).double(), want[0], atol=1e-4, rtol=1e-5)

    # 32 rows x 151,936 > the 4M-logit chunk: two row chunks through the tiled path
    logits = (hidden @ weight.T).detach()[:32].requires_grad_()
    out = token_logprobs(logits, targets[:32], with_entropy=with_entropy)
    logp = out[0] if with_entropy else out
    (grad,) = torch.autograd.grad((logp * weights[:32]).sum(), logits)
    logits64 = logits.detach().double().requires_grad_()
    want_logp, _ = reference_logprobs(logits64, targets[:32], 1.0)
    (want_grad,) = torch.autograd.grad((want_logp * weights[:32]).sum(), logits64)
    torch.testing.assert_close(logp.double(), want_logp, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(grad.double(), want_grad, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("tiles", ["plain", "many"])
def test_gradcheck_float64_torch_path(monkeypatch, tiles):
    monkeypatch.setenv("KERNELS_BACKEND", "torch")
    set_tiles(monkeypatch, "torch", tiles, chunk_elements=10, tile_elements=6, max_rows=2)
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 5, (3,), generator=gen)
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, targets, temperature=0.7, with_entropy=True), (logits,))
    hidden = torch.randn(3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(5, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda h, w: linear_token_logprobs(h, w, targets, temperature=1.3, with_entropy=True), (hidden, weight)
    )
    # log-ratios 0.05 .. 0.45 and advantages of both signs: inside and outside the clip range, off its edges
    logp = torch.linspace(-1.5, -0.5, 6, dtype=torch.float64, requires_grad=True)
    old = logp.detach() - torch.linspace(0.05, 0.45, 6, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 2.0, -0.5, 1.5, -2.0], dtype=torch.float64)
    ref = logp.detach() + 0.3
    for estimator in torch_ref.KL_ESTIMATORS:
        assert torch.autograd.gradcheck(
            lambda lp: clipped_policy_loss(lp, old, adv, ref_logp=ref, beta=0.1, kl_estimator=estimator)[:2], (logp,)
        )


def _policy_case(log_ratio: float, advantage: float, clip_high: float = 0.2):
    logp = torch.tensor([-1.0], requires_grad=True)
    loss, kl, clipped = clipped_policy_loss(logp, logp.detach() - log_ratio, torch.tensor([advantage]), clip_high=clip_high)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    return loss.item(), clipped.item(), grad.item(), kl.item()


@pytest.mark.parametrize(
    "log_ratio, advantage, clip_high, want_loss, want_clipped, want_grad",
    [
        (0.1, 2.0, 0.2, -2.0 * math.exp(0.1), 0.0, -2.0 * math.exp(0.1)),  # inside [0.8, 1.2]
        (0.5, 2.0, 0.2, -2.0 * 1.2, 1.0, 0.0),  # r = 1.65 > 1.2 with A > 0: clipped
        (-0.5, -1.0, 0.2, 0.8, 1.0, 0.0),  # r = 0.61 < 0.8 with A < 0: clipped at 0.8 * A
        (0.5, -1.0, 0.2, math.exp(0.5), 0.0, math.exp(0.5)),  # r > 1.2 with A < 0: min keeps r A
        (-0.5, 3.0, 0.2, -3.0 * math.exp(-0.5), 0.0, -3.0 * math.exp(-0.5)),  # r < 0.8 with A > 0: r A
        (0.2, 1.0, 0.28, -math.exp(0.2), 0.0, -math.exp(0.2)),  # DAPO clip-higher: 1.22 < 1.28 is kept
        (0.2, 1.0, 0.2, -1.2, 1.0, 0.0),  # ... and clipped under the symmetric 0.2
        (30.0, -1.0, 0.2, math.exp(20.0), 0.0, 0.0),  # log-ratio clamped at 20: finite, no gradient
    ],
)
def test_clipped_surrogate_hand_computed(backend, log_ratio, advantage, clip_high, want_loss, want_clipped, want_grad):
    loss, clipped, grad, kl = _policy_case(log_ratio, advantage, clip_high)
    assert loss == pytest.approx(want_loss, rel=1e-5)
    assert clipped == want_clipped
    assert grad == pytest.approx(want_grad, rel=1e-5, abs=1e-7)
    assert kl == 0.0


# logp = -1, ref = -1.5: log r = -0.5; d/dlogp: k1 -> 1, k2 -> -log r, k3 -> 1 - r
@pytest.mark.parametrize(
    "estimator, want_kl, want_dkl",
    [("k1", 0.5, 1.0), ("k2", 0.125, 0.5), ("k3", math.exp(-0.5) - 1 + 0.5, 1 - math.exp(-0.5))],
)
def test_kl_estimators_hand_computed(backend, estimator, want_kl, want_dkl):
    logp = torch.tensor([-1.0, -1.0], requires_grad=True)
    adv = torch.tensor([0.0, 2.0])  # A = 0 isolates the KL term; A = 2 adds -r A = -2 (r = 1)
    loss, kl, _ = clipped_policy_loss(logp, logp.detach(), adv, ref_logp=torch.tensor([-1.5, -1.5]), beta=0.1, kl_estimator=estimator)
    (grad_loss,) = torch.autograd.grad(loss.sum(), logp, retain_graph=True)
    (grad_kl,) = torch.autograd.grad(kl.sum(), logp)
    torch.testing.assert_close(kl, torch.tensor([want_kl, want_kl]), atol=1e-7, rtol=1e-6)
    torch.testing.assert_close(loss, torch.tensor([0.1 * want_kl, -2.0 + 0.1 * want_kl]), atol=1e-7, rtol=1e-6)
    torch.testing.assert_close(grad_kl, torch.tensor([want_dkl, want_dkl]), atol=1e-7, rtol=1e-6)
    torch.testing.assert_close(grad_loss, torch.tensor([0.1 * want_dkl, -2.0 + 0.1 * want_dkl]), atol=1e-7, rtol=1e-6)


def test_k3_keeps_precision_for_small_log_ratios(backend):
    # k3(x) = e^x - 1 - x = x^2/2 + x^3/6 + ...; a naive float32 e^x - 1 - x keeps no digit at 1e-3
    logp = torch.full((4,), -2.0)
    ref = logp + torch.tensor([1e-3, -1e-3, 2e-2, -0.3])
    _, kl, _ = clipped_policy_loss(logp, logp, torch.zeros(4), ref_logp=ref, kl_estimator="k3")
    x = (ref - logp).double()  # the float32 log-ratio the kernels see
    torch.testing.assert_close(kl.double(), torch.expm1(x) - x, rtol=1e-3, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backends_agree(monkeypatch, dtype):
    pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(4)
    logits = (torch.randn(7, 97, generator=gen) * 4).to(dtype)
    hidden, weight = torch.randn(7, 8, generator=gen).to(dtype), torch.randn(97, 8, generator=gen).to(dtype)
    targets = torch.randint(0, 97, (7,), generator=gen)
    logp = (torch.randn(3, 7, generator=gen) - 2).to(dtype)
    old, ref = logp + 0.3 * torch.randn(3, 7, generator=gen), logp + 0.3 * torch.randn(3, 7, generator=gen)
    adv = torch.randn(3, 1, generator=gen)
    results = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("KERNELS_BACKEND", backend)
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        inputs = [x.clone().requires_grad_() for x in (logits, hidden, weight, logp)]
        outs = [
            *token_logprobs(inputs[0], targets, temperature=0.9, with_entropy=True),
            *linear_token_logprobs(inputs[1], inputs[2], targets, with_entropy=True),
            *clipped_policy_loss(inputs[3], old, adv, ref_logp=ref, beta=0.05, clip_high=0.28),
        ]
        grads = torch.autograd.grad(sum(o.sum() for o in outs[:-1]), inputs)
        results[backend] = [o.float() for o in (*outs, *grads)]
    for a, b in zip(results["torch"], results["triton"]):
        torch.testing.assert_close(a, b, atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=1e-4 if dtype == torch.float32 else 2e-2)


def test_dispatch_reads_the_environment_at_call_time(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv("KERNELS_BACKEND", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert kernels._ops(cpu) is torch_ref.TORCH_OPS
    monkeypatch.setenv("KERNELS_BACKEND", "torch")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernels._ops(cpu) is torch_ref.TORCH_OPS
    if kernels._triton_imports():
        monkeypatch.delenv("KERNELS_BACKEND")
        assert kernels._ops(cpu) is kernels._triton_module(True).TRITON_OPS
        # both modes coexist in one process, whatever TRITON_INTERPRET was when triton was imported
        compiled, interpreted = kernels._triton_module(False), kernels._triton_module(True)
        assert type(compiled._fold_kernel).__name__ == "JITFunction"
        assert type(interpreted._fold_kernel).__name__ == "InterpretedFunction"


def test_empty_inputs(backend):
    logp, entropy = token_logprobs(torch.zeros(0, 11), torch.zeros(0, dtype=torch.long), with_entropy=True)
    assert logp.shape == entropy.shape == (0,)
    loss, kl, clipped = clipped_policy_loss(torch.zeros(2, 0), torch.zeros(2, 0), torch.zeros(2, 1))
    assert loss.shape == (2, 0)


def _logits_call(logits_shape, targets):
    return lambda: token_logprobs(torch.zeros(logits_shape), targets)


def _policy_call(**kwargs):
    tensors = dict(logp=torch.zeros(2, 3), old_logp=torch.zeros(2, 3), advantages=torch.zeros(2, 3))
    tensors.update((k, kwargs.pop(k)) for k in list(kwargs) if k in tensors)
    return lambda: clipped_policy_loss(tensors["logp"], tensors["old_logp"], tensors["advantages"], **kwargs)


@pytest.mark.parametrize(
    "call, message",
    [
        (_logits_call((2, 5, 11), torch.zeros(2, 4, dtype=torch.long)), r"targets \[2, 4\] do not match logits \[2, 5, 11\].*\[2, 5\]"),
        (_logits_call((4, 11), torch.zeros(4)), r"targets must be an integer tensor.*torch.float32"),
        (_logits_call((4, 11), torch.tensor([0, 3, -100, 2])), r"targets must lie in \[0, 11\).*min -100"),
        (_logits_call((4, 11), torch.tensor([0, 3, 11, 2])), r"targets must lie in \[0, 11\).*max 11"),
        (_logits_call((4, 11), torch.zeros(4, dtype=torch.bool)), r"integer tensor"),
        (_logits_call((4, 11), torch.zeros(4, dtype=torch.long, device="meta")), r"targets are on meta but logits \[4, 11\] is on cpu"),
        (lambda: token_logprobs(torch.zeros(4, 11, dtype=torch.long), torch.zeros(4, dtype=torch.long)), r"logits must be a floating-point"),
        (lambda: token_logprobs(torch.zeros(4, 11), torch.zeros(4, dtype=torch.long), temperature=0.0), r"temperature must be"),
        (lambda: linear_token_logprobs(torch.zeros(4, 8), torch.zeros(8, 11), torch.zeros(4, dtype=torch.long)), r"weight must be \[V, H\]"),
        (lambda: linear_token_logprobs(torch.zeros(4, 8), torch.zeros(11, 8, dtype=torch.float64), torch.zeros(4, dtype=torch.long)), r"share dtype"),
        (lambda: linear_token_logprobs(torch.zeros(4, 8), torch.zeros(11, 8), torch.full((4,), 11)), r"must lie in \[0, 11\)"),
        (_policy_call(kl_estimator="k4"), r"kl_estimator must be one of \('k1', 'k2', 'k3'\), got 'k4'"),
        (_policy_call(old_logp=torch.zeros(2, 4)), r"old_logp \[2, 4\] must have logp's shape \[2, 3\]"),
        (_policy_call(ref_logp=torch.zeros(3)), r"ref_logp \[3\] must have logp's shape"),
        (_policy_call(advantages=torch.zeros(2)), r"advantages \[2\] must have logp's shape \[2, 3\] or broadcast"),
        (_policy_call(beta=0.1), r"beta=0.1 > 0 needs ref_logp"),
        (_policy_call(clip_low=1.5), r"0 <= clip_low <= 1"),
        (_policy_call(old_logp=torch.zeros(2, 3, dtype=torch.long)), r"old_logp must be a floating-point"),
    ],
)
def test_bad_input_is_a_clear_error(backend, call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_bad_backend_choice_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("KERNELS_BACKEND", "cuda")
    with pytest.raises(ValueError, match=r"KERNELS_BACKEND='cuda' is not a backend"):
        token_logprobs(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long))
    monkeypatch.setenv("KERNELS_BACKEND", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"KERNELS_BACKEND=triton needs .*TRITON_INTERPRET=1"):
        token_logprobs(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long))
    monkeypatch.setenv("KERNELS_BACKEND", "torch")
    monkeypatch.setenv("KERNELS_LINEAR", "fast")
    with pytest.raises(ValueError, match=r"KERNELS_LINEAR='fast' is not .*use 'tiles', 'fused', or leave it unset"):
        linear_token_logprobs(torch.zeros(2, 3), torch.zeros(5, 3), torch.zeros(2, dtype=torch.long))


def run_benchmark(*flags: str) -> list[list[str]]:
    """benchmarks/kernels.py run from the command line (a fresh process) -> its table rows, as cells."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "kernels.py"
    env = {k: v for k, v in os.environ.items() if k not in ("KERNELS_BACKEND", "TRITON_INTERPRET")}
    done = subprocess.run([sys.executable, str(script), *flags], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("| ") and not line.startswith("| N ")]
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines if not line.startswith("| method")]


def test_benchmark_cpu_table_runs():
    """The CPU table end to end at a tiny size (one process per method; numbers meaningless here)."""
    rows = run_benchmark("--part", "cpu", "--cpu-tokens", "8", "--cpu-hidden", "8", "--cpu-vocab", "64",
                         "--cpu-repeats", "1", "--cpu-threads", "1", "--cpu-methods", "naive", "kernels", "--small-repeats", "3")
    big, small = [row for row in rows if len(row) == 9], [row for row in rows if len(row) == 4]
    assert [row[0] for row in big] == ["`naive`", "`kernels`"]
    assert all(float(row[2]) >= 0 and float(row[5]) >= 0 and float(row[7]) >= 0 for row in big)
    assert len(small) == 6 and all(float(row[2]) > 0 for row in small)


@NEEDS_TRITON
def test_benchmark_gpu_tables_dry_run():
    """The GPU tables' code path, on CPU tensors through the Triton interpreter (numbers meaningless)."""
    rows = [row for row in run_benchmark("--part", "gpu", "--gpu-dry-run", "--entropy") if row[0] == "7"]
    for method, entropy, passes in itertools.product(("kernels", "eager"), ("False", "True"), ("fwd", "fwd+bwd")):
        # one row in the token_logprobs table and one in the linear table, each timed without error
        cells = [row for row in rows if method in row and passes in row and row[row.index(passes) - 1] == entropy]
        assert len(cells) == 2 and all(row[-1] == "" and float(row[row.index(passes) + 1]) > 0 for row in cells)
        # the fused-linear kernel (KERNELS_LINEAR=fused), in the linear table only
        fused = [row for row in rows if "kernels (fused)" in row and passes in row
                 and row[row.index(passes) - 1] == entropy]
        assert len(fused) == 1 and fused[0][-1] == "" and float(fused[0][fused[0].index(passes) + 1]) > 0
    # like with like: TRL's token kernel (it always computes the entropy) only in entropy rows, Liger
    # (no entropy output) only in the others; a method that does not import says so
    token_rows = [row for row in rows if row[1] == "97"]  # the linear table's second column is H = 16
    for table, label, entropy in ((token_rows, "trl", "True"), (token_rows, "liger CE", "False"),
                                  (rows, "liger FLCE (sum loss)", "False")):
        mine = [row for row in table if label in row]
        assert mine and all(row[row.index(label) + 1] == entropy for row in mine)
        assert all(row[-1] in ("", "not installed") for row in mine)


# ---------------------------------------------------------------------------------------------
# float32 under autocast, masked vocabularies, bounded KL, strided rows (issue 16, items 12-15)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend, tiles", LINEAR_TILES, indirect=["backend"])
def test_linear_logprobs_stay_float32_under_bf16_autocast(backend, monkeypatch, tiles):
    # float32 hidden and weight: the matmul must not be cast to bfloat16 by an active autocast
    set_tiles(monkeypatch, backend, tiles, tile_elements=96, max_rows=3)
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(5, 64, generator=gen, requires_grad=True)
    weight = torch.randn(97, 64, generator=gen, requires_grad=True)
    targets = torch.randint(0, 97, (5,), generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, entropy = linear_token_logprobs(hidden, weight, targets, with_entropy=True)
    grads = torch.autograd.grad((logp + entropy).sum(), (hidden, weight))  # backward outside, as AMP does
    hidden64, weight64 = (x.detach().double().requires_grad_() for x in (hidden, weight))
    want = reference_logprobs(hidden64 @ weight64.T, targets, 1.0)
    want_grads = torch.autograd.grad((want[0] + want[1]).sum(), (hidden64, weight64))
    for got, ref in zip((logp, entropy, *grads), (*want, *want_grads)):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend, tiles", BACKEND_TILES, indirect=["backend"])
def test_masked_vocabulary_gives_finite_entropy_and_gradients(backend, monkeypatch, tiles):
    # logits of -inf (a masked vocabulary) contribute p log p = 0 and no gradient, never 0 * -inf
    set_tiles(monkeypatch, backend, tiles, chunk_elements=2 * 97)
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(7, 97, generator=gen) * 2
    masked = torch.zeros(97, dtype=torch.bool)
    masked[::5] = True
    masked[40:60] = True  # a run of masked columns, some in a tile of their own
    logits[:, masked] = -math.inf
    keep = (~masked).nonzero().squeeze(1)
    targets = keep[torch.randint(0, len(keep), (7,), generator=gen)]
    weights = torch.randn(7, generator=gen)
    logits = logits.requires_grad_()
    logp, entropy = token_logprobs(logits, targets, with_entropy=True)
    (grad,) = torch.autograd.grad(backward_pair(logp, entropy, weights), logits)
    # reference: the same softmax over the unmasked columns only
    sub64 = logits.detach()[:, keep].double().requires_grad_()
    local = (keep[None, :] == targets[:, None]).long().argmax(1)
    want = reference_logprobs(sub64, local, 1.0)
    (want_sub,) = torch.autograd.grad(backward_pair(*want, weights), sub64)
    torch.testing.assert_close(logp.double(), want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy.double(), want[1], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(grad).all() and (grad[:, masked] == 0).all()
    torch.testing.assert_close(grad[:, keep].double(), want_sub, atol=2e-5, rtol=1e-4)


def test_k3_kl_is_bounded_for_a_far_off_policy_token(backend):
    # log r = ref - logp = 29: unbounded k3 is e^20 - 21 = 4.9e8 after the log-ratio clamp; the
    # estimate itself is clamped to [-10, 10] (verl's kl_penalty), with no gradient beyond the bound
    logp = torch.tensor([-30.0, -1.0], requires_grad=True)
    ref = torch.tensor([-1.0, -1.5])
    loss, kl, _ = clipped_policy_loss(logp, logp.detach(), torch.zeros(2), ref_logp=ref, beta=0.1)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    near = math.exp(-0.5) - 1 + 0.5
    torch.testing.assert_close(kl, torch.tensor([10.0, near]), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(loss, torch.tensor([1.0, 0.1 * near]), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad, torch.tensor([0.0, 0.1 * (1 - math.exp(-0.5))]), atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_token_logprobs_reads_strided_rows_without_a_copy(backend, monkeypatch):
    # logits[:, :-1] of a [B, T, V] tensor cannot be flattened to [B * (T - 1), V] without a copy;
    # every tile the kernels read must lie in the caller's storage
    set_tiles(monkeypatch, backend, "one")
    module, name = (torch_ref, "TORCH_OPS") if backend == "torch" else (kernels._triton_module(True), "TRITON_OPS")
    ops = getattr(module, name)
    seen = []

    def fold(x, *args):
        seen.append(x.untyped_storage().data_ptr())
        return ops.fold(x, *args)

    monkeypatch.setattr(module, name, dataclasses.replace(ops, fold=fold))
    gen = torch.Generator().manual_seed(9)
    full = torch.randn(3, 6, 97, generator=gen, requires_grad=True)
    targets = torch.randint(0, 97, (3, 5), generator=gen)
    logits = full[:, :-1]
    logp, entropy = token_logprobs(logits, targets, with_entropy=True)
    assert seen and set(seen) == {full.untyped_storage().data_ptr()}
    (grad,) = torch.autograd.grad((logp + entropy).sum(), full)
    full64 = full.detach().double().requires_grad_()
    want = reference_logprobs(full64[:, :-1], targets, 1.0)
    (want_grad,) = torch.autograd.grad((want[0] + want[1]).sum(), full64)
    torch.testing.assert_close(logp.double(), want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad.double(), want_grad, atol=2e-5, rtol=1e-4)


# ----------------------------------------------------------------------------- compiled on a CUDA GPU
# The tests above run the Triton kernels in the interpreter on CPU tensors. These compile them, at real sizes
# (Qwen2's vocabulary of 151,936 and GPT-2's 50,257, which is not a multiple of 16), and skip without a GPU.

CUDA = pytest.mark.skipif(not (torch.cuda.is_available() and kernels._triton_imports()),
                          reason="needs a CUDA GPU and triton: the compiled kernels run only there")


@pytest.fixture
def compiled(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("KERNELS_BACKEND", "triton")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.detach().double() - want.detach()).norm() / want.detach().norm())


@CUDA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [151_936, 50_257])
def test_cuda_token_logprobs_compiled_matches_float64(compiled, dtype, vocab):
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(256, vocab, device="cuda", generator=gen) * 3).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (256,), device="cuda", generator=gen)
    weights = torch.randn(256, device="cuda", generator=gen)
    logp, entropy = token_logprobs(logits, targets, temperature=0.7, with_entropy=True)
    (grad,) = torch.autograd.grad(backward_pair(logp, entropy, weights), logits)
    logits64 = logits.detach().double().requires_grad_()
    want = reference_logprobs(logits64, targets, 0.7)
    (want_grad,) = torch.autograd.grad(backward_pair(*want, weights), logits64)
    for g, w in zip((logp, entropy), want):
        assert g.dtype == torch.float32 and rel_err(g, w) < 1e-5
    assert grad.dtype == dtype and rel_err(grad, want_grad) < (1e-5 if dtype == torch.float32 else 1e-2)


@CUDA
@pytest.mark.parametrize("linear", ["tiles", "fused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden_size", [896, 3584])
def test_cuda_linear_token_logprobs_compiled_matches_float64(compiled, monkeypatch, dtype, hidden_size, linear):
    monkeypatch.setenv("KERNELS_LINEAR", linear)  # fused: its default (H100) blocks, the last row block partial
    gen = torch.Generator(device="cuda").manual_seed(1)
    n, vocab = 500, 151_936
    hidden = torch.randn(n, hidden_size, device="cuda", generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, device="cuda", generator=gen) / hidden_size ** 0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (n,), device="cuda", generator=gen)
    weights = torch.randn(n, device="cuda", generator=gen)
    logp, entropy = linear_token_logprobs(hidden, weight, targets, with_entropy=True)
    grads = torch.autograd.grad(backward_pair(logp, entropy, weights), (hidden, weight))
    hidden64, weight64 = (x.detach().double().requires_grad_() for x in (hidden, weight))
    want = reference_logprobs(hidden64 @ weight64.T, targets, 1.0)
    want_grads = torch.autograd.grad(backward_pair(*want, weights), (hidden64, weight64))
    # float32 operands go through the matrix units as tf32 (about 3e-4 relative; tl.dot's default), bf16 through bf16
    tol = 2e-3 if dtype == torch.float32 else 2e-2
    for g, w in zip((logp, entropy), want):
        assert g.dtype == torch.float32 and rel_err(g, w) < tol
    for g, w in zip(grads, want_grads):
        assert g.dtype == dtype and rel_err(g, w) < tol


@CUDA
def test_cuda_rows_past_two_to_the_31_elements(compiled):
    """N x V = 16,384 x 151,936 = 2.49e9 > 2^31 bf16 logits: rows past element 2^31 (from row 14,134 on) must
    be read and written at the right offsets. Checked in float64 on the first and last 64 rows."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    n, vocab = 16_384, 151_936
    logits = torch.empty(n, vocab, device="cuda", dtype=torch.bfloat16)
    for i in range(0, n, 2048):
        logits[i : i + 2048] = torch.randn(min(2048, n - i), vocab, device="cuda", generator=gen) * 3
    logits.requires_grad_()
    targets = torch.randint(0, vocab, (n,), device="cuda", generator=gen)
    weights = torch.randn(n, device="cuda", generator=gen)
    logp = token_logprobs(logits, targets)
    (grad,) = torch.autograd.grad((logp * weights).sum(), logits)
    assert torch.isfinite(logp).all() and (logp <= 0).all()
    rows = torch.cat([torch.arange(64), torch.arange(n - 64, n)]).cuda()
    part = logits.detach()[rows].double().requires_grad_()
    want = torch.log_softmax(part, -1).gather(-1, targets[rows, None])[:, 0]
    (want_grad,) = torch.autograd.grad((want * weights[rows]).sum(), part)
    assert rel_err(logp[rows], want) < 1e-5 and rel_err(grad[rows], want_grad) < 1e-2
    del grad, logits

    # the fused linear path at the same N: the logits never exist, each tile's offsets stay small
    hidden = torch.randn(n, 896, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(vocab, 896, device="cuda", generator=gen) / 896 ** 0.5).to(torch.bfloat16).requires_grad_()
    logp = linear_token_logprobs(hidden, weight, targets)
    (grad_hidden,) = torch.autograd.grad((logp * weights).sum(), hidden)
    h64 = hidden.detach()[rows].double().requires_grad_()
    want = torch.log_softmax(h64 @ weight.detach().double().T, -1).gather(-1, targets[rows, None])[:, 0]
    (want_grad,) = torch.autograd.grad((want * weights[rows]).sum(), h64)
    assert rel_err(logp[rows], want) < 2e-2 and rel_err(grad_hidden[rows], want_grad) < 2e-2


@CUDA
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_cuda_clipped_policy_loss_compiled_matches_pytorch(monkeypatch, estimator):
    gen = torch.Generator(device="cuda").manual_seed(3)
    n = (1 << 20) + 3  # not a multiple of the block
    logp = (-torch.rand(n, device="cuda", generator=gen) * 5).requires_grad_()
    old = logp.detach() + torch.randn(n, device="cuda", generator=gen) * 0.3
    adv = torch.randn(n, device="cuda", generator=gen)
    ref = logp.detach() + torch.randn(n, device="cuda", generator=gen) * 0.5
    out = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("KERNELS_BACKEND", backend)
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        loss, kl, clipped = clipped_policy_loss(logp, old, adv, ref_logp=ref, clip_high=0.28, beta=0.04,
                                                kl_estimator=estimator)
        (grad,) = torch.autograd.grad(loss.sum() + kl.sum(), logp)
        out[backend] = (loss, kl, clipped.float(), grad)
    for a, b in zip(out["triton"], out["torch"]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
