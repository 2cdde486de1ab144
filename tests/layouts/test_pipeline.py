"""Layout inference runs one way: config -> family -> candidates -> chosen reading (docs/layouts.md §11).

Read from the modules' own import statements: a step may import the steps before it and the
vocabulary, never a later step; the vocabulary imports no step.
"""

import ast
import importlib
from pathlib import Path

import pytest

from audit.layouts.families import BY_ARCHITECTURE, BY_MODEL_TYPE, Family

LAYOUTS = Path(__file__).resolve().parents[2] / "audit" / "layouts"
STEPS = ["hf_config", "families", "candidates", "infer"]
VOCABULARY = {"model", "states", "pages", "hybrid", "dtypes", "versions", "serve_flags", "vllm_models", "images",
              "rotary", "checkpoint"}


def _module(path: Path) -> str:
    """`families` for every file of the families package, else the file's stem."""
    relative = path.relative_to(LAYOUTS)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def _imports(path: Path) -> set[str]:
    """The audit.layouts modules `path` imports (relative or absolute), by `_module`'s names."""
    names = set()
    package = path.parent
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package
            for _ in range(node.level - 1):
                base = base.parent
            target = base / node.module.replace(".", "/") if node.module else base
            if target == LAYOUTS:  # `from .. import x`: x is the module
                names |= {alias.name for alias in node.names}
            elif LAYOUTS in (target, *target.parents):
                names.add(target.relative_to(LAYOUTS).parts[0])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("audit.layouts."):
            names.add(node.module.split(".")[2])
    return names - {_module(path)}


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in LAYOUTS.rglob("*.py"):
        if path.name != "__init__.py" or path.parent != LAYOUTS:
            graph.setdefault(_module(path), set()).update(_imports(path))
    return graph


def test_the_graph_is_read():
    graph = _graph()
    assert graph["infer"] == {"candidates", "model", "versions"}
    assert graph["hf_config"] == {"hybrid", "model"}
    assert "vllm_models" in graph["families"] and "hf_config" in graph["families"]


@pytest.mark.parametrize("step", STEPS)
def test_a_step_imports_only_earlier_steps_and_the_vocabulary(step):
    allowed = set(STEPS[:STEPS.index(step)]) | VOCABULARY
    assert _graph()[step] <= allowed, f"{step} imports {sorted(_graph()[step] - allowed)}"


def test_the_vocabulary_imports_no_step():
    graph = _graph()
    for module in VOCABULARY:
        assert not graph[module] & set(STEPS), f"{module} imports {sorted(graph[module] & set(STEPS))}"


def test_every_family_module_is_registered():
    """A family module whose Family no registry line names would be dead code."""
    registered = {family.name for family in (*BY_MODEL_TYPE.values(), *BY_ARCHITECTURE.values())}
    modules = [importlib.import_module(f"audit.layouts.families.{path.stem}")
               for path in (LAYOUTS / "families").glob("*.py") if path.stem != "__init__"]
    defined = {value.name for module in modules for value in vars(module).values() if isinstance(value, Family)}
    assert registered | {"attention"} == defined
    assert len(defined) == 13
