"""Actor-critic PPO that learns which working-memory capacity n in {4, 6, 9, 12} a task needs.

Before each task a controller picks n slots: more slots solve harder tasks but spend a finite energy budget. It
reads the hidden difficulty off a noisy 60-dimensional "global workspace" and its own recent accuracy. Details:
docs/capacity_ppo.md.

Papers: PPO, clipped surrogate (Eq. 7) and objective (Eq. 9), arXiv:1707.06347; GAE (Eq. 16), arXiv:1506.02438;
time limits (bootstrap at truncation only), arXiv:1712.00378

    python capacity_ppo.py                                   # about 1 min on one CPU core
    python capacity_ppo.py --capacities 2 4 8 16 --seed 2    # another capacity set
    python capacity_ppo.py --resume runs/<run>/checkpoints/step_N   # continue, bit-identical

Departures from the specification (reasons and measurements in the docs)
- energy term -energy_cost * n, not -0.1 * energy_used / n^2 (under which a larger n costs less)
- learning rate 2.5e-4 annealed linearly to 0, not 3e-4 constant
- 64 environments x 64 steps in 4 minibatches, not 1 environment x 2048 steps in minibatches of 32
- value clipping off (its +-0.2 is in raw return units, returns ~20); --clip-vloss: the element-wise max (ppo2)
- GAE lambda 0.8, not 0.95: a capacity choice pays off at once
- episodes start with the smallest capacity as "previous"; previous-capacity and dwell features in [0, 1]
"""

import copy
import inspect
import json
import os
import re
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass, make_dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn as nn
import tyro
from safetensors.torch import load_file, save_file
from tqdm import tqdm


@dataclass
class Algorithm:
    num_envs: int = 64
    """environments stepped together"""
    num_steps: int = 64
    """steps per environment per rollout"""
    gamma: float = 0.99
    """discount factor"""
    gae_lambda: float = 0.8
    """advantage lambda (GAE): 1 whole returns, 0 one step"""
    num_minibatches: int = 4
    """minibatches per epoch (divides the batch)"""
    update_epochs: int = 10
    """epochs over each rollout"""
    norm_adv: bool = True
    """normalise advantages per minibatch"""
    clip_coef: float = 0.2
    """probability ratio clipped to 1 +- this"""
    clip_vloss: bool = False
    """clip values to the rollout's +- --clip-coef in the value loss"""
    ent_coef: float = 0.01
    """entropy bonus coefficient"""
    vf_coef: float = 0.5
    """value loss coefficient"""
    target_kl: float | None = None
    """stop an update's epochs once approximate KL exceeds this"""



@dataclass
class ModelData:
    hidden_size: int = 256
    """shared trunk width"""
    head_size: int = 128
    """actor and critic head width"""
    capacities: tuple[int, ...] = (4, 6, 9, 12)
    """capacities to choose from, increasing"""
    max_episode_steps: int = 64
    """episode step limit (truncation)"""
    energy_budget: float = 640.0
    """slot-steps an episode may spend (termination)"""
    regime_means: tuple[float, ...] = (0.1, 0.35, 0.6, 0.85)
    """mean difficulty of each task regime"""
    regime_switch_prob: float = 0.05
    """per-step chance of a new regime"""
    difficulty_drift: float = 0.3
    """pull of difficulty toward its regime's mean"""
    difficulty_noise: float = 0.05
    """std of per-step difficulty changes"""
    slots_at_max_difficulty: float = 11.0
    """slots for 50% above chance at difficulty 1"""
    accuracy_temperature: float = 0.8
    """width of the psychometric curve, in slots"""
    chance_accuracy: float = 0.25
    """accuracy with no useful capacity"""
    items_per_step: int = 20
    """task items per step (accuracy: fraction right)"""
    workspace_dim: int = 60
    """global workspace size"""
    workspace_signal: float = 1.0
    """difficulty signal per workspace unit"""
    workspace_noise: float = 0.5
    """noise std per workspace unit"""
    estimate_noise: float = 0.1
    """noise std of the difficulty estimate"""
    accuracy_weight: float = 1.0
    """reward weight of task accuracy"""
    energy_cost: float = 0.05
    """penalty per slot-step (--energy-term linear)"""
    energy_term: Literal["linear", "spec"] = "linear"
    """linear: -energy_cost * n; spec: -0.1 * energy_used / n^2"""
    switch_penalty: float = 0.05
    """penalty for changing capacity"""
    escalation_bonus: float = 0.2
    """bonus for raising capacity at accuracy < --escalation-threshold"""
    escalation_threshold: float = 0.7
    """see --escalation-bonus"""
    efficiency_bonus: float = 0.1
    """bonus for lowering capacity at accuracy > --efficiency-threshold"""
    efficiency_threshold: float = 0.95
    """see --efficiency-bonus"""



@dataclass
class Optimisation:
    total_steps: int = 300_000
    """environment steps of training (whole iterations)"""
    learning_rate: float = 2.5e-4
    """Adam learning rate"""
    anneal_lr: bool = True
    """anneal the learning rate linearly to 0"""
    max_grad_norm: float = 0.5
    """global gradient-norm clip"""



@dataclass
class Logging:
    eval_every: int = 50_000
    """environment steps between evaluations (0: start and end)"""
    num_eval_envs: int = 1024
    """evaluation episodes per policy"""
    eval_seed: int = 12345
    """seed of the evaluation episodes"""
    save_every: int = 0
    """environment steps between checkpoints (0: at the end)"""
    resume: str | None = None
    """runs/<run>/checkpoints/step_N to continue"""



@dataclass
class Engineering:
    exp_name: str = "capacity_ppo"
    """part of the run directory's name"""
    seed: int = 1
    """seed of agent, actions and training environments"""
    torch_deterministic: bool = True
    """deterministic torch algorithms where possible"""
    track: bool = False
    """log to Weights & Biases"""
    wandb_project_name: str = "cleanrl-llm"
    """W&B project"""
    wandb_entity: str | None = None
    """W&B team (None: your default)"""
    output_dir: str = "runs"
    """parent of run directories"""
    device: str = "cpu"
    """torch device (cpu: as fast as cuda here)"""
    torch_threads: int = 1
    """torch CPU threads (1 is fastest here)"""
    run_name: tyro.conf.Suppress[str] = ""
    """set at run time"""


@dataclass
class Args(Engineering, Logging, Optimisation, ModelData, Algorithm):
    @property
    def batch_size(self) -> int:
        return self.num_envs * self.num_steps

    @property
    def num_iterations(self) -> int:
        return self.total_steps // self.batch_size


OBS_SCALARS = 7  # CapacityEnv._observe's scalars


# --- environment


def task_accuracy(capacity, difficulty, args: Args):
    """Expected accuracy p(n, d) of capacity n at difficulty d: a psychometric curve."""
    margin = (capacity - difficulty * args.slots_at_max_difficulty) / args.accuracy_temperature
    return args.chance_accuracy + (1.0 - args.chance_accuracy) * torch.sigmoid(margin)


def reward_terms(accuracy, capacity, prev_capacity, args: Args, energy_used=None) -> dict:
    """Signed reward terms, all [N], summing to the reward; energy_used (--energy-term spec) includes this step."""
    up = capacity > prev_capacity
    down = capacity < prev_capacity
    energy = -args.energy_cost * capacity
    if args.energy_term == "spec":
        energy = -0.1 * energy_used / capacity**2
    return {"accuracy": args.accuracy_weight * accuracy, "energy": energy,
            "switch": -args.switch_penalty * (up | down).float(),
            "escalation": args.escalation_bonus * (up & (accuracy < args.escalation_threshold)).float(),
            "efficiency": args.efficiency_bonus * (down & (accuracy > args.efficiency_threshold)).float()}


def oracle_actions(difficulty, capacities, args: Args):
    """[N] difficulties, [K] capacities -> [N] index maximising expected accuracy reward minus energy; myopic."""
    expected = args.accuracy_weight * task_accuracy(capacities[None, :], difficulty[:, None], args)
    return (expected - args.energy_cost * capacities[None, :]).argmax(dim=1)


class CapacityEnv:
    """Vectorised task stream, tensors [num_envs, ...]. step() draws the same random numbers whatever the actions,
    so policies evaluated from the same seed face the same difficulties."""

    def __init__(self, args: Args, num_envs: int, seed: int, device="cpu"):
        self.args = args
        self.num_envs = num_envs
        self.device = torch.device(device)
        self.capacities = torch.tensor(args.capacities, dtype=torch.float32, device=self.device)
        self.regime_means = torch.tensor(args.regime_means, dtype=torch.float32, device=self.device)
        # part of the task, not of the run: the same for every seed
        signs = torch.randint(0, 2, (args.workspace_dim,), generator=torch.Generator().manual_seed(0))
        self.workspace_code = (2.0 * signs - 1.0).to(self.device)
        self.obs_dim = args.workspace_dim + OBS_SCALARS
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.rng = dict(generator=self.generator, device=self.device)
        self.reset()

    def _regimes(self):
        return torch.randint(len(self.regime_means), (self.num_envs,), **self.rng)

    def _noisy(self, difficulty):
        return (difficulty + self.args.difficulty_noise * torch.randn(self.num_envs, **self.rng)).clamp(0.0, 1.0)

    def _observe(self, noise):
        """noise: [N, workspace_dim + 1] (workspace units, difficulty estimate) -> [N, obs_dim]."""
        a, s = self.args, self.state
        signal = a.workspace_signal * (2.0 * s["difficulty"][:, None] - 1.0) * self.workspace_code
        scalars = [(s["difficulty"] + a.estimate_noise * noise[:, -1]).clamp(0.0, 1.0), s["rolling_acc"],
                   s["budget"].clamp(min=0.0) / a.energy_budget, s["prev_action"] / (len(a.capacities) - 1),
                   s["dwell"].clamp(max=10.0) / 10.0, s["error_rate"], s["t"] / a.max_episode_steps]
        return torch.cat([torch.tanh(signal + a.workspace_noise * noise[:, :-1]), torch.stack(scalars, 1)], 1)

    def _fresh_state(self) -> dict:
        full = lambda value: torch.full((self.num_envs,), value, device=self.device)
        regime = self._regimes()
        return dict(regime=regime, difficulty=self._noisy(self.regime_means[regime]), t=full(0.0),
                    budget=full(self.args.energy_budget), prev_action=full(0),  # the smallest capacity
                    dwell=full(0.0), rolling_acc=full(0.5), error_rate=full(0.5), episode_return=full(0.0))

    def reset(self):
        self.state = self._fresh_state()
        self.obs = self._observe(torch.randn(self.num_envs, self.args.workspace_dim + 1, **self.rng))
        return self.obs

    def step(self, action):
        """action: [N] -> next_obs [N, D], reward, terminated, truncated [N], info. Where an episode ended,
        next_obs starts the next one; info["final_obs"] is its end."""
        a, s, n = self.args, self.state, self.num_envs
        capacity = self.capacities[action]
        # 1. solve the task: items_per_step Bernoulli(p(n, d)) items
        p = task_accuracy(capacity, s["difficulty"], a)
        accuracy = (torch.rand(n, a.items_per_step, **self.rng) < p[:, None]).float().mean(dim=1)
        energy_used = a.energy_budget - s["budget"] + capacity
        terms = reward_terms(accuracy, capacity, self.capacities[s["prev_action"]], a, energy_used)
        reward = sum(terms.values())
        # 2. bookkeeping: energy, time, dwell, running statistics (EMAs of rate 0.2 and 0.5)
        s["budget"] -= capacity
        s["t"] += 1
        s["dwell"] = torch.where(action == s["prev_action"], s["dwell"] + 1, 1.0)
        s["prev_action"] = action.clone()
        s["rolling_acc"] += 0.2 * (accuracy - s["rolling_acc"])
        s["error_rate"] += 0.5 * (1.0 - accuracy - s["error_rate"])
        s["episode_return"] += reward
        terminated = s["budget"] <= 0
        truncated = (s["t"] >= a.max_episode_steps) & ~terminated
        # 3. the task stream moves on: regime switches, then mean reversion with noise
        switch = torch.rand(n, **self.rng) < a.regime_switch_prob
        s["regime"] = torch.where(switch, self._regimes(), s["regime"])
        drift = a.difficulty_drift * (self.regime_means[s["regime"]] - s["difficulty"])
        s["difficulty"] = self._noisy(s["difficulty"] + drift)
        # 4. observe, then reset finished episodes (fresh draws every step keep the random stream action-free)
        noise = torch.randn(n, a.workspace_dim + 1, **self.rng)
        info = {"final_obs": self._observe(noise), "capacity": capacity, "terms": terms,
                "episode_return": s["episode_return"].clone(), "episode_length": s["t"].clone()}
        fresh = self._fresh_state()
        self.state = {k: torch.where(terminated | truncated, fresh[k], v) for k, v in s.items()}
        self.obs = self._observe(noise)
        return self.obs, reward, terminated, truncated, info


# --- PPO math


def compute_gae(rewards, values, next_values, terminated, dones, gamma, gae_lambda):
    """All [T, N] -> (advantages, returns). next_values[t]: V of the state step t reached (or ended in);
    terminated[t] drops the bootstrap, dones[t] cuts the lambda-trace."""
    advantages = torch.zeros_like(rewards)
    last = torch.zeros_like(rewards[0])
    for t in reversed(range(len(rewards))):
        # TD error; the bootstrap is kept at truncation, dropped at termination (arXiv:1712.00378)
        delta = rewards[t] + gamma * next_values[t] * (1.0 - terminated[t]) - values[t]
        # Eq. 16 of arXiv:1506.02438 as the backward recursion A_t = delta_t + gamma * lambda * A_{t+1}
        last = delta + gamma * gae_lambda * (1.0 - dones[t]) * last
        advantages[t] = last
    return advantages, advantages + values


def normalize_advantages(advantages):
    """[B] -> [B] with zero mean and unit (unbiased) std."""
    return (advantages - advantages.mean()) / (advantages.std() + 1e-8)


def mean_clipped_policy_loss(new_logp, old_logp, advantages, clip_coef: float):
    """Clipped surrogate, Eq. 7 of arXiv:1707.06347, negated and averaged. All [B] -> (loss, approx_kl, clip_frac)."""
    log_ratio = new_logp - old_logp
    ratio = log_ratio.exp()
    loss = torch.max(-advantages * ratio, -advantages * ratio.clamp(1.0 - clip_coef, 1.0 + clip_coef)).mean()
    with torch.no_grad():
        approx_kl = ((ratio - 1.0) - log_ratio).mean()  # k3, http://joschu.net/blog/kl-approx.html
        clip_frac = ((ratio - 1.0).abs() > clip_coef).float().mean()
    return loss, approx_kl, clip_frac


def unmasked_value_loss(new_values, old_values, returns, clip_coef: float, clip: bool = True):
    """L^VF of Eq. 9 of arXiv:1707.06347; clip: the element-wise max of baselines' ppo2. All [B] -> []."""
    unclipped = (new_values - returns) ** 2
    if not clip:
        return 0.5 * unclipped.mean()
    clipped = old_values + (new_values - old_values).clamp(-clip_coef, clip_coef)
    return 0.5 * torch.max(unclipped, (clipped - returns) ** 2).mean()


def unmasked_explained_variance(predicted, target) -> float:
    """1 - Var[target - predicted] / Var[target], both [B]; nan when the target is constant."""
    var = target.var()
    return float("nan") if var == 0 else float(1.0 - (target - predicted).var() / var)


# --- agent


def layer_init(layer: nn.Linear, std=2**0.5) -> nn.Linear:
    nn.init.orthogonal_(layer.weight, std)
    nn.init.zeros_(layer.bias)
    return layer


class Agent(nn.Module):
    """Shared trunk, then an actor (logits over capacities) and a critic (state value) head."""

    def __init__(self, obs_dim: int, num_actions: int, hidden_size=256, head_size=128):
        super().__init__()
        block = lambda width: [layer_init(nn.Linear(width, hidden_size)), nn.LayerNorm(hidden_size), nn.ReLU()]
        self.trunk = nn.Sequential(*block(obs_dim), *block(hidden_size))
        head = lambda out, std: nn.Sequential(layer_init(nn.Linear(hidden_size, head_size)), nn.ReLU(),
                                              layer_init(nn.Linear(head_size, out), std=std))
        self.actor = head(num_actions, 0.01)  # output gains 0.01 (near-uniform initial policy) and 1, as in CleanRL
        self.critic = head(1, 1.0)

    def get_value(self, obs):
        """obs: [B, D] -> [B]."""
        return self.critic(self.trunk(obs)).squeeze(-1)

    def get_action_and_value(self, obs, action=None):
        """obs: [B, D] -> action, log-prob, entropy, value, each [B]."""
        hidden = self.trunk(obs)
        dist = torch.distributions.Categorical(logits=self.actor(hidden))
        if action is None:
            action = dist.sample()
        return action, dist.log_prob(action), dist.entropy(), self.critic(hidden).squeeze(-1)

    def greedy(self, obs):
        return self.actor(self.trunk(obs)).argmax(dim=-1)


# --- the steps of the loop


@torch.no_grad()
def env_rollout(agent: Agent, env: CapacityEnv, args: Args) -> tuple[dict, dict]:
    """num_steps steps of every environment -> (batch, metrics); batch: obs [T, N, D], the rest [T, N]."""
    steps, terms = [], []
    for _ in range(args.num_steps):
        obs = env.obs
        action, logprob, _, value = agent.get_action_and_value(obs)
        _, reward, terminated, truncated, info = env.step(action)
        done = terminated | truncated
        next_value = agent.get_value(env.obs)  # V(s_{t+1}); where an episode ended, V of the state it ended in
        if done.any():
            next_value[done] = agent.get_value(info["final_obs"][done])
        steps.append(dict(obs=obs, actions=action, logprobs=logprob, values=value, rewards=reward,
                          terminated=terminated.float(), dones=done.float(), next_values=next_value,
                          episode_return=info["episode_return"], episode_length=info["episode_length"]))
        terms.append(info["terms"])
    b = {k: torch.stack([step[k] for step in steps]) for k in steps[0]}
    stats = {"charts/mean_capacity": env.capacities[b["actions"]].mean().item(),
             **{f"rewards/{k}": torch.stack([t[k] for t in terms]).mean().item() for k in terms[0]},
             "rewards/total": b["rewards"].mean().item()}
    ended = b["dones"].bool()
    if ended.any():
        stats["charts/episodic_return"] = b["episode_return"][ended].mean().item()
        stats["charts/episodic_length"] = b["episode_length"][ended].mean().item()
    return b, stats


def update(agent: Agent, optimizer, batch: dict, args: Args) -> dict:
    """update_epochs passes of minibatch SGD over the batch ([T, N] flattened) -> metrics."""
    b = {k: v.flatten(0, 1) for k, v in batch.items()}
    clipfracs = []
    for epoch in range(args.update_epochs):
        for mb in torch.randperm(args.batch_size, device=args.device).split(args.batch_size // args.num_minibatches):
            _, logp, entropy, value = agent.get_action_and_value(b["obs"][mb], b["actions"][mb])
            adv = normalize_advantages(b["advantages"][mb]) if args.norm_adv else b["advantages"][mb]
            pg_loss, approx_kl, clip_frac = mean_clipped_policy_loss(logp, b["logprobs"][mb], adv, args.clip_coef)
            v_loss = unmasked_value_loss(value, b["values"][mb], b["returns"][mb], args.clip_coef, args.clip_vloss)
            entropy_loss = entropy.mean()
            loss = pg_loss - args.ent_coef * entropy_loss + args.vf_coef * v_loss  # Eq. 9 of arXiv:1707.06347
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
            optimizer.step()
            clipfracs.append(clip_frac.item())
        if args.target_kl is not None and approx_kl.item() > args.target_kl:
            break
    return {"charts/mean_value": b["values"].mean().item(), "charts/mean_return": b["returns"].mean().item(),
            "losses/value_loss": v_loss.item(), "losses/policy_loss": pg_loss.item(), "losses/epochs": epoch + 1,
            "losses/entropy": entropy_loss.item(), "losses/approx_kl": approx_kl.item(),
            "losses/clipfrac": sum(clipfracs) / len(clipfracs),
            "losses/explained_variance": unmasked_explained_variance(b["values"], b["returns"])}


# --- main


def main(args: Args) -> dict:
    args, run_dir, resume_state = start_run(args)
    threads = torch.get_num_threads()  # restored at the end, for callers that import main
    torch.set_num_threads(args.torch_threads)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic

    # 0. environments, agent, Adam; on --resume, their state from the checkpoint
    env = CapacityEnv(args, args.num_envs, args.seed, args.device)
    agent = Agent(env.obs_dim, len(args.capacities), args.hidden_size, args.head_size).to(args.device)
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)
    env.reset()
    global_step = restore_state(resume_state, agent, optimizer, env)
    eval_metrics = evaluate(args, agent, args.device)
    if args.resume is None:
        log_metrics(run_dir, {"step": 0, **eval_metrics}, args.track)
    start_time = time.time()
    start_step = global_step
    progress = tqdm(range(global_step // args.batch_size + 1, args.num_iterations + 1), desc="capacity_ppo", unit="it")
    state = capture_state(agent, optimizer, env, global_step)  # what Ctrl-C and SIGTERM save
    stop = 0
    previous = signal.signal(signal.SIGTERM, sigterm)
    try:
        for iteration in progress:
            if args.anneal_lr:
                optimizer.param_groups[0]["lr"] = (1.0 - (iteration - 1.0) / args.num_iterations) * args.learning_rate

            # 1. roll out the current policy in every environment for num_steps steps
            batch, rollout_stats = env_rollout(agent, env, args)
            global_step += args.batch_size

            # 2. advantages with GAE (Eq. 16 of arXiv:1506.02438), bootstrapping at truncation only
            batch["advantages"], batch["returns"] = compute_gae(
                batch["rewards"], batch["values"], batch["next_values"], batch["terminated"], batch["dones"],
                args.gamma, args.gae_lambda)

            # 3. update_epochs passes of minibatch SGD on the clipped objective (Eq. 9 of arXiv:1707.06347)
            update_stats = update(agent, optimizer, batch, args)

            # 4. log; evaluate and checkpoint when global_step passes a multiple of eval_every / save_every
            sps = int((global_step - start_step) / (time.time() - start_time))
            row = {"step": global_step, "charts/learning_rate": optimizer.param_groups[0]["lr"], "charts/SPS": sps,
                   **rollout_stats, **update_stats}
            if iteration == args.num_iterations or passed_multiple(global_step, args.eval_every, args):
                eval_metrics = evaluate(args, agent, args.device)
                row.update(eval_metrics)
                progress.set_postfix(eval_return=f"{eval_metrics['eval/return']:.2f}",
                                     gap_closed=f"{eval_metrics['eval/gap_closed']:.2f}")
            log_metrics(run_dir, row, args.track)
            state = capture_state(agent, optimizer, env, global_step)
            if passed_multiple(global_step, args.save_every, args) and iteration < args.num_iterations:
                save_checkpoint(run_dir, state, args)
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: the iteration's partial work is dropped
        stop = e.args[0] if e.args else signal.SIGINT
        print(f"\n{signal.Signals(stop).name}: saving the state at step {state['global_step']}")
    finally:
        progress.close()
        signal.signal(signal.SIGTERM, previous)
    return finish_run(run_dir, state, eval_metrics, args, threads, stop)


# ---- plumbing: evaluation, input checks, resume, run directory, metrics, W&B, checkpoints


@torch.no_grad()
def evaluate(args: Args, agent: Agent, device) -> dict:
    """Greedy agent, oracle, each fixed capacity and a uniform random policy on the same num_eval_envs episodes."""
    generator = torch.Generator(device=device).manual_seed(args.eval_seed + 1)
    shape = (args.num_eval_envs,)
    policies = {"": lambda env: agent.greedy(env.obs),  # keyed by the prefix of their eval/...return metric
                "oracle_": lambda env: oracle_actions(env.state["difficulty"], env.capacities, args),
                "random_": lambda env: torch.randint(len(args.capacities), shape, generator=generator, device=device),
                **{f"fixed_{c}_": lambda env, i=i: torch.full(shape, i, device=device)
                   for i, c in enumerate(args.capacities)}}
    m = {}
    for name, policy in policies.items():
        env = CapacityEnv(args, args.num_eval_envs, args.eval_seed, device)
        env.reset()
        alive = torch.ones(shape, dtype=torch.bool, device=device)
        total = used = switches = steps = 0
        for _ in range(args.max_episode_steps):  # one episode in each environment
            action = policy(env)
            switches += ((action != env.state["prev_action"]) & alive).sum()
            _, reward, terminated, truncated, info = env.step(action)
            total += reward * alive
            used += (info["capacity"] * alive).sum()
            steps += alive.sum()
            alive &= ~(terminated | truncated)
        m[f"eval/{name}return"] = total.mean().item()
        if name == "":  # the greedy policy's mean capacity and switches per step
            m["eval/mean_capacity"] = used.item() / steps.item()
            m["eval/switch_rate"] = switches.item() / steps.item()
    best = max(args.capacities, key=lambda c: m[f"eval/fixed_{c}_return"])
    m["eval/best_fixed_capacity"] = best
    fixed = m["eval/best_fixed_return"] = m[f"eval/fixed_{best}_return"]
    oracle = m["eval/oracle_return"]
    m["eval/gap_closed"] = (m["eval/return"] - fixed) / (oracle - fixed) if oracle != fixed else float("nan")
    rand = m["eval/random_return"]
    m["eval/oracle_advantage"] = (oracle - fixed) / (oracle - rand) if oracle != rand else float("nan")
    return m


def passed_multiple(global_step: int, every: int, args: Args) -> bool:
    """Did the last iteration pass a multiple of every? (never when every is 0)"""
    return every > 0 and global_step % every < args.batch_size


def check_args(args: Args) -> None:
    """Raise ValueError naming the bad flag and the fix, before any work is done."""
    for name in ("num_envs", "num_steps", "num_minibatches", "update_epochs", "max_episode_steps", "items_per_step",
                 "num_eval_envs"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(args, name)})")
    caps = list(args.capacities)
    batch = args.batch_size
    for failed, message in [
        (len(caps) < 2 or caps[0] <= 0 or caps != sorted(set(caps)),
         f"--capacities must list at least two positive integers in strictly increasing order (got {caps})"),
        (batch % args.num_minibatches, f"--num-minibatches {args.num_minibatches} does not divide the batch size "
         f"{batch} (--num-envs x --num-steps): pick one of {[d for d in range(2, 65) if batch % d == 0][:4]}"),
        (args.total_steps < batch, f"--total-steps {args.total_steps} is smaller than one rollout ({batch} steps)"),
        (not args.regime_means or min(args.regime_means) < 0 or max(args.regime_means) > 1,
         "--regime-means must be difficulties in [0, 1]"),
        (not 0 <= args.gamma <= 1 or not 0 <= args.gae_lambda <= 1, "--gamma and --gae-lambda must lie in [0, 1]"),
        (min(args.energy_budget, args.clip_coef, args.learning_rate) <= 0,
         "--energy-budget, --clip-coef and --learning-rate must be positive"),
        (args.target_kl is not None and args.target_kl <= 0, "--target-kl must be positive, or unset to disable it"),
        (min(args.eval_every, args.save_every) < 0, "--eval-every and --save-every must be >= 0 (0: only at the end)"),
        (args.resume and not (Path(args.resume) / "trainer_state.pt").is_file(),
         f"--resume {args.resume} is not a checkpoint: pass a runs/<run>/checkpoints/step_N folder"),
        (args.device.startswith("cuda") and not torch.cuda.is_available(), "no CUDA GPU here: use --device cpu"),
    ]:
        if failed:
            raise ValueError(message)


RESUME_MAY_CHANGE = ("total_steps", "eval_every", "save_every", "num_eval_envs", "track", "wandb_project_name",
                     "wandb_entity", "device", "torch_threads")


def saved_args(checkpoint) -> Args:
    saved = json.loads((Path(checkpoint) / "args.json").read_text())
    return Args(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()
                   if k in Args.__dataclass_fields__})


def start_run(args: Args) -> tuple[Args, Path, dict | None]:
    """Arguments (on --resume the run's own), checks, run directory, args.json, W&B -> (args, run_dir, state)."""
    state = None
    overrides = {}
    if args.resume and (Path(args.resume) / "args.json").is_file():
        given = args
        args = saved_args(given.resume)
        for name, new in vars(given).items():
            old = getattr(args, name)
            flag = "--" + name.replace("_", "-")
            if name in ("exp_name", "output_dir", "run_name", "resume") or new in (old, getattr(Args(), name)):
                continue
            if name not in RESUME_MAY_CHANGE:
                raise ValueError(f"{flag} {new} differs from the run's {old!r} and cannot change on resume, as it "
                                 "would change the algorithm: drop it, or start a new run")
            print(f"resume: {flag} {new} (the run had {old})")
            setattr(args, name, new)
            overrides[name] = [old, new]
        args.resume = given.resume
    check_args(args)
    if args.total_steps % args.batch_size:
        print(f"--total-steps {args.total_steps} is not a whole number of iterations of {args.batch_size} steps: "
              f"training {args.num_iterations * args.batch_size} steps")
    if args.resume is None:
        args.run_name = f"capacity__{args.exp_name}__{args.seed}__{int(time.time())}"
        run_dir = Path(args.output_dir) / args.run_name
        run_dir.mkdir(parents=True, exist_ok=True)
        record = asdict(args)
    else:  # args.json keeps the run's arguments and lists each resume's changes; later metrics are dropped
        run_dir = Path(args.resume).resolve().parent.parent
        args.run_name = run_dir.name
        record = json.loads((run_dir / "args.json").read_text())
        record.setdefault("resumed", []).append({"checkpoint": args.resume, "overrides": overrides})
        state = torch.load(Path(args.resume) / "trainer_state.pt", weights_only=False)
        state["agent"] = load_agent(args.resume, args.device).state_dict()
        print(f"resumed from step {state['global_step']} of {args.num_iterations * args.batch_size} ({args.resume})")
        metrics = run_dir / "metrics.jsonl"
        rows = metrics.read_text().splitlines()
        metrics.write_text("".join(f"{r}\n" for r in rows if json.loads(r)["step"] <= state["global_step"]))
    (run_dir / "args.json").write_text(json.dumps(record, indent=2))
    if args.track:
        import wandb

        wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, config=vars(args), name=args.run_name,
                   dir=str(run_dir), save_code=True)
    return args, run_dir, state


def log_metrics(run_dir: Path, row: dict, track: bool) -> None:
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    if track:
        import wandb

        wandb.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])


def capture_state(agent, optimizer, env, global_step: int) -> dict:
    """Copy of what a resumed run needs to continue exactly."""
    env_state = {"state": env.state, "obs": env.obs, "generator": env.generator.get_state()}
    return copy.deepcopy({"agent": agent.state_dict(), "optimizer": optimizer.state_dict(), "env": env_state,
                          "global_step": global_step, "torch_rng": torch.get_rng_state()})


def restore_state(state: dict | None, agent, optimizer, env) -> int:
    """Load capture_state's copy (None: a new run) -> its global step."""
    if state is None:
        return 0
    agent.load_state_dict(state["agent"])
    optimizer.load_state_dict(state["optimizer"])
    env.state = {k: v.to(env.device) for k, v in state["env"]["state"].items()}
    env.obs = state["env"]["obs"].to(env.device)
    env.generator.set_state(state["env"]["generator"])
    torch.set_rng_state(state["torch_rng"])
    return state["global_step"]


def save_checkpoint(run_dir: Path, state: dict, args: Args) -> Path:
    """Write checkpoints/step_{global_step}/ atomically: a temporary folder, then a rename."""
    final = run_dir / "checkpoints" / f"step_{state['global_step']}"
    tmp = final.parent / f".tmp_{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in state["agent"].items()}, tmp / "agent.safetensors")
    torch.save({k: v for k, v in state.items() if k != "agent"}, tmp / "trainer_state.pt")
    (tmp / "args.json").write_text(json.dumps(asdict(args), indent=2))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def load_agent(checkpoint, device="cpu") -> Agent:
    """Rebuild the agent of a checkpoint folder from its args.json and agent.safetensors."""
    args = saved_args(checkpoint)
    agent = Agent(args.workspace_dim + OBS_SCALARS, len(args.capacities), args.hidden_size, args.head_size)
    agent.load_state_dict(load_file(Path(checkpoint) / "agent.safetensors", device=str(device)))
    return agent.to(device)


def finish_run(run_dir: Path, state: dict, m: dict, args: Args, threads: int, stop: int) -> dict:
    """Final checkpoint, W&B closed, threads restored; the evaluation returns, then how to resume if stopped."""
    checkpoint = save_checkpoint(run_dir, state, args)
    if args.track:
        import wandb

        wandb.finish()
    torch.set_num_threads(threads)
    print("| policy | mean episode return |\n|---|---|")
    for name, key in [("learned (greedy)", ""), ("oracle", "oracle_"),
                      *((f"fixed n={c}", f"fixed_{c}_") for c in args.capacities), ("random", "random_")]:
        print(f"| {name} | {m[f'eval/{key}return']:.2f} |")
    print(f"\ngap closed: {m['eval/gap_closed']:.3f}, oracle advantage: {m['eval/oracle_advantage']:.3f}\n"
          f"run directory: {run_dir}\ncheckpoint: {checkpoint}")
    if stop:
        print(f"interrupted: saved {checkpoint}; continue with --resume {checkpoint}")
    return {**m, "step": state["global_step"], "run_dir": str(run_dir), "checkpoint": str(checkpoint),
            "interrupted": stop}


def sigterm(signum, frame):  # a cluster's preemption: stop as on Ctrl-C
    raise KeyboardInterrupt(signum)


def command_line(Args, main) -> None:
    """main(the flags); our ValueErrors in one line."""
    boxes = [(re.sub(r"\B(?=[A-Z])", "_", g.__name__).lower(), tyro.conf.OmitArgPrefixes[g]) for g in Args.__bases__]
    flags = asdict(tyro.cli(make_dataclass("Flags", boxes[::-1]), description=__doc__.split("\n\n")[0])).values()
    try:
        stop = main(Args(**{k: v for box in flags for k, v in box.items()}))["interrupted"]
        if stop > 1:  # Ctrl-C 130, SIGTERM 143 (True: a planned pause)
            sys.exit(128 + stop)
    except KeyboardInterrupt:
        print("\ninterrupted again: quit without saving", file=sys.stderr)
        sys.exit(130)
    except ValueError as e:
        if Path(inspect.trace()[-1].filename).resolve().parent != Path(__file__).resolve().parent:
            raise  # from a library: the traceback says where
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    command_line(Args, main)
