"""The TRL side of `benchmarks/vs_trl.py`: TRL's SFTTrainer cold start, then TRL's GRPOTrainer with
tool calling, on the task agentrl's `train` runs, for a wall-clock budget; greedy held-out EM before
and after. Runs inside `.venv-trl` (TRL, transformers, torch CPU, bm25s; no vLLM, no agentrl).

    .venv-trl/bin/python benchmarks/trl_side/grpo_tools.py --model-dir DIR --data DIR --minutes M --out DIR

`--data` is the folder vs_trl.py exports from agentrl (`export.json` lists its files): the passage
corpus, the system prompt and worked-example turns agentrl puts before every question, the
training questions in curriculum order, the gold SFT trajectories as agentrl's token ids and action
masks, the held-out questions, and the recipe numbers (group size, learning rates, trainable layers,
turn and token limits, reward values and schedule).

What is the same as agentrl's side: model weights, trainable parameters (top k decoder layers and
the final norm; the tied embedding frozen), prompt text (system prompt, example turns, question),
Hermes tool-call format, the search service's BM25 (bm25s, same tokenizer, k1, b, text layout and
result formatting), answer extraction and EM (agentrl's own parser and metrics, loaded by path),
process reward values and the process-to-task reward schedule, group size, learning rates and
warm-up, clip epsilons (0.2 / 0.28), no KL, token-mean loss, group-normalised advantages,
temperature 1.0, bf16 autocast over fp32 weights, SFT steps and tokens per step.

What differs because TRL's API decides it (docs/notes/vs-trl.md lists them with their effect):
- Generation runs in-process with transformers `generate` (vLLM is not installed in this venv, so
  `use_vllm=False`: that is TRL on this machine), synchronously with training.
- TRL's tool loop continues while the completion parses as tool calls; a turn with a malformed call
  or with plain text ends the episode (agentrl shows an error message and lets the model retry).
  The process terms are still charged here from the text.
- Turn and token limits: TRL bounds the whole multi-turn completion (`max_completion_length`), and
  the number of tool rounds (`max_tool_calling_iterations` = max_turns - 1); agentrl bounds each
  turn (`max_action_tokens`) and the number of turns.
- Reward granularity: one scalar per completion (TRL's reward-function API): process weight x the
  sum of process terms + task weight x EM, which equals agentrl's `RewardSchedule.episode_reward`.
- The curriculum follows the dataset order (1-hop questions first, for as many optimizer steps as
  agentrl's stage lasts), since TRL has no learner-version signal.

Prints one JSON line last: episodes, optimizer steps, time split, EM before/after, versions.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import agentrl_text as A  # noqa: E402  (after the path insert: this folder is not a package)

# Hermes-style ChatML. Tool results are wrapped in <tool_response> exactly as agentrl's ToolEnv
# wraps them; tool schemas are not rendered here because the system message (agentrl's own system
# prompt text) already lists the tool, so both sides see the same prompt text.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{{- '<|im_start|>tool\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') }}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{{- '<tool_call>' + ({'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson) + '</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# transformers' response parser for the same format (calls are `<tool_call>{json}</tool_call>`).
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}

# A turn boundary inside a decoded multi-turn completion: the tool message(s), then the next assistant head.
_TOOL_GAP = re.compile(r"<\|im_start\|>tool\n.*?<\|im_start\|>assistant\n", re.DOTALL)


def split_turns(completion_text: str) -> list[str]:
    """The assistant turns of a decoded TRL completion (special tokens kept), each without its `<|im_end|>`."""
    return [turn.split("<|im_end|>")[0] for turn in _TOOL_GAP.split(completion_text)]


# ---------------------------------------------------------------- search (the search service's BM25)


class Search:
    """bm25s over the corpus with the settings of agentrl's search service (toolservers/search.py):
    English stopwords, no stemmer, "title\\ntext" per passage, k1 1.5, b 0.75, hits with score <= 0 dropped."""

    def __init__(self, passages: list[dict]):
        import bm25s
        from bm25s.tokenization import Tokenizer

        self.passages = passages
        self.tokenizer = Tokenizer(stopwords="en", stemmer=None)
        ids = self.tokenizer.tokenize([f"{p['title']}\n{p['text']}" for p in passages], return_as="ids", show_progress=False)
        self.retriever = bm25s.BM25(k1=1.5, b=0.75)
        self.retriever.index(ids, show_progress=False)

    def __call__(self, query: str, top_k: int = 3) -> list[dict]:
        top_k = min(top_k, len(self.passages))
        ids = self.tokenizer.tokenize([query], update_vocab=False, return_as="ids", show_progress=False)
        docs, scores = self.retriever.retrieve(ids, k=top_k, show_progress=False)
        hits = []
        for idx, score in zip(docs[0], scores[0], strict=True):
            if score <= 0:
                break
            hits.append(self.passages[int(idx)])
        return hits


def make_search_tool(search: Search):
    def search_tool(query: str, top_k: int = 3) -> str:
        """Search the passage corpus with BM25 and return the top matching passages.

        Args:
            query: Keywords or a question.
            top_k: How many passages to return (default 3).
        """
        problem = A.search_arguments_error({"query": query, "top_k": top_k})
        if problem is not None:
            raise ValueError(problem)
        return A.format_passages(search(query, top_k))

    search_tool.__name__ = "search"
    return search_tool


# ---------------------------------------------------------------- model and data


def load_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load_model(model_dir: str, train_layers: int):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.response_template = RESPONSE_TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for p in model.parameters():
        p.requires_grad_(False)
    layers = model.model.layers
    for layer in list(layers)[len(layers) - train_layers:] if train_layers else []:
        for p in layer.parameters():
            p.requires_grad_(True)
    for p in model.model.norm.parameters():
        p.requires_grad_(True)
    num_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return model, tokenizer, num_trainable


def prompt_messages(prefix: list[dict], question: str) -> list[dict]:
    return [*prefix, {"role": "user", "content": f"Question: {question}"}]


# ---------------------------------------------------------------- evaluation (greedy, agentrl's env rules)


def evaluate(model, tokenizer, prefix: list[dict], tasks: list[dict], search: Search, env: dict, batch_size: int) -> dict:
    """Greedy held-out EM: up to `max_turns` turns of at most `max_action_tokens` tokens each, the
    action cut at agentrl's cut point, answers and tool calls parsed by agentrl's parser, tool
    results and error messages in agentrl's words."""
    import copy

    import torch

    t0 = time.perf_counter()
    # A bf16 copy, as agentrl's vLLM server serves bf16: decoding is bound by reading the weights
    # (540 MB per step in fp32), and autocast would re-cast every weight at every step.
    model = copy.deepcopy(model).to(torch.bfloat16).eval()
    tokenizer.padding_side = "left"
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ems, f1s, valid_calls = [], [], 0
    for start in range(0, len(tasks), batch_size):
        batch = tasks[start:start + batch_size]
        texts = [tokenizer.apply_chat_template(prompt_messages(prefix, t["question"]), tokenize=False, add_generation_prompt=True)
                 for t in batch]
        states: list[dict] = [{} for _ in batch]
        answers: list[str | None] = [None] * len(batch)
        live = list(range(len(batch)))
        for _turn in range(env["max_turns"]):
            if not live:
                break
            enc = tokenizer([texts[i] for i in live], return_tensors="pt", padding=True, add_special_tokens=False)
            room = env["max_total_tokens"] - enc["input_ids"].shape[1]
            if room < env["min_action_tokens"]:
                break
            t_turn = time.perf_counter()
            with torch.no_grad():
                out = model.generate(**enc, max_new_tokens=min(env["max_action_tokens"], room), do_sample=False,
                                     eos_token_id=im_end, pad_token_id=tokenizer.pad_token_id)
            gen = out[:, enc["input_ids"].shape[1]:]
            still = []
            for row, i in enumerate(live):
                ids = gen[row].tolist()
                stopped = im_end in ids
                text = tokenizer.decode(ids[: ids.index(im_end)] if stopped else ids, skip_special_tokens=True)
                text = text[: A.PARSER.cut_point(text)]
                parsed = A.PARSER.parse(text)
                if parsed.answer is not None:
                    answers[i] = parsed.answer
                    continue
                valid_calls += sum(c.name == "search" and A.search_arguments_error(c.arguments) is None for c in parsed.calls)
                obs = A.observation_text(parsed, search, states[i], max_calls_per_turn=env["max_calls_per_turn"],
                                         max_calls_per_episode=env["max_calls_per_episode"])
                texts[i] += f"{text}<|im_end|>\n<|im_start|>tool\n{obs}<|im_end|>\n<|im_start|>assistant\n"
                still.append(i)
            print(f"[trl eval] questions {start}..{start + len(batch)} turn {_turn + 1}: {len(live)} generated in "
                  f"{time.perf_counter() - t_turn:.0f} s, {len(still)} go on", flush=True)
            live = still
        for task, answer in zip(batch, answers, strict=True):
            ems.append(A.metrics.exact_match(answer, task["answers"]) if answer is not None else 0.0)
            f1s.append(A.metrics.f1_score(answer, task["answers"]) if answer is not None else 0.0)
    del model
    n = max(len(tasks), 1)
    return {"em": sum(ems) / n, "f1": sum(f1s) / n, "n": len(tasks), "valid_calls_per_episode": valid_calls / n,
            "eval_s": round(time.perf_counter() - t0, 1)}


# ---------------------------------------------------------------- training


def budget_callback(deadline: float):
    """Stops a trainer at a step boundary when the next step (as long as the last one) would end past `deadline`."""
    from transformers import TrainerCallback

    class Budget(TrainerCallback):
        def __init__(self):
            self.last = time.monotonic()
            self.stopped_by_budget = False

        def on_step_end(self, args, state, control, **kwargs):
            now = time.monotonic()
            step_s, self.last = now - self.last, now
            if now + step_s > deadline:
                control.should_training_stop = True
                self.stopped_by_budget = True
            return control

    return Budget()


def run_sft(model, tokenizer, gold: list[dict], recipe: dict, out: Path, deadline: float) -> dict:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    mean_len = sum(len(g["token_ids"]) for g in gold) / len(gold)
    batch_size = max(1, round(recipe["sft_tokens_per_step"] / mean_len))
    data = Dataset.from_list([{"input_ids": g["token_ids"], "assistant_masks": g["is_action"]} for g in gold])
    args = SFTConfig(
        output_dir=str(out / "sft"), max_steps=recipe["sft_steps"], per_device_train_batch_size=batch_size,
        learning_rate=recipe["sft_lr"], lr_scheduler_type="constant_with_warmup", warmup_steps=recipe["sft_warmup_steps"],
        weight_decay=0.0, max_grad_norm=recipe["grad_clip"], bf16=True, use_cpu=True, logging_steps=1, save_strategy="no",
        report_to=[], max_length=None, packing=False, dataloader_num_workers=0, seed=recipe["seed"],
        gradient_checkpointing=False,  # TRL's default is on; memory is no concern at 135M and recompute costs time
    )
    budget = budget_callback(deadline)
    trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer, callbacks=[budget])
    t0 = time.perf_counter()
    trainer.train()
    return {"sft_steps": trainer.state.global_step, "sft_batch_size": batch_size, "sft_s": round(time.perf_counter() - t0, 1),
            "sft_stopped_by_budget": budget.stopped_by_budget}


def run_grpo(model, tokenizer, prefix: list[dict], train: list[dict], search: Search, recipe: dict, env: dict, out: Path,
             deadline: float) -> dict:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    values = A.ProcessValues(**recipe["process_values"])
    schedule = recipe["reward_schedule"]
    counts = {"episodes": 0, "em_sum": 0.0, "valid_calls": 0}

    def schedule_weights(step: int) -> tuple[float, float]:
        frac = 1.0 if schedule["num_steps"] == 0 else min(max(step / schedule["num_steps"], 0.0), 1.0)
        return (schedule["process_start"] + frac * (schedule["process_end"] - schedule["process_start"]),
                schedule["task_start"] + frac * (schedule["task_end"] - schedule["task_start"]))

    def agentrl_reward(prompts, completions, completion_ids, answers, trainer_state=None, **kwargs):
        w_process, w_task = schedule_weights(trainer_state.global_step if trainer_state is not None else 0)
        rewards = []
        for ids, gold in zip(completion_ids, answers, strict=True):
            turns = split_turns(tokenizer.decode(ids, skip_special_tokens=False))
            score = A.score_turns(turns, gold, values, max_calls_per_turn=env["max_calls_per_turn"],
                                  max_calls_per_episode=env["max_calls_per_episode"])
            counts["episodes"] += 1
            counts["em_sum"] += score.em
            counts["valid_calls"] += score.num_valid_calls
            rewards.append(w_process * score.process_total + w_task * score.em)
        return rewards

    group = recipe["group_size"]
    data = Dataset.from_list([{"prompt": prompt_messages(prefix, t["question"]), "answers": t["answers"]} for t in train])
    # The whole multi-turn completion: max_turns actions of max_action_tokens plus (max_turns - 1) tool
    # messages of about 110 tokens (3 synthetic passages, ~90 tokens, and the wrappers).
    max_completion = env["max_turns"] * env["max_action_tokens"] + (env["max_turns"] - 1) * 112
    args = GRPOConfig(
        output_dir=str(out / "grpo"), max_steps=10**6, per_device_train_batch_size=group * recipe["prompts_per_step"],
        num_generations=group, gradient_accumulation_steps=1, learning_rate=recipe["rl_lr"],
        lr_scheduler_type="constant_with_warmup", warmup_steps=recipe["rl_warmup_steps"], weight_decay=0.0,
        max_grad_norm=recipe["grad_clip"], bf16=True, use_cpu=True, temperature=recipe["temperature"], top_p=1.0,
        max_completion_length=max_completion, max_tool_calling_iterations=env["max_turns"] - 1,
        epsilon=recipe["eps_low"], epsilon_high=recipe["eps_high"], beta=0.0, loss_type="dapo",
        scale_rewards="group" if recipe.get("std_normalise", True) else "none",
        shuffle_dataset=False, logging_steps=1, save_strategy="no", report_to=[], dataloader_num_workers=0, seed=recipe["seed"],
        gradient_checkpointing=False,  # as in the SFT phase (and agentrl's learner)
    )
    budget = budget_callback(deadline)
    trainer = GRPOTrainer(model=model, reward_funcs=[agentrl_reward], args=args, train_dataset=data, processing_class=tokenizer,
                          tools=[make_search_tool(search)], callbacks=[budget])
    t0 = time.perf_counter()
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    with open(out / "grpo_log.jsonl", "w") as f:
        for h in trainer.state.log_history:
            f.write(json.dumps(h) + "\n")
    return {"rl_steps": trainer.state.global_step, "rl_s": round(time.perf_counter() - t0, 1), "episodes": counts["episodes"],
            "train_em": counts["em_sum"] / max(counts["episodes"], 1),
            "valid_calls_per_episode": counts["valid_calls"] / max(counts["episodes"], 1),
            "last_reward": logs[-1]["reward"] if logs else None, "rl_stopped_by_budget": budget.stopped_by_budget,
            "max_completion_length": max_completion}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", required=True, help="HF folder of the initial policy (agentrl prepare-model)")
    parser.add_argument("--data", required=True, help="folder exported by benchmarks/vs_trl.py")
    parser.add_argument("--minutes", type=float, required=True, help="wall-clock budget of SFT + GRPO, minutes")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--eval-batch-size", type=int, default=16, help="held-out questions generated together")
    args = parser.parse_args(argv)
    if args.minutes <= 0:
        parser.error("--minutes must be > 0")

    import torch
    import transformers
    import trl

    data_dir, out = Path(args.data), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    spec = json.loads((data_dir / "export.json").read_text())
    recipe, env, prefix = spec["recipe"], spec["env"], spec["prompt_prefix"]
    search = Search(load_jsonl(data_dir / spec["files"]["corpus"]))
    train = load_jsonl(data_dir / spec["files"]["train"])
    heldout = load_jsonl(data_dir / spec["files"]["heldout"])
    gold = load_jsonl(data_dir / spec["files"]["gold"])
    torch.manual_seed(recipe["seed"])
    model, tokenizer, num_trainable = load_model(args.model_dir, recipe["train_layers"])
    print(f"[trl] {num_trainable} trainable parameters; held-out evaluation of the untrained model ...", flush=True)
    before = evaluate(model, tokenizer, prefix, heldout, search, env, args.eval_batch_size)
    print(f"[trl] EM before {before['em']:.3f} ({before['eval_s']} s)", flush=True)

    t_start = time.monotonic()
    deadline = t_start + args.minutes * 60
    sft = run_sft(model, tokenizer, gold, recipe, out, deadline) if recipe["sft_enabled"] else {}
    print(f"[trl] SFT done: {sft}", flush=True)
    rl = run_grpo(model, tokenizer, prefix, train, search, recipe, env, out, deadline) if time.monotonic() < deadline else {
        "rl_steps": 0, "episodes": 0}
    train_s = time.monotonic() - t_start
    print(f"[trl] GRPO done: {rl}", flush=True)
    after = evaluate(model, tokenizer, prefix, heldout, search, env, args.eval_batch_size)
    print(f"[trl] EM after {after['em']:.3f} ({after['eval_s']} s)", flush=True)
    result = {
        "em_before": round(before["em"], 4), "em_after": round(after["em"], 4),
        "f1_before": round(before["f1"], 4), "f1_after": round(after["f1"], 4),
        "valid_calls_before": round(before["valid_calls_per_episode"], 3), "valid_calls_after": round(after["valid_calls_per_episode"], 3),
        "episodes": rl.get("episodes", 0), "optimizer_steps": rl.get("rl_steps", 0), "train_s": round(train_s, 1),
        "budget_s": args.minutes * 60, "num_trainable_params": num_trainable,
        **{k: v for k, v in {**sft, **rl}.items() if k not in ("episodes", "rl_steps")},
        "trl_version": trl.__version__, "transformers_version": transformers.__version__, "torch_version": torch.__version__,
        "python": platform.python_version(), "torch_threads": torch.get_num_threads(), "pid": os.getpid(),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
