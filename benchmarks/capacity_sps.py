"""Environment steps per second of capacity_ppo.py's rollout: vectorised vs one environment at a time.

Vectorised: one CapacityEnv holding N environments; each step is one batched agent forward and one
batched env.step. Baseline (how the seed design stepped): N separate single-environment
CapacityEnv objects, and for every step a Python loop that runs the agent on one observation and
steps one environment. Both use the same agent and the same environment code, so the ratio is the
gain of batching alone. Rows "env only" step with random actions and no agent.

    python benchmarks/capacity_sps.py                      # table: medians over --repeats runs
    python benchmarks/capacity_sps.py --num-envs 64 --repeats 3
"""

import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import capacity_ppo as cp  # noqa: E402


@dataclass
class Args:
    num_envs: tuple[int, ...] = (16, 64, 256)
    """environment counts to measure"""
    steps: int = 64
    """rollout steps per measurement (the default rollout length of capacity_ppo.py)"""
    loop_steps: int = 16
    """rollout steps per measurement of the per-environment loop (it is slow)"""
    repeats: int = 5
    """measurements per row; the table shows the median"""
    threads: int = 1
    """torch CPU threads (capacity_ppo.py's default is 1)"""


def vectorised_sps(num_envs: int, steps: int, agent: cp.Agent | None) -> float:
    env = cp.CapacityEnv(cp.Args(), num_envs, seed=0)
    obs = env.reset()
    generator = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    with torch.no_grad():
        for _ in range(steps):
            if agent is None:
                action = torch.randint(0, 4, (num_envs,), generator=generator)
            else:
                action = agent.get_action_and_value(obs)[0]
            obs = env.step(action)[0]
    return num_envs * steps / (time.perf_counter() - start)


def per_env_loop_sps(num_envs: int, steps: int, agent: cp.Agent | None) -> float:
    envs = [cp.CapacityEnv(cp.Args(), 1, seed=i) for i in range(num_envs)]
    observations = [env.reset() for env in envs]
    generator = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    with torch.no_grad():
        for _ in range(steps):
            for i, env in enumerate(envs):
                if agent is None:
                    action = torch.randint(0, 4, (1,), generator=generator)
                else:
                    action = agent.get_action_and_value(observations[i])[0]
                observations[i] = env.step(action)[0]
    return num_envs * steps / (time.perf_counter() - start)


def median_of(fn, repeats: int) -> float:
    fn()  # warm-up
    return statistics.median(fn() for _ in range(repeats))


def main(args: Args) -> list[dict]:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    agent = cp.Agent(cp.Args().workspace_dim + cp.OBS_SCALARS, 4).eval()
    rows = []
    for label, policy in (("agent + env", agent), ("env only", None)):
        for n in args.num_envs:
            loop = median_of(lambda: per_env_loop_sps(n, args.loop_steps, policy), args.repeats)
            vec = median_of(lambda: vectorised_sps(n, args.steps, policy), args.repeats)
            rows.append({"rollout": label, "num_envs": n, "loop": loop, "vectorised": vec, "ratio": vec / loop})
    print(f"capacity_ppo rollout, env steps/s, median of {args.repeats} runs, torch threads={args.threads}\n")
    print("| rollout | num_envs | per-env loop (steps/s) | vectorised (steps/s) | speed-up |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['rollout']} | {r['num_envs']} | {r['loop']:,.0f} | {r['vectorised']:,.0f} | {r['ratio']:.1f}x |")
    return rows


if __name__ == "__main__":
    main(tyro.cli(Args))
