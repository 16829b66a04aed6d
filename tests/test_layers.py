"""The layers import one way (core <- parallel, data, measure <- training), with no import circle, the
private JAX APIs behind ``core.compat`` resolve on the pinned JAX, and the quick tier starts no process."""

from __future__ import annotations

import ast
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit  # all in-process and quick: make test-unit runs them

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "parallel", "data", "measure", "tracking", "training", "models", "conf", "sweeps")
# package -> repository packages it may import (libraries are always allowed)
ALLOWED = {
    "core": {"core"},
    "parallel": {"core", "parallel"},
    "measure": {"core", "measure"},
    "data": {"core", "data"},
    "tracking": {"tracking"},  # the standard library only: W&B's own process imports nothing else of ours
}


def imported_modules(path: Path) -> list[str]:
    """Every module ``path`` imports (top level or inside functions), absolute names."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
            out += [f"{node.module}.{a.name}" for a in node.names]
    return out


SCRIPT_DIRS = ("benchmarks", "scripts", "hydra_plugins")  # run as scripts or found by Hydra; import the packages
TESTS = REPO / "tests"  # on sys.path when pytest runs: ``utils``, ``conftest`` are top-level names there


def module_name(path: Path) -> str:
    root = TESTS if path.is_relative_to(TESTS) else REPO
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def repo_modules(everywhere: bool = False) -> dict[str, Path]:
    """Module name -> file of the packages; with ``everywhere``, also the entry points (``train.py``,
    ``evaluate.py``), benchmarks, scripts, Hydra plugins and tests."""
    paths = [p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")]
    if everywhere:
        paths += list(REPO.glob("*.py")) + [p for d in SCRIPT_DIRS + ("tests",) for p in (REPO / d).rglob("*.py")]
    return {module_name(p): p for p in paths}


def import_graph(everywhere: bool = False) -> dict[str, set[str]]:
    """module -> the repository modules it imports (``from pkg import mod`` counts as ``pkg.mod``)."""
    modules = repo_modules(everywhere)
    graph = {}
    for name, path in modules.items():
        graph[name] = {m for m in imported_modules(path) if m in modules and m != name}
    return graph


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_allowed_layers(package):
    bad = []
    for path in sorted((REPO / package).rglob("*.py")):
        for mod in imported_modules(path):
            top = mod.split(".")[0]
            if top in PACKAGES and top not in ALLOWED[package]:
                bad.append(f"{path.relative_to(REPO)} imports {mod}")
    assert bad == []


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` as [a, b, ..., a], or [] when there is none (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return []


def test_find_cycle_detects_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Module graph collapsed to ``package.subpackage`` level, with a package's __init__ re-exports removed
    (``parallel/__init__`` importing its own modules is not a cycle)."""
    out: dict[str, set[str]] = {}
    for mod, deps in graph.items():
        out.setdefault(mod, set()).update(d for d in deps if not mod.startswith(d + "."))
    return out


def test_no_import_cycles_among_repository_modules():
    graph = import_graph(everywhere=True)
    assert {"train", "evaluate", "training.run", "training.build", "utils", "benchmarks.overhead"} <= set(graph)
    assert find_cycle(package_graph(graph)) == []


def test_nothing_under_parallel_imports_training_or_data():
    bad = sorted(
        f"{mod} imports {dep}"
        for mod, deps in import_graph().items()
        if mod.startswith("parallel")
        for dep in deps
        if dep.split(".")[0] in ("training", "data")
    )
    assert bad == []


def test_training_runtime_and_distributed_import_one_way():
    graph = import_graph()
    assert "training.distributed" in graph["training.runtime"]
    assert "training.runtime" not in graph["training.distributed"]


def test_private_jax_apis_resolve_on_the_pinned_jax():
    import jax

    from core import compat

    assert jax.__version__ == "0.10.2"
    assert compat.xla_bridge() is not None and isinstance(compat.xla_bridge()._backends, dict)
    assert compat.clusters() is not None and len(compat.clusters().ClusterEnv._cluster_types) > 0
    assert compat.cloud_tpu_init() is not None and compat.cloud_tpu_init().running_in_cloud_tpu_vm is False
    jax.devices()
    assert compat.backend_started() is True
    assert compat.distributed_client() is None  # the module resolves; the tests' process joined no job


def test_private_jax_imports_only_in_compat():
    users = sorted(
        str(p.relative_to(REPO))
        for p in repo_modules(everywhere=True).values()
        if any(m.startswith("jax._src") for m in imported_modules(p))
    )
    assert users == ["core/compat.py"]


def test_a_unit_test_cannot_start_a_process(tmp_path):
    """The ``unit`` marker's promise (``make test-unit`` starts no process) is enforced by tests/conftest.py:
    every way to start one raises while a ``unit`` test runs, and nothing was started."""
    from conftest import UnitTestStartedProcess

    marker = tmp_path / "started"
    script = f"open({str(marker)!r}, 'w').close()"
    with pytest.raises(UnitTestStartedProcess, match="test_a_unit_test_cannot_start_a_process is marked `unit`"):
        subprocess.run([sys.executable, "-c", script], check=True)
    with pytest.raises(UnitTestStartedProcess):
        os.system(f"touch {marker}")
    for method in ("fork", "spawn", "forkserver"):
        with pytest.raises(UnitTestStartedProcess):
            multiprocessing.get_context(method).Process(target=print).start()
    assert not marker.exists()
