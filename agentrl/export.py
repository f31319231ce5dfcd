"""`agentrl export RUN_DIR [--step N] --out DIR`: a run's policy as a Hugging Face model folder.

The folder holds what `transformers`' `AutoModelForCausalLM.from_pretrained`, `vllm serve` /
`agentrl serve-model --model DIR` and `agentrl eval --model DIR` need, and what a person needs to
use the policy the way it was trained:

    config.json, model.safetensors      the base model's architecture with the trained weights
                                        (float32: the learner's master weights, exactly)
    tokenizer files, chat template      the base tokenizer; the template renders ChatML and, when a
                                        conversation has no system message, puts in the system
                                        prompt and worked example the policy was trained with
    agentrl/prompt.json                 that system prompt, the tool schemas it lists, the worked
                                        example turns and the user prefix ("Question: ")
    agentrl/config.toml                 the run's resolved config (`agentrl eval --model DIR` uses it)
    agentrl/export.json                 run directory, phase, step / policy version, base model
    README.md                           all of the above in prose, with the run's held-out scores

Which weights: the latest checkpoint of the RL phase (or `--step N`), else of the SFT phase. The
checkpoint's policy state is the learner's `PackedPolicy` (keys under `lm.`, plus a value head
when GAE trained one, which is not part of the policy and is dropped).

A run that trained LoRA adapters (`[learner.trainer.lora]`, learner/lora.py) exports the base
weights with the adapter merged in (weight + alpha / rank x B @ A), the same folder as above; with
`--adapter` it writes the `peft` adapter folder instead (adapter_config.json naming the base model,
adapter_model.safetensors in float32, plus the tokenizer, agentrl/ and README.md), which
`PeftModel.from_pretrained(base, DIR)` and `vllm serve BASE --enable-lora --lora-modules NAME=DIR` load.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

PROMPT_FILE = "prompt.json"
"""Written by the supervisor at the start of a run: what the policy sees before the task."""


def _checkpoint(run: Path, step: int | None) -> tuple[str, Path]:
    from agentrl.learner.checkpoint import CHECKPOINT_PREFIX, checkpoint_dirs

    for phase in ("rl", "sft"):
        dirs = checkpoint_dirs(run / phase / "checkpoints")
        if step is not None:
            dirs = [d for d in dirs if d.name == f"{CHECKPOINT_PREFIX}{step:08d}"]
        if dirs:
            return phase, dirs[-1]
    where = f"step {step}" if step is not None else "any checkpoint"
    raise FileNotFoundError(f"{run} holds no {where} under rl/checkpoints or sft/checkpoints")


def chat_template(prompt: dict) -> str:
    """ChatML; a conversation without a system message gets the trained system prompt and worked
    example first, so `apply_chat_template([{"role": "user", "content": "Question: ..."}])` renders
    exactly what the policy saw in training."""
    preamble = f"<|im_start|>system\n{prompt['system_prompt']}<|im_end|>\n" + "".join(
        f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in prompt["example_messages"])
    return ("{%- if messages[0]['role'] != 'system' %}{% raw %}" + preamble + "{% endraw %}{%- endif %}"
            "{%- for message in messages %}"
            "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
            "{%- endfor %}"
            "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")


def _readme(prompt: dict, info: dict, scores: dict) -> str:
    tools = "\n".join(f"- `{s['function']['name']}`: {s['function'].get('description', '')}" for s in prompt["tools"])
    example = "\n".join(f"    {role}: {content}" for role, content in prompt["example_messages"]) or "    (none)"
    score_lines = "\n".join(f"- {k}: {v}" for k, v in scores.items()) or "- (no evaluation recorded)"
    load = ('from transformers import AutoModelForCausalLM, AutoTokenizer\n'
            'tok = AutoTokenizer.from_pretrained("THIS_FOLDER")\n'
            'model = AutoModelForCausalLM.from_pretrained("THIS_FOLDER")')
    serve = ("Serve it with `agentrl serve-model --model THIS_FOLDER` (or `vllm serve`);\nevaluate it with "
             "`agentrl eval --model THIS_FOLDER` (it uses `agentrl/config.toml`, the run's config).")
    if info.get("contents") == "adapter":  # a peft adapter folder over the base model
        serve = (f"Serve it with `vllm serve {info['base_model']} --enable-lora --max-lora-rank R --lora-modules "
                 "policy=THIS_FOLDER`\n(R: the adapter's rank or more), requests naming the model `policy`; "
                 "`agentrl export` without\n--adapter writes the merged model, which `agentrl eval --model` takes.")
        load = ('from peft import PeftModel\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n'
                'tok = AutoTokenizer.from_pretrained("THIS_FOLDER")\n'
                f'model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("{info["base_model"]}"), "THIS_FOLDER")')
    return f"""# agentrl policy: {info['run']} ({info['phase']} step {info['step']})

Trained with agentrl from `{info['base_model']}`. Policy version {info['step']}
(optimizer steps, SFT included).

## Use it

```python
{load}
inputs = tok.apply_chat_template([{{"role": "user", "content": "{prompt['user_prefix']}..."}}], add_generation_prompt=True,
                                return_dict=True, return_tensors="pt")
out = model.generate(**inputs, max_new_tokens=96, do_sample=False)
print(tok.decode(out[0, inputs["input_ids"].shape[1]:]))
```

The chat template adds the system prompt and worked example below when the conversation has no
system message. {serve}

Tool calls are `<tool_call>{{"name": ..., "arguments": {{...}}}}</tool_call>`; tool results come back
in a `tool` turn as `<tool_response>...</tool_response>`; the final answer is `<answer>...</answer>`.

## Tools it was trained with

{tools}

## System prompt

```
{prompt['system_prompt']}
```

## Worked example (turns after the system message)

{example}

## Held-out scores of the run

{score_lines}
"""


def _lora_split(config: dict, weights: dict, ckpt: Path, num_layers: int):
    """(base weights, adapter, LoraConfig, adapter layers) of a LoRA checkpoint's weights, or None
    for full weights; ValueError when the checkpoint and the run's config disagree."""
    from agentrl.common.config import build
    from agentrl.learner.lora import adapter_tensors, base_weights, is_lora_state, lora_layer_indices
    from agentrl.learner.trainer_config import TrainerConfig

    trainer = build(TrainerConfig, config.get("learner", {}).get("trainer", {}), prefix=("learner", "trainer"))
    if not is_lora_state(weights):
        if trainer.lora.enabled:
            raise ValueError(f"{ckpt} holds full weights, but the run's config has learner.trainer.lora.rank = {trainer.lora.rank}")
        return None
    if not trainer.lora.enabled:
        raise ValueError(f"{ckpt} holds LoRA adapters, but the run's config has learner.trainer.lora.rank = 0")
    return (base_weights(weights), adapter_tensors(weights), trainer.lora,
            lora_layer_indices(num_layers, trainer.train_layers))


def export(run: Path, out: Path, step: int | None = None, *, adapter: bool = False) -> Path:
    """Write the HF folder for `run` at `out` (atomically: built beside it, renamed into place);
    `adapter`: the peft adapter folder of a LoRA run instead (module docstring)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.common.config import read_toml
    from agentrl.common.files import read_jsonl
    from agentrl.common.model import resolve_model
    from agentrl.learner.checkpoint import policy_weights

    prompt_path = run / PROMPT_FILE
    if not prompt_path.is_file():
        raise FileNotFoundError(f"{run} has no {PROMPT_FILE} (written when a run starts); is it an agentrl train run?")
    prompt = json.loads(prompt_path.read_text())
    config = read_toml(run / "config.toml")
    phase, ckpt = _checkpoint(run, step)
    state = torch.load(ckpt / "state.pt", weights_only=False, map_location="cpu")
    base = resolve_model(config.get("model_dir") or None)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    weights = {k.removeprefix("lm."): v for k, v in policy_weights(state).items()}
    lora = _lora_split(config, weights, ckpt, model.config.num_hidden_layers)
    if adapter and lora is None:
        raise ValueError(f"--adapter: {run} trained the weights, not LoRA adapters (learner.trainer.lora.rank = 0); "
                         "export it without --adapter")
    if lora is not None:
        from agentrl.common.adapters import merge_adapter

        weights, adapter_state, lora_config, lora_layers = lora
        weights.update(merge_adapter(weights, adapter_state, lora_config.scaling))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - tied:
        raise ValueError(f"{ckpt} does not fit {base}: missing {sorted(set(missing) - tied)[:5]}, unexpected {unexpected[:5]}")
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.chat_template = chat_template(prompt)

    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        if adapter:
            from agentrl.learner.lora import write_adapter_folder

            write_adapter_folder(tmp, adapter_state, lora_config, lora_layers, str(base))
        else:
            model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        meta = tmp / "agentrl"
        meta.mkdir()
        (meta / PROMPT_FILE).write_text(json.dumps(prompt, indent=1))
        shutil.copy(run / "config.toml", meta / "config.toml")
        info = {"run": str(run.resolve()), "phase": phase, "checkpoint": ckpt.name, "step": int(state["step"]),
                "base_model": str(base), "contents": "adapter" if adapter else "merged" if lora is not None else "weights"}
        (meta / "export.json").write_text(json.dumps(info, indent=1))
        scores = {f"{e['label']} {e['score_metric']}": round(e['score'], 4) for e in read_jsonl(run / "evals.jsonl")}
        (tmp / "README.md").write_text(_readme(prompt, info, scores))
        tmp.chmod(0o755)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="agentrl export", description="Write a run's policy as a Hugging Face model folder.")
    parser.add_argument("run", type=Path, help="the run directory of agentrl train")
    parser.add_argument("--out", type=Path, required=True, help="the folder to write (replaced if it exists)")
    parser.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the latest)")
    parser.add_argument("--adapter", action="store_true",
                        help="a LoRA run: write the peft adapter folder (PeftModel.from_pretrained, vllm --lora-modules) "
                             "instead of the merged model")
    args = parser.parse_args(argv)
    try:
        path = export(args.run, args.out, args.step, adapter=args.adapter)
    except (FileNotFoundError, ValueError) as err:
        print(f"agentrl export: {err}", file=sys.stderr)
        return 2
    print(path)
    return 0
