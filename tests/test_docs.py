"""The README stays a manual, the configuration reference covers the schema, and every raw result the docs cite
is committed (the house rules of README.md, docs/ and benchmarks/results/)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from conf import schema

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


@pytest.mark.unit
def test_readme_is_a_manual_without_history():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 450
    assert "session" not in readme.lower()
    assert not re.search(r"\brun \d+\b", readme), re.findall(r".{30}\brun \d+\b.{30}", readme)


@pytest.mark.unit
def test_results_hold_current_raw_outputs_only():
    results = sorted(p.name for p in (REPO / "benchmarks" / "results").iterdir())
    assert len(results) <= 25, results
    assert not [n for n in results if "_script" in n or n.endswith(".sh")], results
    assert "overhead_history.md" not in results


@pytest.mark.unit
def test_every_cited_raw_output_exists():
    for doc in DOCS:
        for name in re.findall(r"benchmarks/results/([\w.-]+\.\w+)", doc.read_text()):
            assert (REPO / "benchmarks" / "results" / name).is_file(), f"{doc.name} cites a missing {name}"


def _anchors(path: Path) -> set[str]:
    """GitHub's ids of the headings of a Markdown file (lower case, punctuation dropped, spaces to hyphens)."""
    heads = re.findall(r"^#+ (.+)$", path.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


@pytest.mark.unit
def test_local_links_resolve():
    for doc in DOCS:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)]*))?\)", doc.read_text()):
            if "://" in target:
                continue
            path = (doc.parent / target) if target else doc
            assert path.exists(), f"{doc.name} links to a missing {target}"
            if anchor and path.suffix == ".md":
                assert anchor in _anchors(path), f"{doc.name} links to a missing heading {target}#{anchor}"


def _keys(node: type, prefix: str) -> list[str]:
    out = []
    for f in dataclasses.fields(node):
        default = f.default_factory() if callable(f.default_factory) else None
        if dataclasses.is_dataclass(default):
            out += _keys(type(default), f"{prefix}{f.name}.")
        else:
            out.append(f"{prefix}{f.name}")
    return out


@pytest.mark.unit
def test_configuration_reference_names_every_schema_key():
    """Every key of the typed schema (each model's, mode's and optimizer's own keys included) appears in
    docs/configuration.md as `group.key`."""
    keys = set(_keys(schema.Config, ""))
    for group, (schemas, _) in schema.OPTION_SCHEMAS.items():
        keys.discard(f"{group}.name")
        for option in schemas.values():
            keys |= {f"{group}.{k}" for k in _keys(option, "")}
    doc = (REPO / "docs" / "configuration.md").read_text()
    missing = sorted(k for k in keys if f"`{k}`" not in doc)
    assert not missing, missing
