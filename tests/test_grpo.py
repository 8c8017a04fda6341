"""grpo.py: advantages, masks, loss aggregation and KL against hand-computed or float64 references,
log-probs against `generate`'s own logits, dynamic sampling, runs, resume, learning, bad input."""
import copy
import json
import math
import re
import shlex
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import read_metrics, short_gpt2, train_rows
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, GenerationConfig, GPT2Config

import grpo
from kernels import clipped_policy_loss

ROOT = Path(__file__).resolve().parents[1]


def tiny_args(tiny, tmp_path, **kw) -> grpo.Args:
    base = grpo.Args(model_name_or_path=str(tiny / "model"), dataset=str(tiny / "data"), output_dir=str(tmp_path),
                     reward="capitalization", total_steps=2, num_generations=4, prompts_per_step=2,
                     micro_batch_size=4, max_completion_length=8, eval_limit=4, eval_every=0, warmup_steps=0,
                     learning_rate=3e-3, num_iterations=1)
    return replace(base, **kw)


def eos_mask(ids: torch.Tensor, eos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] -> (1 up to the first EOS included, [B] no EOS)."""
    is_eos = (ids == eos).long()
    return ((is_eos.cumsum(1) - is_eos) == 0).float(), is_eos.sum(1) == 0


# ----------------------------------------------------------------------------- pure functions


def reference_advantages(rows: list[list[float]], scale: str) -> list[list[float]]:
    """Float64 GRPO advantages from the statistics module (unbiased std + 1e-4, 0 for equal rewards)."""
    batch_std = statistics.stdev([r for row in rows for r in row])
    out = []
    for row in rows:
        mean = statistics.fmean(row)
        std = {"group": statistics.stdev(row), "batch": batch_std, "none": None}[scale]
        out.append([0.0 if len(set(row)) == 1 else (r - mean) / (std + 1e-4 if std is not None else 1.0) for r in row])
    return out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_against_float64_reference(scale):
    rows = [[1.2, -0.3, -0.5, 1.2], [0.1, 0.1, 0.1, 0.1], [1.0, 0.0, 0.5, -2.0], [-0.5, -0.5, -0.5, -0.5]]
    adv = grpo.group_advantages(torch.tensor(rows), scale)
    assert adv.dtype == torch.float32 and torch.isfinite(adv).all()
    assert torch.allclose(adv.double(), torch.tensor(reference_advantages(rows, scale), dtype=torch.float64), atol=1e-5)
    assert adv[1].eq(0).all() and adv[3].eq(0).all()  # zero-variance groups: exactly 0, never NaN
    if scale == "group":  # by hand: mean 0.4, deviations .8 -.7 -.9 .8, unbiased variance 2.58 / 3
        assert adv[0, 0].item() == pytest.approx(0.8 / (math.sqrt(2.58 / 3) + 1e-4), rel=1e-6)


def test_length_sorted_micro_batches_trim_each_to_its_own_width():
    prompt_mask = torch.tensor([[0, 0, 1], [1, 1, 1], [0, 1, 1], [0, 0, 1]])
    completion_mask = torch.tensor([[1.0, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0]])
    chunks = grpo.length_sorted_micro_batches(prompt_mask, completion_mask, size=2)
    # lengths 2, 1, 4, 3: rows (2, 3) need prompt columns 1.. and 4 completion columns; rows (0, 1) 0.. and 2
    assert [(rows.tolist(), first, end) for rows, first, end in chunks] == [([2, 3], 1, 4), ([0, 1], 0, 2)]


def test_lr_factor_hand_computed():
    # warmup 2, total 10: warmup (s + 1) / 2, then progress = (s - 2) / 8 of the decay
    factors = {name: [grpo.lr_factor(s, 2, 10, name) for s in (0, 1, 2, 4, 6, 10, 12)]
               for name in ("cosine", "linear", "constant")}
    assert factors["constant"] == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert factors["linear"] == pytest.approx([0.5, 1.0, 1.0, 0.75, 0.5, 0.0, 0.0])
    # cosine at progress 1/4: (1 + cos(pi / 4)) / 2 = 0.853553...; at 1/2: 0.5
    assert factors["cosine"] == pytest.approx([0.5, 1.0, 1.0, 0.8535534, 0.5, 0.0, 0.0], abs=1e-7)


# 4 completions of lengths 3, 1, 4, 2; the 9s are padding and must not count.
LOSS = torch.tensor([[1.0, 2, 3, 9], [4, 9, 9, 9], [2, 2, 2, 6], [5, 1, 9, 9]])
MASK = torch.tensor([[1.0, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
# token sums 6, 4, 12, 6 (total 28 over 10 tokens); sequence means 2, 4, 3, 3
EXPECTED = {
    "grpo": ((2 + 4 + 3 + 3) / 4, (2 + 4 + 3 + 3) / 4),  # (one micro-batch, two micro-batches of 2)
    "bnpo": (28 / 10, 28 / 10),  # one process: its token mean, whatever the micro-batching
    "dr_grpo": (28 / (4 * 4), 28 / (4 * 4)),  # max completion length 4
    "dapo": (28 / 10, 28 / 10),
}


@pytest.mark.parametrize("loss_type", list(EXPECTED))
def test_aggregate_loss_hand_computed_with_ragged_lengths(loss_type):
    args = SimpleNamespace(loss_type=loss_type, prompts_per_step=2, num_generations=2, max_completion_length=4)
    whole = grpo.aggregate_loss(LOSS, MASK, args, 10, 10, 1)  # 10 tokens in the step, all of them this process's
    split = sum(grpo.aggregate_loss(LOSS[r], MASK[r], args, 10, 10, 1) for r in (slice(0, 2), slice(2, 4)))
    assert (whole.item(), split.item()) == pytest.approx(EXPECTED[loss_type], rel=1e-6)
    # two processes holding rows 0-1 (4 tokens) and 2-3 (6 tokens): bnpo is the mean of their token means
    procs = sum(grpo.aggregate_loss(LOSS[r], MASK[r], args, 10, n, 2) for r, n in ((slice(0, 2), 4), (slice(2, 4), 6)))
    assert procs.item() == pytest.approx((10 / 4 + 18 / 6) / 2 if loss_type == "bnpo" else EXPECTED[loss_type][0])


@pytest.mark.parametrize("kl_estimator", ["k1", "k2", "k3"])
def test_clipped_loss_with_kl_matches_eq3_in_float64(kl_estimator):
    """The per-token loss grpo.py uses, against Eq. 3-4 of arXiv:2402.03300 written out in float64."""
    logp = torch.tensor([[-1.0, -0.5, -2.0], [-0.1, -3.0, -0.7]])
    old = torch.tensor([[-1.3, -0.5, -1.0], [-0.1, -2.0, -0.8]])
    ref = torch.tensor([[-0.9, -0.8, -2.5], [-0.3, -3.0, -0.2]])
    adv = torch.tensor([1.5, -0.5])
    loss, kl, clipped = clipped_policy_loss(logp, old, adv[:, None], ref_logp=ref, clip_low=0.2, clip_high=0.28,
                                            beta=0.04, kl_estimator=kl_estimator)
    for i in range(2):
        for t in range(3):
            r = math.exp(logp[i, t].item() - old[i, t].item())
            a = adv[i].item()
            log_q = ref[i, t].item() - logp[i, t].item()
            want_kl = {"k1": -log_q, "k2": log_q**2 / 2, "k3": math.exp(log_q) - log_q - 1}[kl_estimator]
            surrogate = min(r * a, min(max(r, 0.8), 1.28) * a)
            assert kl[i, t].item() == pytest.approx(want_kl, abs=1e-6)
            assert loss[i, t].item() == pytest.approx(-surrogate + 0.04 * want_kl, abs=1e-6)
            assert clipped[i, t].item() == float(min(max(r, 0.8), 1.28) * a < r * a)
    assert clipped.sum() > 0  # the example does exercise clipping


def test_rloo_advantages_against_float64_reference():
    """RLOO (arXiv:2402.14740): each completion's reward minus the mean of the other G - 1, then the chosen scaling."""
    rows = [[1.2, -0.3, -0.5, 1.2], [0.1, 0.1, 0.1, 0.1], [1.0, 0.0, 0.5, -2.0]]
    loo = [[0.0 if len(set(row)) == 1 else r - statistics.fmean(row[:i] + row[i + 1:]) for i, r in enumerate(row)]
           for row in rows]
    f64 = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    assert torch.allclose(grpo.group_advantages(torch.tensor(rows), "none", "rloo").double(), f64(loo), atol=1e-6)
    group = [[a / (statistics.stdev(row) + 1e-4) for a in adv] for adv, row in zip(loo, rows)]
    assert torch.allclose(grpo.group_advantages(torch.tensor(rows), "group", "rloo").double(), f64(group), atol=1e-5)
    assert loo[0][1] == pytest.approx(-0.3 - 1.9 / 3)  # by hand: the other three sum to 1.2 - 0.5 + 1.2 = 1.9

POLICY_LOGP = [[-1.0, -0.5, -2.0, -0.4], [-0.1, -3.0, -0.7, -1.0], [-2.0, -0.2, -0.9, -1.1]]
POLICY_OLD = [[-1.3, -0.5, -1.0, -9.0], [-0.1, -2.0, -0.8, -1.2], [-2.2, -0.1, -0.3, -0.5]]
POLICY_MASK = [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]]
POLICY_ADV = [1.5, -0.5, -2.0]
POLICY_REF = [[-1.1, -0.4, -2.5, -0.3], [-0.3, -2.0, -0.9, -1.0], [-1.5, -0.2, -1.0, -2.0]]


def reference_policy_loss(level: str, loss_type: str, clip_low: float, clip_high: float, delta):
    """Float64, per token and by the chain rule worked out by hand: (loss [i][t], dL/dlogp [i][t]) where
    L = sum_i 1/|o_i| sum_t loss_it (the grpo aggregation without its 1/G) -- GSPO Eq. 5/7/13/14, CISPO Eq. 4-5,
    the two-sided clip of INTELLECT-2. Padding tokens get no gradient."""
    losses, grads = [], []
    for logp, old, mask, a in zip(POLICY_LOGP, POLICY_OLD, POLICY_MASK, POLICY_ADV):
        n = sum(mask)
        s = math.exp(sum(lp - o for lp, o, m in zip(logp, old, mask) if m) / n)  # the sequence's ratio (Eq. 7)
        row_loss, row_grad = [], []
        for lp, o, m in zip(logp, old, mask):
            x = math.exp(lp - o) if level == "token" else s  # the value of the ratio this token is weighted by
            if loss_type == "cispo":  # -sg[min(x, 1 + eps_high)] A log pi: d/dlogp = -min(x, 1 + eps_high) A
                w = min(x, 1 + clip_high)
                loss, d = -w * a * lp, -w * a
            else:
                capped = x if delta is None else min(x, delta)
                unclipped, clipped = capped * a, min(max(x, 1 - clip_low), 1 + clip_high) * a
                loss = -min(unclipped, clipped)
                # the gradient flows through the smaller term, and only where its own clamp is not active;
                # d x / d logp_t = x for the token ratio and GSPO-token, and s / |o_i| per token for GSPO (through
                # every token's copy of s_i, summed over the n copies and divided by n in L: s / n overall)
                live = (capped == x) if unclipped < clipped else (1 - clip_low < x < 1 + clip_high)
                d = -a * x if live else 0.0
            row_loss.append(loss)
            row_grad.append(d / n * m)
        losses.append(row_loss)
        grads.append(row_grad)
    return losses, grads


@pytest.mark.parametrize("level,loss_type,clip,delta", [
    ("token", "grpo", (0.2, 0.28), None), ("token", "grpo", (0.2, 0.28), 1.5), ("sequence", "grpo", (0.05, 0.05), None),
    ("sequence_token", "grpo", (0.05, 0.05), None), ("sequence", "grpo", (0.3, 0.3), 1.02),
    ("token", "cispo", (0.2, 0.28), None), ("sequence", "cispo", (0.2, 0.02), None)])
def test_policy_loss_variants_against_float64_reference(level, loss_type, clip, delta):
    logp = torch.tensor(POLICY_LOGP, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor(POLICY_MASK, dtype=torch.float64)
    args = SimpleNamespace(importance_sampling_level=level, loss_type=loss_type, clip_low=clip[0], clip_high=clip[1],
                           delta=delta, beta=0.0, kl_estimator="k3")
    loss, kl, clipped = grpo.policy_loss(logp, torch.tensor(POLICY_OLD, dtype=torch.float64),
                                         torch.tensor(POLICY_ADV, dtype=torch.float64)[:, None], mask, None, args)
    assert not kl.any()
    ((loss * mask).sum(dim=1) / mask.sum(dim=1)).sum().backward()
    want_loss, want_grad = reference_policy_loss(level, loss_type, clip[0], clip[1], delta)
    assert torch.allclose(loss * mask, torch.tensor(want_loss, dtype=torch.float64) * mask, atol=1e-12)
    assert torch.allclose(logp.grad, torch.tensor(want_grad, dtype=torch.float64), atol=1e-12)
    assert 0 < float((clipped * mask).sum()) < float(mask.sum())  # each example clips (or caps) some tokens, not all


@pytest.mark.parametrize("kl_estimator", ["k1", "k3"])
def test_policy_loss_token_level_equals_the_fused_kernel(kl_estimator, monkeypatch):
    """On CUDA, token-level clip losses without delta take kernels.clipped_policy_loss (fused Triton): on the same
    inputs, with the KL term, policy_loss's own lines give the same numbers as the kernel (its PyTorch reference
    here; tests/test_kernels.py holds Triton to that reference)."""
    logp, old, adv, ref = (torch.tensor(x) for x in (POLICY_LOGP, POLICY_OLD, POLICY_ADV, POLICY_REF))
    args = SimpleNamespace(importance_sampling_level="token", loss_type="grpo", clip_low=0.2, clip_high=0.28, delta=None,
                           beta=0.04, kl_estimator=kl_estimator)
    mine = grpo.policy_loss(logp, old, adv[:, None], torch.ones_like(logp), ref, args)
    fused = clipped_policy_loss(logp, old, adv[:, None], ref_logp=ref, clip_low=0.2, clip_high=0.28, beta=0.04,
                                kl_estimator=kl_estimator)
    assert all(torch.equal(a, b) for a, b in zip(mine, fused))
    calls = []  # and on CUDA tensors policy_loss hands the whole term to the kernel
    monkeypatch.setattr(grpo, "clipped_policy_loss", lambda *a, **kw: calls.append(kw) or fused)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    assert grpo.policy_loss(logp, old, adv[:, None], torch.ones_like(logp), ref, args) is fused
    assert calls == [{"ref_logp": ref, "clip_low": 0.2, "clip_high": 0.28, "beta": 0.04, "kl_estimator": kl_estimator}]


def test_truncated_is_weights_hand_computed():
    """min(exp(old - sampler), cap) per token; padding weighs 1 and is never counted as capped."""
    old, sampler = torch.tensor([[-1.0, -2.0, -0.5]]), torch.tensor([[-1.5, -1.0, -3.0]])
    weights, capped = grpo.truncated_is_weights(old, sampler, torch.tensor([[1.0, 1.0, 0.0]]), cap=1.5)
    assert weights[0].tolist() == pytest.approx([1.5, math.exp(-1.0), 1.0])  # e^0.5 = 1.649 capped at 1.5
    assert capped.tolist() == [[True, False, False]]


def test_high_entropy_tokens_pool_the_whole_batch():
    """Top-rho by entropy over the loss tokens of every micro-batch (padding not counted), whatever the split."""
    h = torch.tensor([[0.1, 0.9, 0.5, 7.0], [0.3, 0.8, 0.2, 0.6]])
    m = torch.tensor([[1.0, 1, 1, 0], [1, 1, 1, 1]])  # 7.0 is padding; the 7 loss tokens sorted: .1 .2 .3 .5 .6 .8 .9
    whole = grpo.high_entropy_tokens([h], [m], 0.5)[0]  # tau = the 0.5-quantile of the 7 = 0.5
    split = torch.cat(grpo.high_entropy_tokens([h[:1], h[1:]], [m[:1], m[1:]], 0.5))
    assert torch.equal(whole, split)
    assert (whole & m.bool()).tolist() == [[False, True, True, False], [False, True, False, True]]
    assert int((grpo.high_entropy_tokens([h], [m], 2 / 6)[0] & m.bool()).sum()) == 3  # tau = 0.6: .6 .8 .9

def fake_draw(reward_rows: list[list[float]], widths: list[int]):
    """A stand-in for sampling: each call returns the next groups with these rewards and prompt widths."""
    queue = list(zip(reward_rows, widths))
    calls = []

    def draw(n: int) -> dict:
        picked, queue[:] = queue[:n], queue[n:]
        calls.append(n)
        batches = []
        for rewards, width in picked:
            g = len(rewards)
            batches.append({"prompt_ids": torch.full((g, width), 7), "prompt_mask": torch.ones(g, width, dtype=torch.long),
                            "completion_ids": torch.full((g, 3), 5), "completion_mask": torch.ones(g, 3),
                            "truncated": torch.zeros(g, dtype=torch.bool),
                            "rewards": {"total": torch.tensor(rewards)}, "prompts": [f"w{width}"] * g})
        return grpo.concat_rollouts(batches, 0, range(sum(len(rewards) for rewards, _ in picked)))

    return draw, calls


def test_dynamic_sampling_drops_equal_groups_and_refills():
    rows = [[1, 0], [0, 0], [1, 1], [0, 1], [1, 1], [1, 0], [0, 1]]
    draw, calls = fake_draw(rows, widths=[2, 3, 2, 4, 2, 5, 2])
    batch, stats = grpo.dynamic_sampling(draw, num_groups=3, group_size=2, max_rounds=4, pad_id=0)
    draws, informative = stats["train/sampling_draws"], stats["train/informative_groups"]
    # draw 3 -> keeps [1, 0]; draw the 2 missing -> keeps [0, 1] (width 4); draw 1 -> keeps [1, 0] (width 5)
    assert calls == [3, 2, 1] and draws == 3 and informative == 3
    assert batch["rewards"]["total"].view(3, 2).tolist() == [[1, 0], [0, 1], [1, 0]]
    assert batch["prompts"] == ["w2", "w2", "w4", "w4", "w5", "w5"]
    assert batch["prompt_ids"].shape == (6, 5)  # re-padded on the left to the widest prompt
    assert batch["prompt_mask"].sum(1).tolist() == [2, 2, 4, 4, 5, 5]
    assert batch["prompt_mask"][0].tolist() == [0, 0, 0, 1, 1]


def test_dynamic_sampling_stops_after_max_rounds_and_tops_up():
    draw, calls = fake_draw([[1, 0], [2, 2], [3, 3], [4, 4], [5, 5], [6, 6], [7, 7]], widths=[2] * 7)
    batch, stats = grpo.dynamic_sampling(draw, num_groups=2, group_size=2, max_rounds=2, pad_id=0)
    draws, informative = stats["train/sampling_draws"], stats["train/informative_groups"]
    assert calls == [2, 1, 1] and draws == 3 and informative == 1
    assert batch["rewards"]["total"].view(2, 2).tolist() == [[1, 0], [2, 2]]  # topped up with a dropped group
    assert grpo.group_advantages(batch["rewards"]["total"].view(2, 2), "group")[1].eq(0).all()


@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])
def test_completion_logprobs_equal_generates_own_distribution(tiny, arch):
    """Log-probs from hidden states + lm_head, with left padding, equal log_softmax(logits / T) of `generate`.

    GPT-2's learned absolute positions make the check see the position ids (RoPE is shift-invariant).
    """
    torch.manual_seed(0)
    model = (AutoModelForCausalLM.from_pretrained(tiny / "model") if arch == "qwen2" else AutoModelForCausalLM.from_config(
        GPT2Config(vocab_size=103, n_embd=32, n_layer=2, n_head=2, n_positions=64, pad_token_id=0, eos_token_id=1))).eval()
    ids, mask = grpo.left_pad([[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]], pad_id=0)
    torch.manual_seed(1)
    config = GenerationConfig(do_sample=True, temperature=0.7, max_new_tokens=6, pad_token_id=0, eos_token_id=1)
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config, output_logits=True,
                         return_dict_in_generate=True)
    completion = out.sequences[:, ids.shape[1]:]
    c_mask, _ = eos_mask(completion, 1)
    attention = torch.cat([mask, c_mask.long()], dim=1)
    with torch.no_grad():
        logp = grpo.completion_logprobs(model, out.sequences, attention, ids.shape[1], temperature=0.7)
    steps = torch.stack(out.logits, dim=1).double() / 0.7  # [B, Tc, V], the raw logits at each sampling step
    want = torch.log_softmax(steps, dim=-1).gather(-1, completion[..., None]).squeeze(-1)
    assert logp.shape == completion.shape
    assert torch.allclose((logp * c_mask).double(), want * c_mask, atol=1e-5)


BACKENDS = ["shared", "static"]


@pytest.fixture(scope="module")
def embedded():
    return (AutoModelForCausalLM.from_pretrained(ROOT / "models/tiny-arith").eval(),
            AutoTokenizer.from_pretrained(ROOT / "models/tiny-arith"))


def grouped_prompts(tokenizer, groups: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`groups` prompts of the embedded task, of different lengths, each repeated `size` times, left-padded."""
    rows = [json.loads(line)["prompt"] for line in (ROOT / "data/arith/test.jsonl").read_text().splitlines()[:groups]]
    rows[0] = rows[0] + " 1 + 1"  # one longer prompt, so the others carry left padding
    return grpo.left_pad([tokenizer(r, add_special_tokens=False).input_ids for r in rows for _ in range(size)],
                         tokenizer.pad_token_id)


@pytest.mark.parametrize("backend", BACKENDS)
def test_generation_backends_greedy_equals_generate(embedded, backend, monkeypatch):
    """Every --generation-backend decodes greedily exactly as plain `generate` on the embedded model; `shared`
    prefills each group's prompt once."""
    model, tokenizer = embedded
    repeats, repeat = [], DynamicCache.batch_repeat_interleave
    monkeypatch.setattr(DynamicCache, "batch_repeat_interleave", lambda cache, n: repeats.append(n) or repeat(cache, n))
    ids, mask = grouped_prompts(tokenizer, groups=3, size=3)
    config = GenerationConfig(do_sample=False, temperature=1.0, max_new_tokens=24, pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=tokenizer.eos_token_id)
    with torch.no_grad():
        want = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, ids.shape[1]:]
        got, _ = grpo.sample(model, ids, mask, config, backend)
    assert got.shape == want.shape and torch.equal(got, want)
    assert [n.tolist() for n in repeats] == ([[3, 3, 3]] if backend == "shared" else [])


def test_sampling_keeps_the_kv_cache_under_gradient_checkpointing(embedded):
    """sample runs the model in eval mode (in training mode gradient checkpointing drops the KV cache, and the static
    cache fails outright) and hands it back in training mode."""
    _, tokenizer = embedded
    model = AutoModelForCausalLM.from_pretrained(ROOT / "models/tiny-arith")
    model.gradient_checkpointing_enable()
    ids, mask = grouped_prompts(tokenizer, groups=2, size=2)
    config = GenerationConfig(do_sample=False, temperature=1.0, max_new_tokens=16, pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=tokenizer.eos_token_id)
    with torch.no_grad():
        got = {b: grpo.sample(model.train(), ids, mask, config, b)[0] for b in ("shared", "static")}
        assert model.training
        want = model.eval().generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, ids.shape[1]:]
    assert all(torch.equal(g, want) for g in got.values())


def test_static_backend_samples_under_bf16_autocast(embedded):
    """Under bfloat16 autocast (--dtype auto on CUDA; CPU autocast stands in) RoPE turns the keys float32 while the
    values stay bfloat16, and a static cache holds one dtype: it failed with "index_copy_(): ... Float and BFloat16"
    on an H100. static now samples in the weights' dtype, autocast off: exactly float32 generate's greedy tokens.
    (`sample` is in the plumbing block, byte-identical in all six scripts: tests/test_lifecycle.py.)"""
    model, tokenizer = embedded
    ids, mask = grouped_prompts(tokenizer, groups=2, size=2)
    config = GenerationConfig(do_sample=False, temperature=1.0, max_new_tokens=16, pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=tokenizer.eos_token_id)
    with torch.no_grad():
        want = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, ids.shape[1]:]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got, logp = grpo.sample(model, ids, mask, config, "static")
    assert torch.equal(got, want) and logp.dtype == torch.float32 and torch.isfinite(logp).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_generation_backends_report_the_trainers_log_probs(embedded, backend):
    """Sampling at T = 0.7, each backend's log-probs of its tokens are the trainer's log softmax(logits / T), and
    every completion is padded after its first EOS (what the sampler start check relies on)."""
    model, tokenizer = embedded
    ids, mask = grouped_prompts(tokenizer, groups=2, size=4)
    torch.manual_seed(0)
    config = GenerationConfig(do_sample=True, temperature=0.7, top_k=0, max_new_tokens=24,
                              pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    with torch.no_grad():
        completion, sampler_logp = grpo.sample(model, ids, mask, config, backend)
        c_mask, _ = eos_mask(completion, tokenizer.eos_token_id)
        logp = grpo.completion_logprobs(model, torch.cat([ids, completion], 1), torch.cat([mask, c_mask.long()], 1),
                                        ids.shape[1], temperature=0.7)
    assert sampler_logp.shape == completion.shape and c_mask.sum() > len(ids)
    assert ((logp - sampler_logp).abs() * c_mask).max() < 1e-4
    assert (completion[c_mask == 0] == tokenizer.pad_token_id).all()


def test_sampler_copy_is_the_merged_weights_in_bfloat16_updated_in_place():
    """--generation-backend copy: the copy holds bfloat16(W + LoRA's B A s), exactly what merging the adapters gives;
    after an update a call rewrites the same tensors (a compiled CUDA graph keeps its addresses); the model's own
    parameters and state_dict do not include it, and a deepcopy (the final LoRA merge) shares it."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(ROOT / "models/tiny-arith"),
                           LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    keys, n_params = set(model.state_dict()), len(list(model.parameters()))
    for step in range(2):
        with torch.no_grad():  # an update: B starts at 0, so a zero delta would hide a wrong merge
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.add_(torch.randn_like(p) * 0.05)
        sampler = grpo.sampler_copy(model)
        if step == 0:
            first, pointers = sampler, [p.data_ptr() for p in sampler.parameters()]
        merged = copy.deepcopy(model).merge_and_unload().state_dict()
        assert sampler is first and [p.data_ptr() for p in sampler.parameters()] == pointers
        for name, p in sampler.named_parameters():
            assert p.dtype == torch.bfloat16 and torch.equal(p, merged[name].to(torch.bfloat16)), name
    assert set(model.state_dict()) == keys and len(list(model.parameters())) == n_params
    assert copy.deepcopy(model).get_base_model().bf16_copy() is sampler


def test_sampler_copy_decodes_greedily_as_float32_except_at_near_ties(embedded):
    """The bfloat16 copy's greedy completions equal the float32 model's on the embedded task, except where float32's
    two best logits are closer than bfloat16's rounding of the logits (measured up to 0.23 here): at least 90% of
    prompts decode identically, and each other one first differs at a token whose float32 margin is under 0.25."""
    model, tokenizer = embedded
    rows = [json.loads(line)["prompt"] for line in (ROOT / "data/arith/test.jsonl").read_text().splitlines()[:200]]
    ids, mask = grpo.left_pad([tokenizer(r, add_special_tokens=False).input_ids for r in rows], tokenizer.pad_token_id)
    config = GenerationConfig(do_sample=False, max_new_tokens=24, pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=tokenizer.eos_token_id)
    with torch.no_grad():
        want = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        got = grpo.sampler_copy(model).generate(input_ids=ids, attention_mask=mask, generation_config=config)
        full_mask = torch.cat([mask, torch.ones_like(want[:, ids.shape[1]:])], 1)
        top2 = model(input_ids=want, attention_mask=full_mask).logits[:, ids.shape[1] - 1 : -1].topk(2).values
    margin = top2[..., 0] - top2[..., 1]  # float32's margin at each completion token it chose
    same = [torch.equal(a, b) for a, b in zip(want, got)]
    assert sum(same) >= 0.9 * len(rows)
    for i in (i for i, s in enumerate(same) if not s):
        first = int((want[i, ids.shape[1]:] != got[i, ids.shape[1]:]).nonzero()[0])
        assert margin[i, first] < 0.25, (i, first, float(margin[i, first]))


def test_generation_backend_auto_picks_copy_on_cuda_and_shared_on_cpu():
    pick = lambda backend, dtype, device: grpo.generation_backend(  # noqa: E731
        SimpleNamespace(generation_backend=backend, dtype=dtype), torch.device(device))
    assert [pick("auto", d, "cuda") for d in ("auto", "float32", "bfloat16")] == ["copy", "shared", "static"]
    assert [pick("auto", d, "cpu") for d in ("auto", "float32", "bfloat16")] == ["shared"] * 3
    assert pick("copy", "auto", "cpu") == "copy" and pick("shared", "auto", "cuda") == "shared"


def test_the_sampler_check_takes_bf16s_tolerance_wherever_bf16_computes(monkeypatch):
    """Its 1e-3 holds only where sampler and trainer are float32 throughout: CPU, or CUDA with --dtype float32 (--fsdp
    too: its bf16 compute is --dtype auto's); a first-batch gap of 0.01 passes everywhere else (0.25)."""
    tensor = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda data, device=None: tensor(data))  # no CUDA tensors on this machine

    def stops(device: str, dtype: str, fsdp: bool = False, backend: str = "auto") -> bool:
        run = SimpleNamespace(args=SimpleNamespace(dtype=dtype, generation_backend=backend), fsdp=fsdp,
                              device=torch.device(device), gather=lambda x: x)
        try:
            grpo.sampler_gap(run, 0.01, 1)
        except ValueError as e:
            return "the sampler and the trainer disagree" in str(e)
        return False

    assert stops("cpu", "auto") and stops("cpu", "float32") and stops("cuda", "float32")
    assert stops("cuda", "float32", fsdp=True)
    assert not any([stops("cpu", "auto", backend="copy"), stops("cpu", "bfloat16"), stops("cuda", "auto"),
                    stops("cuda", "auto", fsdp=True), stops("cuda", "float32", backend="copy")])


@pytest.mark.parametrize("lr,warns", [(1e-6, True), (1e-4, False)])
def test_bf16_weights_warning_predicts_the_updates_adamw_loses(lr, warns):
    """The warning's count (entries where bfloat16(w + lr) == w) is the share of entries one AdamW step of size lr
    leaves unchanged in bfloat16 weights: Adam's first step moves every entry by lr exactly (m / sqrt(v) = +-1)."""
    model = AutoModelForCausalLM.from_pretrained(ROOT / "models/tiny-arith", dtype=torch.bfloat16)
    said = []
    grpo.check_bf16_updates(SimpleNamespace(say=said.append), model, lr)
    assert bool(said) == warns and all("--dtype auto" in s for s in said)
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0).step()
    kept = sum(int((p == b).sum()) for p, b in zip(model.parameters(), before)) / sum(b.numel() for b in before)
    predicted = sum(int(((b.float() + lr).bfloat16() == b).sum()) for b in before) / sum(b.numel() for b in before)
    assert kept == pytest.approx(predicted, abs=0.02) and (kept > 0.5) == warns  # 1e-6: 99% lost; 1e-4: 30%


# ----------------------------------------------------------------------------- runs


def test_truncated_importance_sampling_weighs_each_tokens_loss(tiny, tmp_path, monkeypatch):
    """--importance-sampling-cap multiplies every token's loss by its TIS weight: weights of 2 double the gradient
    (mu = 1, the same seed, so the same batch; the norm before clipping); on policy nothing is capped."""
    plain = grpo.main(tiny_args(tiny, tmp_path / "plain", total_steps=1))
    on_policy = grpo.main(tiny_args(tiny, tmp_path / "tis", total_steps=1, importance_sampling_cap=2.0))
    assert on_policy["train/tis_capped_frac"] == 0 and plain["train/grad_norm"] > 0
    assert on_policy["train/grad_norm"] == pytest.approx(plain["train/grad_norm"], rel=1e-4)
    monkeypatch.setattr(grpo, "truncated_is_weights", lambda old, sampler, mask, cap: (
        torch.full_like(old, 2.0), mask > 0))
    doubled = grpo.main(tiny_args(tiny, tmp_path / "doubled", total_steps=1, importance_sampling_cap=2.0))
    assert doubled["train/grad_norm"] == pytest.approx(2 * plain["train/grad_norm"], rel=1e-5)
    assert doubled["train/tis_capped_frac"] == 1


def test_a_run_samples_with_the_static_backend(tiny, tmp_path):  # shared, the default, runs in every other test
    out = grpo.main(tiny_args(tiny, tmp_path, total_steps=1, generation_backend="static"))
    assert math.isfinite(out["train/loss"]) and out["train/sampler_gap"] < 1e-4  # the start check passed, far inside


def test_few_step_run_writes_the_run_directory(tiny, tmp_path, capsys):
    out = grpo.main(tiny_args(tiny, tmp_path / "runs", total_steps=3, save_every=2, micro_batch_size=2, loss_type="dapo",
                              dynamic_sampling=True, mask_truncated_completions=True, track=True, warmup_steps=2))
    run = Path(out["run_dir"])
    assert json.loads((run / "args.json").read_text())["loss_type"] == "dapo"
    rows = train_rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    # the logged rate is the one each step's update used: warmup 1/2, 2/2, then cosine at progress 0 -> 1
    assert [r["train/lr"] for r in rows] == pytest.approx([3e-3 / 2, 3e-3, 3e-3])
    for key in ("train/reward", "rewards/capitalization", "train/kl", "train/clip_frac", "train/entropy",
                "train/completion_length", "train/frac_zero_std", "perf/step_s", "perf/generate_s", "perf/train_s"):
        assert all(math.isfinite(r[key]) for r in rows), key
    assert all(r["train/informative_groups"] <= 2 for r in rows)
    # overlong filtering: a batch of only truncated completions has no loss tokens, hence no gradient
    assert all((r["train/grad_norm"] == 0) == (r["train/truncated_frac"] == 1) for r in rows)
    assert {r["step"] for r in read_metrics(run) if "eval/accuracy" in r} == {0, 3}
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["last", "step_2", "step_3"]
    state = torch.load(run / "checkpoints" / "step_3" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 3 and "reward" in state
    AutoModelForCausalLM.from_pretrained(run / "final")
    AutoTokenizer.from_pretrained(run / "final")
    assert list((run / "wandb").rglob("*.wandb"))  # --track: the offline W&B run (conftest) is in the run directory
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert len(lines) == 3 and not any(" kl " in line for line in lines)  # beta = 0: no KL, so none shown


@pytest.mark.parametrize("num_iterations", [1, 2])
@pytest.mark.parametrize("level,loss_type", [("token", "grpo"), ("sequence", "grpo"), ("sequence_token", "grpo"),
                                             ("token", "cispo")])
def test_ratio_moves_only_after_the_first_update(tiny, tmp_path, num_iterations, level, loss_type):
    """mu = 1: pi_old = pi, the ratio is exactly 1 and nothing is clipped; mu = 2: the second update sees the
    first one's effect, so with a 0.1% clip range tokens get clipped (GSPO: whole completions; CISPO: capped)."""
    out = grpo.main(tiny_args(tiny, tmp_path, num_iterations=num_iterations, clip_low=1e-3, clip_high=1e-3,
                              learning_rate=1e-2, eval_split=None, importance_sampling_level=level, loss_type=loss_type))
    clip = [r["train/clip_frac"] for r in train_rows(out["run_dir"])]
    if num_iterations == 1:
        assert clip == [0.0, 0.0]
    else:
        assert all(c > 0.05 for c in clip)


@pytest.mark.parametrize("kl_estimator,lora_r", [("k1", 0), ("k2", 0), ("k3", 0), ("k3", 4)])
def test_reference_kl_starts_at_zero_and_grows(tiny, tmp_path, capsys, kl_estimator, lora_r):
    out = grpo.main(tiny_args(tiny, tmp_path, beta=0.04, kl_estimator=kl_estimator, lora_r=lora_r, eval_split=None,
                              learning_rate=1e-2 if lora_r == 0 else 5e-2))
    kl = [r["train/kl"] for r in train_rows(out["run_dir"])]
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert len(lines) == 2 and all(f" kl {k:.3g} " in line for k, line in zip(kl, lines))  # the progress line shows it
    assert kl[0] == 0.0  # the policy starts as the reference (LoRA: the base model with adapters off)
    assert kl[1] != 0.0 if kl_estimator == "k1" else kl[1] > 1e-7
    if lora_r:
        final = load_file(Path(out["run_dir"]) / "final" / "model.safetensors")
        assert not any("lora" in k for k in final)  # merged into plain weights, loadable without peft


@pytest.mark.parametrize("loss_type", ["dapo", "bnpo"])
def test_skipping_zero_advantage_completions_changes_nothing(tiny, tmp_path, loss_type):
    """With beta = 0, completions with zero advantage are left out of the backward pass; a negligible
    beta keeps them in (the KL term needs every row) and must give the same weights."""
    kw = {"total_steps": 3, "num_generations": 2, "prompts_per_step": 4, "eval_split": None, "loss_type": loss_type}
    skipped = grpo.main(tiny_args(tiny, tmp_path / "a", **kw))
    kept = grpo.main(tiny_args(tiny, tmp_path / "b", beta=1e-12, **kw))
    assert any(r["train/frac_zero_std"] > 0 for r in train_rows(skipped["run_dir"]))  # there was something to skip
    a = load_file(Path(skipped["run_dir"]) / "final" / "model.safetensors")
    b = load_file(Path(kept["run_dir"]) / "final" / "model.safetensors")
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


@pytest.mark.parametrize("variant,same_as", [
    ({"importance_sampling_level": "sequence"}, {}), ({"importance_sampling_level": "sequence_token"}, {}),
    ({"delta": 1.5}, {}), ({"loss_type": "cispo"}, {"loss_type": "dapo"}),
    ({"top_entropy_quantile": 0.3}, None)])
def test_on_policy_the_variants_reduce_to_grpo_or_dapo(tiny, tmp_path, variant, same_as):
    """At mu = 1 every ratio is 1: GSPO, GSPO-token and delta give GRPO's gradient (GSPO Sec. 4.3), CISPO gives
    DAPO's; the high-entropy selection does change it (it drops tokens)."""
    kw = {"total_steps": 2, "eval_split": None}
    a = load_file(Path(grpo.main(tiny_args(tiny, tmp_path / "a", **kw, **variant))["run_dir"]) / "final/model.safetensors")
    b = load_file(Path(grpo.main(tiny_args(tiny, tmp_path / "b", **kw, **(same_as or {})))["run_dir"])
                  / "final/model.safetensors")
    same = all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    assert same == (same_as is not None)


def test_resume_with_more_steps_continues_the_lr_decay(tiny, tmp_path):
    kw = {"total_steps": 4, "eval_split": None, "save_every": 2, "lr_schedule": "linear"}
    first = grpo.main(tiny_args(tiny, tmp_path, **kw))
    ckpt = Path(first["run_dir"]) / "checkpoints" / "step_2"
    with pytest.raises(ValueError, match=r"--learning-rate 0.5 differs from the run's 0.003.*cannot change on resume"):
        grpo.main(grpo.Args(resume=str(ckpt), learning_rate=0.5))
    out = grpo.main(grpo.Args(resume=str(ckpt), total_steps=6))  # longer: the decay continues from where it was
    rows = train_rows(out["run_dir"])
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    # linear decay over 4 steps reached 1 - 2/4 = 0.5 at step 2; from there it falls linearly to 0 at step 6
    assert [r["train/lr"] / 3e-3 for r in rows[2:]] == pytest.approx([0.5, 0.375, 0.25, 0.125])
    saved = json.loads((Path(out["run_dir"]) / "args.json").read_text())
    assert saved["total_steps"] == 4 and saved["resumed"][-1]["overrides"] == {"total_steps": [4, 6]}


def test_resume_is_exact_with_the_sampler_copy(tiny, tmp_path):
    """The copy is rebuilt from the restored weights: steps 3-4 of a resumed run equal a straight run's."""
    out = grpo.main(tiny_args(tiny, tmp_path, total_steps=4, eval_split=None, save_every=2, generation_backend="copy",
                              beta=0.04))
    straight = train_rows(out["run_dir"])
    rows = train_rows(grpo.main(grpo.Args(resume=str(Path(out["run_dir"]) / "checkpoints" / "step_2")))["run_dir"])
    train = lambda r: {k: v for k, v in r.items() if k.startswith("train/")}  # noqa: E731
    assert [train(r) for r in rows[2:]] == [train(r) for r in straight[2:]] and rows[2]["train/sampler_gap"] > 1e-4


def test_at_a_real_learning_rate_the_copy_moves_the_weights_as_float32_does_and_bf16_weights_do_not(tiny, tmp_path, capsys):
    """lr 1e-6, beta 0.04, 6 steps on the embedded model (prompts from the small copy of the task). Float32 weights
    sampled by the bfloat16 copy (the CUDA default) move the policy as float32 does: its KL to the start on fixed texts
    within 2x of float32's (measured 0.98x), the weights' change as large (||theta_6 - theta_0|| 1.00x, all but 0.1% of
    entries moved). bfloat16 weights keep 99% of their entries (AdamW's steps round away, and the run warns): a
    change 0.11x as large and a KL 1.9e-4 of float32's."""
    start = load_file(ROOT / "models/tiny-arith/model.safetensors")
    tokenizer = AutoTokenizer.from_pretrained(ROOT / "models/tiny-arith")
    rows = [json.loads(line) for line in (ROOT / "data/arith/test.jsonl").read_text().splitlines()[:64]]
    texts = tokenizer([f"{r['prompt']} {r['answer']}" for r in rows], return_tensors="pt", padding=True,
                      add_special_tokens=False)

    def logp(folder, dtype=torch.float32) -> torch.Tensor:
        with torch.no_grad():
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).float()
            return model(**texts).logits.double().log_softmax(-1)[texts.attention_mask.bool()]

    moved, kl = {}, {}
    for name, kw in {"float32": {"dtype": "float32"}, "copy": {"generation_backend": "copy"},
                     "bf16": {"dtype": "bfloat16"}}.items():
        out = grpo.main(grpo.Args(output_dir=str(tmp_path / name), dataset=str(tiny / "data"), total_steps=6,
                                  prompts_per_step=8, num_generations=4, eval_split=None, beta=0.04,
                                  learning_rate=1e-6, warmup_steps=0, **kw))
        final = load_file(Path(out["run_dir"]) / "final/model.safetensors")
        delta = torch.cat([(final[k].double() - start[k].to(final[k].dtype).double()).flatten() for k in final])
        moved[name] = (float(delta.norm()), float((delta != 0).double().mean()))
        initial = logp(ROOT / "models/tiny-arith", torch.bfloat16 if name == "bf16" else torch.float32)
        after = logp(Path(out["run_dir"]) / "final")
        kl[name] = float((after.exp() * (after - initial)).sum(-1).mean())
    assert 0.5 < moved["copy"][0] / moved["float32"][0] < 2 and moved["copy"][1] > 0.999 and moved["float32"][1] > 0.999
    assert moved["bf16"][0] < 0.2 * moved["float32"][0] and moved["bf16"][1] < 0.05
    assert 0.5 < kl["copy"] / kl["float32"] < 2 and kl["bf16"] < 1e-3 * kl["float32"]
    assert "leaves 99% of the weights unchanged" in capsys.readouterr().out


def test_lr_factor_anchor_continues_the_decay():
    # cosine over 10 steps (warmup 2) resumed at step 6 with 20 steps: starts where it was, ends at 0
    f6 = grpo.lr_factor(6, 2, 10, "cosine")
    assert f6 == pytest.approx(0.5)
    assert grpo.lr_factor(6, 2, 20, "cosine", (6, f6)) == pytest.approx(f6)
    assert grpo.lr_factor(13, 2, 20, "cosine", (6, f6)) == pytest.approx(f6 * 0.5)
    assert grpo.lr_factor(20, 2, 20, "cosine", (6, f6)) == pytest.approx(0.0)
    assert grpo.lr_factor(1, 2, 20, "cosine", (1, 1.0)) == 1.0  # an anchor inside warmup changes nothing


def test_prompts_and_completions_must_fit_the_context(tiny, tmp_path):
    """Every prompt generation sees (training prompts as --max-prompt-length keeps them, eval prompts whole) plus
    --max-completion-length must fit the model's positions: one short is refused before any work; at the limit a
    run completes."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text('{"prompt": "1+2+3+4+5+6+7=", "answer": "28"}\n' * 4)  # kept: its last 4 tokens
    (data / "test.jsonl").write_text('{"prompt": "12+34=", "answer": "46"}\n')  # the longest prompt
    longest = len(AutoTokenizer.from_pretrained(tiny / "model")("12+34=", add_special_tokens=False).input_ids)
    kw = {"dataset": str(data), "max_prompt_length": 4, "total_steps": 1}
    with pytest.raises(ValueError, match=rf"a {longest}-token prompt and --max-completion-length 8 exceed the model's "
                                         rf"{longest + 7} positions"):
        grpo.main(tiny_args(tiny, tmp_path / "a", model_name_or_path=short_gpt2(tmp_path / "short", longest + 7), **kw))
    assert not (tmp_path / "a").exists()
    out = grpo.main(tiny_args(tiny, tmp_path / "b", model_name_or_path=short_gpt2(tmp_path / "fits", longest + 8), **kw))
    assert out["step"] == 1 and "eval/accuracy" in out


def test_learning_raises_the_reward(tiny, tmp_path):
    """The task's prompts, a random 2-layer model and the `capitalization` reward (0.5 for an upper-case
    first letter + 0.5 for final punctuation): the mean reward of the last 5 of 30 steps must beat the
    first 5 by 0.3. A policy gradient with the wrong sign, or log-probs or advantages attached to the
    wrong completions, leaves it flat or lowers it. (Learning on models/tiny-arith with the default
    reward: the next test.)
    """
    out = grpo.main(tiny_args(tiny, tmp_path, total_steps=30, num_generations=8, prompts_per_step=8,
                              micro_batch_size=64, learning_rate=1e-2, eval_split=None))
    rewards = [r["train/reward"] for r in train_rows(out["run_dir"])]
    assert len(rewards) == 30
    assert statistics.fmean(rewards[-5:]) > statistics.fmean(rewards[:5]) + 0.3


def test_learning_on_the_embedded_task(tmp_path):
    """models/tiny-arith with 64 prompts x 8 completions a step (the default) and mu = 1: the mean training
    reward of steps 61-80 beats that of steps 1-20 (measured: 0.098 -> 0.209; the per-step mean over 512
    completions has a standard error near 0.02, a 20-step mean near 0.005). About 100 s on 2 cores.
    """
    out = grpo.main(grpo.Args(output_dir=str(tmp_path), total_steps=80, eval_split=None, num_iterations=1))
    rewards = [r["train/reward"] for r in train_rows(out["run_dir"])]
    assert len(rewards) == 80
    assert statistics.fmean(rewards[-20:]) > statistics.fmean(rewards[:20]) + 0.06


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("overrides,message", [
    ({"num_generations": 1}, "--num-generations must be >= 2"),
    ({"prompts_per_step": 3, "num_generations": 2, "micro_batch_size": 4}, "not divisible by --micro-batch-size 4"),
    ({"max_completion_length": 0}, "--max-completion-length must be positive"),
    ({"eval_limit": 0}, "--eval-limit must be positive"),
    ({"reward": "correctness,bogus"}, "unknown reward type 'bogus'"),
    ({"reward": "correctness", "answer_column": "solution"}, "has no column ['solution']"),
    ({"prompts_per_step": 3, "num_generations": 4, "micro_batch_size": 8}, "use --micro-batch-size 6"),
    ({"delta": 1.1}, "above 1 + --clip-high = 1.2"),
    ({"delta": 4.0, "loss_type": "cispo"}, "it needs a clip loss type"),
    ({"importance_sampling_cap": 0.5}, "must be >= 1, e.g. 2"),
    ({"fsdp": True}, "launch with torchrun --nproc-per-node N"),
    ({"top_entropy_quantile": 0.0}, "--top-entropy-quantile must be in (0, 1]"),
    ({"tools": ("calculater",)}, "--tools calculater: unknown tool; use calculator, file.py:function or tag=either"),
    ({"tools": ("tools.py:f",)}, "--tools tools.py:f: no file tools.py"),
    ({"tools": ("my tool=calculator",)}, "'my tool' is not a tag name: name it with <tag>=calculator"),
    ({"max_turns": 0}, "--max-turns must be positive, got 0"),
    ({"max_tool_output": 0}, "--max-tool-output must be positive, got 0"),
    ({"tool_result_template": "<result></result>"}, "--tool-result-template needs {} where the tool's output goes"),
])
def test_bad_input_fails_before_any_work(tiny, tmp_path, overrides, message):
    with pytest.raises(ValueError) as e:
        grpo.main(tiny_args(tiny, tmp_path, **overrides))
    assert message in str(e.value)
    assert not any(tmp_path.iterdir())  # no run directory was created


def test_fsdp_bad_input_fails_before_loading(tiny, tmp_path, monkeypatch):
    """Under torchrun (LOCAL_RANK set), --fsdp with LoRA, or with a model without a list of decoder layers, fails in
    the checks, before any process group or model exists."""
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(ValueError, match="--fsdp with --lora-r is not supported"):
        grpo.main(tiny_args(tiny, tmp_path, fsdp=True, lora_r=4))
    with pytest.raises(ValueError, match="no list of decoder layers found in Sequential"):
        grpo.decoder_layers(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)))
    assert len(grpo.decoder_layers(AutoModelForCausalLM.from_pretrained(tiny / "model"))) == 2
    assert not any(tmp_path.iterdir())


def test_default_micro_batch_fits_the_batch(tiny, tmp_path):
    """0 (the default) picks the largest divisor of each process's batch up to 128."""
    assert grpo.fit_micro_batch(0, 512, "") == 128 and grpo.fit_micro_batch(0, 96, "") == 96
    assert grpo.fit_micro_batch(0, 300, "") == 100
    out = grpo.main(tiny_args(tiny, tmp_path, micro_batch_size=0, prompts_per_step=3, num_generations=3,
                              eval_split=None, total_steps=1))
    assert out["step"] == 1


def test_reward_needing_a_missing_column(tiny, tmp_path):
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "1+1="}\n{"prompt": "2+2="}\n')
    with pytest.raises(ValueError, match=r"has no column \['answer'\].*--reward"):
        grpo.main(tiny_args(tiny, tmp_path / "out", dataset=str(tmp_path / "prompts.jsonl"), reward="correctness",
                            eval_split=None))


def test_lora_without_peft_names_the_fix(tiny, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft now raises ImportError
    with pytest.raises(ValueError, match="pip install peft"):
        grpo.main(tiny_args(tiny, tmp_path, lora_r=8))


def head_models():
    """Tiny causal LMs whose logits are not hidden @ lm_head.weight.T."""
    from transformers import (CohereConfig, CohereForCausalLM, Gemma2Config, Gemma2ForCausalLM, GraniteConfig,
                              GraniteForCausalLM, Qwen2Config, Qwen2ForCausalLM)

    size = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    biased = Qwen2ForCausalLM(Qwen2Config(**size, tie_word_embeddings=False))
    biased.lm_head = torch.nn.Linear(32, 64, bias=True)
    return {"gemma2 soft-capping": Gemma2ForCausalLM(Gemma2Config(**size, head_dim=16, final_logit_softcapping=0.5)),
            "cohere logit_scale": CohereForCausalLM(CohereConfig(**size, logit_scale=4.0)),
            "granite logits_scaling": GraniteForCausalLM(GraniteConfig(**size, logits_scaling=0.25)),
            "lm_head bias": biased}


@pytest.mark.parametrize("name", ["gemma2 soft-capping", "cohere logit_scale", "granite logits_scaling", "lm_head bias"])
def test_completion_logprobs_are_of_the_models_own_logits_whatever_its_head(name):
    """Log-probs from the hidden states and the head must equal log softmax(model(...).logits / T) in float64."""
    model = head_models()[name].eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 64, (3, 9), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # a left-padded prompt
    with torch.no_grad():
        got = grpo.completion_logprobs(model, ids, mask, 4, 0.7)
        position_ids = (mask.cumsum(dim=1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits.double()
        plain = torch.log_softmax(model.get_decoder()(input_ids=ids, attention_mask=mask, position_ids=position_ids)
                                  .last_hidden_state.double() @ model.get_output_embeddings().weight.double().T / 0.7,
                                  dim=-1)[:, 3:-1].gather(-1, ids[:, 4:, None])[..., 0]
    want = torch.log_softmax(logits / 0.7, dim=-1)[:, 3:-1].gather(-1, ids[:, 4:, None])[..., 0]
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    assert (plain - want).abs().max() > 1e-2  # the plain matmul would be wrong for this model
    # new tensors, not views (of the kernel's flat rows): FSDP2 warns that its backward hook on a view is fragile
    assert got._base is None and all(x._base is None for x in grpo.completion_logprobs(model, ids, mask, 4, 0.7, True))


def test_variants_benchmark_runs_and_tabulates(tmp_path):
    """benchmarks/grpo_variants.py end to end at a toy budget: a row per variant with each seed's accuracy, and the plot."""
    plot = tmp_path / "curves.png"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "grpo_variants.py"), "--variants", "grpo", "gspo",
                           "--seeds", "1", "--jobs", "2", "--output-dir", str(tmp_path / "runs"), "--plot", str(plot),
                           "--", "--total-steps", "2", "--prompts-per-step", "2", "--num-generations", "2",
                           "--eval-limit", "8", "--warmup-steps", "1"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {line.split("|")[1].strip(): line for line in done.stdout.splitlines() if line.startswith("| g")}
    assert set(rows) == {"grpo", "gspo"} and "--importance-sampling-level sequence" in rows["gspo"]
    assert plot.stat().st_size > 0
    assert len(list((tmp_path / "runs").glob("*__gspo__1__*/final/model.safetensors"))) == 1


# ----------------------------------------------------------------------------- tools


def test_calculator_is_exact_and_refuses_what_is_not_arithmetic():
    assert [grpo.calculator(e) for e in ("347+589", " 2*21 ", "1/3+1/6", "-(3-5)**3", "2**-2", "0.1+0.2")] == [
        "936", "42", "1/2", "8", "1/4", "3/10"]
    for expression, message in (("__import__('os').system('x')", "not arithmetic"), ("x+1", "not arithmetic"), ("7//2", "not arithmetic: 7 // 2"),
                                ("9**9**9", "of over 1,000 digits"), ("2**0.5", "not an integer power"), ("10**500*10**501", "a number of over 1,000 digits"), ("1/(2-2)", "division by zero"),
                                ("1" * 201, "over 200 characters"), ("1+", "invalid syntax")):
        with pytest.raises((ValueError, SyntaxError), match=re.escape(message)):
            grpo.calculator(expression)


def test_load_tools_builds_each_and_names_the_fix_for_bad_ones(tmp_path):
    (tmp_path / "mine.py").write_text("def search(q):\n    return q.upper()\nvalue = 3\n")
    mine = str(tmp_path / "mine.py")
    tools = grpo.load_tools(("calculator", f"{mine}:search", f"calc=calculator"))
    assert list(tools) == ["calculator", "search", "calc"] and tools["search"]("ab") == "AB"
    for spec, message in (("bogus", "--tools bogus: unknown tool; use calculator, file.py:function"),
                          ("nope.py:f", "--tools nope.py:f: no file nope.py"),
                          (f"{mine}:absent", "has no function 'absent'"), (f"{mine}:value", "has no function 'value'"),
                          ("a b=calculator", "'a b' is not a tag name: name it with <tag>=calculator"),
                          ("cal<c=calculator", "'cal<c' is not a tag name")):
        with pytest.raises(ValueError, match=re.escape(message)):
            grpo.load_tools((spec,))
    with pytest.raises(ValueError, match="'calculator' is taken"):
        grpo.load_tools(("calculator", "calculator"))


@pytest.fixture(scope="module")
def char_tokenizer():
    return AutoTokenizer.from_pretrained(ROOT / "data/arith/tokenizer")


def test_call_tool_runs_the_last_call_shows_errors_and_cuts_long_output(char_tokenizer):
    tok, args = char_tokenizer, grpo.Args(max_tool_output=8)
    tools = {"calculator": grpo.calculator, "echo": lambda a: a, "boom": lambda a: 1 / 0}
    decode = lambda ids: tok.decode(ids)
    ids, failed = grpo.call_tool(tok, "<think><calculator>1+1</calculator><calculator>2*21</calculator>", tools, args)
    assert decode(ids) == "<result>2</result>" and not failed  # the first closing tag ends the turn: 1+1
    ids, failed = grpo.call_tool(tok, "<think>x<calculator>2*21</calculator>", tools, args)
    assert decode(ids) == "<result>42</result>" and not failed
    ids, failed = grpo.call_tool(tok, "<boom>x</boom>", tools, args)
    assert decode(ids) == "<result>error: division by zero</result>"[:8] + "error: d...(cut)</result>" and failed
    ids, failed = grpo.call_tool(tok, "2*21</calculator>", tools, replace(args, max_tool_output=99))
    assert decode(ids) == "<result>error: no <calculator> before </calculator></result>" and failed
    ids, failed = grpo.call_tool(tok, "<echo>ab<|endoftext|></echo>", tools, replace(args, max_tool_output=99))
    assert decode(ids) == "<result>ab<|endoftext|></result>" and tok.eos_token_id not in ids  # text, never an EOS
    ids, _ = grpo.call_tool(tok, "<echo>7</echo>", tools, replace(args, tool_result_template="\n[{}]"))
    assert decode(ids) == "\n[7]"


def masked_loss(logp, old_logp, ref_logp, mask, loss_type="grpo", level="token", beta=0.04, fused=False):
    args = SimpleNamespace(importance_sampling_level=level, loss_type=loss_type, delta=None, clip_low=0.2,
                           clip_high=0.2, beta=beta, kl_estimator="k3", prompts_per_step=1,
                           num_generations=len(logp), max_completion_length=logp.shape[1])
    advantages = torch.tensor([[1.0], [-0.5], [2.0]])[: len(logp)]
    if fused:
        per_token, kl, _ = clipped_policy_loss(logp, old_logp, advantages, ref_logp=ref_logp, clip_low=0.2,
                                               clip_high=0.2, beta=beta, kl_estimator="k3")
    else:
        per_token, kl, _ = grpo.policy_loss(logp, old_logp, advantages, mask, ref_logp, args)
    return grpo.aggregate_loss(per_token, mask, args, int(mask.sum()), int(mask.sum()), 1), (kl * mask).sum()


@pytest.mark.parametrize("loss_type,level,fused", [("grpo", "token", False), ("dapo", "token", False),
                                                   ("dr_grpo", "token", False), ("bnpo", "sequence", False),
                                                   ("cispo", "token", False), ("grpo", "token", True)])
def test_tool_tokens_are_in_no_loss_term(loss_type, level, fused):
    """The loss mask (model tokens up to EOS, no tool token), as main builds it: the gradient with respect to a tool
    token's logits is exactly 0, and changing a tool token's log-prob (policy, old or reference) changes neither the
    loss nor the KL; the fused kernel's per-token loss under the same mask too."""
    torch.manual_seed(0)
    completion_mask = torch.tensor([[1.0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    tool_mask = torch.tensor([[0, 1, 1, 0, 0, 0], [0, 0, 1, 0, 0, 0], [1, 1, 0, 1, 1, 0]], dtype=torch.bool)
    mask = completion_mask * ~tool_mask
    logits = torch.randn(3, 6, 11, requires_grad=True)
    targets = torch.randint(0, 11, (3, 6))
    logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
    old, ref = logp.detach() + 0.1 * torch.randn(3, 6), logp.detach() + 0.3 * torch.randn(3, 6)
    loss, kl = masked_loss(logp, old, ref, mask, loss_type, level, fused=fused)
    loss.backward()
    per_position = logits.grad.abs().sum(-1)
    assert (per_position[tool_mask] == 0).all() and (per_position[mask > 0] > 0).all()
    moved = torch.where(tool_mask, -30.0, 0.0)  # a tool token the policy finds very unlikely
    for changed in ((logp.detach() + moved, old, ref), (logp.detach(), old + moved, ref), (logp.detach(), old, ref + moved)):
        again, kl_again = masked_loss(*changed, mask, loss_type, level, fused=fused)
        assert again.item() == loss.item() and kl_again.item() == kl.item()


def tool_file(tmp_path, body: str) -> str:
    (tmp_path / "toolbox.py").write_text(f"def tool(arguments):\n    return {body}\n")
    return str(tmp_path / "toolbox.py")


@pytest.mark.parametrize("result,template", [("'7'", "<result>{}</result>"), ("''", "{}")])
def test_turns_keep_the_sampled_tokens_and_the_trainer_agrees_with_the_sampler(embedded, tmp_path, result, template,
                                                                               monkeypatch):
    """models/tiny-arith ends its trace with </think>: a tool tagged `think` makes that a call. The completion is the
    sampled ids, then the tool's tokens (tool_mask marks exactly those), then what the model sampled after them; the
    trainer's log-probs over the whole row equal the sampler's at every model token, as in a single-turn run (a tool
    that returns nothing leaves the row exactly the model's tokens)."""
    model, tokenizer = embedded
    tools = grpo.load_tools((f"think={tool_file(tmp_path, result)}:tool",))
    args = grpo.Args(max_completion_length=48, max_turns=2, tool_result_template=template)  # one call: turn 2 is the last
    prompts = [tokenizer(r, add_special_tokens=False).input_ids for r in ("12+34=", "905-528=", "7-3=")]
    config = GenerationConfig(do_sample=True, temperature=0.7, top_k=0, eos_token_id=[tokenizer.eos_token_id],
                              pad_token_id=tokenizer.pad_token_id)
    gaps, repeats, repeat = {}, [], DynamicCache.batch_repeat_interleave
    monkeypatch.setattr(DynamicCache, "batch_repeat_interleave", lambda cache, n: repeats.append(n) or repeat(cache, n))
    for name, toolset in (("tools", tools), ("single", {})):
        torch.manual_seed(0)
        out = grpo.turns(model, tokenizer, [p for p in prompts for _ in range(4)], config, "shared",
                         [tokenizer.eos_token_id], toolset, args)
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
        attention = torch.cat([out["prompt_mask"], out["completion_mask"].long()], 1)
        with torch.no_grad():
            logp = grpo.completion_logprobs(model, ids, attention, out["prompt_ids"].shape[1], temperature=0.7)
        loss_mask = out["completion_mask"] * ~out["tool_mask"]
        gaps[name] = float(((logp - out["sampler_logp"]).abs() * loss_mask).max())
        texts = tokenizer.batch_decode(out["completion_ids"], skip_special_tokens=True)
        if name == "tools":
            assert (out["tool_calls"] == 1).all() and (out["tool_errors"] == 0).all()
            want = len(tokenizer(template.replace("{}", eval(result)), add_special_tokens=False).input_ids)
            assert out["tool_mask"].sum(1).tolist() == [want] * 12
            assert all(f"</think>{template.replace('{}', eval(result))}" in t for t in texts)
            for row, tool_row in zip(out["completion_ids"], out["tool_mask"]):  # the tool's tokens follow </think>
                first = int(tool_row.float().argmax()) if tool_row.any() else int((row == 4).float().argmax()) + 1
                assert row[first - 1] == tokenizer.convert_tokens_to_ids("</think>")
    assert gaps["tools"] < 1e-4 and gaps["single"] < 1e-4
    assert repeats[0].tolist() == repeats[-1].tolist() == [4, 4, 4]  # the first turn prefills each prompt once


def test_correctness_in_a_tool_run_reads_only_the_answer_tag():
    """The tool's result holds the right number; only the <answer> tag counts (no last-number fallback)."""
    from rewards import make_reward

    completions = ["<think><calculator>2*21</calculator><result>42</result></think>", "<answer>42</answer>"]
    plain, tool_run = make_reward("correctness"), make_reward("correctness", {"correctness": {"tagged_only": True}})
    assert plain(completions, prompts=["", ""], answer=["42", "42"]) == [1.0, 1.0]
    assert tool_run(completions, prompts=["", ""], answer=["42", "42"]) == [-0.5, 1.0]
    spec = {"type": "correctness", "tagged_only": False}  # the spec's own option wins
    assert make_reward(spec, {"correctness": {"tagged_only": True}})(completions, prompts=["", ""],
                                                                      answer=["42", "42"]) == [1.0, 1.0]


def tool_args(tmp_path, tiny, **kw) -> grpo.Args:
    """models/tiny-arith on the tiny task with a tool tagged `think` (its </think> is a call)."""
    tool = f"think={tool_file(tmp_path, repr('<answer>') + ' + arguments[-2:]')}:tool"
    return tiny_args(tiny, tmp_path / "runs", model_name_or_path=str(ROOT / "models/tiny-arith"), tools=(tool,),
                     reward="correctness:1.0,format:0.2", max_completion_length=40, eval_limit=8, **kw)


def test_a_tool_run_logs_its_tools_and_resumes_exactly(tiny, tmp_path):
    """With dynamic sampling (the turns' tensors concatenated across draws) and the static-cache backend."""
    out = grpo.main(tool_args(tmp_path, tiny, total_steps=3, save_every=1, dynamic_sampling=True,
                              generation_backend="static"))
    run = Path(out["run_dir"])
    rows = train_rows(run)
    assert all(r["train/tool_calls"] > 0.5 and r["train/tool_tokens"] > 1 and r["train/sampler_gap"] < 1e-4
               for r in rows)
    evals = [r for r in read_metrics(run) if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 3] and all(0.5 < r["eval/call_rate"] <= 1 for r in evals)
    assert {"eval/tool_calls", "eval/tool_errors", "eval/tool_tokens", "eval/accuracy_with_call"} <= evals[0].keys()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in read_metrics(run) if r["step"] <= 1))
    grpo.main(replace(grpo.Args(), resume=str(run / "checkpoints" / "step_1")))
    for a, b in zip(train_rows(run)[1:], rows[1:], strict=True):  # the sampler's rounding: the static cache's length
        assert a["train/sampler_gap"] == pytest.approx(b["train/sampler_gap"], abs=1e-7)
        assert {k: v for k, v in a.items() if k.startswith(("train/", "rewards/")) and k != "train/sampler_gap"} == {
            k: v for k, v in b.items() if k.startswith(("train/", "rewards/")) and k != "train/sampler_gap"}


def test_a_tool_run_under_torchrun(tiny, tmp_path):
    """2 gloo processes with --fsdp (whole weights while the turns sample), each with its own rows and turns."""
    from conftest import run_torchrun

    args = tool_args(tmp_path, tiny, prompts_per_step=4, eval_split=None)
    out = run_torchrun("grpo.py", "--model-name-or-path", args.model_name_or_path, "--dataset", args.dataset,
                       "--tools", args.tools[0], "--output-dir", str(tmp_path / "tr"), "--total-steps", "1",
                       "--prompts-per-step", "4", "--num-generations", "4", "--max-completion-length", "40",
                       "--eval-split", "None", "--warmup-steps", "0", "--fsdp")
    assert "2 processes, FSDP2" in out
    (run,) = (tmp_path / "tr").iterdir()
    assert [r["train/tool_calls"] > 0.5 for r in train_rows(run)] == [True]


def tool_recipe() -> list[list[str]]:
    """docs/grpo.md's tool recipe: the first bash block after '## Tool calls', one argv per command."""
    block = (ROOT / "docs/grpo.md").read_text().split("## Tool calls")[1].split("```bash\n")[1].split("```")[0]
    return [shlex.split(line, comments=True) for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def test_the_tool_recipe_as_pasted_and_a_short_tool_run_learns(tmp_path, monkeypatch):
    """docs/grpo.md's two commands as written, in a fresh folder (data/ and models/ linked in), a tiny budget appended
    (the last value of a flag wins): sft.py makes a cold start, grpo.py --tools calculator trains it. Then the learning
    test of a tool run: from the shipped cold start (models/tiny-arith-tools: a call in 5% of its greedy completions
    of the first 64 test problems), 5 steps of 16 prompts x 8 make calls the rule and raise greedy accuracy (measured:
    calls 6% -> 100%, accuracy 22% -> 73%, the same on one thread; seeds 2 / 3: calls 95 / 97%, accuracy 61 / 69%).
    The recipe's flags are also benchmarks/tools.py's."""
    import sft
    import tyro

    for folder in ("data", "models"):
        (tmp_path / folder).symlink_to(ROOT / folder)
    monkeypatch.chdir(tmp_path)
    cold, train = tool_recipe()
    assert [cold[:2], train[:2]] == [["python", "sft.py"], ["python", "grpo.py"]]
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import tools  # benchmarks/tools.py measures these two commands

    assert cold[1:] == [*tools.COLD_START, "--eval-every", "250", "--final-dir", "models/tiny-arith-tools"]
    flags = lambda argv: dict(zip(argv[1::2], argv[2::2], strict=True))
    assert flags(train[1:]) == {**flags(tools.RECIPE), "--model-name-or-path": "models/tiny-arith-tools",
                                "--eval-every": "10"} and train[1] == tools.RECIPE[0]
    sft.main(tyro.cli(sft.Args, args=cold[2:] + "--total-steps 2 --batch-size 8 --eval-split None --warmup-steps 0 "
                                                "--final-dir cold".split()))
    out = grpo.main(tyro.cli(grpo.Args, args=train[2:] + "--model-name-or-path cold --total-steps 1 --prompts-per-step 2 "
                                                         "--num-generations 2 --eval-limit 4".split()))
    assert out["step"] == 1 and "eval/call_rate" in out and "train/tool_calls" in out
    out = grpo.main(tyro.cli(grpo.Args, args=train[2:] + "--total-steps 5 --prompts-per-step 16 --eval-limit 64 "
                                                         "--eval-every 0 --warmup-steps 2".split()))
    first, last = [r for r in read_metrics(out["run_dir"]) if "eval/accuracy" in r]
    assert first["eval/call_rate"] < 0.2 and last["eval/call_rate"] > 0.8
    assert last["eval/accuracy"] > first["eval/accuracy"] + 0.25
