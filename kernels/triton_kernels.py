"""Triton kernels: the per-tile log-prob arithmetic and the fused clipped policy loss.

The tile loops (and so the autograd wiring of `token_logprobs` / `linear_token_logprobs`) are the
PyTorch reference's, in `torch_ref.py`; this file swaps in kernels for `fold` and `grad`, which read
a tile once in its own dtype and keep every intermediate in float32 registers:

- `_fold_kernel`: one program per row (a 1-D grid, so no 65,535 limit on the second grid axis),
  looping over the row's columns with an online log-sum-exp (arXiv:1805.02867), entropy in the same
  pass. Any vocabulary size: the last block is masked.
- `_grad_kernel`: one elementwise pass per row writing d(loss)/d(logits) in the output's dtype.
- `_policy_loss_fwd_kernel` / `_policy_loss_bwd_kernel`: the clipped surrogate and KL per token.

triton.jit decides at decoration time whether a kernel is compiled or interpreted
(`knobs.runtime.interpret`, read from TRITON_INTERPRET), so `kernels/__init__.py` loads this file
once per mode; nothing here reads the environment.
"""
import torch
import triton
import triton.language as tl

from kernels.torch_ref import KL_ESTIMATORS, KL_MAX, LOG_RATIO_MAX, TileOps, compute_dtype

# Columns per loop step. 4096 float32 values per program keep the loads wide on a GPU; the
# interpreter (numpy) is happy with any size.
MAX_BLOCK = 4096


def _launch(n_cols: int) -> dict:
    """Block size and warps for a row loop over n_cols (8 warps once a block is 2048 wide or more)."""
    block = min(MAX_BLOCK, triton.next_power_of_2(max(n_cols, 16)))
    return dict(BLOCK=block, num_warps=8 if block >= 2048 else 4)


@triton.jit
def _fold_kernel(
    x_ptr, x_row_stride, targets_ptr, max_ptr, sum_exp_ptr, sum_exp_shift_ptr, target_ptr,
    vocab_start, n_cols, inv_t, WITH_ENTROPY: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    m = tl.load(max_ptr + row)
    s = tl.load(sum_exp_ptr + row)
    w = 0.0
    if WITH_ENTROPY:
        w = tl.load(sum_exp_shift_ptr + row)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        z = tl.load(x_row + cols, mask=mask, other=-float("inf")).to(tl.float32) * inv_t
        new_m = tl.maximum(m, tl.max(z, axis=0))
        rescale = tl.exp(m - new_m)
        shifted = z - new_m
        e = tl.exp(shifted)  # 0 in the masked tail
        if WITH_ENTROPY:
            # rebase w from m to new_m (nothing to move while s = 0, when m may still be -inf)
            moved = tl.where(s > 0, new_m - m, 0.0) * s
            # e (z - m) is 0 where e is (the masked tail, a logit of -inf): never 0 * -inf
            w = (w - moved) * rescale + tl.sum(e * tl.where(e > 0, shifted, 0.0), axis=0)
        s = s * rescale + tl.sum(e, axis=0)
        m = new_m
    tl.store(max_ptr + row, m)
    tl.store(sum_exp_ptr + row, s)
    if WITH_ENTROPY:
        tl.store(sum_exp_shift_ptr + row, w)
    local = tl.load(targets_ptr + row) - vocab_start
    if (local >= 0) & (local < n_cols):
        tl.store(target_ptr + row, tl.load(x_row + local).to(tl.float32) * inv_t)


@triton.jit
def _grad_kernel(
    x_ptr, x_row_stride, out_ptr, out_row_stride, targets_ptr, max_ptr, log_sum_ptr, entropy_ptr, grad_logp_ptr,
    grad_entropy_ptr, vocab_start, n_cols, inv_t,
    HAS_GRAD_LOGP: tl.constexpr, HAS_GRAD_ENTROPY: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    out_row = out_ptr + row * out_row_stride
    row_max = tl.load(max_ptr + row)
    log_sum = tl.load(log_sum_ptr + row)
    local = tl.load(targets_ptr + row) - vocab_start
    g_logp = 0.0
    g_entropy = 0.0
    entropy = 0.0
    if HAS_GRAD_LOGP:
        g_logp = tl.load(grad_logp_ptr + row)
    if HAS_GRAD_ENTROPY:
        g_entropy = tl.load(grad_entropy_ptr + row)
        entropy = tl.load(entropy_ptr + row)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        # (z_j - m) - log s, not z_j - (m + log s): m + log s rounds at the scale of m
        logp = (tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32) * inv_t - row_max) - log_sum
        p = tl.exp(logp)
        dz = tl.zeros((BLOCK,), dtype=tl.float32)
        if HAS_GRAD_LOGP:
            dz += g_logp * (tl.where(cols == local, 1.0, 0.0) - p)  # d log p_t / dz_j = 1[j = t] - p_j
        if HAS_GRAD_ENTROPY:
            # dH / dz_j = -p_j (log p_j + H), 0 where p_j = 0 (a logit of -inf)
            dz -= g_entropy * p * tl.where(p > 0, logp + entropy, 0.0)
        tl.store(out_row + cols, (dz * inv_t).to(out_ptr.dtype.element_ty), mask=mask)


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(1) == 1 else x.contiguous()


def fold_tile(x, inv_t, targets, vocab_start, stats) -> None:
    """Triton version of torch_ref.fold_tile (same arguments, same in-place update)."""
    n, n_cols = x.shape
    if n == 0:
        return
    x = _rows_contiguous(x)
    with_entropy = stats.sum_exp_shift is not None
    _fold_kernel[(n,)](
        x, x.stride(0), targets, stats.max, stats.sum_exp, stats.sum_exp_shift if with_entropy else stats.sum_exp,
        stats.target, vocab_start, n_cols, inv_t, WITH_ENTROPY=with_entropy, **_launch(n_cols),
    )


def grad_tile(x, out, inv_t, targets, vocab_start, row_max, log_sum, entropy, grad_logp, grad_entropy):
    """Triton version of torch_ref.grad_tile; out=None writes into x (each element is read, then written)."""
    n, n_cols = x.shape
    x = _rows_contiguous(x)
    out = x if out is None else out
    if n == 0:
        return out
    _grad_kernel[(n,)](
        x, x.stride(0), out, out.stride(0), targets, row_max, log_sum, entropy,
        log_sum if grad_logp is None else grad_logp, log_sum if grad_entropy is None else grad_entropy,
        vocab_start, n_cols, inv_t,
        HAS_GRAD_LOGP=grad_logp is not None, HAS_GRAD_ENTROPY=grad_entropy is not None, **_launch(n_cols),
    )
    return out


# token_logprobs hands all rows to one launch (the kernels hold no tile); the fused-linear matmul
# tile is 64M float32 (256 MB), next to 5 GB of bfloat16 logits for 16k tokens x 151,936 vocab.
# Measured on an H100 (benchmarks/kernel_tuning.py, two runs): BLOCK 4096 x 8 warps and 8192 x 8 were the fastest of
# seven row-kernel launches, within run-to-run noise of each other; tiles of 2^26 to 2^28 elements were within 5% of
# this one, 2^25 was 5-9% slower.
TRITON_OPS = TileOps(fold=fold_tile, grad=grad_tile, chunk_elements=1 << 62, tile_elements=1 << 26, max_rows=4096)


@triton.jit
def _kl_and_grad(logp, ref_logp, LOG_RATIO_MAX: tl.constexpr, KL_MAX: tl.constexpr, KL: tl.constexpr):
    """Schulman's k1/k2/k3 of KL(pi || pi_ref) and its derivative in logp (torch_ref.kl_estimate)."""
    log_r = ref_logp - logp
    in_range = (log_r >= -LOG_RATIO_MAX) & (log_r <= LOG_RATIO_MAX)
    log_r = tl.minimum(tl.maximum(log_r, -LOG_RATIO_MAX), LOG_RATIO_MAX)
    if KL == 1:
        kl = -log_r
        dkl = tl.full(log_r.shape, 1.0, tl.float32)
    elif KL == 2:
        kl = 0.5 * log_r * log_r
        dkl = -log_r
    else:
        # exp(x) - 1 - x loses every digit to cancellation for small x; its Taylor series does not
        x = log_r
        series = x * x * (0.5 + x * (1.0 / 6.0 + x * (1.0 / 24.0 + x * (1.0 / 120.0))))
        kl = tl.where(tl.abs(x) < 0.1, series, tl.exp(x) - 1.0 - x)
        dkl = tl.where(kl > KL_MAX, 0.0, 1.0 - tl.exp(x))
        kl = tl.minimum(kl, KL_MAX)  # k3 >= 0: only the upper bound of torch_ref's clamp can bind
    return kl, tl.where(in_range, dkl, 0.0)


@triton.jit
def _policy_terms(
    offs, mask, logp_ptr, old_ptr, adv_ptr, ref_ptr, clip_low, clip_high, beta,
    LOG_RATIO_MAX: tl.constexpr, KL_MAX: tl.constexpr, HAS_REF: tl.constexpr, KL: tl.constexpr,
):
    """Per-token loss, d loss / d logp, kl, d kl / d logp and the clipped flag (torch_ref.clipped_policy_loss)."""
    logp = tl.load(logp_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    log_ratio = logp - tl.load(old_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    adv = tl.load(adv_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    in_range = (log_ratio >= -LOG_RATIO_MAX) & (log_ratio <= LOG_RATIO_MAX)
    ratio = tl.exp(tl.minimum(tl.maximum(log_ratio, -LOG_RATIO_MAX), LOG_RATIO_MAX))
    unclipped = ratio * adv
    clipped = tl.minimum(tl.maximum(ratio, 1.0 - clip_low), 1.0 + clip_high) * adv
    is_clipped = clipped < unclipped
    loss = -tl.minimum(unclipped, clipped)
    # the clipped branch is constant in logp, the unclipped one has derivative r A
    dloss = tl.where(is_clipped | (~in_range), 0.0, -unclipped)
    kl = tl.zeros(logp.shape, tl.float32)
    dkl = tl.zeros(logp.shape, tl.float32)
    if HAS_REF:
        kl, dkl = _kl_and_grad(logp, tl.load(ref_ptr + offs, mask=mask, other=0.0).to(tl.float32), LOG_RATIO_MAX, KL_MAX, KL)
        loss += beta * kl
        dloss += beta * dkl
    return loss, dloss, kl, dkl, is_clipped


@triton.jit
def _policy_loss_fwd_kernel(
    logp_ptr, old_ptr, adv_ptr, ref_ptr, loss_ptr, kl_ptr, clipped_ptr, n, clip_low, clip_high, beta,
    LOG_RATIO_MAX: tl.constexpr, KL_MAX: tl.constexpr, HAS_REF: tl.constexpr, KL: tl.constexpr, BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    loss, _, kl, _, is_clipped = _policy_terms(
        offs, mask, logp_ptr, old_ptr, adv_ptr, ref_ptr, clip_low, clip_high, beta, LOG_RATIO_MAX, KL_MAX, HAS_REF, KL
    )
    tl.store(loss_ptr + offs, loss, mask=mask)
    tl.store(kl_ptr + offs, kl, mask=mask)
    tl.store(clipped_ptr + offs, is_clipped.to(tl.float32), mask=mask)


@triton.jit
def _policy_loss_bwd_kernel(
    logp_ptr, old_ptr, adv_ptr, ref_ptr, grad_loss_ptr, grad_kl_ptr, dlogp_ptr, n, clip_low, clip_high, beta,
    LOG_RATIO_MAX: tl.constexpr, KL_MAX: tl.constexpr, HAS_REF: tl.constexpr, KL: tl.constexpr,
    HAS_GRAD_LOSS: tl.constexpr, HAS_GRAD_KL: tl.constexpr, BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    _, dloss, _, dkl, _ = _policy_terms(
        offs, mask, logp_ptr, old_ptr, adv_ptr, ref_ptr, clip_low, clip_high, beta, LOG_RATIO_MAX, KL_MAX, HAS_REF, KL
    )
    dlogp = tl.zeros(dloss.shape, tl.float32)
    if HAS_GRAD_LOSS:
        dlogp += tl.load(grad_loss_ptr + offs, mask=mask, other=0.0).to(tl.float32) * dloss
    if HAS_GRAD_KL:
        dlogp += tl.load(grad_kl_ptr + offs, mask=mask, other=0.0).to(tl.float32) * dkl
    tl.store(dlogp_ptr + offs, dlogp.to(dlogp_ptr.dtype.element_ty), mask=mask)


POLICY_BLOCK = 1024


class ClippedPolicyLoss(torch.autograd.Function):
    """Fused forward and backward of torch_ref.clipped_policy_loss; flat [n] contiguous inputs."""

    @staticmethod
    def forward(ctx, logp, old_logp, advantages, ref_logp, clip_low, clip_high, beta, kl_estimator):
        ctx.set_materialize_grads(False)
        n = logp.numel()
        outputs = [torch.empty(n, device=logp.device, dtype=torch.float32) for _ in range(3)]
        ctx.consts = dict(
            clip_low=clip_low, clip_high=clip_high, beta=beta, LOG_RATIO_MAX=LOG_RATIO_MAX, KL_MAX=KL_MAX,
            HAS_REF=ref_logp is not None, KL=KL_ESTIMATORS.index(kl_estimator) + 1, BLOCK=POLICY_BLOCK,
        )
        ref = logp if ref_logp is None else ref_logp
        if n:
            _policy_loss_fwd_kernel[(triton.cdiv(n, POLICY_BLOCK),)](logp, old_logp, advantages, ref, *outputs, n, **ctx.consts)
        ctx.save_for_backward(logp, old_logp, advantages, ref)
        ctx.mark_non_differentiable(outputs[2])
        return tuple(outputs)

    @staticmethod
    def backward(ctx, grad_loss, grad_kl, _grad_clipped):
        logp, old_logp, advantages, ref = ctx.saved_tensors
        n = logp.numel()
        dlogp = torch.empty(n, device=logp.device, dtype=compute_dtype(logp.dtype))
        if n:
            _policy_loss_bwd_kernel[(triton.cdiv(n, POLICY_BLOCK),)](
                logp, old_logp, advantages, ref,
                logp if grad_loss is None else grad_loss.contiguous(), logp if grad_kl is None else grad_kl.contiguous(),
                dlogp, n, HAS_GRAD_LOSS=grad_loss is not None, HAS_GRAD_KL=grad_kl is not None, **ctx.consts,
            )
        return dlogp.to(logp.dtype), None, None, None, None, None, None, None
