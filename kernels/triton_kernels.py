"""Triton kernels: the per-tile log-prob arithmetic and the fused clipped policy loss.

The tile loops (and so the autograd wiring of `token_logprobs` / `linear_token_logprobs`, but for the fused kernel
below) are the PyTorch reference's, in `torch_ref.py`; this file swaps in kernels for `fold` and `grad`, which read
a tile once in its own dtype and keep every intermediate in float32 registers:

- `_fold_kernel`: one program per row (a 1-D grid, so no 65,535 limit on the second grid axis),
  looping over the row's columns with an online log-sum-exp (arXiv:1805.02867), entropy in the same
  pass. Any vocabulary size: the last block is masked.
- `_grad_kernel`: one elementwise pass per row writing d(loss)/d(logits) in the output's dtype.
- `_linear_logprobs_kernel` (KERNELS_LINEAR=fused): linear_token_logprobs' matmul with the log-sum-exp (forward)
  or d(loss)/d(logits) (backward) in its epilogue, so no float32 logits tile goes to memory; see FUSED_LINEAR.
- `_policy_loss_fwd_kernel` / `_policy_loss_bwd_kernel`: the clipped surrogate and KL per token.

triton.jit decides at decoration time whether a kernel is compiled or interpreted
(`knobs.runtime.interpret`, read from TRITON_INTERPRET), so `kernels/__init__.py` loads this file
once per mode; nothing here reads the environment.
"""
import torch
import triton
import triton.language as tl

from kernels.torch_ref import KL_ESTIMATORS, KL_MAX, LOG_RATIO_MAX, TileOps, compute_dtype
from kernels.torch_ref import RowStats, _flat_grads, matmul_fp32

# Columns per loop step. 4096 float32 values per program keep the loads wide on a GPU; the
# interpreter (numpy) is happy with any size.
MAX_BLOCK = 4096


def _launch(n_cols: int) -> dict:
    """Block size and warps for a row loop over n_cols (8 warps once a block is 2048 wide or more)."""
    block = min(MAX_BLOCK, triton.next_power_of_2(max(n_cols, 16)))
    return dict(BLOCK=block, num_warps=8 if block >= 2048 else 4)


@triton.jit
def _online_lse_step(z, m, s, w, WITH_ENTROPY: tl.constexpr):
    """Fold z [R, C] (float32, -inf where masked) into each row's running m, s, w [R] (torch_ref.fold_tile)."""
    new_m = tl.maximum(m, tl.max(z, axis=1))
    rescale = tl.exp(m - new_m)
    shifted = z - new_m[:, None]
    e = tl.exp(shifted)  # 0 in the masked tail
    if WITH_ENTROPY:
        # rebase w from m to new_m (nothing to move while s = 0, when m may still be -inf)
        moved = tl.where(s > 0, new_m - m, 0.0) * s
        # e (z - m) is 0 where e is (the masked tail, a logit of -inf): never 0 * -inf
        w = (w - moved) * rescale + tl.sum(e * tl.where(e > 0, shifted, 0.0), axis=1)
    return new_m, s * rescale + tl.sum(e, axis=1), w


@triton.jit
def _dlogits(z, is_target, row_max, log_sum, entropy, g_logp, g_entropy, inv_t,
             HAS_GRAD_LOGP: tl.constexpr, HAS_GRAD_ENTROPY: tl.constexpr):
    """d(loss)/d(raw logits) from z = logits / T and the row statistics, broadcast against z (torch_ref.grad_tile)."""
    # (z_j - m) - log s, not z_j - (m + log s): m + log s rounds at the scale of m
    logp = (z - row_max) - log_sum
    p = tl.exp(logp)
    dz = tl.zeros(z.shape, dtype=tl.float32)
    if HAS_GRAD_LOGP:
        dz += g_logp * (tl.where(is_target, 1.0, 0.0) - p)  # d log p_t / dz_j = 1[j = t] - p_j
    if HAS_GRAD_ENTROPY:
        # dH / dz_j = -p_j (log p_j + H), 0 where p_j = 0 (a logit of -inf)
        dz -= g_entropy * p * tl.where(p > 0, logp + entropy, 0.0)
    return dz * inv_t


@triton.jit
def _fold_kernel(
    x_ptr, x_row_stride, targets_ptr, max_ptr, sum_exp_ptr, sum_exp_shift_ptr, target_ptr,
    vocab_start, n_cols, inv_t, WITH_ENTROPY: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    one = row + tl.arange(0, 1)  # the row as a [1] block, the shape _online_lse_step reduces over
    m = tl.load(max_ptr + one)
    s = tl.load(sum_exp_ptr + one)
    w = tl.zeros((1,), dtype=tl.float32)
    if WITH_ENTROPY:
        w = tl.load(sum_exp_shift_ptr + one)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = tl.load(x_row + cols[None, :], mask=cols[None, :] < n_cols, other=-float("inf")).to(tl.float32) * inv_t
        m, s, w = _online_lse_step(z, m, s, w, WITH_ENTROPY)
    tl.store(max_ptr + one, m)
    tl.store(sum_exp_ptr + one, s)
    if WITH_ENTROPY:
        tl.store(sum_exp_shift_ptr + one, w)
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
        z = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32) * inv_t
        dz = _dlogits(z, cols == local, row_max, log_sum, entropy, g_logp, g_entropy, inv_t,
                      HAS_GRAD_LOGP, HAS_GRAD_ENTROPY)
        tl.store(out_row + cols, dz.to(out_ptr.dtype.element_ty), mask=mask)


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


# ------------------------------------------------- linear_token_logprobs with the log-sum-exp in the matmul's epilogue
# KERNELS_LINEAR=fused. Forward: a program owns BLOCK_N rows and a run of vocab tiles (its split); it makes each
# [BLOCK_N, BLOCK_V] logits tile with tl.dot over H in BLOCK_H steps (float32 accumulator) and folds it into the rows'
# online log-sum-exp: 2NVH FLOPs as in the tiled path, without its 8 bytes of float32 logits written and read per logit.
# Backward: the kernel recomputes each tile into d(loss)/d(logits), stored in the inputs' dtype for a vocab chunk of all
# rows (2NVH); grad_hidden += dz @ W[chunk] and grad_weight[chunk] = dz.T @ hidden are float32-accumulated matmuls
# (4NVH). 6NVH, and 6 bytes of dz per logit (one 16-bit write, two reads) against the tiled path's 14. The gradient
# matmuls in-kernel would need a [BLOCK_N, H] float32 accumulator per program (917 KB at H = 3584, BLOCK_N = 64): z
# recomputed for each H slice of it, or the accumulator through memory once per vocab tile, both dearer than dz.
# Untuned defaults for an H100 (benchmarks/kernel_tuning.py sweeps them). SPLITS fills the GPU at a few thousand tokens;
# programs in flight share SPLITS weight tiles and ~#SMs / SPLITS hidden blocks, which stay in L2.
FUSED_LINEAR = dict(BLOCK_N=128, BLOCK_V=128, BLOCK_H=64, SPLITS=8, num_warps=8, num_stages=3)


@triton.jit
def _linear_logprobs_kernel(
    h_ptr, h_row_stride, w_ptr, w_row_stride, targets_ptr, n_rows, n_cols, n_hidden, vocab_start, tiles_per_split,
    n_splits, inv_t, max_ptr, sum_ptr, shift_ptr, target_ptr, dz_ptr, grad_logp_ptr, grad_entropy_ptr,
    BACKWARD: tl.constexpr, ENTROPY: tl.constexpr, HAS_GRAD_LOGP: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Forward: partial m, s, w [n_splits, n_rows] of each split and z_target [n_rows] where the split holds it.
    Backward (max_ptr, sum_ptr, shift_ptr = m, log s, H [n_rows]): dz [n_rows, n_cols] of weight rows
    vocab_start ...; ENTROPY means "compute w" forward and "has an entropy gradient" backward."""
    split = tl.program_id(0) % n_splits  # splits of one row block are neighbours: they share its hidden block
    # 64-bit scalar bases (rows x H and V x H may pass 2^31), 32-bit offsets inside a block (int64 [BLOCK, BLOCK]
    # offsets would take two registers per element)
    row0 = (tl.program_id(0) // n_splits).to(tl.int64) * BLOCK_N
    r = tl.arange(0, BLOCK_N)
    rows, row_ok = row0 + r, r < n_rows - row0
    local = tl.load(targets_ptr + rows, mask=row_ok, other=-1) - vocab_start
    m = tl.load(max_ptr + rows, mask=row_ok, other=0.0) if BACKWARD else tl.full((BLOCK_N,), -float("inf"), tl.float32)
    s = tl.load(sum_ptr + rows, mask=row_ok, other=0.0) if BACKWARD else tl.zeros((BLOCK_N,), tl.float32)
    # backward's H and incoming gradients; 0 where there are none, and forward's w starts at 0
    w = tl.load(shift_ptr + rows, mask=row_ok & BACKWARD & ENTROPY, other=0.0)
    g_logp = tl.load(grad_logp_ptr + rows, mask=row_ok & HAS_GRAD_LOGP, other=0.0)
    g_entropy = tl.load(grad_entropy_ptr + rows, mask=row_ok & BACKWARD & ENTROPY, other=0.0)
    z_target = tl.zeros((BLOCK_N,), tl.float32)
    h_block = h_ptr + row0 * h_row_stride
    v = tl.arange(0, BLOCK_V)
    first = split.to(tl.int64) * tiles_per_split
    for tile in range(first, tl.minimum(first + tiles_per_split, tl.cdiv(n_cols, BLOCK_V))):
        c0 = tile * BLOCK_V
        col_ok = v < n_cols - c0
        w_block = w_ptr + c0 * w_row_stride
        acc = tl.zeros((BLOCK_N, BLOCK_V), tl.float32)
        for k0 in range(0, n_hidden, BLOCK_H):
            k = k0 + tl.arange(0, BLOCK_H)
            k_ok = k < n_hidden
            h = tl.load(h_block + r[:, None] * h_row_stride + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            # the W^T tile [BLOCK_H, BLOCK_V]
            wt = tl.load(w_block + v[None, :] * w_row_stride + k[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0.0)
            if DOT_FP32:  # exact: a product of two bfloat16 is exact in float32
                h, wt = h.to(tl.float32), wt.to(tl.float32)
            acc = tl.dot(h, wt, acc)
        z = tl.where(col_ok[None, :], acc * inv_t, -float("inf"))
        is_target = v[None, :] == (local - c0).to(tl.int32)[:, None]
        if BACKWARD:
            dz = _dlogits(z, is_target, m[:, None], s[:, None], w[:, None], g_logp[:, None], g_entropy[:, None], inv_t,
                          HAS_GRAD_LOGP, ENTROPY)
            # on the rows stored, r * n_cols < min(BLOCK_N, n_rows) * n_cols: a chunk's size (backward's `cols`)
            dz_ptrs = dz_ptr + (row0 * n_cols + c0) + (r[:, None] * n_cols + v[None, :])
            tl.store(dz_ptrs, dz.to(dz_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
        else:
            m, s, w = _online_lse_step(z, m, s, w, ENTROPY)
            z_target += tl.sum(tl.where(is_target, z, 0.0), axis=1)
    if not BACKWARD:
        out = split.to(tl.int64) * n_rows + rows
        tl.store(max_ptr + out, m, mask=row_ok)
        tl.store(sum_ptr + out, s, mask=row_ok)
        if ENTROPY:
            tl.store(shift_ptr + out, w, mask=row_ok)
        mine = (local >= first * BLOCK_V) & (local < (first + tiles_per_split) * BLOCK_V)
        tl.store(target_ptr + rows, z_target, mask=row_ok & mine)


# Triton 3.9's interpreter multiplies bfloat16 tl.dot operands as their raw uint16 storage (np.matmul in
# interpreter.py create_dot), so there they are upcast first
_INTERPRETED = type(_linear_logprobs_kernel).__name__ == "InterpretedFunction"


def _linear_launch(hidden, weight, targets, vocab_start, inv_t, entropy, *pointers):
    """_linear_logprobs_kernel over all rows of hidden [n, H] and weight [n_cols, H] -> its number of splits.

    pointers: max, sum, shift, target, dz, grad_logp, grad_entropy (see the kernel); None where unused."""
    launch = dict(FUSED_LINEAR)
    n_tiles = max(1, triton.cdiv(weight.shape[0], launch["BLOCK_V"]))
    per_split = triton.cdiv(n_tiles, min(launch.pop("SPLITS"), n_tiles))
    splits = triton.cdiv(n_tiles, per_split)  # none empty
    if hidden.shape[0] == 0:
        return splits
    _linear_logprobs_kernel[(triton.cdiv(hidden.shape[0], launch["BLOCK_N"]) * splits,)](
        hidden, hidden.stride(0), weight, weight.stride(0), targets, hidden.shape[0], weight.shape[0], hidden.shape[1],
        vocab_start, per_split, splits, inv_t, *(hidden if x is None else x for x in pointers),
        BACKWARD=pointers[4] is not None, ENTROPY=entropy, HAS_GRAD_LOGP=pointers[5] is not None,
        DOT_FP32=_INTERPRETED and hidden.dtype == torch.bfloat16, **launch,
    )
    return splits


class FusedLinearTokenLogprobs(torch.autograd.Function):
    """torch_ref.LinearTokenLogprobs with each logits tile made and used inside one kernel (see FUSED_LINEAR).
    hidden: [N, H], weight: [V, H] (float32 / bfloat16 / float16), targets: [N] int64 -> logp [N] (, entropy [N])."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, with_entropy):
        ctx.set_materialize_grads(False)
        hidden, weight = _rows_contiguous(hidden), _rows_contiguous(weight)
        partial = torch.empty(3, FUSED_LINEAR["SPLITS"], hidden.shape[0], device=hidden.device, dtype=torch.float32)
        target = torch.zeros(hidden.shape[0], device=hidden.device, dtype=torch.float32)
        no_grads = (None, None, None)  # forward: no dz, grad_logp, grad_entropy
        splits = _linear_launch(hidden, weight, targets, 0, 1.0 / temperature, with_entropy, *partial, target, *no_grads)
        m, s, w = partial[:, :splits]
        # merge the splits' online log-sum-exps (every split saw >= 1 real logit, so m is finite):
        # s = sum_k s_k e^(m_k - m), w = sum_k (w_k + (m_k - m) s_k) e^(m_k - m)
        row_max = m.amax(0)
        scale = torch.exp(m - row_max)
        shift = ((w + (m - row_max) * s) * scale).sum(0) if with_entropy else None
        log_sum, logp, entropy = RowStats(row_max, (s * scale).sum(0), shift, target).finish()
        ctx.save_for_backward(hidden, weight, targets, row_max, log_sum, entropy if with_entropy else log_sum)
        ctx.temperature = temperature
        return (logp, entropy) if with_entropy else logp

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy=None):
        if grad_logp is None and grad_entropy is None:
            return None, None, None, None, None
        hidden, weight, targets, row_max, log_sum, entropy = ctx.saved_tensors
        grads = _flat_grads(grad_logp, grad_entropy)
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        # dz of all rows for `cols` vocab entries at a time: about TRITON_OPS.tile_elements of them, whole tiles
        n, block_v = hidden.shape[0], FUSED_LINEAR["BLOCK_V"]
        cols = max(1, TRITON_OPS.tile_elements // max(n, 1) // block_v) * block_v
        grad_hidden = torch.zeros(hidden.shape, device=hidden.device, dtype=torch.float32) if need_hidden else None
        grad_weight = torch.empty_like(weight) if need_weight else None
        for c0 in range(0, weight.shape[0], cols):
            w = weight[c0:c0 + cols]
            dz = torch.empty(n, w.shape[0], device=hidden.device, dtype=hidden.dtype)  # 16-bit for the matrix units
            stats = (row_max, log_sum, entropy, None)
            _linear_launch(hidden, w, targets, c0, 1.0 / ctx.temperature, grads[1] is not None, *stats, dz, *grads)
            if need_hidden:
                matmul_fp32(dz, w, acc=grad_hidden)
            if need_weight:
                grad_weight[c0:c0 + cols] = matmul_fp32(dz.t(), hidden)
        return (None if grad_hidden is None else grad_hidden.to(hidden.dtype)), grad_weight, None, None, None


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
