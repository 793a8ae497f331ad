"""The package's shape: no import cycle (imports inside functions included), and modes that only
describe their state (no file I/O of their own)."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ds_lowcomm"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, modules: set, this: str):
    """Every ds_lowcomm module imported anywhere in ``tree`` (functions included), except under
    ``if TYPE_CHECKING:``, which never runs."""
    out = set()
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "ds_lowcomm")
        elif isinstance(node, ast.ImportFrom):
            assert not node.level, f"{this}: relative import; the package imports absolutely"
            base = node.module or ""
            if base.split(".")[0] == "ds_lowcomm":
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    out.add(sub if sub in modules else base)
        stack.extend(ast.iter_child_nodes(node))
    return out


def import_graph():
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(files)
    return {name: _imports(ast.parse(path.read_text()), modules, name) - {name}
            for name, path in files.items()}


def find_cycle(graph):
    """One import cycle as a list of modules (first == last), or None."""
    state, path = {}, []

    def visit(node):
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = "done"
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 20 and "ds_lowcomm.modes.acco" in graph["ds_lowcomm.modes"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles():
    # The check itself, on the cycle this package once had (config -> modes -> config).
    graph = import_graph()
    graph["ds_lowcomm.config"] = graph["ds_lowcomm.config"] | {"ds_lowcomm.modes"}
    cycle = find_cycle(graph)
    assert cycle is not None and "ds_lowcomm.config" in cycle and "ds_lowcomm.modes" in cycle


def test_modes_and_the_registry_stay_apart():
    graph = import_graph()
    for name, deps in graph.items():
        if name.startswith("ds_lowcomm.modes."):
            assert "ds_lowcomm.modes" not in deps, f"{name} imports the mode registry"
            assert "ds_lowcomm.optimizer" not in deps, f"{name} imports the optimizer: use ModeContext"
    assert "ds_lowcomm.modes" not in graph["ds_lowcomm.config"], "config imports the mode registry"


def test_modes_do_no_file_io():
    """Modes describe their state; the checkpoint component writes and reads files."""
    banned = {("torch", "save"), ("torch", "load"), (None, "open")}
    for path in (PACKAGE / "modes").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                key = (f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else None,
                       f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None))
                assert key not in banned, f"{path.name}:{node.lineno} calls {'.'.join(k for k in key if k)}"
