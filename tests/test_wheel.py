"""The package as a user without the source tree gets it: `pip wheel .`, installed without -e.

The wheel must hold every module of the source tree (setup.py finds the subpackages of each
component folder) and the package data (configs, the init-env templates). Installed into a fresh
virtual environment whose dependencies come from the project's venv by a plain path entry (so the
editable install's finder, a .pth file there, is never run) and run from a folder outside the
checkout, `agentrl train --help`, `agentrl init-env` and `agentrl check` on the folder it wrote
must work, and every module must import from the installed copy.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from setup import COMPONENTS  # noqa: E402  (the one map of folders to import names)

sys.path.remove(str(ROOT))


ENTRY_MODULES = ("agentrl.cli", "agentrl.train", "agentrl.phases.rl", "agentrl.engine.actor", "agentrl.learner.service",
                 "agentrl.toolservers.cli", "agentrl.gateway.server", "agentrl.evaluate", "agentrl.export")
"""What `agentrl train` runs in its own process and starts as the learner, actor and tool services."""


def _source_files() -> dict[str, Path]:
    """Installed path inside the wheel -> the tracked source file, for every module and data file
    of the component folders."""
    tracked = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", *COMPONENTS.values()], cwd=ROOT,
                             check=True, capture_output=True,
                             text=True).stdout.split()
    out = {}
    for name, folder in COMPONENTS.items():
        prefix = folder + "/"
        for rel in tracked:
            if rel.startswith(prefix):
                out[name.replace(".", "/") + "/" + rel[len(prefix):]] = ROOT / rel
    return out


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    """(the venv's bin folder, a working folder outside the checkout) with the wheel installed."""
    tmp = tmp_path_factory.mktemp("wheel")
    # Built from a copy of the tracked files (as a clean checkout has them): the build writes its
    # build/ and egg-info folders there, not into this checkout.
    source = tmp / "source"
    tracked = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout.split()
    for rel in tracked:
        if (ROOT / rel).is_file():
            (source / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, source / rel)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp / "dist"), str(source)], check=True, capture_output=True, text=True, timeout=300)
    (wheel,) = (tmp / "dist").glob("agentrl-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))
    # The dependencies (torch, vllm, ...) from the project's venv, as a plain sys.path entry: .pth
    # files there (the editable install's finder among them) are not processed.
    (site / "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--no-deps",
                    "--no-index", "-q", str(wheel)], check=True, capture_output=True, text=True, timeout=300)
    work = tmp / "elsewhere"
    work.mkdir()
    return venv / "bin", work, wheel


def _run(installed, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    bin_dir, work, _ = installed
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run(list(argv), cwd=work, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_wheel_holds_every_module_and_data_file_of_the_tree(installed):
    names = set(zipfile.ZipFile(installed[2]).namelist())
    missing = sorted(path for path in _source_files() if path not in names)
    assert not missing, f"the wheel lacks {missing}"
    assert "agentrl/phases/rl.py" in names and "agentrl/configs/cpu_default.toml" in names
    assert "agentrl/templates/view/episode.html" in names  # agentrl view's pages


@pytest.mark.slow
def test_an_installed_wheel_trains_from_outside_the_checkout(installed):
    bin_dir, work, _ = installed
    # Every module is found in the installed copy, never in the checkout, and the entry points of
    # every process a run starts import from there.
    modules = sorted({p[:-3].replace("/", ".").removesuffix(".__init__") for p in _source_files()
                      if p.endswith(".py") and "/templates/" not in p})
    probe = ("import importlib, importlib.util\n"
             f"mods = {modules!r}\n"
             "bad = [(m, importlib.util.find_spec(m).origin) for m in mods]\n"
             f"bad = [(m, f) for m, f in bad if not f.startswith({str(bin_dir.parent)!r})]\n"
             f"for m in {ENTRY_MODULES!r}:\n"
             "    importlib.import_module(m)\n"
             "print(len(mods), bad)\n")
    result = _run(installed, str(bin_dir / "python"), "-P", "-c", probe)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split(" ", 1) == [str(len(modules)), "[]\n"], result.stdout

    result = _run(installed, "agentrl", "train", "--help")
    assert result.returncode == 0 and "learner.trainer.optimizer.lr" in result.stdout, result.stderr[-2000:]
    result = _run(installed, "agentrl", "init-env", "my_env")
    assert result.returncode == 0, result.stderr[-2000:]
    result = _run(installed, "agentrl", "check", "--config", "my_env/config.toml")
    print(result.stdout)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "ready to train" in result.stdout
