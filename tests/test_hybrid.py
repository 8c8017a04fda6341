"""hybrid.py: the curriculum, the SFT loss against sft.py's, the PPO pieces against float64 / hand-computed
references, the optimiser and scheduler factories, the JSON reward spec, the reference and KL wiring, runs, learning,
hybrid's own resume state and bad input (the shared lifecycle is tests/test_lifecycle.py's)."""
import json
import math
import shutil
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import read_metrics, short_gpt2, train_rows
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import hybrid
import sft

ROOT = Path(__file__).resolve().parents[1]


def tiny_args(tiny, tmp_path, **kw) -> hybrid.Args:
    base = hybrid.Args(model_name_or_path=str(tiny / "model"), dataset=str(tiny / "data"), output_dir=str(tmp_path),
                       total_steps=4, prompts_per_step=4, sft_batch_size=4, max_completion_length=8, eval_limit=4,
                       eval_every=0, warmup_steps=0, learning_rate=3e-3, sft_fraction_start=0.5, sft_fraction_end=0.5)
    return replace(base, **kw)


# ----------------------------------------------------------------------------- curriculum


def test_sft_fraction_hand_computed():
    # 5 steps: progress 0, 1/4, 1/2, 3/4, 1 from 0.9 to 0.1
    linear = [hybrid.sft_fraction(s, 5, 0.9, 0.1, "linear") for s in range(1, 6)]
    assert linear == pytest.approx([0.9, 0.7, 0.5, 0.3, 0.1])
    cosine = [hybrid.sft_fraction(s, 5, 0.9, 0.1, "cosine") for s in range(1, 6)]
    # 0.1 + 0.8 (1 + cos(pi p)) / 2: at p = 1/4, (1 + 0.7071068) / 2 = 0.8535534
    assert cosine == pytest.approx([0.9, 0.1 + 0.8 * 0.8535534, 0.5, 0.1 + 0.8 * 0.1464466, 0.1], abs=1e-6)
    assert [hybrid.sft_fraction(s, 5, 0.9, 0.1, "step") for s in range(1, 6)] == [0.9, 0.9, 0.1, 0.1, 0.1]


@pytest.mark.parametrize("curriculum", ["linear", "cosine", "step"])
def test_step_kinds_are_deterministic_and_follow_the_fractions(curriculum):
    kinds = hybrid.step_kinds(200, 1.0, 0.0, curriculum, seed=3)
    assert kinds == hybrid.step_kinds(200, 1.0, 0.0, curriculum, seed=3)  # a resumed run recomputes the same list
    fractions = [hybrid.sft_fraction(s, 200, 1.0, 0.0, curriculum) for s in range(1, 201)]
    for lo in range(0, 200, 20):  # every window holds its share of SFT steps to within one
        for hi in (lo + 7, lo + 20):
            assert abs(sum(kinds[lo:hi]) - sum(fractions[lo:hi])) <= 1 + 1e-9
    assert kinds[0] and not kinds[-1]  # SFT-heavy first, PPO-heavy last
    assert hybrid.step_kinds(10, 1.0, 1.0, curriculum, seed=5) == [True] * 10
    assert hybrid.step_kinds(10, 0.0, 0.0, curriculum, seed=5) == [False] * 10


def test_step_kinds_depend_on_the_seed_only_through_the_phase():
    a, b = (hybrid.step_kinds(40, 0.5, 0.5, "linear", seed) for seed in (1, 2))
    assert sum(a) in (19, 20, 21) and sum(b) in (19, 20, 21)
    assert [a[i] for i in range(0, 40, 2)] == [a[0]] * 20  # fraction 1/2: alternating, the phase picks the start
    assert a != b or a[0] == b[0]


# ----------------------------------------------------------------------------- SFT loss


def test_sft_loss_equals_sft_py_on_the_same_batch(tiny):
    """hybrid's SFT forward (hidden states + lm_head, through PolicyWithValueHead) gives sft.py's loss and gradient."""
    model = AutoModelForCausalLM.from_pretrained(tiny / "model")
    rows = [json.loads(line) for line in (tiny / "data" / "sft.jsonl").read_text().splitlines()[:5]]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny / "model")
    examples = [sft.build_example(tok(r["prompt"], add_special_tokens=False)["input_ids"],
                                  tok(r["completion"], add_special_tokens=False)["input_ids"], tok.eos_token_id, 20)
                for r in rows]  # max_length 20 truncates some completions
    ids, mask, labels = sft.collate(examples, tok.pad_token_id)
    assert (hybrid.collate(examples, tok.pad_token_id)[2] == labels).all()
    want, n_want = sft.completion_only_loss(model(input_ids=ids, attention_mask=mask).logits, labels)
    want.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    actor_critic = hybrid.PolicyWithValueHead(model, torch.nn.Linear(32, 1))
    got, n_got = actor_critic(ids, mask, labels=labels)
    got.backward()
    assert n_got == n_want > 0
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    assert all(torch.allclose(p.grad, grads[n], atol=1e-6) for n, p in model.named_parameters())


def test_value_head_reads_the_state_before_each_completion_token(tiny):
    model = AutoModelForCausalLM.from_pretrained(tiny / "model").eval()
    torch.manual_seed(0)
    head = torch.nn.Linear(32, 1)
    ids, mask = hybrid.left_pad([[5, 6, 7, 8], [9, 10]], pad_id=0)
    completion = torch.tensor([[11, 12, 13], [14, 15, 16]])
    full, attention = torch.cat([ids, completion], 1), torch.cat([mask, torch.ones_like(completion)], 1)
    with torch.no_grad():
        logp, _, values = hybrid.PolicyWithValueHead(model, head)(full, attention, ids.shape[1], 0.7)
        want_logp = hybrid.completion_logprobs(model, full, attention, ids.shape[1], 0.7)
        hidden = model(input_ids=full[1:, 2:], output_hidden_states=True).hidden_states[-1][0]  # row 1 unpadded
    assert torch.allclose(logp, want_logp, atol=1e-6)
    # row 1's real tokens are 9 10 | 14 15 16: V of completion token t is read at the hidden state of the token before
    assert torch.allclose(values[1], head(hidden[1:4]).squeeze(-1), atol=1e-5)


# ----------------------------------------------------------------------------- PPO pieces (ppo.py's, copied)


def reference_gae(rewards, values, lengths, gamma, lam):
    """Float64 GAE over each row's first `length` tokens, written from Eq. 10-16 of arXiv:1506.02438."""
    adv, ret = [], []
    for r, v, n in zip(rewards, values, lengths):
        a, row_adv = 0.0, [0.0] * len(r)
        for t in reversed(range(n)):
            next_v = v[t + 1] if t + 1 < n else 0.0
            a = r[t] + gamma * next_v - v[t] + gamma * lam * a
            row_adv[t] = a
        adv.append(row_adv)
        ret.append([row_adv[t] + v[t] if t < n else 0.0 for t in range(len(r))])
    return adv, ret


def test_gae_against_a_float64_loop():
    torch.manual_seed(0)
    rewards, values = torch.randn(3, 5), torch.randn(3, 5)
    lengths = [5, 2, 3]
    mask = torch.tensor([[1.0] * n + [0.0] * (5 - n) for n in lengths])
    adv, ret = hybrid.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    want_adv, want_ret = reference_gae(rewards.double().tolist(), values.double().tolist(), lengths, 0.9, 0.8)
    assert torch.allclose(adv.double(), torch.tensor(want_adv, dtype=torch.float64), atol=1e-5)
    assert torch.allclose(ret.double(), torch.tensor(want_ret, dtype=torch.float64), atol=1e-5)
    assert adv[1, 2:].eq(0).all()  # padding gets nothing


def test_per_token_rewards_and_whitening_hand_computed():
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1, 1], [1, 0, 0]])
    rewards = hybrid.per_token_rewards(torch.tensor([1.0, -0.5]), kl, mask, kl_coef=0.1)
    assert torch.allclose(rewards, torch.tensor([[-0.01, -0.02, 0.97], [-0.55, 0.0, 0.0]]), atol=1e-6)
    x = torch.tensor([[1.0, 2, 3], [4, 99, 99]])
    white = hybrid.masked_whiten(x, mask)  # real entries 1 2 3 4: mean 2.5, unbiased variance 5/3
    sd = math.sqrt(5 / 3)
    assert torch.allclose(white, torch.tensor([[-1.5 / sd, -0.5 / sd, 0.5 / sd], [1.5 / sd, 0, 0]]), atol=1e-5)
    kl_k3 = hybrid.kl_estimate(torch.tensor([-1.0]), torch.tensor([-1.5]), "k3")  # e^-0.5 + 0.5 - 1
    assert kl_k3.item() == pytest.approx(math.exp(-0.5) + 0.5 - 1, abs=1e-6)


def test_value_loss_is_the_elementwise_max():
    values = torch.tensor([[1.0, 0.0, 2.0], [0.5, 0.5, 9.0]])
    old = torch.tensor([[0.5, 0.5, 0.5], [0.0, 1.0, 0.0]])
    returns = torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    loss, clip_frac = hybrid.value_loss(values, old, returns, mask, cliprange_value=0.2)
    per_token, clipped = [], []
    for i in range(2):
        for t in range(3):
            if mask[i, t]:
                v, o, r = values[i, t].item(), old[i, t].item(), returns[i, t].item()
                vc = o + min(max(v - o, -0.2), 0.2)
                per_token.append(0.5 * max((v - r) ** 2, (vc - r) ** 2))
                clipped.append((vc - r) ** 2 > (v - r) ** 2)
    assert loss.item() == pytest.approx(sum(per_token) / len(per_token), rel=1e-6)
    assert clip_frac.item() == pytest.approx(sum(clipped) / len(clipped))
    assert 0 < sum(clipped) < len(clipped)  # the example exercises both branches


def test_kl_controllers_hand_computed():
    fixed = hybrid.KLController("fixed", 0.1, 1.0, 100)
    fixed.update(5.0, 10)
    assert fixed.value == 0.1
    adaptive = hybrid.KLController("adaptive", 0.1, 1.0, 100)
    adaptive.update(1.1, 10)  # error 0.1: x (1 + 0.1 x 10 / 100)
    assert adaptive.value == pytest.approx(0.1 * 1.01)
    adaptive.update(9.0, 10)  # error clipped to 0.2
    assert adaptive.value == pytest.approx(0.1 * 1.01 * 1.02)
    step = hybrid.KLController("step", 0.1, 1.0, 100)
    step.update(1.6, 10)
    assert step.value == pytest.approx(0.15)
    step.update(0.6, 10)
    step.update(0.6, 10)
    assert step.value == pytest.approx(0.15 / 1.5 / 1.5)
    step.update(1.0, 10)
    assert step.value == pytest.approx(0.15 / 2.25)


def test_explained_variance_hand_computed():
    returns = torch.tensor([[1.0, 2.0, 3.0, 7.0]])
    mask = torch.tensor([[1.0, 1, 1, 0]])
    assert hybrid.explained_variance(returns, returns, mask) == pytest.approx(1.0)
    # residual 1 0 -1: variance 2/3 against the returns' 2/3 -> 0
    assert hybrid.explained_variance(torch.tensor([[0.0, 2.0, 4.0, 0.0]]), returns, mask) == pytest.approx(0.0)


def test_ppo_math_is_ppo_py_s_verbatim():
    """The PPO math and ppo.py's loop steps are copied from ppo.py so the two files diff cleanly; re-copy them if
    ppo.py changes. hybrid's ppo_step composes the steps as ppo.py's loop body does."""
    import inspect

    import ppo
    for name in ("masked_mean", "masked_whiten", "per_token_rewards", "gae", "value_loss",
                 "KLController", "explained_variance", "completion_mask", "completion_logprobs",
                 "length_sorted_micro_batches", "left_pad", "prompt_texts", "rl_prompts", "eval_prompts_and_answers",
                 "DataOrder", "ppo_rollout", "ppo_reference_logprobs", "ppo_micro_batches", "old_logprobs_and_values",
                 "compute_advantages", "ppo_update", "ppo_metrics", "perf_metrics", "sample_table",
                 "truncated_is_weights"):
        assert inspect.getsource(getattr(hybrid, name)) == inspect.getsource(getattr(ppo, name)), name
    assert hybrid.PPO_STATS == ppo.PPO_STATS


# ----------------------------------------------------------------------------- wiring: the reference and the KL


def ppo_only(tiny, tmp_path, **kw) -> hybrid.Args:
    """PPO steps only, on the random tiny model with the `capitalization` reward, fast enough to move the policy."""
    return tiny_args(tiny, tmp_path, **{"sft_fraction_start": 0.0, "sft_fraction_end": 0.0, "reward": "capitalization",
                                        "prompts_per_step": 16, "learning_rate": 1e-2, "eval_split": None, **kw})


def test_train_kl_is_that_of_the_policy_from_the_reference(tiny, tmp_path, capsys):
    """k1 = log pi_old - log pi_ref on pi_old's samples has mean KL(pi_old || pi_ref) >= 0: 0 at the first step (the
    policy is the reference), positive once the policy moved. The arguments swapped give -KL; the reference aliased to
    the policy gives 0 throughout. The progress line shows it (without the KL term, beta = 0, it does not: below)."""
    rows = train_rows(hybrid.main(ppo_only(tiny, tmp_path, total_steps=4, beta=0.05, kl_estimator="k1"))["run_dir"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert len(lines) == 4 and all("| reward " in line and "| kl " in line for line in lines), lines
    assert abs(rows[0]["train/kl"]) < 1e-4
    assert all(r["train/kl"] > 1e-3 for r in rows[1:]), [r["train/kl"] for r in rows]
    assert all(r["train/non_score_reward"] == pytest.approx(-0.05 * r["train/kl"]) for r in rows)


@pytest.mark.parametrize("lora_r", [0, 4])
def test_the_reference_stays_the_initial_model(tiny, tmp_path, monkeypatch, lora_r):
    """The log-probs the reference gives at the last of 3 PPO steps are those of the model as loaded (a frozen copy, or
    with LoRA the base model without adapters), while the policy's on the same completions have moved away."""
    calls = []

    def spy(ref_model, model, inputs, temperature):
        out = reference_logprobs(ref_model, model, inputs, temperature)
        calls.append((*inputs, temperature, out))
        return out

    reference_logprobs = hybrid.ppo_reference_logprobs
    monkeypatch.setattr(hybrid, "ppo_reference_logprobs", spy)
    out = hybrid.main(ppo_only(tiny, tmp_path, total_steps=3, beta=0.05, lora_r=lora_r))
    ids, attention, width, temperature, got = calls[-1]
    initial = AutoModelForCausalLM.from_pretrained(tiny / "model")
    trained = AutoModelForCausalLM.from_pretrained(Path(out["run_dir"]) / "final")
    with torch.no_grad():
        want = hybrid.completion_logprobs(initial, ids, attention, width, temperature)
        now = hybrid.completion_logprobs(trained, ids, attention, width, temperature)
    assert torch.allclose(got, want, atol=1e-5)
    assert (now - want).abs().max() > 1e-2


# ----------------------------------------------------------------------------- optimiser and schedule


def test_optimizer_factory_builds_each_choice_and_rejects_unknown_names(monkeypatch):
    for name in hybrid.TORCH_OPTIMIZERS:
        w = torch.nn.Parameter(torch.ones(3))
        head = torch.nn.Parameter(torch.ones(1))
        opt = hybrid.make_optimizer(name, [{"params": [w], "lr": 0.1}, {"params": [head], "lr": 0.01}],
                                    hybrid.Args(momentum=0.9))
        (w.sum() + head.sum()).backward()
        opt.step()
        assert (w < 1).all() and (head < 1).all(), name  # both groups moved
        assert [g["lr"] for g in opt.param_groups] == [0.1, 0.01]
    with pytest.raises(ValueError, match="unknown optimizer 'lamb'; valid optimizers: adamw, adam, sgd.*paged_adamw_8bit"):
        hybrid.make_optimizer("lamb", [{"params": [torch.nn.Parameter(torch.ones(1))], "lr": 0.1}], hybrid.Args())
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import bitsandbytes now raises ImportError
    with pytest.raises(ValueError, match="--optimizer paged_adamw_8bit needs the bitsandbytes package"):
        hybrid.make_optimizer("paged_adamw_8bit", [{"params": [torch.nn.Parameter(torch.ones(1))], "lr": 0.1}],
                              hybrid.Args())


@pytest.mark.parametrize("name", hybrid.HF_SCHEDULERS + hybrid.TORCH_SCHEDULERS)
def test_scheduler_factory_builds_each_choice(name):
    w = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([{"params": [w], "lr": 1.0}, {"params": [torch.nn.Parameter(torch.ones(1))], "lr": 0.5}])
    args = hybrid.Args(total_steps=20, warmup_steps=2, lr_step_size=5, lr_milestones=(4, 8), lr_decay=0.5,
                       plateau_patience=0)
    scheduler = hybrid.make_scheduler(name, opt, args)
    seen = []
    for step in range(20):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step(0.5) if name == "reduce_on_plateau" else scheduler.step()
    assert all(math.isfinite(x) and x >= 0 for x in seen)
    assert len(set(seen)) > 1 or name in ("constant", "none"), name  # the schedule moves the lr
    if name == "step":
        assert seen[:6] == pytest.approx([1, 1, 1, 1, 1, 0.5])
    if name == "multistep":
        assert seen[3:9] == pytest.approx([1, 0.5, 0.5, 0.5, 0.5, 0.25])
    if name == "linear":  # warmup 2 steps then linear to 0 at step 20
        assert seen[:4] == pytest.approx([0.0, 0.5, 1.0, 17 / 18])
    if name == "reduce_on_plateau":  # no improvement after the first: halved at every evaluation (patience 0)
        assert seen[:3] == pytest.approx([1.0, 1.0, 0.5])
    assert opt.param_groups[1]["lr"] == pytest.approx(opt.param_groups[0]["lr"] / 2)  # each group in proportion


def test_optimizer_settings_reach_torch_and_bitsandbytes(monkeypatch):
    """SGD's dampening and Nesterov, RMSprop's alpha and centring, Adagrad's lr decay and initial accumulator; each
    bitsandbytes name builds its class with the settings of its family (AdEMAMix keeps its own three betas)."""
    args = hybrid.Args(momentum=0.9, sgd_nesterov=True, rmsprop_alpha=0.9, rmsprop_centered=True, adagrad_lr_decay=0.1,
                       adagrad_initial_accumulator=0.5, sgd_dampening=0.0)
    group = lambda: [{"params": [torch.nn.Parameter(torch.ones(2))], "lr": 0.1}]  # noqa: E731
    assert hybrid.make_optimizer("sgd", group(), args).param_groups[0]["nesterov"] is True
    assert {k: hybrid.make_optimizer("rmsprop", group(), args).param_groups[0][k] for k in ("alpha", "centered")} == {
        "alpha": 0.9, "centered": True}
    adagrad = hybrid.make_optimizer("adagrad", group(), args)
    assert adagrad.param_groups[0]["lr_decay"] == 0.1 and adagrad.param_groups[0]["initial_accumulator_value"] == 0.5
    built = {}

    class Fake:
        def __init__(self, params, **kw):
            built[self.name] = kw

    fake = type(sys)("bitsandbytes")
    fake.optim = type(sys)("bitsandbytes.optim")
    for cls in set(hybrid.BNB_OPTIMIZERS.values()):
        setattr(fake.optim, cls, type(cls, (Fake,), {"name": cls}))
    monkeypatch.setitem(sys.modules, "bitsandbytes", fake)
    for name in hybrid.BNB_OPTIMIZERS:
        hybrid.make_optimizer(name, group(), args)
    assert len(hybrid.TORCH_OPTIMIZERS) + len(hybrid.BNB_OPTIMIZERS) >= 24 and len(built) == len(hybrid.BNB_OPTIMIZERS)
    assert built["SGD8bit"] == {"lr": 0.1, "weight_decay": 0.0, "momentum": 0.9, "dampening": 0.0, "nesterov": True}
    assert built["Adagrad32bit"]["initial_accumulator_value"] == 0.5
    assert built["RMSprop8bit"]["centered"] is True and "betas" not in built["PagedAdEMAMix8bit"]
    assert built["PagedLion32bit"]["betas"] == (0.9, 0.99) and "eps" not in built["Lion8bit"]
    assert built["PagedAdam32bit"]["eps"] == 1e-8


def test_warmup_ratio_and_onecycle_with_any_optimizer():
    w = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([w], lr=1.0)
    scheduler = hybrid.make_scheduler("linear", opt, hybrid.Args(total_steps=20, warmup_steps=0, warmup_ratio=0.1))
    seen = []
    for _ in range(3):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    assert seen == pytest.approx([0.0, 0.5, 1.0])  # 2 warmup steps: a tenth of 20
    for name in ("sgd", "adagrad", "adafactor"):  # onecycle schedules the lr only: no momentum switched on
        opt = hybrid.make_optimizer(name, [{"params": [torch.nn.Parameter(torch.ones(2))], "lr": 0.1}], hybrid.Args())
        hybrid.make_scheduler("onecycle", opt, hybrid.Args(total_steps=10))
        assert opt.param_groups[0].get("momentum", 0.0) == 0.0, name


def test_scheduler_factory_rejects_unknown_names():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0)
    with pytest.raises(ValueError, match="unknown lr scheduler 'warmup_decay'; valid schedulers: linear, cosine.*"
                                         "reduce_on_plateau"):
        hybrid.make_scheduler("warmup_decay", opt, hybrid.Args())


# ----------------------------------------------------------------------------- runs


SEED_STYLE_SPEC = {"REWARD": {"type": "weighted_sum", "components": [
    {"type": "correctness", "weight": 1.0},
    {"type": "bleu", "weight": 0.5, "postprocess": [{"type": "scale", "factor": 2.0}, {"type": "clip", "min": 0, "max": 1}]},
    {"type": "rouge_l", "weight": 0.5}],
    "postprocess": [{"type": "ema_normalize", "decay": 0.9}]}}


def test_the_bfloat16_sampler_copy_samples_for_the_float32_policy(tiny, tmp_path):
    """--generation-backend copy (the CUDA default): the sampler's log-probs differ
    from the float32 trainer's by bfloat16 rounding, inside the start check's tolerance (float32 sampling: 1e-7)."""
    out = hybrid.main(tiny_args(tiny, tmp_path, total_steps=4, eval_split=None, generation_backend="copy"))
    assert 1e-4 < out["train/sampler_gap"] < 0.25 and out["step"] == 4


def test_few_step_run_writes_the_run_directory(tiny, tmp_path):
    """Both kinds of step, the specification's JSON reward form (its `target`: the demonstrations, joined on the
    prompt), the run directory, final/ loadable with AutoModelForCausalLM and the value head beside it."""
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(SEED_STYLE_SPEC))
    out = hybrid.main(tiny_args(tiny, tmp_path / "runs", total_steps=5, save_every=2, reward=str(spec),
                                lr_scheduler="constant_with_warmup", warmup_steps=2, num_ppo_epochs=2,
                                num_mini_batches=2, value_head_lr=1e-2))
    run = Path(out["run_dir"])
    rows = train_rows(run)
    kinds = hybrid.step_kinds(5, 0.5, 0.5, "linear", 1)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["train/is_sft_step"] for r in rows] == [int(k) for k in kinds] and 0 < sum(kinds) < 5
    assert all(r["train/sft_fraction"] == 0.5 for r in rows)
    assert [r["train/lr"] for r in rows] == pytest.approx([0.0, 1.5e-3, 3e-3, 3e-3, 3e-3])
    for r in rows:
        keys = ("train/sft_loss",) if r["train/is_sft_step"] else (
            "train/reward", "rewards/correctness", "rewards/bleu", "rewards/rouge_l", "train/kl", "train/value_loss",
            "train/policy_loss", "train/clip_frac", "train/explained_variance", "train/kl_coef")
        assert all(k in r for k in keys), r
        assert ("train/reward" in r) != bool(r["train/is_sft_step"])
    assert {r["step"] for r in read_metrics(run) if "eval/accuracy" in r} == {0, 5}
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["last", "step_2", "step_4", "step_5"]
    assert (run / "checkpoints" / "step_2" / "value_head.safetensors").exists()
    state = torch.load(run / "checkpoints" / "step_5" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 5 and state["reward"]  # ema_normalize's running moments
    assert [g["lr"] for g in state["optimizer"]["param_groups"]] == pytest.approx([3e-3, 1e-2])  # --value-head-lr
    AutoModelForCausalLM.from_pretrained(run / "final")
    head = load_file(run / "final" / "value_head.safetensors")
    assert head["weight"].shape == (1, 32) and head["weight"].abs().sum() > 0  # trained by the PPO steps


def test_learning_sft_steps_fit_the_demonstrations(tiny, tmp_path):
    """SFT only (fraction 1) on the tiny task's demonstrations, from the random tiny model: the loss of the last 5 of
    30 steps is more than 1 nat per token below that of the first 5 (measured: 3.96 -> 2.69). A wrong sign, or
    gradients that do not reach the model, leave it flat or raise it."""
    out = hybrid.main(tiny_args(tiny, tmp_path, total_steps=30, sft_fraction_start=1.0, sft_fraction_end=1.0,
                                sft_batch_size=16, learning_rate=1e-2, eval_split=None))
    losses = [r["train/sft_loss"] for r in train_rows(out["run_dir"])]
    assert len(losses) == 30
    assert statistics.fmean(losses[-5:]) < statistics.fmean(losses[:5]) - 1.0


def test_learning_ppo_steps_raise_the_reward(tiny, tmp_path, capsys):
    """PPO only (fraction 0) with the `capitalization` reward on the random tiny model (conftest): the mean reward
    of the last 5 of 30 steps beats the first 5 by 0.2. A wrong sign, or advantages on the wrong tokens, fail. With
    beta = 0, train/kl is 0 by construction: the progress line leaves it out."""
    out = hybrid.main(tiny_args(tiny, tmp_path, total_steps=30, sft_fraction_start=0.0, sft_fraction_end=0.0,
                                reward="capitalization", prompts_per_step=32, learning_rate=1e-2, beta=0.0,
                                eval_split=None, value_head_lr=1e-2))
    rewards = [r["train/reward"] for r in train_rows(out["run_dir"])]
    assert len(rewards) == 30
    assert statistics.fmean(rewards[-5:]) > statistics.fmean(rewards[:5]) + 0.2
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert len(lines) == 30 and all("| reward " in line and "| kl " not in line for line in lines), lines[:2]


def test_resume_restores_the_value_head_and_the_kl_controller_and_refuses_total_steps(tiny, tmp_path):
    """hybrid's own state on resume (test_lifecycle.py has the rest): from step 2 of a 4-step run with both kinds of
    step and the adaptive KL controller, the value head and beta equal the straight run's; --total-steps, which
    shapes the curriculum, is refused."""
    kw = {"total_steps": 4, "eval_split": None, "save_every": 2, "kl_controller": "adaptive",
          "kl_controller_target": 0.01, "seed": 2}
    straight = hybrid.main(tiny_args(tiny, tmp_path / "a", **kw))
    run = tmp_path / "b" / Path(straight["run_dir"]).name
    shutil.copytree(straight["run_dir"], run)
    shutil.rmtree(run / "final")
    shutil.rmtree(run / "checkpoints" / "step_4")
    hybrid.main(hybrid.Args(resume=str(run / "checkpoints" / "step_2")))
    a, b = train_rows(straight["run_dir"]), train_rows(run)
    assert {r["train/is_sft_step"] for r in a} == {0, 1}
    assert [r.get("train/kl_coef") for r in b] == [r.get("train/kl_coef") for r in a]
    assert len({r["train/kl_coef"] for r in a if "train/kl_coef" in r}) > 1  # the controller moved beta
    w1, w2 = (load_file(Path(d) / "final" / "value_head.safetensors") for d in (straight["run_dir"], run))
    assert w1["weight"].abs().sum() > 0 and all(torch.allclose(w1[k], w2[k], atol=1e-6) for k in w1)
    with pytest.raises(ValueError, match="--total-steps 8 differs from the run's 4.*cannot change on resume"):
        hybrid.main(hybrid.Args(resume=str(run / "checkpoints" / "step_2"), total_steps=8))


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("overrides,message", [
    ({"sft_fraction_start": 1.5}, "--sft-fraction-start must be in [0, 1]"),
    ({"sft_fraction_end": -0.1}, "--sft-fraction-end must be in [0, 1]"),
    ({"sft_split": "train"}, "split 'train' has no column ['completion']; available columns: ['prompt', 'answer'] "
                            "(choose with --sft-split, --prompt-column or --completion-column)"),
    ({"optimizer": "adamw_8bit"}, "--optimizer adamw_8bit needs the bitsandbytes package: `pip install bitsandbytes`"),
    ({"optimizer": "lamb"}, "unknown optimizer 'lamb'; valid optimizers: adamw, adam, sgd"),
    ({"lr_scheduler": "reduce_on_plateau", "eval_split": None}, "reduce_on_plateau steps on eval/accuracy: it needs"),
    ({"lr_scheduler": "reduce_on_plateau", "eval_every": 0}, "it needs --eval-split and --eval-every > 0"),
    ({"lr_scheduler": "warmup"}, "unknown lr scheduler 'warmup'"),
    ({"optimizer": "sgd_8bit"}, "--optimizer sgd_8bit needs --momentum > 0"),
    ({"warmup_ratio": 1.5}, "--warmup-ratio must be in [0, 1)"),
    ({"optimizer": "sgd", "sgd_nesterov": True}, "Nesterov momentum requires a momentum"),
    ({"sft_batch_size": 6, "micro_batch_size": 4}, "--sft-batch-size / processes = 6 is not divisible by "
                                                   "--micro-batch-size 4: use --micro-batch-size 3"),
    ({"reward": "correctness,bogus"}, "unknown reward type 'bogus'"),
    ({"sft_split": "nope"}, "has no nope.jsonl"),
    ({"value_head_lr": 0.0}, "--value-head-lr must be positive"),
    ({"kl_controller": "adaptive"}, "--kl-controller adaptive needs a positive --kl-controller-target"),
    ({"prompts_per_step": 4, "num_mini_batches": 3}, "--num-mini-batches must divide each process's 4 completions: "
                                                     "use --num-mini-batches 2"),
])
def test_bad_input_fails_before_any_work(tiny, tmp_path, monkeypatch, overrides, message):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    with pytest.raises(ValueError) as e:
        hybrid.main(tiny_args(tiny, tmp_path, **overrides))
    assert message in str(e.value)
    assert not any(tmp_path.iterdir())  # no run directory was created


def test_prompts_and_completions_must_fit_the_context(tiny, tmp_path):
    """Every prompt generation sees (RL prompts as --max-prompt-length keeps them, eval prompts whole) plus
    --max-completion-length must fit the model's positions: one short is refused before any work, naming the flag."""
    data = tmp_path / "data"
    data.mkdir()
    row = '{"prompt": "1+2+3+4+5+6+7=", "answer": "28", "completion": "<answer>28</answer>"}\n'
    (data / "train.jsonl").write_text(row * 4)  # kept: its last 4 tokens
    (data / "sft.jsonl").write_text(row * 4)
    (data / "test.jsonl").write_text('{"prompt": "12+34=", "answer": "46"}\n')  # the longest prompt
    longest = len(AutoTokenizer.from_pretrained(tiny / "model")("12+34=", add_special_tokens=False).input_ids)
    with pytest.raises(ValueError, match=rf"a {longest}-token prompt and --max-completion-length 8 exceed the model's "
                                         rf"{longest + 7} positions"):
        hybrid.main(tiny_args(tiny, tmp_path / "runs", model_name_or_path=short_gpt2(tmp_path / "short", longest + 7),
                              dataset=str(data), max_prompt_length=4))
    with pytest.raises(ValueError, match=r"--max-length 33 exceed the model's 32 positions: pass --max-length 32"):
        hybrid.main(tiny_args(tiny, tmp_path / "runs", model_name_or_path=short_gpt2(tmp_path / "s32", 32),
                              dataset=str(data), max_prompt_length=4, max_length=33))  # the SFT rows too
    assert not (tmp_path / "runs").exists()


def test_rl_prompt_without_a_demonstration_names_the_fix(tiny, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(tiny / "data", data)
    (data / "train.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    with pytest.raises(ValueError, match="have no demonstration in the SFT split 'sft'.*`target` column"):
        hybrid.main(tiny_args(tiny, tmp_path / "out", dataset=str(data), eval_split=None))
    assert not (tmp_path / "out").exists()


def test_ablation_benchmark_table_from_finished_runs(tmp_path, capsys):
    """benchmarks/hybrid_ablation.py --summarize-only: the final accuracy per seed and its mean, the reward of
    the last 20 PPO steps and the summed step seconds, from runs written here by hand."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import hybrid_ablation

    def fake_run(arm: str, seed: int, acc: float, rewards: list, step_s: float) -> None:
        run = tmp_path / "t" / f"arith__{arm}__{seed}__1700000000"
        (run / "final").mkdir(parents=True)
        rows = [{"step": 0, "eval/accuracy": 0.4}]
        for step in range(1, len(rewards) + 1):
            rows.append({"step": step, "perf/step_s": step_s, "train/reward": rewards[step - 1]})
        rows.append({"step": len(rewards), "eval/accuracy": acc})
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    fake_run("curriculum", 1, 0.80, [0.0] * 10 + [1.0] * 20, 0.5)  # the last 20 PPO rewards are all 1
    fake_run("curriculum", 2, 0.70, [0.5] * 30, 1.5)
    hybrid_ablation.main(hybrid_ablation.Args(seeds=(1, 2), arms=("curriculum",), output_dir=str(tmp_path), tag="t",
                                              summarize_only=True))
    row = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| curriculum")][0]
    # accuracies 80.0 / 70.0, mean 75.0; reward mean of 1.0 and 0.5; seconds mean of 30 x 0.5 and 30 x 1.5
    assert [c.strip() for c in row.strip("|").split("|")] == ["curriculum", "400", "80.0", "70.0", "**75.0**",
                                                             "0.75", "30"]
