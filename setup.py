"""Package discovery for the design's layout.

Every component lives in a top-level folder (engine/, learner/, ...) but installs as a subpackage
of the one import name `agentrl`, so that installing the project cannot shadow (or be shadowed by)
distributions with generic names such as Hugging Face's `kernels`. The folders are mapped here;
the packages inside each are found by setuptools' own discovery, so a new subpackage (a folder
with an `__init__.py`) is in the wheel without a list to keep. tests/test_wheel.py builds the
wheel, installs it without -e and checks that it holds every module of the source tree.
"""

from setuptools import find_packages, setup

COMPONENTS = {
    "agentrl": "agentrl",
    "agentrl.engine": "engine",
    "agentrl.learner": "learner",
    "agentrl.kernels": "kernels",
    "agentrl.toolservers": "toolservers",
    "agentrl.gateway": "gateway",
}
"""Import name -> the folder that holds it."""


def discover() -> tuple[list[str], dict[str, str]]:
    packages: list[str] = []
    for name, folder in COMPONENTS.items():
        packages += [name, *(f"{name}.{sub}" for sub in find_packages(folder))]
    return packages, dict(COMPONENTS)


if __name__ == "__main__":  # setuptools runs this file as __main__; tests import COMPONENTS
    packages, package_dir = discover()
    setup(packages=packages, package_dir=package_dir)
