"""The package's shape: no import cycle (imports inside functions included), and modes that only
describe their state (no file I/O of their own)."""
import pytest
import ast
from pathlib import Path

pytestmark = pytest.mark.unit

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


#: the package's layers, lowest first: a module imports from its own layer or lower ones only.
#: ``ds_lowcomm`` is the package's ``__init__`` (the public names); the bench and the example
#: scripts it runs are tools on top.
LAYERS = [("memory", "config", "configs"), ("comm",), ("shard",), ("checkpoint",), ("modes",), ("auto", "optimizer"),
          ("integration",), ("ds_lowcomm",), ("bench", "examples")]
#: third-party frameworks the core never imports: DeepSpeed and Hugging Face live in integration/
FRAMEWORKS = ("deepspeed", "transformers", "accelerate", "trl", "datasets")


def _layer(module: str) -> int:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "ds_lowcomm"
    return next(i for i, names in enumerate(LAYERS) if top in names)


def _upward(graph):
    return [(a, b) for a, deps in graph.items() for b in deps if _layer(b) > _layer(a)]


def test_no_module_imports_a_higher_layer():
    graph = import_graph()
    assert {m.split(".")[1] for m in graph if "." in m} <= {n for names in LAYERS for n in names}
    assert _upward(graph) == []
    # the check itself: the comm layer importing the modes is caught
    graph["ds_lowcomm.comm.worker"] = graph["ds_lowcomm.comm.worker"] | {"ds_lowcomm.modes"}
    assert _upward(graph) == [("ds_lowcomm.comm.worker", "ds_lowcomm.modes")]


def _framework_imports(path: Path):
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        found += [n for n in names if n.split(".")[0] in FRAMEWORKS]
    return found


def test_frameworks_are_imported_in_integration_only():
    """DeepSpeed, transformers and accelerate are imported (functions included) only by
    integration/, the bench and the example scripts: the collectives, shards, modes and checkpoints run without them."""
    offenders = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).parts
        if rel[0] in ("integration", "bench", "examples"):
            continue
        if found := _framework_imports(path):
            offenders[str(path.relative_to(PACKAGE))] = found
    assert offenders == {}
    assert _framework_imports(PACKAGE / "integration" / "engine.py")  # the check sees them
