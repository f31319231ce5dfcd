"""Function and class sizes of the package (an ast walk): `python scripts/code_sizes.py [ROOT]`."""

import ast
import pathlib
import statistics
import sys

PACKAGE_FOLDERS = ("agentrl", "engine", "learner", "kernels", "toolservers", "gateway")


def main() -> None:
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    funcs, classes = [], []
    for folder in PACKAGE_FOLDERS:
        for path in (root / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                size = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    funcs.append(size)
                elif isinstance(node, ast.ClassDef):
                    classes.append((size, f"{path.relative_to(root)}:{node.name}"))
    funcs.sort()
    print(f"functions {len(funcs)} median {statistics.median(funcs)} p90 {funcs[int(0.9 * len(funcs))]}")
    print("longest classes:", ", ".join(f"{name} {size}" for size, name in sorted(classes, reverse=True)[:8]))


if __name__ == "__main__":
    main()
