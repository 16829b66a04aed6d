"""Setting up: ``make setup`` installs into a virtual environment (the active one, else ``.venv``, made first), and
CI (``.ci/run``) installs requirements.txt into a fresh one, so that a missing dependency fails there."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RECORD = '#!/bin/sh\necho "{name} $*" >> "$SETUP_LOG"\n'
# stands in for python3: `-c ...` (the Makefile's IN_VENV) exits $FAKE_IN_VENV; `-m venv DIR` makes DIR with an
# activate script that puts DIR/bin (a recording pip and python) first on PATH
FAKE_PYTHON3 = """#!/bin/sh
if [ "$1" = "-c" ]; then exit "$FAKE_IN_VENV"; fi
echo "python3 $*" >> "$SETUP_LOG"
mkdir -p "$3/bin"
printf 'export PATH="%s/bin:$PATH"\\n' "$3" > "$3/bin/activate"
for tool in pip python; do printf '#!/bin/sh\\necho "venv-%s $*" >> "$SETUP_LOG"\\n' "$tool" > "$3/bin/$tool"; done
chmod +x "$3/bin/pip" "$3/bin/python"
"""


def _make_setup(tmp_path: Path, in_venv: bool) -> tuple[subprocess.CompletedProcess, list[str]]:
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    for name, text in (
        ("python3", FAKE_PYTHON3),
        ("pip", RECORD.format(name="pip")),
        ("python", RECORD.format(name="python")),
    ):
        (fake / name).write_text(text)
        (fake / name).chmod(0o755)
    log = tmp_path / "log"
    env = {
        **os.environ,
        "PATH": f"{fake}:{os.environ['PATH']}",
        "SETUP_LOG": str(log),
        "FAKE_IN_VENV": "0" if in_venv else "1",
    }
    res = subprocess.run(
        ["make", "--no-print-directory", "setup", f"VENV={tmp_path / 'venv'}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return res, log.read_text().splitlines() if log.exists() else []


def test_make_setup_in_a_virtual_environment_installs_there(tmp_path):
    res, calls = _make_setup(tmp_path, in_venv=True)
    assert res.returncode == 0, res.stderr
    assert calls == ["pip install -r requirements.txt", "python train.py parallel=jit_sharding precision=bf16"]
    assert not (tmp_path / "venv").exists() and "virtual environment" not in res.stdout


def test_make_setup_outside_one_makes_dot_venv_and_installs_into_it(tmp_path):
    venv = tmp_path / "venv"
    res, calls = _make_setup(tmp_path, in_venv=False)
    assert res.returncode == 0, res.stderr
    assert calls == [
        f"python3 -m venv {venv}",
        "venv-pip install -r requirements.txt",
        "venv-python train.py parallel=jit_sharding precision=bf16",
    ]
    assert res.stdout.splitlines() == [
        f"make setup: no virtual environment is active: installing into {venv} "
        f"(activate it in each new shell: . {venv}/bin/activate)"
    ]
    (tmp_path / "log").unlink()  # a second time: the environment is reused, not made again
    res, calls = _make_setup(tmp_path, in_venv=False)
    assert res.returncode == 0, res.stderr
    assert calls == [
        "venv-pip install -r requirements.txt",
        "venv-python train.py parallel=jit_sharding precision=bf16",
    ]


def test_the_virtual_environment_check_tells_a_venv_from_the_base_interpreter(tmp_path):
    """The Makefile's IN_VENV (run by the real interpreters): 0 in a venv, 1 in the Python it was made from."""
    (command,) = re.findall(r"^IN_VENV = python3 (-c '.*')$", (REPO / "Makefile").read_text(), re.M)
    code = command[len("-c '") : -1]
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    base = subprocess.run([sys.executable, "-c", "import sys; print(sys.base_prefix)"], capture_output=True, text=True)
    base_python = Path(base.stdout.strip()) / "bin" / "python3"
    env = {k: v for k, v in os.environ.items() if k not in ("CONDA_PREFIX", "VIRTUAL_ENV")}
    assert subprocess.run([str(venv / "bin" / "python"), "-c", code], env=env).returncode == 0
    assert subprocess.run([str(base_python), "-c", code], env=env).returncode == 1
    assert subprocess.run([str(base_python), "-c", code], env={**env, "CONDA_PREFIX": "/opt/conda"}).returncode == 0


def test_ci_installs_into_a_fresh_virtual_environment_of_its_own():
    """.ci/run makes a virtual environment without the system's site-packages (which would hide a dependency
    requirements.txt lacks, as IPython was), installs requirements.txt into it and runs the linter and exactly the
    README's test command there."""
    script = (REPO / ".ci" / "run").read_text()
    lines = [line.strip() for line in script.splitlines() if line.strip() and not line.startswith("#")]
    assert "--system-site-packages" not in script and "--user" not in script
    make_venv = next(i for i, line in enumerate(lines) if re.fullmatch(r'python3 -m venv "\$work/venv"', line))
    activate = lines.index('. "$work/venv/bin/activate"')
    install = lines.index("python -m pip install -q --disable-pip-version-check -r requirements.txt")
    test = 'python -m pytest -q -m "not slow"'
    assert make_venv < activate < install < lines.index("make lint") < lines.index(test) == len(lines) - 1
    assert f"\n{test}\n" in (REPO / "README.md").read_text()


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@pytest.mark.unit
def test_every_package_the_repository_imports_is_installed_by_requirements_txt():
    """Each third-party module imported anywhere (code, tests, benchmarks) belongs to a distribution that
    requirements.txt names or that one of those requires: a fresh virtual environment has it (IPython, imported
    by tests/test_startup.py, was missing)."""
    import ast
    from importlib import metadata

    from packaging.requirements import Requirement

    wanted = [
        Requirement(line.split("#")[0].strip())
        for line in (REPO / "requirements.txt").read_text().splitlines()
        if line.split("#")[0].strip()
    ]
    installed, todo = set(), list(wanted)
    while todo:
        req = todo.pop()
        if _normal(req.name) in installed or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        installed.add(_normal(req.name))
        todo += [Requirement(r) for r in metadata.requires(req.name) or ()]
    files = [p for p in REPO.rglob("*.py") if not {".git", ".venv", "outputs", "multirun"} & set(p.parts)]
    local = {p.stem for p in files} | {p.parent.name for p in files}
    imported = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported.add(node.module.split(".")[0])
    third_party = sorted(imported - local - set(sys.stdlib_module_names))
    providers = metadata.packages_distributions()
    missing = [m for m in third_party if not {_normal(d) for d in providers.get(m, [])} & installed]
    assert missing == [], missing
    assert {"jax", "IPython", "hydra", "wandb", "matplotlib"} <= set(third_party)
