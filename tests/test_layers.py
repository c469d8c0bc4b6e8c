"""The engine's modules import each other without a cycle, lazy imports included.

Built from the modules' own imports (`ast`): every `import` and `from ... import` anywhere in
a module (top level, inside functions, under TYPE_CHECKING) is an edge to the engine module it
names; `from engine.x import name` where `name` is a module is an edge to that module, and a
module inside a package also imports the package's `__init__`.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "engine"


def modules() -> dict[str, Path]:
    """Dotted name -> file of every module in the engine package."""
    found = {}
    for path in (ROOT / PACKAGE).rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports_of(path: Path, known: dict[str, Path]) -> set[str]:
    """The engine modules `path` imports (anywhere in it)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known
                     else node.module for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] != PACKAGE:
                continue
            while name not in known:  # `import engine.a.b` of an attribute: its module
                name = name.rsplit(".", 1)[0]
            out.add(name)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(path, known) - {name} for name, path in known.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_the_graph_sees_lazy_and_package_imports(tmp_path):
    known = {"engine": tmp_path, "engine.x": tmp_path, "engine.x.y": tmp_path,
             "engine.z": tmp_path}
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from engine.x import y\n    import engine.z\n")
    assert imports_of(src, known) == {"engine.x.y", "engine.z"}
    src.write_text("from engine import LLMEngine\n")
    assert imports_of(src, known) == {"engine"}


def test_no_import_cycle_among_engine_modules():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# The import layers of docs/ARCHITECTURE.md: a module imports only modules of its own layer or
# of the layers below (first match of its name's prefix decides).
LAYERS = [
    ("engine.config engine.errors engine.device_io engine.sampling_params engine.sequence "
     "engine.batch engine.sample.keys", 0),
    ("engine.block_manager engine.scheduler engine.outputs engine.request_check "
     "engine.structured engine.engine_stats", 1),
    ("engine.kernels engine.attention engine.models engine.parallel.shard engine.parallel.group",
     2),
    ("engine.sample", 3),
    ("engine.model_runner engine.static_steps engine.memory_plan engine.runner_plan "
     "engine.parallel", 4),
    ("engine.spec_decode", 5),
    ("engine.llm_engine engine", 6),
]


def layer_of(module: str) -> int:
    for names, layer in LAYERS:
        for name in names.split():
            if module == name or (name != PACKAGE and module.startswith(name + ".")):
                return layer
    raise AssertionError(f"{module} is in no layer of docs/ARCHITECTURE.md")


def test_every_import_goes_to_the_same_layer_or_below():
    assert layer_of("engine.parallel.shard") == 2 and layer_of("engine.parallel.workers") == 4
    upward = [f"{m} (layer {layer_of(m)}) imports {d} (layer {layer_of(d)})"
              for m, deps in graph().items() for d in deps if layer_of(d) > layer_of(m)]
    assert not upward, "\n".join(upward)


MAX_FUNCTION_LINES = 60


def test_no_engine_function_is_longer_than_a_screen():
    """Functions short enough to read at once; a Triton kernel (`@triton.jit`) is one piece."""
    long = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            jit = any("jit" in ast.unparse(d) for d in node.decorator_list)
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES and not jit:
                long.append(f"{name}.{node.name}: {lines} lines")
    assert not long, "\n".join(long)
