"""The layout's import rules (docs/ARCHITECTURE.md), checked on the source: every `import` and
`from ... import` in every module, lazy ones inside functions included.

- agentrl.common imports no other agentrl package; agentrl.kernels only common (its config system);
- agentrl.toolservers imports only agentrl.common; agentrl.learner only common and kernels (never
  the orchestrator's package); agentrl.engine only common and toolservers; agentrl.gateway only common and engine;
- agentrl.envs (environment packages) imports only common, engine and toolservers, and no other
  component imports an environment package (the engine names them by string, as a user's);
- no component imports the applications at the package root (agentrl.train, agentrl.cli, ...);
- no cycle between modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"agentrl": ROOT / "agentrl", "agentrl.engine": ROOT / "engine", "agentrl.learner": ROOT / "learner",
           "agentrl.kernels": ROOT / "kernels", "agentrl.toolservers": ROOT / "toolservers",
           "agentrl.gateway": ROOT / "gateway"}
COMPONENTS = ("agentrl.common", "agentrl.engine", "agentrl.learner", "agentrl.kernels", "agentrl.toolservers",
              "agentrl.gateway", "agentrl.envs")
ALLOWED = {
    "agentrl.common": set(),
    "agentrl.kernels": {"agentrl.common"},
    "agentrl.toolservers": {"agentrl.common"},
    "agentrl.learner": {"agentrl.common", "agentrl.kernels"},
    "agentrl.engine": {"agentrl.common", "agentrl.toolservers"},
    "agentrl.gateway": {"agentrl.common", "agentrl.engine"},
    "agentrl.envs": {"agentrl.common", "agentrl.engine", "agentrl.toolservers"},
}


def _modules() -> dict[str, Path]:
    out = {}
    for package, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([package, *parts]) if parts else package
            if package == "agentrl" and parts and parts[0] in ("configs", "templates"):  # data, not modules
                continue
            out[name] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    found = set()
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {m for m in found if m.startswith("agentrl")}


def _component(module: str) -> str:
    for comp in COMPONENTS:
        if module == comp or module.startswith(comp + "."):
            return comp
    return "agentrl (application)"


GRAPH = {name: {m for m in _imports(name, path) if m in MODULES and m != name} for name, path in MODULES.items()}


@pytest.mark.parametrize("component", COMPONENTS)
def test_components_import_only_what_they_may(component):
    bad = []
    for name, path in MODULES.items():
        if _component(name) != component:
            continue
        for imported in _imports(name, path):
            target = _component(imported)
            if imported == "agentrl":
                continue
            if target != component and target not in ALLOWED[component]:
                bad.append(f"{path.relative_to(ROOT)} imports {imported}")
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(GRAPH):
        if node not in state:
            visit(node, [])
    assert not cycles, "\n".join(cycles)


def test_the_rules_see_the_packages():
    """The checks above would pass vacuously if the module map were empty or wrong."""
    assert {"agentrl.learner.service", "agentrl.engine.orchestrator", "agentrl.common.trajectory",
            "agentrl.kernels.policy_loss", "agentrl.toolservers.server", "agentrl.train"} <= set(MODULES)
    assert "agentrl.common.trajectory" in GRAPH["agentrl.learner.service"]


def test_each_folder_says_what_lives_there_and_what_it_may_import():
    for package in (*COMPONENTS, "agentrl"):
        doc = ast.get_docstring(ast.parse(MODULES[package].read_text())) or ""
        assert "import" in doc.lower(), f"{package}/__init__.py does not state its import rule"


HEAVY = ("torch", "transformers", "vllm")
_CLI_MODULES = """
import sys
from agentrl.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exit:  # argparse's --help
    code = exit.code
print("LOADED", sorted(m for m in {heavy!r} if m in sys.modules), "EXIT", code)
"""


@pytest.mark.parametrize("argv", [["train", "--help"], ["train", "--print-config"],
                                  ["train", "--print-config", "--set", "learner.trainer.optimizer.lr=-1"]],
                         ids=["help", "print-config", "config-error"])
def test_reading_a_run_config_imports_no_training_stack(argv):
    """`agentrl train --help`, `--print-config` and a config error answer without importing torch,
    transformers or vLLM: the config tree (runconfig -> learner/config -> trainer_config ->
    kernels/policy_loss_config) is plain data."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _CLI_MODULES.format(heavy=HEAVY), *argv], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    last = [line for line in out.stdout.splitlines() if line.startswith("LOADED")]
    assert last, out.stdout[-2000:] + out.stderr[-2000:]
    assert last[-1].startswith("LOADED []"), last[-1]
    if argv[-1].endswith("=-1"):  # the bad value is refused, with its key
        assert not last[-1].endswith("EXIT 0") and "optimizer.lr" in out.stderr + out.stdout
