"""The installed package contains every sub-package and the CUDA headers."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _declared() -> set[str]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return set(data["tool"]["setuptools"]["packages"])


def test_every_python_package_is_listed():
    mapping = {"mpk_dist": ROOT / "mpk_dist", "mpk_dist.models": ROOT / "models", "mpk_dist.csrc": ROOT / "csrc"}
    found = set()
    for prefix, base in mapping.items():
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            found.add(".".join([prefix, *rel.parts]) if rel.parts else prefix)
    missing = found - _declared()
    assert not missing, f"add these to [tool.setuptools] packages in pyproject.toml: {sorted(missing)}"


def test_console_script_declared():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert data["project"]["scripts"]["mpk-dist"] == "mpk_dist.cli:main"


def test_every_cuda_source_is_package_data():
    """Every .cu/.cuh/.h under csrc/ (e.g. csrc/bench/comm_bench.cu), and the µGraph a checked-in generated body is
    rendered from (csrc/tasks/generated/*.json), matches a package-data glob."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = data["tool"]["setuptools"]["package-data"]["mpk_dist.csrc"]
    shipped = {p for g in globs for p in (ROOT / "csrc").glob(g)}
    sources = {p for p in (ROOT / "csrc").rglob("*") if p.suffix in (".cu", ".cuh", ".h") and "__pycache__" not in p.parts}
    sources |= set((ROOT / "csrc" / "tasks" / "generated").glob("*.json"))
    assert (ROOT / "csrc" / "bench" / "comm_bench.cu") in sources
    missing = sorted(str(p.relative_to(ROOT)) for p in sources - shipped)
    assert not missing, f"add these to [tool.setuptools.package-data] in pyproject.toml: {missing}"
