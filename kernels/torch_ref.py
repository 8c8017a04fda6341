"""PyTorch implementation of the kernels: the readable reference, and what CPU users run.

Both log-prob functions stream the vocabulary through an *online log-sum-exp* (Milakov & Gimelshein,
arXiv:1805.02867): for each row we keep the running maximum m, s = sum_j exp(z_j - m) and, for the
entropy, w = sum_j exp(z_j - m) (z_j - m), so that after the last tile

    log p(target) = (z_target - m) - log s,   H = log s - w / s.

Everything stays relative to m: log Z = m + log s rounded to float32 would lose 5e-4 at logits of
1e4, while z - m is exact there. m, log s and H (three floats per row) are all that backward keeps;
it recomputes each tile's log p_j = (z_j - m) - log s and

    d log p(t) / d z_j = 1[j = t] - p_j,        d H / d z_j = -p_j (log p_j + H),

and z = logits / temperature adds a factor 1 / temperature. The tile loops are shared with the Triton
backend through `TileOps`: Triton replaces only the per-tile arithmetic (`fold` and `grad`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

# The log-ratios are clamped to [-LOG_RATIO_MAX, LOG_RATIO_MAX] before exp(), as verl does
# (core_algos.compute_policy_loss): exp(20) = 4.9e8 is finite in float32, exp(89) is not.
LOG_RATIO_MAX = 20.0
# The k3 estimate itself is clamped to [-KL_MAX, KL_MAX], as verl does for it (core_algos.kl_penalty,
# "low_var_kl"): at the log-ratio clamp k3 is e^20 - 21 = 4.9e8, which one far-off-policy token
# would add to the loss. Beyond the bound the KL term has no gradient.
KL_MAX = 10.0
KL_ESTIMATORS = ("k1", "k2", "k3")


@dataclass(frozen=True)
class TileOps:
    """The per-tile arithmetic of one backend, plus how big a tile it wants.

    fold(x, inv_t, targets, vocab_start, stats): fold the raw logits tile x [n, v] (columns
        vocab_start .. vocab_start + v) into the running row statistics, in place.
    grad(x, out, inv_t, targets, vocab_start, row_max, log_sum, entropy, grad_logp, grad_entropy) -> dx:
        d(loss)/d(x) for the tile, written into out [n, v]; out=None lets it overwrite x instead.
    chunk_elements: how many logits `token_logprobs` hands to one fold/grad call (bounds the
        float32 temporaries of the PyTorch ops; Triton's need none, so it takes all rows at once).
    tile_elements, max_rows: the largest matmul tile of `linear_token_logprobs`.
    plain_elements: inputs with at most this many logits skip the tiles and go through the
        textbook formula and autograd (`plain_logprobs`): a few fused ops beat the tile loop's
        Python overhead (about 2x at 512 tokens x 40 vocab, `benchmarks/kernels.py --part small`),
        and there is no memory to save.
    """

    fold: Callable
    grad: Callable
    chunk_elements: int
    tile_elements: int
    max_rows: int
    plain_elements: int = 0


@dataclass
class RowStats:
    """Running online-log-sum-exp statistics of n rows (all [n], compute dtype)."""

    max: torch.Tensor  # m: running max of z
    sum_exp: torch.Tensor  # s: sum_j exp(z_j - m)
    sum_exp_shift: torch.Tensor | None  # w: sum_j exp(z_j - m) (z_j - m), only for the entropy
    target: torch.Tensor  # z_target

    @classmethod
    def empty(cls, n: int, device, dtype, with_entropy: bool) -> "RowStats":
        zeros = lambda: torch.zeros(n, device=device, dtype=dtype)  # noqa: E731
        return cls(torch.full((n,), -math.inf, device=device, dtype=dtype), zeros(), zeros() if with_entropy else None, zeros())

    def rows(self, r: slice) -> "RowStats":
        w = None if self.sum_exp_shift is None else self.sum_exp_shift[r]
        return RowStats(self.max[r], self.sum_exp[r], w, self.target[r])

    def finish(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """-> log s [n], log p(target) [n] (<= 0), entropy [n] (>= 0) or None."""
        log_sum = self.sum_exp.log()
        # z_t <= m and s >= 1 hold exactly, so logp <= 0; the clamp only guards the last rounding
        logp = (self.target - self.max - log_sum).clamp(max=0.0)
        entropy = None if self.sum_exp_shift is None else (log_sum - self.sum_exp_shift / self.sum_exp).clamp(min=0.0)
        return log_sum, logp, entropy


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for float32/bfloat16/float16 inputs; float64 inputs stay float64 (gradcheck needs it)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _target_columns(targets: torch.Tensor, vocab_start: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """targets [n] -> (rows whose target falls in the tile [k], its column inside the tile [k])."""
    local = targets - vocab_start
    rows = ((local >= 0) & (local < width)).nonzero().squeeze(1)
    return rows, local[rows]


def fold_tile(x, inv_t, targets, vocab_start, stats: RowStats) -> None:
    """Online log-sum-exp over one tile. x: [n, v] raw logits; stats: [n] each, updated in place."""
    z = x.to(stats.max.dtype)
    if inv_t != 1.0:
        z = z * inv_t
    new_max = torch.maximum(stats.max, z.amax(dim=1))
    rescale = torch.exp(stats.max - new_max)  # exp(-inf) = 0 on the first tile
    shifted = z - new_max[:, None]
    e = shifted.exp_() if stats.sum_exp_shift is None else shifted.exp()
    if stats.sum_exp_shift is not None:
        # sum e (z - m_old) rebased to m_new: subtract (m_new - m_old) s_old (m_old = -inf: nothing yet)
        moved = torch.where(stats.sum_exp > 0, new_max - stats.max, 0.0) * stats.sum_exp
        # a logit of -inf (masked vocabulary) adds e (z - m) = 0, not 0 * -inf = nan
        stats.sum_exp_shift.sub_(moved).mul_(rescale).add_(shifted.masked_fill_(e == 0, 0.0).mul_(e).sum(dim=1))
    stats.sum_exp.mul_(rescale).add_(e.sum(dim=1))
    stats.max.copy_(new_max)
    rows, cols = _target_columns(targets, vocab_start, x.shape[1])
    stats.target[rows] = z[rows, cols]


def grad_tile(x, out, inv_t, targets, vocab_start, row_max, log_sum, entropy, grad_logp, grad_entropy):
    """d(loss)/dx for one tile. x: [n, v] raw logits; row_max (m), log_sum (log s), entropy, grad_*: [n].

    A grad is None when that output was not used. Writes the result into out [n, v] and returns it;
    with out=None, x is scratch space that may be overwritten, and the result is returned.
    """
    logp = x.to(row_max.dtype, copy=out is not None)
    logp.mul_(inv_t).sub_(row_max[:, None]).sub_(log_sum[:, None])  # log p_j = (z_j - m) - log s
    if grad_entropy is None:
        dz = logp.exp_().mul_(-grad_logp[:, None])  # -g_logp p_j
    else:
        p = logp.exp()
        # -g_H p_j (log p_j + H); 0 where p_j = 0 (a logit of -inf: 0 * -inf would be nan)
        dz = logp.add_(entropy[:, None]).mul_(p).masked_fill_(p == 0, 0.0).mul_(-grad_entropy[:, None])
        if grad_logp is not None:
            dz.addcmul_(p, grad_logp[:, None], value=-1.0)  # -g_logp p_j
    if grad_logp is not None:
        rows, cols = _target_columns(targets, vocab_start, x.shape[1])
        dz[rows, cols] += grad_logp[rows]  # + g_logp 1[j = t]
    if inv_t != 1.0:
        dz.mul_(inv_t)
    return dz if out is None else out.copy_(dz)


# token_logprobs: 4M logits (16 MB of float32) per chunk. linear_token_logprobs: 16M-logit (64 MB)
# matmul tiles, [2048, 8192] at most; fewer, wider tiles ran 1.46x -> 1.28x of naive's time at
# N=2048, H=896, V=32768 on 2 cores (4M -> 16M), against 1.2 GB for the full [2048, 151936] logits.
TORCH_OPS = TileOps(fold_tile, grad_tile, chunk_elements=1 << 22, tile_elements=1 << 24, max_rows=2048, plain_elements=1 << 22)


def tile_shape(n_rows: int, n_cols: int, ops: TileOps) -> tuple[int, int]:
    """Rows and columns of one matmul tile: all rows up to ops.max_rows, then as many columns as fit."""
    rows = max(1, min(n_rows, ops.max_rows))
    cols = max(1, min(n_cols, ops.tile_elements // rows))
    return rows, cols


def _flat_grads(*grads):
    """Incoming gradients (None when an output was unused) -> contiguous [N] in the compute dtype.

    (sum() hands back an expanded, stride-0 gradient, which a kernel indexing row * 1 would misread.)
    """
    return [None if g is None else g.reshape(-1).to(compute_dtype(g.dtype)).contiguous() for g in grads]


class TokenLogprobs(torch.autograd.Function):
    """log softmax(logits / T)[target] (and the entropy), saving only m, log s and H per row.

    logits: [N, V], targets: [N] int64 -> logp [N] (, entropy [N]).
    """

    @staticmethod
    def forward(ctx, logits, targets, temperature, with_entropy, ops: TileOps):
        ctx.set_materialize_grads(False)
        n, vocab = logits.shape
        stats = RowStats.empty(n, logits.device, compute_dtype(logits.dtype), with_entropy)
        rows_per_chunk = max(1, ops.chunk_elements // max(vocab, 1))
        for r0 in range(0, n, rows_per_chunk):
            r = slice(r0, r0 + rows_per_chunk)
            ops.fold(logits[r], 1.0 / temperature, targets[r], 0, stats.rows(r))
        log_sum, logp, entropy = stats.finish()
        ctx.save_for_backward(logits, targets, stats.max, log_sum, entropy if with_entropy else log_sum)
        ctx.temperature, ctx.ops, ctx.rows_per_chunk = temperature, ops, rows_per_chunk
        return (logp, entropy) if with_entropy else logp

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy=None):
        if grad_logp is None and grad_entropy is None:
            return None, None, None, None, None
        logits, targets, row_max, log_sum, entropy = ctx.saved_tensors
        grad_logp, grad_entropy = _flat_grads(grad_logp, grad_entropy)
        dlogits = torch.empty(logits.shape, device=logits.device, dtype=logits.dtype)
        step = ctx.rows_per_chunk
        for r0 in range(0, logits.shape[0], step):
            r = slice(r0, r0 + step)
            ctx.ops.grad(
                logits[r], dlogits[r], 1.0 / ctx.temperature, targets[r], 0, row_max[r], log_sum[r], entropy[r],
                None if grad_logp is None else grad_logp[r], None if grad_entropy is None else grad_entropy[r],
            )
        return dlogits, None, None, None, None


_HAS_OUT_DTYPE = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 8)


def matmul_fp32(a: torch.Tensor, b: torch.Tensor, acc: torch.Tensor | None = None) -> torch.Tensor:
    """a [m, k] @ b [k, n] in float32 (added into acc [m, n] when given), never rounded to a's dtype.

    16-bit CUDA inputs use the tensor cores with a float32 output (torch >= 2.8 `out_dtype`);
    elsewhere the operands are upcast, so a CPU bfloat16 model gets exact float32 products.
    Autocast is switched off here: under torch.autocast(bfloat16) a float32 mm would otherwise be
    run in bfloat16 (log-probs off by 0.19 at H=896, where float32 gives 1.6e-5).
    """
    with torch.autocast(a.device.type, enabled=False):
        return _matmul_fp32(a, b, acc)


def _matmul_fp32(a: torch.Tensor, b: torch.Tensor, acc: torch.Tensor | None) -> torch.Tensor:
    out_dtype = torch.float64 if a.dtype == torch.float64 else torch.float32
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and _HAS_OUT_DTYPE:
        if acc is None:
            return torch.mm(a, b, out_dtype=out_dtype)
        return torch.addmm(acc, a, b, out_dtype=out_dtype, out=acc)
    a, b = a.to(out_dtype), b.to(out_dtype)
    return torch.mm(a, b) if acc is None else acc.addmm_(a, b)


class LinearTokenLogprobs(torch.autograd.Function):
    """log softmax(hidden @ weight.T / T)[target] without ever holding the [N, V] logits.

    hidden: [N, H], weight: [V, H], targets: [N] -> logp [N] (, entropy [N]).
    Tiles of [rows, cols] logits are computed, folded into the row statistics and dropped. Backward
    recomputes each tile, turns it into d(loss)/d(logits) in place and accumulates
    grad_hidden += dz @ W[cols] and grad_weight[cols] += dz.T @ hidden[rows], both in float32.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, with_entropy, ops: TileOps):
        ctx.set_materialize_grads(False)
        n, vocab = hidden.shape[0], weight.shape[0]
        stats = RowStats.empty(n, hidden.device, compute_dtype(hidden.dtype), with_entropy)
        rows, cols = tile_shape(n, vocab, ops)
        for c0 in range(0, vocab, cols):
            w_t = weight[c0:c0 + cols].t()
            for r0 in range(0, n, rows):
                r = slice(r0, r0 + rows)
                ops.fold(matmul_fp32(hidden[r], w_t), 1.0 / temperature, targets[r], c0, stats.rows(r))
        log_sum, logp, entropy = stats.finish()
        ctx.save_for_backward(hidden, weight, targets, stats.max, log_sum, entropy if with_entropy else log_sum)
        ctx.temperature, ctx.ops, ctx.tile = temperature, ops, (rows, cols)
        return (logp, entropy) if with_entropy else logp

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy=None):
        if grad_logp is None and grad_entropy is None:
            return None, None, None, None, None, None
        hidden, weight, targets, row_max, log_sum, entropy = ctx.saved_tensors
        grad_logp, grad_entropy = _flat_grads(grad_logp, grad_entropy)
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        n, vocab = hidden.shape[0], weight.shape[0]
        rows, cols = ctx.tile
        acc_dtype = compute_dtype(hidden.dtype)
        grad_hidden = torch.zeros(hidden.shape, device=hidden.device, dtype=acc_dtype) if need_hidden else None
        grad_weight = torch.empty_like(weight) if need_weight else None
        # vocab-outer order: each weight tile's gradient is summed over all rows in float32, then
        # written once in the weight's dtype, so no [V, H] float32 buffer is needed
        for c0 in range(0, vocab, cols):
            w = weight[c0:c0 + cols]
            grad_w = torch.zeros(w.shape, device=w.device, dtype=acc_dtype) if need_weight else None
            for r0 in range(0, n, rows):
                r = slice(r0, r0 + rows)
                z = matmul_fp32(hidden[r], w.t())
                # on CUDA dz is written straight in the 16-bit dtype the tensor cores take (one pass, half the
                # bytes of a float32 dz and a conversion); elsewhere it overwrites z in float32
                out = torch.empty(z.shape, device=z.device, dtype=hidden.dtype) if hidden.is_cuda else None
                dz = ctx.ops.grad(
                    z, out, 1.0 / ctx.temperature, targets[r], c0, row_max[r], log_sum[r], entropy[r],
                    None if grad_logp is None else grad_logp[r], None if grad_entropy is None else grad_entropy[r],
                )
                if need_hidden:
                    matmul_fp32(dz, w, acc=grad_hidden[r])
                if need_weight:
                    matmul_fp32(dz.t(), hidden[r], acc=grad_w)
            if need_weight:
                grad_weight[c0:c0 + cols] = grad_w
        return (None if grad_hidden is None else grad_hidden.to(hidden.dtype)), grad_weight, None, None, None, None


def plain_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool):
    """The textbook formula, differentiated by autograd. logits: [N, V] -> logp [N] (, entropy [N]).

    No clamps needed: log_softmax computes (z - max) - log(sum), both terms of one sign, so it is
    <= 0, and the entropy sums terms p log p <= 0 (0 for a logit of -inf, not 0 * -inf = nan).
    Run with autocast off, so that an enclosing bfloat16 autocast cannot round the float32 math.
    """
    with torch.autocast(logits.device.type, enabled=False):
        z = logits.to(compute_dtype(logits.dtype))
        logp_all = torch.log_softmax(z if temperature == 1.0 else z / temperature, dim=-1)
        logp = logp_all.gather(-1, targets[:, None])[:, 0]
        if not with_entropy:
            return logp
        return logp, (logp_all.exp() * logp_all.masked_fill(torch.isneginf(logp_all), 0.0)).sum(-1).neg()


def token_logprobs(logits, targets, temperature: float, with_entropy: bool, ops: TileOps):
    """logits: [N, V], targets: [N] -> logp [N] (, entropy [N]), through `ops`' tiles or the plain formula."""
    if logits.numel() <= ops.plain_elements:
        return plain_logprobs(logits, targets, temperature, with_entropy)
    return TokenLogprobs.apply(logits, targets, temperature, with_entropy, ops)


def linear_token_logprobs(hidden, weight, targets, temperature: float, with_entropy: bool, ops: TileOps):
    """hidden: [N, H], weight: [V, H], targets: [N] -> logp [N] (, entropy [N])."""
    if hidden.shape[0] * weight.shape[0] <= ops.plain_elements:
        return plain_logprobs(matmul_fp32(hidden, weight.t()), targets, temperature, with_entropy)
    return LinearTokenLogprobs.apply(hidden, weight, targets, temperature, with_entropy, ops)


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi, http://joschu.net/blog/kl-approx.html.

    logp, ref_logp: [...] -> [...]. With log r = ref_logp - logp:
    k1 = -log r, k2 = (log r)^2 / 2, k3 = (r - 1) - log r (Eq. 4 of arXiv:2402.03300), k3 clamped
    to [-KL_MAX, KL_MAX] (see KL_MAX).
    """
    log_r = (ref_logp - logp).clamp(-LOG_RATIO_MAX, LOG_RATIO_MAX)
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    return (torch.expm1(log_r) - log_r).clamp(-KL_MAX, KL_MAX)


def clipped_policy_loss(logp, old_logp, advantages, ref_logp=None, clip_low=0.2, clip_high=0.2, beta=0.0, kl_estimator="k3"):
    """PPO clipped surrogate (Eq. 7 of arXiv:1707.06347) with DAPO's separate bounds (arXiv:2503.14476).

    All tensors [...] (advantages broadcast) -> (loss, kl, clipped) [...], float32 (float64 for
    float64 inputs):
        r = exp(clamp(logp - old_logp, -20, 20))
        loss = -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A) + beta * kl
        clipped = 1 where the clipped term is the smaller one, i.e. the token gets no policy gradient.
    """
    dtype = compute_dtype(logp.dtype)
    logp, old_logp, advantages = logp.to(dtype), old_logp.to(dtype), advantages.to(dtype)
    ratio = torch.exp((logp - old_logp).clamp(-LOG_RATIO_MAX, LOG_RATIO_MAX))
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    kl = torch.zeros_like(loss) if ref_logp is None else kl_estimate(logp, ref_logp.to(dtype), kl_estimator)
    if ref_logp is not None and beta != 0.0:
        loss = loss + beta * kl
    return loss, kl, (clipped < unclipped).to(dtype)
