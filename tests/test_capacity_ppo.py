"""Tests of capacity_ppo.py: the math against hand-computed numbers and a float64 loop, the
environment, a learning run, checkpoints (save, load, exact resume after Ctrl-C) and bad input."""
import json
import math
import signal
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import tyro

import capacity_ppo as cp

# A few seconds per run: 8 environments x 16 steps per iteration, small evaluation.
TINY = dict(num_envs=8, num_steps=16, num_minibatches=2, update_epochs=2, total_steps=8 * 16 * 4,
            num_eval_envs=32, eval_every=0, hidden_size=32, head_size=16)


def tiny_args(tmp_path, **overrides) -> cp.Args:
    return cp.Args(output_dir=str(tmp_path), **{**TINY, **overrides})


def read_metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


REWARD_ARGS = cp.Args(accuracy_weight=1.0, energy_cost=0.03, switch_penalty=0.05, escalation_bonus=0.2,
                      escalation_threshold=0.7, efficiency_bonus=0.1, efficiency_threshold=0.95)


# ---------------------------------------------------------------------------------------------- GAE


def gae_reference(rewards, values, next_values, terminated, truncated, gamma, lam):
    """Per-environment float64 loop written from the definitions: A_t = sum_k (gamma*lam)^k delta_{t+k}
    within an episode, with delta_t = r_t + gamma * V(s_{t+1}) * (1 - terminated_t) - V(s_t)."""
    T, N = len(rewards), len(rewards[0])
    adv = [[0.0] * N for _ in range(T)]
    for n in range(N):
        for t in range(T):
            total, discount = 0.0, 1.0
            for k in range(t, T):
                bootstrap = 0.0 if terminated[k][n] else gamma * next_values[k][n]
                total += discount * (rewards[k][n] + bootstrap - values[k][n])
                if terminated[k][n] or truncated[k][n]:
                    break
                discount *= gamma * lam
            adv[t][n] = total
    return adv


def test_gae_hand_computed_truncation_bootstraps_termination_does_not():
    gamma, lam = 0.5, 0.5
    rewards = torch.tensor([[1.0, 1.0], [2.0, 2.0]])
    values = torch.tensor([[0.5, 0.5], [1.0, 1.0]])
    next_values = torch.tensor([[1.0, 1.0], [4.0, 4.0]])  # V(s_1) = 1; V(state reached after step 1) = 4
    terminated = torch.tensor([[0.0, 0.0], [1.0, 0.0]])  # env 0 terminates at t=1, env 1 is truncated there
    dones = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    adv, ret = cp.compute_gae(rewards, values, next_values, terminated, dones, gamma, lam)
    # env 0: delta_1 = 2 - 1 = 1;          delta_0 = 1 + 0.5*1 - 0.5 = 1; A_0 = 1 + 0.25*1 = 1.25
    # env 1: delta_1 = 2 + 0.5*4 - 1 = 3;  delta_0 = 1;                   A_0 = 1 + 0.25*3 = 1.75
    assert torch.allclose(adv, torch.tensor([[1.25, 1.75], [1.0, 3.0]]))
    assert torch.allclose(ret, adv + values)


def test_gae_matches_float64_loop_with_terminations_and_truncations():
    g = torch.Generator().manual_seed(0)
    T, N, gamma, lam = 13, 5, 0.99, 0.95
    rewards, values, next_values = (torch.randn(T, N, generator=g) for _ in range(3))
    u = torch.rand(T, N, generator=g)
    terminated, truncated = u < 0.15, (u >= 0.15) & (u < 0.3)
    assert terminated.any() and truncated.any()
    adv, _ = cp.compute_gae(rewards, values, next_values, terminated.float(), (terminated | truncated).float(),
                            gamma, lam)
    ref = gae_reference(rewards.double().tolist(), values.double().tolist(), next_values.double().tolist(),
                        terminated.tolist(), truncated.tolist(), gamma, lam)
    assert torch.allclose(adv.double(), torch.tensor(ref, dtype=torch.float64), atol=1e-5)


# ---------------------------------------------------------------------------------------------- PPO losses


def test_clipped_policy_loss_hand_computed():
    # ratios 1.5, 0.5, 1.1 with advantages +1, -1, +2 and clip 0.2:
    # min(1.5*1, 1.2*1) = 1.2; min(0.5*-1, 0.8*-1) = -0.8; min(1.1*2, 1.2*2) = 2.2 -> loss = -(1.2 - 0.8 + 2.2)/3
    ratio = torch.tensor([1.5, 0.5, 1.1])
    old = torch.tensor([-1.0, -2.0, -0.5])
    advantages = torch.tensor([1.0, -1.0, 2.0])
    loss, approx_kl, clip_frac = cp.mean_clipped_policy_loss(old + ratio.log(), old, advantages, 0.2)
    assert loss.item() == pytest.approx(-(1.2 - 0.8 + 2.2) / 3, rel=1e-6)
    k3 = [(r - 1) - math.log(r) for r in (1.5, 0.5, 1.1)]  # http://joschu.net/blog/kl-approx.html
    assert approx_kl.item() == pytest.approx(sum(k3) / 3, rel=1e-5)
    assert clip_frac.item() == pytest.approx(2 / 3)


@pytest.mark.parametrize("clip, expected", [
    # new 2.0, old 1.0, return 3.0: unclipped (2-3)^2 = 1; clipped to 1.2: (1.2-3)^2 = 3.24 -> max = 3.24
    (True, 0.5 * (3.24 + 0.0) / 2),
    (False, 0.5 * (1.0 + 0.0) / 2),
])
def test_value_loss_hand_computed(clip, expected):
    new, old, returns = torch.tensor([2.0, 1.0]), torch.tensor([1.0, 1.0]), torch.tensor([3.0, 1.0])
    loss = cp.unmasked_value_loss(new, old, returns, 0.2, clip)
    assert loss.item() == pytest.approx(expected, rel=1e-6)


def value_loss_reference(new, old, returns, clip):
    """float64 loop: 0.5 * mean_i max((V_i - R_i)^2, (old_i + clip(V_i - old_i, -c, c) - R_i)^2)."""
    total = 0.0
    for v, o, r in zip(new, old, returns):
        clipped = o + min(max(v - o, -clip), clip)
        total += max((v - r) ** 2, (clipped - r) ** 2)
    return 0.5 * total / len(new)


def test_value_loss_takes_the_elementwise_max_not_the_max_of_the_means():
    # element 0: the clipped error is larger (3.24 > 1); element 1: the unclipped one (6.25 > 4.84).
    # element-wise max then mean: 0.5 * (3.24 + 6.25) / 2 = 2.3725; the max of the two means
    # (the specification's form) would give 0.5 * max(3.625, 4.04) = 2.02
    new, old, returns = [2.0, 0.5], [1.0, 1.0], [3.0, 3.0]
    loss = cp.unmasked_value_loss(torch.tensor(new), torch.tensor(old), torch.tensor(returns), 0.2, True)
    assert value_loss_reference(new, old, returns, 0.2) == pytest.approx(2.3725)
    assert loss.item() == pytest.approx(2.3725, rel=1e-6)
    g = torch.Generator().manual_seed(3)
    new, old, returns = (torch.randn(50, generator=g).double() * 2 for _ in range(3))
    want = value_loss_reference(new.tolist(), old.tolist(), returns.tolist(), 0.3)
    assert cp.unmasked_value_loss(new, old, returns, 0.3, True).item() == pytest.approx(want, rel=1e-12)


def test_normalize_advantages_and_explained_variance():
    adv = cp.normalize_advantages(torch.tensor([1.0, 2.0, 3.0]))
    assert torch.allclose(adv, torch.tensor([-1.0, 0.0, 1.0]), atol=1e-6)  # unbiased std of 1,2,3 is 1
    x = torch.tensor([1.0, 2.0, 3.0])
    assert cp.unmasked_explained_variance(x, x) == pytest.approx(1.0)
    assert math.isnan(cp.unmasked_explained_variance(torch.zeros(3), torch.ones(3)))


# ---------------------------------------------------------------------------------------------- environment math


@pytest.mark.parametrize("accuracy, capacity, prev, expected", [
    # accuracy - 0.03 * n - switch + escalation + efficiency
    (0.9, 9, 9, 0.9 - 0.27),                      # stay: no switch terms
    (0.5, 12, 9, 0.5 - 0.36 - 0.05 + 0.2),        # up while failing: escalation bonus
    (0.8, 12, 9, 0.8 - 0.36 - 0.05),              # up while accurate enough: no bonus
    (0.97, 4, 6, 0.97 - 0.12 - 0.05 + 0.1),       # down while very accurate: efficiency bonus
    (0.9, 4, 6, 0.9 - 0.12 - 0.05),               # down, not accurate enough for the bonus
    (0.6, 4, 6, 0.6 - 0.12 - 0.05),               # down while failing: no escalation bonus either
])
def test_reward_terms_hand_computed(accuracy, capacity, prev, expected):
    terms = cp.reward_terms(torch.tensor([accuracy]), torch.tensor([float(capacity)]), torch.tensor([float(prev)]),
                            REWARD_ARGS)
    assert set(terms) == {"accuracy", "energy", "switch", "escalation", "efficiency"}
    assert sum(terms.values()).item() == pytest.approx(expected, abs=1e-6)


def test_task_accuracy_and_oracle_hand_computed():
    args = cp.Args(slots_at_max_difficulty=12.0, accuracy_temperature=1.0, chance_accuracy=0.25, energy_cost=0.03)
    # d = 0.5 needs 6 slots: n = 6 is at the midpoint between chance and 1
    assert cp.task_accuracy(torch.tensor(6.0), torch.tensor(0.5), args).item() == pytest.approx(0.625)
    sig = 1 / (1 + math.exp(-3.0))
    assert cp.task_accuracy(torch.tensor(9.0), torch.tensor(0.5), args).item() == pytest.approx(0.25 + 0.75 * sig)
    caps = torch.tensor([4.0, 6.0, 9.0, 12.0])
    difficulty = torch.tensor([0.0, 0.5, 1.0])
    expected = [max(range(4), key=lambda i: 0.25 + 0.75 / (1 + math.exp(-(caps[i].item() - 12 * d))) - 0.03 * caps[i].item())
                for d in difficulty.tolist()]
    got = cp.oracle_actions(difficulty, caps, args)
    assert got.tolist() == expected == [0, 2, 3]


def rollout(env, actions):
    return [env.step(a) for a in actions]


def test_env_is_deterministic_under_a_seed_and_has_the_documented_shapes():
    args = cp.Args()
    g = torch.Generator().manual_seed(1)
    actions = [torch.randint(0, 4, (6,), generator=g) for _ in range(20)]
    first, second, other = (cp.CapacityEnv(args, 6, seed) for seed in (3, 3, 4))
    obs0 = first.reset()
    assert obs0.shape == (6, args.workspace_dim + 7) and torch.equal(obs0, second.reset())
    for a, b in zip(rollout(first, actions), rollout(second, actions)):
        for x, y in zip(a[:4], b[:4]):
            assert torch.equal(x, y)
    obs, reward, terminated, truncated, info = a
    assert obs.shape == (6, first.obs_dim) and info["final_obs"].shape == obs.shape
    assert reward.shape == terminated.shape == truncated.shape == (6,) and terminated.dtype == torch.bool
    other.reset()
    assert not torch.equal(rollout(other, actions)[-1][0], obs)  # another seed gives another stream
    # the observation's scalars are the documented features in [0, 1]
    assert obs[:, -7:].min() >= 0 and obs[:, -7:].max() <= 1


def test_difficulty_stream_does_not_depend_on_the_actions():
    args = cp.Args()
    envs = [cp.CapacityEnv(args, 16, 0) for _ in range(2)]
    for step in range(30):
        difficulties = [env.state["difficulty"].clone() for env in envs]
        assert torch.equal(*difficulties)
        envs[0].step(torch.zeros(16, dtype=torch.long))
        envs[1].step(torch.full((16,), 3, dtype=torch.long))


def test_budget_terminates_and_step_limit_truncates():
    args = cp.Args(energy_budget=100.0, max_episode_steps=5)
    env = cp.CapacityEnv(args, 2, 0)
    env.reset()
    events = []
    for t in range(1, 6):
        obs, _, terminated, truncated, info = env.step(torch.tensor([3, 0]))  # n = 12 and n = 4
        events.append((terminated.tolist(), truncated.tolist()))
    # neither env spends 100 slot-steps within the 5-step limit: both are truncated at t = 5
    assert events[-1] == ([False, False], [True, True]) and all(e == ([False, False], [False, False]) for e in events[:-1])
    assert not torch.equal(info["final_obs"], obs)  # final_obs is the end state, obs the next episode's start
    assert env.state["t"].tolist() == [0, 0] and env.state["budget"].tolist() == [100.0, 100.0]
    assert info["episode_length"].tolist() == [5, 5]

    env = cp.CapacityEnv(replace(args, max_episode_steps=50), 1, 0)
    for t in range(1, 10):  # n = 12 spends the 100 slot-steps in ceil(100 / 12) = 9 steps
        _, _, terminated, truncated, _ = env.step(torch.tensor([3]))
        assert terminated.item() == (t == 9) and not truncated.item()


# ---------------------------------------------------------------------------------------------- training runs


def test_short_run_beats_the_best_fixed_capacity(tmp_path):
    args = cp.Args(output_dir=str(tmp_path), total_steps=40_960, eval_every=0, num_eval_envs=512)
    torch.manual_seed(args.seed)  # the untrained agent must not depend on what ran before in this process
    before = cp.evaluate(args, cp.Agent(args.workspace_dim + 7, 4), "cpu")
    metrics = cp.main(args)
    # adaptation matters in this environment: the oracle beats every fixed capacity by >= 15% of its lead on random
    assert metrics["eval/oracle_advantage"] >= 0.15
    # an untrained agent does not: its near-uniform logits make greedy pick one capacity throughout
    assert before["eval/return"] <= metrics["eval/best_fixed_return"]
    assert metrics["eval/return"] > metrics["eval/best_fixed_return"]
    assert metrics["eval/gap_closed"] > 0.3


def test_run_directory_metrics_and_checkpoint_reload(tmp_path):
    args = tiny_args(tmp_path, save_every=8 * 16 * 2, eval_every=8 * 16 * 2, max_episode_steps=10)
    metrics = cp.main(args)
    run_dir = tmp_path / args.run_name
    assert json.loads((run_dir / "args.json").read_text())["capacities"] == [4, 6, 9, 12]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 128, 256, 384, 512]
    train_keys = {"charts/episodic_return", "charts/learning_rate", "losses/value_loss", "losses/policy_loss",
                  "losses/entropy", "losses/approx_kl", "losses/clipfrac", "losses/explained_variance"}
    eval_keys = {"eval/return", "eval/oracle_return", "eval/best_fixed_return", "eval/random_return"}
    assert train_keys <= set(rows[1]) and eval_keys <= set(rows[0]) and eval_keys <= set(rows[2])
    assert eval_keys.isdisjoint(rows[1]) and eval_keys <= set(rows[-1])
    # annealed linearly to 0: iteration i of 4 uses (1 - (i - 1) / 4) * lr
    assert [r["charts/learning_rate"] for r in rows[1:]] == pytest.approx([args.learning_rate * f for f in (1, 0.75, 0.5, 0.25)])
    # every reward term is logged as its mean per step, and the terms add up to the reward
    terms = ["accuracy", "energy", "switch", "escalation", "efficiency"]
    for row in rows[1:]:
        assert {f"rewards/{t}" for t in terms} | {"rewards/total", "charts/mean_value", "charts/mean_return"} <= set(row)
        assert sum(row[f"rewards/{t}"] for t in terms) == pytest.approx(row["rewards/total"], abs=1e-5)
        assert row["rewards/accuracy"] > 0 > row["rewards/energy"]
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == ["step_256", "step_512"]  # periodic + final, no temporary folder left
    assert metrics["checkpoint"] == str(run_dir / "checkpoints" / "step_512")

    agent = cp.load_agent(metrics["checkpoint"])
    reloaded = cp.evaluate(args, agent, "cpu")
    assert reloaded["eval/return"] == metrics["eval/return"]


def test_target_kl_stops_the_epochs_early(tmp_path):
    for target_kl, expected in [(None, [4, 4, 4, 4]), (1e-8, [1, 1, 1, 1])]:
        args = tiny_args(tmp_path, target_kl=target_kl, update_epochs=4, anneal_lr=False, learning_rate=1e-3,
                         exp_name=f"kl{target_kl}")
        cp.main(args)
        rows = read_metrics(tmp_path / args.run_name)[1:]
        assert [r["losses/epochs"] for r in rows] == expected
        assert all(r["charts/learning_rate"] == 1e-3 for r in rows)  # --no-anneal-lr keeps it constant


def command_line(argv: list[str]) -> int:
    """capacity_ppo.py's command line in this process -> its exit status."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(sys, "argv", ["capacity_ppo.py", *argv])
        try:
            cp.command_line(cp.Args, cp.main)
        except SystemExit as exit:
            return exit.code
    return 0


def test_ctrl_c_or_sigterm_saves_a_checkpoint_and_resume_is_exact(tmp_path, monkeypatch, capsys):
    straight = cp.main(tiny_args(tmp_path, exp_name="straight"))
    real_gae = cp.compute_gae
    tiny_flags = [s for k, v in TINY.items() for s in (f"--{k.replace('_', '-')}", str(v))]
    saved = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        calls = {"n": 0}

        def signal_on_third_call(*a, **kw):  # the signal arrives during the third iteration
            calls["n"] += 1
            if calls["n"] == 3:
                signal.raise_signal(sig)
            return real_gae(*a, **kw)

        monkeypatch.setattr(cp, "compute_gae", signal_on_third_call)
        assert command_line(["--output-dir", str(tmp_path / sig.name), *tiny_flags]) == 128 + sig  # 130, 143
        (saved[sig],) = (tmp_path / sig.name).glob("*/checkpoints/*")  # the state after two iterations
        assert saved[sig].name == "step_256"
        last = capsys.readouterr().out.splitlines()[-1]
        assert last == f"interrupted: saved {saved[sig]}; continue with --resume {saved[sig]}"
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # main restores the handler it replaced

    monkeypatch.setattr(cp, "compute_gae", real_gae)
    assert command_line(["--resume", str(saved[signal.SIGTERM])]) == 0  # the run's own (tiny) arguments come back
    assert f"resumed from step 256 of 512 ({saved[signal.SIGTERM]})" in capsys.readouterr().out
    run_dir = saved[signal.SIGTERM].parents[1]
    resumed = cp.load_agent(run_dir / "checkpoints" / "step_512")
    for (name, x), y in zip(cp.load_agent(straight["checkpoint"]).state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(x, y), name
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 128, 256, 384, 512]
    for x, y in zip(*(cp.load_agent(saved[s]).state_dict().values() for s in saved)):
        assert torch.equal(x, y)  # either signal saves the same state


def test_ctrl_c_while_saving_quits_at_once_with_130(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cp, "save_checkpoint", lambda *a: signal.raise_signal(signal.SIGINT))
    assert command_line(["--output-dir", str(tmp_path), "--num-envs", "8", "--num-steps", "16", "--total-steps", "128",
                         "--num-eval-envs", "4", "--hidden-size", "8", "--head-size", "8"]) == 130
    assert "quit without saving" in capsys.readouterr().err


def test_track_logs_to_wandb_offline(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    logged, real_init = [], wandb.init

    def init(*a, **kw):  # wandb.init rebinds wandb.log to the run's: record what main passes to it
        run = real_init(*a, **kw)
        real_log = wandb.log
        monkeypatch.setattr(wandb, "log", lambda row, step=None, **k: (logged.append((step, row)), real_log(row, step=step, **k)))
        return run

    monkeypatch.setattr(wandb, "init", init)
    args = tiny_args(tmp_path, track=True, total_steps=8 * 16 * 2)
    cp.main(args)
    assert list((tmp_path / args.run_name / "wandb").glob("offline-run-*"))
    # W&B receives every metrics.jsonl row, at its step, with the same values
    rows = read_metrics(tmp_path / args.run_name)
    assert [step for step, _ in logged] == [r["step"] for r in rows] == [0, 128, 256]
    for (_, got), row in zip(logged, rows):
        assert got == pytest.approx({k: v for k, v in row.items() if k != "step"}, nan_ok=True)
    assert "rewards/energy" in logged[-1][1] and "losses/value_loss" in logged[-1][1]


def test_truncated_steps_bootstrap_from_the_final_state_terminated_ones_do_not(tmp_path, monkeypatch):
    """main's next_values: V(state the episode ended in) on truncation, never V(next episode's first
    state); terminations carry terminated = 1 so that GAE drops the bootstrap."""
    args = tiny_args(tmp_path, total_steps=8 * 16, energy_budget=40.0, max_episode_steps=6, num_eval_envs=4)
    agents, steps, checked = [], [], []
    real_agent, real_step, real_gae = cp.Agent, cp.CapacityEnv.step, cp.compute_gae

    class RecordingAgent(real_agent):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            agents.append(self)

    def recording_step(env, action):
        out = real_step(env, action)
        if env.num_envs == args.num_envs:  # the training environments, not the evaluation ones
            steps.append({"obs": out[0].clone(), "terminated": out[2].clone(), "truncated": out[3].clone(),
                          "final_obs": out[4]["final_obs"].clone()})
        return out

    def checking_gae(rewards, values, next_values, terminated, dones, gamma, lam):
        (agent,) = agents
        with torch.no_grad():
            for t, s in enumerate(steps[-len(rewards):]):
                v_final, v_next_start = agent.get_value(s["final_obs"]), agent.get_value(s["obs"])
                assert terminated[t].bool().tolist() == s["terminated"].tolist()
                assert dones[t].bool().tolist() == (s["terminated"] | s["truncated"]).tolist()
                trunc = s["truncated"]
                assert torch.allclose(next_values[t][trunc], v_final[trunc])
                assert not torch.isclose(next_values[t][trunc], v_next_start[trunc]).any()
                alive = ~(s["terminated"] | trunc)
                following = values[t + 1] if t + 1 < len(rewards) else v_next_start
                assert torch.allclose(next_values[t][alive], following[alive])
                checked.append((int(s["terminated"].sum()), int(trunc.sum())))
        return real_gae(rewards, values, next_values, terminated, dones, gamma, lam)

    monkeypatch.setattr(cp, "Agent", RecordingAgent)
    monkeypatch.setattr(cp.CapacityEnv, "step", recording_step)
    monkeypatch.setattr(cp, "compute_gae", checking_gae)
    cp.main(args)
    assert len(checked) == 16
    assert sum(t for t, _ in checked) > 0 and sum(u for _, u in checked) > 0  # both kinds of episode end occurred


def test_value_clipping_is_off_by_default():
    # the clip (+-clip_coef) is in raw return units while returns are ~20: it made the critic lag
    # the whole run (docs/capacity_ppo.md); --clip-vloss turns it back on
    assert cp.Args().clip_vloss is False
    assert tyro.cli(cp.Args, args=["--clip-vloss"]).clip_vloss is True


def test_spec_energy_term_hand_computed():
    # -0.1 * energy_used / n^2: 30 slot-steps used at n = 6 -> -0.1 * 30 / 36
    terms = cp.reward_terms(torch.tensor([0.5]), torch.tensor([6.0]), torch.tensor([6.0]), cp.Args(energy_term="spec"),
                            torch.tensor([30.0]))
    assert terms["energy"].item() == pytest.approx(-0.1 * 30 / 36)
    env = cp.CapacityEnv(cp.Args(energy_term="spec"), 1, 0)
    rewards_seen = [env.step(torch.tensor([1]))[4]["terms"]["energy"].item() for _ in range(3)]
    assert rewards_seen == pytest.approx([-0.1 * 6 / 36, -0.1 * 12 / 36, -0.1 * 18 / 36])


# ---------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("overrides, message", [
    (dict(capacities=()), "--capacities must list at least two"),
    (dict(capacities=(9, 4, 12)), "strictly increasing"),
    (dict(capacities=(4, 4, 6)), "strictly increasing"),
    (dict(num_envs=0), "--num-envs must be at least 1"),
    (dict(num_minibatches=3), "--num-minibatches 3 does not divide the batch size 128"),
    (dict(total_steps=10), "--total-steps 10 is smaller than one rollout"),
    (dict(target_kl=0.0), "--target-kl must be positive"),
    (dict(resume="/nonexistent/step_5"), "is not a checkpoint"),
])
def test_bad_input_is_rejected_before_any_work(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        cp.main(tiny_args(tmp_path, **overrides))
    assert not any(tmp_path.iterdir())  # no run directory was created


def test_resume_with_other_capacities_is_rejected(tmp_path):
    metrics = cp.main(tiny_args(tmp_path, total_steps=128))
    with pytest.raises(ValueError, match=r"--capacities \(4, 8\) differs from the run's .*cannot change on resume"):
        cp.main(tiny_args(tmp_path, total_steps=256, capacities=(4, 8), resume=metrics["checkpoint"]))
    resumed = cp.main(cp.Args(resume=metrics["checkpoint"], total_steps=256))  # a longer run may continue it
    assert resumed["step"] == 256
    record = json.loads((Path(metrics["run_dir"]) / "args.json").read_text())
    assert record["total_steps"] == 128 and record["resumed"][-1]["overrides"] == {"total_steps": [128, 256]}


def test_total_steps_rounded_to_whole_iterations_says_so(tmp_path, capsys):
    out = cp.main(tiny_args(tmp_path, total_steps=300))  # iterations of 128 steps
    assert out["step"] == 256
    assert "--total-steps 300 is not a whole number of iterations of 128 steps" in capsys.readouterr().out


def test_cli_parses_capacities_and_hides_computed_fields():
    args = tyro.cli(cp.Args, args=["--capacities", "2", "4", "8", "--num-envs", "3"])
    assert args.capacities == (2, 4, 8) and args.num_envs == 3
    with pytest.raises(SystemExit):
        tyro.cli(cp.Args, args=["--batch-size", "7"])
