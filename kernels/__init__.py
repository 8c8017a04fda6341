"""Fused log-prob and clipped policy-loss kernels: Triton on GPU, PyTorch elsewhere.

    from kernels import token_logprobs, linear_token_logprobs, clipped_policy_loss

token_logprobs(logits, targets, *, temperature=1.0, with_entropy=False)
    logits [..., V] any float dtype, targets [...] integer -> logp [...] (, entropy [...])
linear_token_logprobs(hidden, weight, targets, *, temperature=1.0, with_entropy=False)
    hidden [..., H], weight [V, H] (the lm_head) -> the same, never holding the [N, V] logits
clipped_policy_loss(logp, old_logp, advantages, *, ref_logp=None, clip_low=0.2, clip_high=0.2,
                    beta=0.0, kl_estimator="k3")
    per-token tensors -> (per_token_loss, per_token_kl, per_token_clipped)

Outputs are float32 whatever the input dtype (float64 inputs give float64 on the PyTorch backend,
so that torch.autograd.gradcheck can check it). Log-probs are <= 0 and entropies >= 0.

Backend, chosen at every call: Triton when the tensors are on CUDA, or TRITON_INTERPRET=1 is set,
and triton imports; PyTorch otherwise. KERNELS_BACKEND=torch|triton forces one. KERNELS_LINEAR=fused makes the
Triton backend's linear_token_logprobs one kernel per logits tile, matmul and log-sum-exp together (not yet timed on
a GPU, so not the default); unset or `tiles`: torch matmul tiles, folded by Triton kernels. Both give the same
numbers (tests/test_kernels.py) and both check their inputs here, before any work, with a
ValueError that names the problem. Checking that targets lie in [0, V) reads their min and max
back to the host: on CUDA that is one synchronisation per call (tens of microseconds), which we pay
because an out-of-range id would otherwise read past the end of a row and return a wrong number.
"""
import functools
import importlib.util
import itertools
import math
import os
from pathlib import Path

import torch

from kernels import torch_ref

__all__ = ["token_logprobs", "linear_token_logprobs", "clipped_policy_loss"]


@functools.cache
def _triton_module(interpret: bool):
    """kernels/triton_kernels.py, loaded with its kernels compiled or interpreted.

    triton.jit picks compiled vs interpreted when the decorator runs (triton 3.x reads
    TRITON_INTERPRET then, not at launch), so each mode gets its own copy of the module, loaded
    with the variable set accordingly. A process can then run the interpreter on CPU tensors and
    compiled kernels on CUDA tensors, whatever order it meets them in.
    """
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        name = f"kernels._triton_{'interpreted' if interpret else 'compiled'}"
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("triton_kernels.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved
    return module


@functools.cache
def _triton_imports() -> bool:
    return importlib.util.find_spec("triton") is not None


def _triton_for(device: torch.device):
    """The Triton module to use for tensors on `device`, or None for the PyTorch backend."""
    choice = os.environ.get("KERNELS_BACKEND", "").strip().lower()
    if choice not in ("", "torch", "triton"):
        raise ValueError(f"KERNELS_BACKEND={choice!r} is not a backend: use 'torch', 'triton', or leave it unset")
    if choice == "torch":
        return None
    interpret = os.environ.get("TRITON_INTERPRET") == "1" or device.type != "cuda"
    usable = _triton_imports() and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")
    if choice == "triton" and not usable:
        raise ValueError(
            f"KERNELS_BACKEND=triton needs triton installed and CUDA tensors (got {device.type}) or "
            "TRITON_INTERPRET=1 to run the kernels in Triton's CPU interpreter; or set KERNELS_BACKEND=torch"
        )
    return _triton_module(interpret) if usable else None


def _linear_path() -> str:
    """KERNELS_LINEAR: 'tiles' (the default) or 'fused', see the module docstring."""
    choice = os.environ.get("KERNELS_LINEAR", "").strip().lower() or "tiles"
    if choice not in ("tiles", "fused"):
        raise ValueError(f"KERNELS_LINEAR={choice!r} is not a linear_token_logprobs path: use 'tiles', 'fused', "
                         "or leave it unset")
    return choice


def _ops(device: torch.device) -> torch_ref.TileOps:
    triton_module = _triton_for(device)
    return torch_ref.TORCH_OPS if triton_module is None else triton_module.TRITON_OPS


def _check_float(name: str, x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a floating-point tensor, got {got}")


def _check_temperature(temperature: float) -> None:
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")


def _check_targets(targets: torch.Tensor, shape: torch.Size, vocab: int, scores: str, device: torch.device) -> torch.Tensor:
    """targets [...] integer ids in [0, vocab) on `device`, shaped like `scores` without its last dimension."""
    is_ids = isinstance(targets, torch.Tensor) and not (targets.is_floating_point() or targets.is_complex())
    if not is_ids or targets.dtype == torch.bool:
        got = targets.dtype if isinstance(targets, torch.Tensor) else type(targets).__name__
        raise ValueError(f"targets must be an integer tensor of token ids (e.g. torch.long), got {got}")
    if targets.shape != shape:
        raise ValueError(
            f"targets {list(targets.shape)} do not match {scores}: targets must have its shape without the "
            f"last dimension, {list(shape)} (for next-token log-probs, drop the last position of the scores "
            "and the first of the ids)"
        )
    if targets.device != device:
        name = scores.split()[0]
        raise ValueError(f"targets are on {targets.device} but {scores} is on {device}: move them with .to({name}.device)")
    if targets.numel():
        lo, hi = torch.stack(torch.aminmax(targets)).tolist()  # one device-to-host read
        if lo < 0 or hi >= vocab:
            raise ValueError(
                f"targets must lie in [0, {vocab}) (the vocabulary), found min {lo}, max {hi}; replace padding "
                "ids such as -100 by any valid id and mask those positions out of the loss afterwards"
            )
    return targets.reshape(-1).long().contiguous()  # the Triton kernels read ids at targets_ptr + row


def _unflatten(out, shape):
    return tuple(o.view(shape) for o in out) if isinstance(out, tuple) else out.view(shape)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0, with_entropy: bool = False):
    """log softmax(logits / temperature) at `targets` (and the entropy of that softmax).

    logits: [..., V] any float dtype, targets: [...] integer in [0, V)
    -> logp [...] float32 (, entropy [...] float32). Differentiable w.r.t. logits.
    Saves three floats per row for backward (max, log-sum-exp, entropy), never the softmax.
    Strided rows such as logits[:, :-1] are read in place, never copied: when the leading
    dimensions do not flatten into one row stride, each leading index is a [T, V] view of its own.
    """
    _check_float("logits", logits)
    if logits.dim() == 0 or logits.shape[-1] == 0:
        raise ValueError(f"logits must have a non-empty last (vocabulary) dimension, got shape {list(logits.shape)}")
    _check_temperature(temperature)
    vocab = logits.shape[-1]
    flat_targets = _check_targets(targets, logits.shape[:-1], vocab, f"logits {list(logits.shape)}", logits.device)
    ops = _ops(logits.device)
    rows = _row_views(logits)
    if len(rows) == 1:
        out = torch_ref.token_logprobs(rows[0], flat_targets, float(temperature), with_entropy, ops)
    else:
        per_view, start = [], 0
        for view in rows:
            part = torch_ref.token_logprobs(view, flat_targets[start:start + view.shape[0]], float(temperature), with_entropy, ops)
            per_view.append(part if isinstance(part, tuple) else (part,))
            start += view.shape[0]
        out = tuple(torch.cat(parts) for parts in zip(*per_view))
        out = out if with_entropy else out[0]
    return _unflatten(out, targets.shape)


def _row_views(logits: torch.Tensor) -> list[torch.Tensor]:
    """logits [..., V] -> [N, V] views covering its rows in order, without copying: one view when
    the leading dimensions flatten into a single row stride, else one [T, V] view per leading index
    (e.g. logits[:, :-1] of a contiguous [B, T + 1, V] tensor gives B views)."""
    vocab = logits.shape[-1]
    try:
        return [logits.view(-1, vocab)]
    except RuntimeError:
        pass
    if logits.dim() < 3:
        return [logits]
    return [logits[index] for index in itertools.product(*map(range, logits.shape[:-2]))]


def linear_token_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0, with_entropy: bool = False,
    bias: torch.Tensor | None = None, logit_scale: float | None = None, softcap: float | None = None,
):
    """token_logprobs(hidden @ weight.T, targets, ...) without ever holding the [N, V] logits.

    hidden: [..., H], weight: [V, H] (lm_head.weight, same dtype and device), targets: [...]
    -> logp [...] float32 (, entropy [...]). Differentiable w.r.t. hidden and weight; the gradients
    are accumulated in float32 and returned in the inputs' dtype.
    The heads that are not a plain matmul: `bias` [V] (an lm_head bias) and `logit_scale` (Cohere's
    logits = scale * hidden @ weight.T) stay fused, as one more hidden unit fixed at 1 and a scaled
    hidden; `softcap` (Gemma 2's logits = c * tanh(hidden @ weight.T / c)) is not fused: its logits
    are made whole, then token_logprobs.
    """
    fused = _linear_path() == "fused"  # read first, so that a bad value fails whichever head
    if bias is not None:
        hidden = torch.cat([hidden, torch.ones_like(hidden[..., :1])], dim=-1)
        weight = torch.cat([weight, bias.to(weight.dtype)[:, None]], dim=1)
    if logit_scale is not None:
        hidden = hidden * logit_scale
    if softcap is not None:
        logits = softcap * torch.tanh((hidden @ weight.T).float() / softcap)
        return token_logprobs(logits, targets, temperature=temperature, with_entropy=with_entropy)
    _check_float("hidden", hidden)
    _check_float("weight", weight)
    if weight.dim() != 2 or hidden.dim() == 0 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must be [V, H] with H = hidden.shape[-1]; got weight {list(weight.shape)} and hidden "
            f"{list(hidden.shape)} (pass lm_head.weight, not its transpose)"
        )
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise ValueError(
            f"hidden ({hidden.dtype}, {hidden.device}) and weight ({weight.dtype}, {weight.device}) must share "
            "dtype and device: cast hidden with .to(weight)"
        )
    _check_temperature(temperature)
    flat_targets = _check_targets(targets, hidden.shape[:-1], weight.shape[0], f"hidden {list(hidden.shape)}", hidden.device)
    flat_hidden, triton_module = hidden.reshape(-1, hidden.shape[-1]), _triton_for(hidden.device)
    if triton_module is not None and fused and hidden.dtype != torch.float64:  # (its sums are float32)
        args = (flat_hidden, weight, flat_targets, float(temperature), with_entropy)
        out = triton_module.FusedLinearTokenLogprobs.apply(*args)
    else:
        ops = torch_ref.TORCH_OPS if triton_module is None else triton_module.TRITON_OPS
        out = torch_ref.linear_token_logprobs(flat_hidden, weight, flat_targets, float(temperature), with_entropy, ops)
    return _unflatten(out, targets.shape)


def clipped_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    *,
    ref_logp: torch.Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    beta: float = 0.0,
    kl_estimator: str = "k3",
):
    """Per-token PPO clipped surrogate with DAPO's clip-higher and an optional KL penalty.

    logp, old_logp, ref_logp: [...]; advantages: [...] or broadcastable to it (e.g. [B, 1])
    -> (loss, kl, clipped), each [...] float32, where (a loss to minimise)

        r       = exp(clamp(logp - old_logp, -20, 20))
        loss    = -min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A) + beta * kl
        kl      = k1 | k2 | k3 estimate of KL(pi || pi_ref) from log r' = clamp(ref_logp - logp, -20, 20):
                  k1 = -log r', k2 = (log r')^2 / 2, k3 = r' - 1 - log r'   (0 when ref_logp is None)
        clipped = 1.0 where the clipped term is the smaller one (the token gets no policy gradient)

    The clamps keep exp() finite in float32 (as verl does); beyond them the log-ratio's gradient is 0.
    Gradients flow to logp only: old_logp, advantages and ref_logp are constants.
    """
    if kl_estimator not in torch_ref.KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {torch_ref.KL_ESTIMATORS}, got {kl_estimator!r}")
    for name, x in (("logp", logp), ("old_logp", old_logp), ("advantages", advantages), ("ref_logp", ref_logp)):
        if x is not None:
            _check_float(name, x)
    for name, x in (("old_logp", old_logp), ("ref_logp", ref_logp)):
        if x is not None and x.shape != logp.shape:
            raise ValueError(f"{name} {list(x.shape)} must have logp's shape {list(logp.shape)}")
    try:
        advantages = advantages.expand(logp.shape)
    except RuntimeError:
        raise ValueError(
            f"advantages {list(advantages.shape)} must have logp's shape {list(logp.shape)} or broadcast to it "
            "(per-sequence advantages [B] go in as advantages[:, None])"
        ) from None
    if not (0.0 <= clip_low <= 1.0 and 0.0 <= clip_high):
        raise ValueError(f"need 0 <= clip_low <= 1 and clip_high >= 0, got clip_low={clip_low}, clip_high={clip_high}")
    if not (math.isfinite(beta) and beta >= 0.0):
        raise ValueError(f"beta must be a finite number >= 0, got {beta!r}")
    if beta > 0.0 and ref_logp is None:
        raise ValueError(f"beta={beta} > 0 needs ref_logp (the reference model's log-probs); or set beta=0")
    old_logp, advantages = old_logp.detach(), advantages.detach()
    ref_logp = None if ref_logp is None else ref_logp.detach()
    triton_module = _triton_for(logp.device)
    if triton_module is None:
        return torch_ref.clipped_policy_loss(logp, old_logp, advantages, ref_logp, clip_low, clip_high, beta, kl_estimator)
    flat = [None if x is None else x.reshape(-1).contiguous() for x in (logp, old_logp, advantages, ref_logp)]
    out = triton_module.ClippedPolicyLoss.apply(*flat, float(clip_low), float(clip_high), float(beta), kl_estimator)
    return _unflatten(out, logp.shape)
