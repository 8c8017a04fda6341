"""ppo.py: GAE, per-token rewards, whitening, value loss, KL controllers against float64 or hand-computed
references; the KL's wiring (direction, a frozen reference); runs, learning, resume of the value model and the KL
coefficient, bad input. The shared plumbing (resume, Ctrl-C, torchrun, generic bad input): tests/test_lifecycle.py."""
import json
import math
import shutil
import statistics
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import read_metrics, short_gpt2, train_rows
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

import ppo
from kernels import clipped_policy_loss

ROOT = Path(__file__).resolve().parents[1]


def tiny_args(tiny, tmp_path, **kw) -> ppo.Args:
    base = ppo.Args(model_name_or_path=str(tiny / "model"), dataset=str(tiny / "data"), output_dir=str(tmp_path),
                    reward="capitalization", total_steps=2, prompts_per_step=4, num_mini_batches=2,
                    max_completion_length=8, eval_limit=4, eval_every=0, warmup_steps=0, learning_rate=3e-3,
                    value_learning_rate=3e-3)
    return replace(base, **kw)


# ----------------------------------------------------------------------------- pure functions


def test_completion_mask_stops_at_the_first_eos_and_flags_truncation():
    ids = torch.tensor([[5, 1, 7, 1], [5, 6, 7, 8], [1, 0, 0, 0], [4, 2, 9, 9]])
    mask, truncated = ppo.completion_mask(ids, torch.tensor([1, 2]))  # two EOS ids, as chat models have
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]]
    assert truncated.tolist() == [False, True, False, False]

# Three completions of lengths 3, 1 and 4 (T = 4); the 9s sit on padding and must change nothing.
MASK = torch.tensor([[1.0, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
REWARDS = torch.tensor([[0.1, -0.2, 1.0, 9], [0.7, 9, 9, 9], [0.0, 0.3, -0.1, 2.0]])
VALUES = torch.tensor([[0.5, 0.2, 0.8, 9], [-0.3, 9, 9, 9], [0.1, 0.4, 0.0, 1.5]])


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8)])
def test_gae_against_float64_double_loop(gamma, lam):
    """A_t = sum_l (gamma lam)^l delta_t+l with delta_k = r_k + gamma V_k+1 - V_k and V = 0 past the last token."""
    adv, ret = ppo.gae(REWARDS, VALUES, MASK, gamma, lam)
    for i, n in enumerate(MASK.sum(dim=1).long().tolist()):
        r, v = REWARDS[i, :n].double().tolist(), VALUES[i, :n].double().tolist() + [0.0]
        delta = [r[k] + gamma * v[k + 1] - v[k] for k in range(n)]
        for t in range(n):
            want = sum((gamma * lam) ** (k - t) * delta[k] for k in range(t, n))
            assert adv[i, t].item() == pytest.approx(want, abs=1e-6)
            assert ret[i, t].item() == pytest.approx(want + v[t], abs=1e-6)  # returns = A + V
        assert adv[i, n:].eq(0).all() and ret[i, n:].eq(0).all()
    # by hand, row 1 (one token): A = r - V = 0.7 + 0.3
    assert adv[1, 0].item() == pytest.approx(1.0)


def test_per_token_rewards_layout():
    kl = torch.tensor([[0.5, -0.1, 0.2, 7], [0.3, 7, 7, 7], [0.0, 0.4, 0.1, 0.2]])
    scores = torch.tensor([1.0, -0.5, 1.5])
    rewards = ppo.per_token_rewards(scores, kl, MASK, kl_coef=0.1)
    want = [[-0.05, 0.01, -0.02 + 1.0, 0.0],  # -beta KL at each real token, the score on the last one
            [-0.03 - 0.5, 0.0, 0.0, 0.0],
            [0.0, -0.04, -0.01, -0.02 + 1.5]]
    assert torch.allclose(rewards, torch.tensor(want), atol=1e-7)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimate_matches_the_kernels_estimators(estimator):
    logp, ref = torch.tensor([[-1.0, -0.2, -3.0]]), torch.tensor([[-1.5, -0.1, -2.0]])
    _, want, _ = clipped_policy_loss(logp, logp, torch.zeros(1, 1), ref_logp=ref, kl_estimator=estimator)
    assert torch.allclose(ppo.kl_estimate(logp, ref, estimator), want, atol=1e-6)
    assert ppo.kl_estimate(logp, ref, "k1")[0, 0].item() == pytest.approx(0.5)  # log pi - log pi_ref by hand


def test_masked_whiten_ignores_padding():
    x = REWARDS.clone()
    real = [v for row, m in zip(x.tolist(), MASK.tolist()) for v, k in zip(row, m) if k]
    mean, std = statistics.fmean(real), statistics.stdev(real)  # unbiased, as the N+ details use
    out = ppo.masked_whiten(x, MASK)
    x_other = torch.where(MASK.bool(), x, torch.full_like(x, -1e3))  # other padding: same output
    assert torch.equal(ppo.masked_whiten(x_other, MASK), out)
    want = [(v - mean) / math.sqrt(std**2 + 1e-8) for v in real]
    assert out[MASK.bool()].tolist() == pytest.approx(want, abs=1e-5)
    assert out[~MASK.bool()].eq(0).all()
    kept = ppo.masked_whiten(x, MASK, shift_mean=False)[MASK.bool()]
    assert kept.mean().item() == pytest.approx(mean, abs=1e-5) and kept.std().item() == pytest.approx(1.0, abs=1e-4)
    assert ppo.masked_mean(x, MASK).item() == pytest.approx(mean, abs=1e-6)


def test_value_loss_takes_the_max_per_token():
    """Token a: V moved 1.0 from V_old = 0 towards nothing (R = 0): unclipped 1.0, clipped (0.2 - 0)^2 = 0.04.
    Token b: R = 2: unclipped 1.0, clipped (0.2 - 2)^2 = 3.24. Per token: 0.5 (1 + 3.24) / 2 = 1.06; the max of
    the two means would be 0.5 max(1.0, 1.64) = 0.82. The third token is padding."""
    values, old, returns = torch.tensor([[1.0, 1.0, 50.0]]), torch.zeros(1, 3), torch.tensor([[0.0, 2.0, -50.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, clip_frac = ppo.value_loss(values, old, returns, mask, cliprange_value=0.2)
    assert loss.item() == pytest.approx(1.06) and clip_frac.item() == pytest.approx(0.5)
    loss, clip_frac = ppo.value_loss(values, old, returns, mask, cliprange_value=10.0)  # nothing clipped
    assert loss.item() == pytest.approx(0.5 * (1.0 + 1.0) / 2) and clip_frac.item() == 0.0


def test_kl_controllers_hand_computed():
    kls = [2.0, 1.1, 0.5, 1.0, 0.6]
    fixed = ppo.KLController("fixed", 0.1)
    adaptive = ppo.KLController("adaptive", 0.1, target=1.0, horizon=100)
    step = ppo.KLController("step", 0.1, target=1.0)
    seen = {"fixed": [], "adaptive": [], "step": []}
    for kl in kls:
        for name, c in (("fixed", fixed), ("adaptive", adaptive), ("step", step)):
            c.update(kl, n_steps=10)
            seen[name].append(c.value)
    assert seen["fixed"] == [0.1] * 5
    # e = clip(KL / 1 - 1, +-0.2) = 0.2, 0.1, -0.2, 0, -0.2; beta *= 1 + e * 10 / 100
    assert seen["adaptive"] == pytest.approx([0.102, 0.10302, 0.1009596, 0.1009596, 0.098940408])
    # x1.5 above 1.5, /1.5 below 1/1.5 = 0.667: 2.0 up, 1.1 stay, 0.5 down, 1.0 stay, 0.6 down
    assert seen["step"] == pytest.approx([0.15, 0.15, 0.1, 0.1, 0.1 / 1.5])


def test_explained_variance_hand_computed():
    returns = torch.tensor([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert ppo.explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert ppo.explained_variance(torch.full_like(returns, 2.0), returns, mask) == pytest.approx(0.0)
    # residuals 1, 2, 3 -> Var 2/3 = Var(returns): 0; residuals 0.5 x returns: 1 - 0.25
    assert ppo.explained_variance(0.5 * returns, returns, mask) == pytest.approx(0.75)


def test_compute_advantages_kl_is_of_pi_old_from_the_reference():
    """The per-token KL is KL(pi_old || pi_ref) estimated from pi_old's samples: log pi_old = -1, log pi_ref = -2
    gives k1 = 1 and k3 = e^-1 (the arguments swapped: -1 and e - 2). The score 2 of a completion without EOS loses
    --missing-eos-penalty 0.5. Rewards, GAE and whitening follow the pure functions; beta = 0 has no KL at all."""
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    batch = {"completion_mask": mask, "old_logp": torch.tensor([[-1.0, -1.0, -5.0]]),
             "ref_logp": torch.tensor([[-2.0, -2.0, -0.1]]), "old_values": torch.tensor([[0.5, 0.25, 3.0]]),
             "rewards": {"total": torch.tensor([2.0])}, "truncated": torch.tensor([True])}
    args = ppo.Args(missing_eos_penalty=0.5, whiten_advantages=False)
    for estimator, want in (("k1", 1.0), ("k3", math.exp(-1))):
        out = ppo.compute_advantages(batch, 0.1, replace(args, kl_estimator=estimator))
        assert out["kl"][0].tolist() == pytest.approx([want, want, 0.0])
        assert out["scores"].tolist() == [1.5]
        rewards = ppo.per_token_rewards(out["scores"], out["kl"], mask, 0.1)
        assert rewards[0].tolist() == pytest.approx([-0.1 * want, 1.5 - 0.1 * want, 0.0])
        advantages, returns = ppo.gae(rewards, batch["old_values"], mask, args.gamma, args.lam)
        assert torch.equal(out["advantages"], advantages) and torch.equal(out["returns"], returns)
    assert ppo.compute_advantages(batch, 0.1, replace(args, beta=0.0))["kl"].eq(0).all()
    assert ppo.compute_advantages(batch, 0.1, replace(args, missing_eos_penalty=0.0))["scores"].tolist() == [2.0]
    with_eos = {**batch, "truncated": torch.tensor([False])}
    assert ppo.compute_advantages(with_eos, 0.1, args)["scores"].tolist() == [2.0]


# ----------------------------------------------------------------------------- runs


def test_the_bfloat16_sampler_copy_samples_for_the_float32_policy(tiny, tmp_path):
    """--generation-backend copy (the CUDA default) with LoRA merged into it: the sampler's log-probs differ
    from the float32 trainer's by bfloat16 rounding only (measured 8e-4; unmerged adapters: 0.09; float32: 1e-7)."""
    out = ppo.main(tiny_args(tiny, tmp_path, total_steps=2, eval_split=None, generation_backend="copy", lora_r=4))
    assert 1e-4 < out["train/sampler_gap"] < 0.01 and out["step"] == 2


def test_few_step_run_writes_the_run_directory(tiny, tmp_path):
    out = ppo.main(tiny_args(tiny, tmp_path / "runs", total_steps=3, save_every=2, micro_batch_size=1, track=True,
                             kl_controller="adaptive", kl_controller_target=1e-6, kl_horizon=4, missing_eos_penalty=1.0,
                             num_ppo_epochs=2, early_stop_kl=1e9))
    run = Path(out["run_dir"])
    assert json.loads((run / "args.json").read_text())["kl_controller"] == "adaptive"
    rows = train_rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in ("train/reward", "rewards/capitalization", "train/kl", "train/kl_coef", "train/non_score_reward",
                "train/clip_frac", "train/value_clip_frac", "train/approx_kl", "train/entropy",
                "train/explained_variance", "train/policy_loss", "train/value_loss", "train/completion_length",
                "perf/step_s", "perf/tokens_per_s"):
        assert all(key in r and math.isfinite(r[key]) for r in rows), key
    assert [r["train/ppo_epochs"] for r in rows] == [2, 2, 2]
    # each step logs the coefficient it used; after it, beta *= 1 + clip(KL / target - 1, +-0.2) x 4 / 4
    assert rows[0]["train/kl"] == 0.0 and rows[0]["train/kl_coef"] == 0.05  # the policy starts as the reference
    beta = 0.05
    for row, before in zip(rows[1:], rows):
        beta *= 1 + min(max(before["train/kl"] / 1e-6 - 1, -0.2), 0.2)
        assert row["train/kl_coef"] == pytest.approx(beta)
    assert rows[1]["train/kl_coef"] == pytest.approx(0.04)  # KL 0 < target: down by the most, 0.2
    assert all(r["train/score"] == pytest.approx(r["train/reward"] - r["train/truncated_frac"]) for r in rows)
    assert [r["step"] for r in read_metrics(run) if "eval/accuracy" in r] == [0, 3]
    for folder in (run / "checkpoints" / "step_2", run / "final"):
        AutoModelForCausalLM.from_pretrained(folder)
        value_model = AutoModelForTokenClassification.from_pretrained(folder / "value_model")
        assert value_model.config.num_labels == 1
    assert list((run / "wandb").glob("offline-run-*"))


@pytest.mark.parametrize("lora_r", [0, 4])
def test_reference_stays_the_initial_policy_and_kl_grows(tiny, tmp_path, monkeypatch, lora_r):
    """With beta > 0, every reference log-prob (steps 1-3) equals a freshly loaded initial model's on the same tokens,
    so the reference is frozen, not the live policy (LoRA: the policy with adapters off); and train/kl, the k1 estimate
    of KL(pi_old || pi_ref), is 0 at step 1 and grows positive as the policy moves away."""
    calls = []

    def spy(ref_model, model, inputs, temperature):
        out = reference_logprobs(ref_model, model, inputs, temperature)
        calls.append(([x.clone() if torch.is_tensor(x) else x for x in inputs], temperature, out.clone()))
        return out

    reference_logprobs = ppo.ppo_reference_logprobs
    monkeypatch.setattr(ppo, "ppo_reference_logprobs", spy)
    out = ppo.main(tiny_args(tiny, tmp_path, total_steps=3, beta=0.05, kl_estimator="k1", eval_split=None, lora_r=lora_r,
                             learning_rate=1e-2 if lora_r == 0 else 5e-2))
    assert len(calls) == 3 * 2  # 3 steps x 2 micro-batches of 2 completions
    initial = AutoModelForCausalLM.from_pretrained(tiny / "model").eval()
    with torch.no_grad():
        for inputs, temperature, logp in calls:
            assert torch.allclose(ppo.completion_logprobs(initial, *inputs, temperature), logp, atol=1e-5)
    kl = [r["train/kl"] for r in train_rows(out["run_dir"])]
    assert kl[0] == 0.0 and kl[1] > 1e-3 and kl[2] > 1e-3, kl


def test_early_stop_kl_stops_the_epochs(tiny, tmp_path, capsys):
    """Also: with beta > 0 the progress line shows train/kl (the next test: hidden without the KL term)."""
    out = ppo.main(tiny_args(tiny, tmp_path, num_ppo_epochs=3, early_stop_kl=1e-12, eval_split=None,
                             learning_rate=1e-2))
    assert [r["train/ppo_epochs"] for r in train_rows(out["run_dir"])] == [1, 1]
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert len(lines) == 2 and all("| reward " in line and "| kl " in line for line in lines), lines


def test_early_stop_kl_is_that_of_all_processes_also_under_fsdp(monkeypatch):
    """Under torchrun, with DDP or --fsdp (whose module is not DDP-wrapped, as here), the epochs stop on the KL summed
    over the processes, so that all stop together: this process's own KL is 0, another's (added by the all_reduce)
    is 1 a token, above --early-stop-kl, so one epoch of three runs."""
    class ActorCritic(torch.nn.Module):  # log-probs and values from two scalars; pi = pi_old at the start
        def __init__(self):
            super().__init__()
            self.policy, self.value = torch.nn.Parameter(torch.zeros(())), torch.nn.Parameter(torch.zeros(()))

        def forward(self, ids, attention, prompt_width, temperature):
            logp = self.policy - torch.ones(ids[:, prompt_width:].shape)
            return logp, torch.zeros_like(logp), self.value.expand_as(logp)

    def all_reduce(kl_tokens):  # another process, as many tokens at KL 1
        kl_tokens += torch.stack([kl_tokens[1], kl_tokens[1]])
        reduced.append(True)

    reduced, model = [], ActorCritic()
    monkeypatch.setattr(ppo.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(ppo.dist, "all_reduce", all_reduce)
    ones = torch.ones(2, 3)
    batch = {"completion_mask": ones, "prompt_ids": torch.zeros(2, 1, dtype=torch.long),
             "prompt_mask": torch.ones(2, 1, dtype=torch.long), "ids": torch.zeros(2, 4, dtype=torch.long),
             "attention": torch.ones(2, 4, dtype=torch.long), "old_logp": -ones, "advantages": ones,
             "old_values": 0 * ones, "returns": ones}
    optimizer = torch.optim.AdamW([{"params": [model.policy]}, {"params": [model.value]}], lr=1e-3)
    args = ppo.Args(num_ppo_epochs=3, num_mini_batches=1, early_stop_kl=0.1)
    stats = ppo.ppo_update(model, optimizer, batch, 2, args, torch.autocast("cpu", enabled=False))
    assert stats["ppo_epochs"] == 1 and reduced == [True] and stats["approx_kl"] == 0.0


def test_learning_raises_the_reward(tiny, tmp_path, capsys):
    """The task's prompts, a random 2-layer model and the `capitalization` reward (0.5 for an upper-case first
    letter + 0.5 for final punctuation): the mean reward of the last 5 of 25 steps must beat the first 5 by 0.3
(measured 0.28 -> 0.81; with one PPO epoch instead of two, 0.25 -> 0.48).
    A policy gradient with the wrong sign, or advantages attached to the wrong tokens, leaves it flat or lowers it.
    (The embedded task with the defaults: README.) With beta = 0, train/kl is 0 by construction: the progress line
    leaves it out."""
    out = ppo.main(tiny_args(tiny, tmp_path, total_steps=25, prompts_per_step=64, num_mini_batches=1, beta=0.0,
                             learning_rate=1e-2, value_learning_rate=1e-2, eval_split=None))
    rewards = [r["train/reward"] for r in train_rows(out["run_dir"])]
    assert len(rewards) == 25
    assert statistics.fmean(rewards[-5:]) > statistics.fmean(rewards[:5]) + 0.3
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert len(lines) == 25 and all("| reward " in line and "| kl " not in line for line in lines), lines[:2]


@pytest.mark.parametrize("value_model_layers", [0, 1])
def test_resume_restores_the_value_model_and_the_kl_coefficient(tiny, tmp_path, value_model_layers):
    """Resume from step 2 of a 4-step run with an adaptive KL coefficient and 2 epochs x 2 mini-batches: the value
    model, the optimiser's two groups and the coefficient come back, so steps 3-4 and both final models equal the
    straight run's (the generic resume test, tests/test_lifecycle.py, compares the policy only); also with a value
    model cut to its first layer (--value-model-layers 1), which is saved as a 1-layer model."""
    kw = {"total_steps": 4, "eval_split": None, "save_every": 2, "kl_controller": "adaptive", "kl_horizon": 8,
          "kl_controller_target": 1e-6, "num_ppo_epochs": 2, "lr_schedule": "linear",
          "value_model_layers": value_model_layers}
    straight = ppo.main(tiny_args(tiny, tmp_path / "a", **kw))
    run = tmp_path / "b" / Path(straight["run_dir"]).name
    shutil.copytree(straight["run_dir"], run)
    shutil.rmtree(run / "final")
    resumed = ppo.main(ppo.Args(resume=str(run / "checkpoints" / "step_2")))
    assert resumed["train/kl_coef"] == straight["train/kl_coef"] != 0.05  # it moved, and came back from the checkpoint
    for key in ("train/value_loss", "train/explained_variance", "train/value_mean", "train/kl"):
        assert resumed[key] == pytest.approx(straight[key], abs=1e-6)
    for name in ("model.safetensors", "value_model/model.safetensors"):
        a, b = load_file(Path(straight["run_dir"]) / "final" / name), load_file(run / "final" / name)
        assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    critic = run / "final" / "value_model"
    layers = json.loads((critic / "config.json").read_text())["num_hidden_layers"]
    second_block = any(k.startswith("model.layers.1.") for k in load_file(critic / "model.safetensors"))
    assert layers == (value_model_layers or 2) and second_block == (not value_model_layers)


def test_pause_then_resume_with_a_new_reward(tiny, tmp_path):
    """Iterated RLHF: --pause-at-step 2 of 4 stops after step 2 with a checkpoint and no final/; resumed with a new
    --reward (a reward model retrained on the policy's samples), the run scores with it from step 3, and does not load
    the old reward's state, which lacks the new spec's ema_normalize moments (Reward.load_state_dict refuses it)."""
    old = {"type": "capitalization", "postprocess": [{"type": "scale", "factor": 2.0}]}
    new = {"type": "capitalization", "postprocess": [{"type": "scale", "factor": 0.0, "shift": 0.5}, "ema_normalize",
                                                     {"type": "scale", "shift": 0.25}]}  # a constant 0.25
    first = ppo.main(tiny_args(tiny, tmp_path, total_steps=4, pause_at_step=2, eval_split=None, reward=json.dumps(old)))
    assert first["interrupted"] and first["step"] == 2 and not (Path(first["run_dir"]) / "final").exists()
    ppo.main(ppo.Args(resume=str(Path(first["run_dir"]) / "checkpoints" / "step_2"), reward=json.dumps(new)))
    rows = train_rows(first["run_dir"])
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert {r["rewards/capitalization"] for r in rows[2:]} == {0.25}
    assert {r["rewards/capitalization"] for r in rows[:2]} != {0.25}
    saved = json.loads((Path(first["run_dir"]) / "args.json").read_text())
    assert saved["resumed"][0]["overrides"]["reward"] == [json.dumps(old), json.dumps(new)]


def test_value_model_layers_keeps_the_first_blocks(tiny):
    """--value-model-layers 1: the value model is the checkpoint's embeddings, first decoder block, final norm and a
    zero head; the second block is gone from the module and the config alike."""
    full = AutoModelForCausalLM.from_pretrained(tiny / "model").state_dict()
    cut = ppo.load_value_model(str(tiny / "model"), torch.float32, layers=1)
    assert len(cut.model.layers) == cut.config.num_hidden_layers == 1 and len(cut.config.layer_types) == 1
    kept = {k: v for k, v in cut.state_dict().items() if not k.startswith("score.")}
    assert kept and all(torch.equal(v, full[k]) for k, v in kept.items())
    assert not any(k.startswith("model.layers.1.") for k in kept) and not cut.score.weight.any()


# ----------------------------------------------------------------------------- bad input


def test_truncated_importance_sampling_weighs_each_tokens_policy_loss(tiny, tmp_path, monkeypatch):
    """--importance-sampling-cap (as grpo.py; hybrid.py has the same code): on policy nothing is capped and the policy
    gradient is unchanged; weights forced to 2 double it (one update on one batch, the same seed)."""
    one = dict(total_steps=1, num_ppo_epochs=1, num_mini_batches=1)
    plain = ppo.main(tiny_args(tiny, tmp_path / "plain", **one))
    on_policy = ppo.main(tiny_args(tiny, tmp_path / "tis", importance_sampling_cap=2.0, **one))
    assert on_policy["train/tis_capped_frac"] == 0 and plain["train/grad_norm"] > 0
    assert on_policy["train/grad_norm"] == pytest.approx(plain["train/grad_norm"], rel=1e-4)
    monkeypatch.setattr(ppo, "truncated_is_weights", lambda old, sampler, mask, cap: (
        torch.full_like(old, 2.0), mask > 0))
    doubled = ppo.main(tiny_args(tiny, tmp_path / "doubled", importance_sampling_cap=2.0, **one))
    assert doubled["train/grad_norm"] == pytest.approx(2 * plain["train/grad_norm"], rel=1e-5)
    assert doubled["train/tis_capped_frac"] == 1


@pytest.mark.parametrize("overrides,message", [
    ({"beta": -0.1}, "--beta must be >= 0"),
    ({"importance_sampling_cap": 0.9}, "--importance-sampling-cap must be >= 1"),
    ({"kl_controller": "adaptive"}, "--kl-controller adaptive needs a positive --kl-controller-target"),
    ({"kl_controller": "step", "kl_controller_target": -1.0}, "needs a positive --kl-controller-target"),
    ({"kl_controller": "step", "kl_controller_target": 1.0, "beta": 0.0},
     "needs a positive --kl-controller-target (e.g. 1.0) and --beta"),
    ({"prompts_per_step": 6, "num_mini_batches": 4}, "--num-mini-batches must divide each process's 6 completions: "
                                                     "use --num-mini-batches 3"),
    ({"value_model_name_or_path": "models/nope"}, "model 'models/nope' does not exist"),
    ({"value_model_layers": 3}, "--value-model-layers: use 0 (all) to 2"),
    ({"value_model_layers": -1}, "--value-model-layers must be >= 0"),
    ({"reward": "correctness", "answer_column": "solution"}, "has no column ['solution']"),
    ({"prompts_per_step": 4, "num_mini_batches": 1, "micro_batch_size": 3}, "use --micro-batch-size 2"),
    ({"center_scores_per_prompt": True}, "--center-scores-per-prompt needs several completions of a prompt"),
    ({"pause_at_step": -1}, "--pause-at-step must be >= 0"),
    ({"early_stop_kl": 0.0}, "--early-stop-kl must be positive"),
    ({"eval_limit": 0}, "--eval-limit must be positive"),
    ({"temperature": 0.0}, "--temperature must be positive"),
    ({"gamma": 1.5}, "need 0 <= --clip-low, --gamma, --lam <= 1"),
    ({"gold_reward": "correctnes"}, "unknown reward type 'correctnes'"),
    ({"gold_reward": "correctness", "answer_column": "solution"}, "has no column ['solution']"),
])
def test_bad_input_fails_before_any_work(tiny, tmp_path, overrides, message):
    with pytest.raises(ValueError) as e:
        ppo.main(tiny_args(tiny, tmp_path, **overrides))
    assert message in str(e.value)
    assert not any(tmp_path.iterdir())  # no run directory was created


def test_prompts_and_completions_must_fit_the_context(tiny, tmp_path):
    """Every prompt generation sees (training prompts as --max-prompt-length keeps them, eval prompts whole) plus
    --max-completion-length must fit the policy's positions, and the training prompts the value model's: one short
    of either is refused before any work; at both limits (the value model's below the eval prompt's) a run completes."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text('{"prompt": "1+2+3+4+5+6+7=", "answer": "28"}\n' * 4)  # kept: its last 4 tokens
    (data / "test.jsonl").write_text('{"prompt": "12+34=", "answer": "46"}\n')  # the longest prompt
    longest = len(AutoTokenizer.from_pretrained(tiny / "model")("12+34=", add_special_tokens=False).input_ids)
    assert longest > 4
    kw = {"dataset": str(data), "max_prompt_length": 4, "total_steps": 1}
    policy, value_model = short_gpt2(tmp_path / "policy", longest + 8), short_gpt2(tmp_path / "value", 4 + 8)
    for model, value, n, positions in ((short_gpt2(tmp_path / "short", longest + 7), None, longest, longest + 7),
                                       (policy, short_gpt2(tmp_path / "short_value", 4 + 7), 4, 4 + 7)):
        with pytest.raises(ValueError, match=rf"a {n}-token prompt and --max-completion-length 8 exceed the model's "
                                             rf"{positions} positions"):
            ppo.main(tiny_args(tiny, tmp_path / "runs", model_name_or_path=model, value_model_name_or_path=value, **kw))
    assert not (tmp_path / "runs").exists()
    out = ppo.main(tiny_args(tiny, tmp_path / "runs", model_name_or_path=policy, value_model_name_or_path=value_model,
                             **kw))
    assert out["step"] == 1 and not out["interrupted"] and "eval/accuracy" in out


def test_reward_needing_a_missing_column(tiny, tmp_path):
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "1+1="}\n{"prompt": "2+2="}\n')
    with pytest.raises(ValueError, match=r"has no column \['answer'\].*--reward"):
        ppo.main(tiny_args(tiny, tmp_path / "out", dataset=str(tmp_path / "prompts.jsonl"), reward="correctness",
                           eval_split=None))
    assert not (tmp_path / "out").exists()


def test_gold_reward_is_logged_beside_the_reward_and_scores_are_centred_per_prompt(tiny, tmp_path):
    """--gold-reward: rewards/gold is the gold reward's mean on the step's samples (here the trained reward itself, so
    the two agree) and never enters the trained reward; --center-scores-per-prompt: each prompt's G scores less their
    mean, so the trained reward's batch mean is 0 while the reward's own component keeps its raw mean."""
    out = ppo.main(tiny_args(tiny, tmp_path, num_generations=2, center_scores_per_prompt=True,
                             gold_reward="capitalization"))
    for r in train_rows(out["run_dir"]):
        assert r["train/reward"] == pytest.approx(0.0, abs=1e-6) and r["rewards/capitalization"] > 0.0
        assert r["rewards/gold"] == pytest.approx(r["rewards/capitalization"], abs=1e-6)
