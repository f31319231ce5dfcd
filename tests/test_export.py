"""`agentrl export`: a run's checkpoint becomes a Hugging Face folder that transformers loads and
generates with, whose chat template renders the trained prompt, and that carries the run's config."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from agentrl.common.config import dump_toml
from agentrl.export import PROMPT_FILE, export
from agentrl.learner.checkpoint import save_checkpoint
from agentrl.runconfig import config_data, load_run_config

PROMPT = {
    "system_prompt": "You answer questions by searching a knowledge base.\n<tools>\nsearch(query: string): Search.\n</tools>",
    "example_messages": [["user", "Question: Which city?"], ["assistant", "<answer>Lorrowby</answer>"]],
    "tools": [{"type": "function", "function": {"name": "search", "description": "Search.", "parameters": {}}}],
    "user_prefix": "Question: ",
}


def _fake_run(tmp_path, model_dir, step: int = 7):
    """A run directory as `agentrl train` leaves it: resolved config, prompt, evals, an RL checkpoint
    of the PackedPolicy (keys under `lm.`, a value head) with one tensor changed."""
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(dump_toml(config_data(load_run_config().config)))
    (run / PROMPT_FILE).write_text(json.dumps(PROMPT))
    (run / "evals.jsonl").write_text(json.dumps({"label": "final", "score_metric": "correct", "score": 0.25, "n": 4}) + "\n")  # any environment: no em key
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    policy = {f"lm.{k}": v.clone() for k, v in model.state_dict().items()}
    policy["lm.model.norm.weight"] += 0.5
    policy["value_head.weight"] = torch.zeros(1, 576)
    save_checkpoint(run / "rl" / "checkpoints", step, {"policy": policy, "step": step}, keep=2)
    return run, policy


def test_export_loads_with_from_pretrained_and_generates(tmp_path, model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run, policy = _fake_run(tmp_path, model_dir)
    out = export(run, tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(model.model.norm.weight, policy["lm.model.norm.weight"])  # the trained weights, exactly
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    tok = AutoTokenizer.from_pretrained(out)
    text = tok.apply_chat_template([{"role": "user", "content": "Question: Who founded Velorix Labs?"}],
                                   add_generation_prompt=True, tokenize=False)
    # Without a system message the template puts in the trained prompt and worked example, in order.
    assert text.startswith("<|im_start|>system\n" + PROMPT["system_prompt"] + "<|im_end|>\n<|im_start|>user\nQuestion: Which city?")
    assert text.endswith("<|im_start|>user\nQuestion: Who founded Velorix Labs?<|im_end|>\n<|im_start|>assistant\n")
    own = tok.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}], tokenize=False)
    assert own == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
    ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
    generated = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert generated.shape[1] == ids.shape[1] + 5
    meta = json.loads((out / "agentrl" / "export.json").read_text())
    assert meta["phase"] == "rl" and meta["step"] == 7
    assert (out / "agentrl" / "config.toml").read_text() == (run / "config.toml").read_text()
    readme = (out / "README.md").read_text()
    assert PROMPT["system_prompt"] in readme and "final correct: 0.25" in readme
    # The README's snippet runs as written with the installed transformers (fewer tokens here).
    snippet = readme.split("```python\n", 1)[1].split("```", 1)[0].replace("THIS_FOLDER", str(out))
    run_snippet = subprocess.run([sys.executable, "-c", snippet.replace("max_new_tokens=96", "max_new_tokens=3")],
                                 capture_output=True, text=True, timeout=300)
    assert run_snippet.returncode == 0, run_snippet.stderr[-2000:]


def test_export_cli_names_what_is_missing(tmp_path, model_dir):
    run, _ = _fake_run(tmp_path, model_dir)
    cmd = [sys.executable, "-P", "-m", "agentrl.cli", "export", str(run), "--out", str(tmp_path / "hf")]
    missing_step = subprocess.run([*cmd, "--step", "99"], capture_output=True, text=True, timeout=300)
    assert missing_step.returncode == 2 and "holds no step 99" in missing_step.stderr
    (run / PROMPT_FILE).unlink()
    no_prompt = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert no_prompt.returncode == 2 and "prompt.json" in no_prompt.stderr
    assert not (tmp_path / "hf").exists()

