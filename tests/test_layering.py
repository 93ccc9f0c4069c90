"""The package's imports go one way: no module or package imports one that (indirectly) imports it.

Every `import featherweight...` and `from featherweight... import ...` in the package is read from
the source (AST, so imports inside functions count too) and turned into edges between modules and
between packages (`featherweight.step`, `featherweight.memory`, ...). A cycle at either level fails,
naming it; so does an import that goes against the layer order `docs/DESIGN.md` gives.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import featherweight

PACKAGE_ROOT = Path(featherweight.__file__).resolve().parent
# lowest first: a package may import only packages to its left (docs/DESIGN.md, "Layers")
LAYERS = (
    "errors",
    "quant",
    "parallel",
    "models",
    "peft",
    "optim",
    "step",
    "io",
    "inference",
    "data",
    "recipe",
    "memory",
    "train",
    "demo",
    "cli",
    "dev",
)
RUNTIME = LAYERS[: LAYERS.index("dev")]  # what a training run imports; never the dev area


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def module_imports() -> dict[str, set[str]]:
    """{module: the featherweight modules it imports}, for every module of the package."""
    modules = {_module_name(path): path for path in PACKAGE_ROOT.rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, path.name == "__init__.py", node)
                # `from pkg import mod` imports the module pkg.mod when there is one
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    for alias in node.names
                ]
            else:
                continue
            found.update(t for t in targets if t.startswith("featherweight") and t != name)
        edges[name] = found
    return edges


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph `edges`, as a path that returns to its start, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def package_edges(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """Edges between the subpackages (and top-level modules) of featherweight."""
    packages: dict[str, set[str]] = {}
    for module, targets in edges.items():
        source = _package(module)
        if not source:
            continue  # featherweight/__init__.py re-exports the public API from everywhere
        packages.setdefault(source, set()).update(
            _package(t) for t in targets if _package(t) not in ("", source)
        )
    return packages


def test_no_module_cycle():
    edges = {m: t for m, t in module_imports().items() if m != "featherweight"}
    assert find_cycle(edges) is None, " -> ".join(find_cycle(edges) or [])


def test_no_package_cycle():
    cycle = find_cycle(package_edges(module_imports()))
    assert cycle is None, " -> ".join(cycle or [])


def test_imports_follow_the_layers():
    wrong = [
        f"{source} imports {target}"
        for source, targets in package_edges(module_imports()).items()
        for target in targets
        if LAYERS.index(target) > LAYERS.index(source)
    ]
    assert not wrong, "; ".join(sorted(wrong))


def test_every_package_has_a_layer():
    assert set(package_edges(module_imports())) <= set(LAYERS)


def test_no_runtime_module_imports_the_development_area():
    """`featherweight.dev` (calibration fitting, the HLO reader, the attention check) measures
    featherweight; nothing a training run imports may import it, not even inside a function."""
    wrong = [
        f"{module} imports {target}"
        for module, targets in module_imports().items()
        if _package(module) in RUNTIME or module == "featherweight"
        for target in targets
        if _package(target) == "dev"
    ]
    assert not wrong, "; ".join(sorted(wrong))


def test_the_finder_finds_a_cycle():
    # negative control: a cycle planted in a copy of the real graph is found
    edges = module_imports()
    edges["featherweight.quant.nf4"] = {*edges["featherweight.quant.nf4"], "featherweight.cli.main"}
    assert find_cycle(edges) is not None
    assert find_cycle(package_edges(edges)) is not None


# --- docs/DESIGN.md names only modules that exist -------------------------------------------------

DESIGN = PACKAGE_ROOT.parent / "docs" / "DESIGN.md"
REPO_FOLDERS = ("tests/", "benchmarks/", "docs/", "featherweight/")


def named_files(text: str) -> set[str]:
    """Every file a design text names in backticks: `memory/plan.py`, `plan.py`, `targets.json`
    (a path is read from the package unless it starts with a repository folder)."""
    return set(re.findall(r"`([\w/]+\.(?:py|json|md))`", text))


def missing_files(names: set[str]) -> list[str]:
    package_files = {path.name for path in PACKAGE_ROOT.rglob("*") if path.is_file()}
    missing = []
    for name in sorted(names):
        if "/" not in name:
            found = name in package_files
        elif name.startswith(REPO_FOLDERS):
            found = (PACKAGE_ROOT.parent / name).is_file()
        else:
            found = (PACKAGE_ROOT / name).is_file()
        if not found:
            missing.append(name)
    return missing


def test_every_module_the_design_names_exists():
    names = named_files(DESIGN.read_text())
    assert len(names) > 30  # the design does name its modules
    assert not missing_files(names), missing_files(names)


def test_every_package_of_the_layer_line_is_in_the_design_and_exists():
    text = DESIGN.read_text()
    for layer in LAYERS:
        named = f"`{layer}.py`" if layer == "errors" else f"`{layer}/`"
        assert named in text, named
        assert (PACKAGE_ROOT / layer).is_dir() or (PACKAGE_ROOT / f"{layer}.py").is_file()


def test_the_design_check_finds_a_missing_module():
    # negative control: a name planted in the design's text is reported missing
    planted = DESIGN.read_text() + "\nsee `memory/verdict.py` and `sharding_rules.py`\n"
    assert missing_files(named_files(planted)) == ["memory/verdict.py", "sharding_rules.py"]


def test_the_data_pipeline_does_not_import_the_steps():
    """`data` builds batches and `step` consumes them; the batch type sits below both
    (models/batch.py), so the data pipeline needs nothing from the steps."""
    edges = module_imports()
    from_data = {
        target
        for module, targets in edges.items()
        if module.startswith("featherweight.data")
        for target in targets
        if target.startswith("featherweight.step")
    }
    assert not from_data, f"featherweight.data imports {sorted(from_data)}"


MAX_FUNCTION_LINES = 80  # a function reads on one screen (STYLE.md: small functions with one job)


def test_no_function_in_the_package_is_over_80_lines():
    """Every function (signature, docstring and body) fits in 80 lines."""
    long = []
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PACKAGE_ROOT)}:{node.lineno} {node.name}")
    assert not long, f"over {MAX_FUNCTION_LINES} lines: {long}"
