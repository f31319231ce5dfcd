"""`agentrl init-env DIR`: write a working environment folder to start from.

DIR gets `environment.py` (a task loader and a `ToolEnv` with its prompt, reward and
demonstration), `tools.py` (a tool service of its own), `config.toml` (layered over the embedded
default, relative paths from DIR) and a README with the two commands, `agentrl check --config
DIR/config.toml` and `agentrl train --config DIR/config.toml`. It trains as written: the task is
a catalogue lookup that only the tool can answer. The files are templates in agentrl/templates/env/.
"""

from __future__ import annotations

import argparse
import string
import sys
from pathlib import Path

TEMPLATES = Path(__file__).parent / "templates" / "env"
FILES = ("environment.py", "tools.py", "config.toml", "README.md")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="agentrl init-env", description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", help="the folder to write (created; refused when it exists and is not empty)")
    args = parser.parse_args(argv)
    folder = Path(args.dir)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        print(f"agentrl init-env: {folder} exists and is not an empty folder; name a new folder", file=sys.stderr)
        return 2
    folder.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        text = (TEMPLATES / name).read_text()
        if name == "README.md":
            text = string.Template(text).substitute(name=folder.resolve().name, folder=args.dir.rstrip("/"))
        (folder / name).write_text(text)
    print(f"wrote {', '.join(FILES)} to {folder}\n"
          f"next:  agentrl check --config {folder / 'config.toml'}\n"
          f"then:  agentrl train --config {folder / 'config.toml'}")
    return 0
