"""The import graph points down — router → profiler → backends → policies — with no cycle, in
module-level and in-function imports alike, and `policies/` stays free of torch and Ray."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("router", "profiler", "backends", "policies")  # each may import only those after it


def _imports(path: Path, root: Path = ROOT) -> set[str]:
    """Every module a file imports, anywhere in it, resolved to absolute dotted names."""
    package = path.relative_to(root).parts[:-1]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                names.add(".".join([*base, node.module] if node.module else base))
            elif node.module:
                names.add(node.module)
    return names


def _files(layer: str) -> list[Path]:
    return sorted((ROOT / layer).rglob("*.py"))


@pytest.mark.parametrize("layer", LAYERS)
def test_a_layer_imports_only_the_layers_below_it(layer: str) -> None:
    above = LAYERS[: LAYERS.index(layer)]
    wrong = {
        f"{path.relative_to(ROOT)} imports {name}"
        for path in _files(layer)
        for name in _imports(path)
        if name.split(".")[0] in above
    }
    assert not wrong, sorted(wrong)


def test_policies_stay_free_of_torch_and_ray() -> None:
    heavy = {"torch", "ray", "transformers"}
    wrong = {
        f"{path.relative_to(ROOT)} imports {name}"
        for path in _files("policies")
        for name in _imports(path)
        if name.split(".")[0] in heavy
    }
    assert not wrong, sorted(wrong)


def test_the_checker_sees_relative_and_in_function_imports(tmp_path: Path) -> None:
    """The rules above are only as good as `_imports`: it must see where a cycle would hide."""
    module = tmp_path / "backends" / "speculative" / "x.py"
    module.parent.mkdir(parents=True)
    module.write_text(
        "from ..kv import PagedCache\nfrom . import drafters\n"
        "def f():\n    from profiler.workloads import quantization_split\n    import router.cli\n"
    )
    assert _imports(module, tmp_path) == {"backends.kv", "backends.speculative", "profiler.workloads", "router.cli"}
