"""The project's import graph, read from the source with `ast` (nothing is imported).

Every `import` / `from ... import` of a project module in pallas_kernels/, sharding/ and dsjax/,
at module level or inside a function, is an edge. The graph must have no cycle (a cycle works
only while one side imports lazily, which hides the dependency), neither between modules nor
between subpackages (dsjax.hf importing dsjax.train while dsjax.train imports dsjax.hf is a
loop even when no two modules import each other); the packages must layer
pallas_kernels <- sharding <- dsjax, and project modules are imported at module level.

The benchmark scripts (benchmarks/*.py, run as scripts: each puts benchmarks/ on sys.path and
imports the others by bare name) are nodes `benchmarks.NAME` of the same graph: no cycle among
them, no product package imports them, and they import each other at module level (they may
import the packages inside functions, after setting XLA flags or platforms).
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("pallas_kernels", "sharding", "dsjax")
SCRIPTS = "benchmarks"  # a folder of scripts that import each other by bare name
# a package may import itself and the packages listed here, nothing else of the project
MAY_IMPORT = {"pallas_kernels": set(), "sharding": {"pallas_kernels"},
              "dsjax": {"sharding", "pallas_kernels"}, SCRIPTS: {"dsjax", "sharding", "pallas_kernels"}}


def module_files() -> dict[str, Path]:
    """Dotted module name -> source file, for every .py file of the packages and the benchmark
    scripts (`benchmarks.train_step`)."""
    out = {f"{SCRIPTS}.{f.stem}": f for f in sorted((ROOT / SCRIPTS).glob("*.py"))}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            parts = f.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = f
    return out


def imported_modules(node: ast.AST, module: str, is_package: bool, known: set[str]) -> list[str]:
    """Project modules that one Import / ImportFrom node loads (`from p import name` counts as
    p.name when that is a module, else as p; in a benchmark script a bare name that is another
    script counts as that script)."""
    def script(name):
        top = f"{SCRIPTS}.{name}"
        return top if module.startswith(SCRIPTS + ".") and top in known else name

    if isinstance(node, ast.Import):
        return [script(a.name) for a in node.names if script(a.name) in known]
    base = script(node.module or "") if not node.level else node.module or ""
    if node.level:  # relative: resolve against this module's package
        pkg = module.split(".") if is_package else module.split(".")[:-1]
        pkg = pkg[:len(pkg) - (node.level - 1)]
        base = ".".join(pkg + ([base] if base else []))
    out = []
    for a in node.names:
        full = f"{base}.{a.name}" if base else a.name
        if full in known:
            out.append(full)
        elif base in known:
            out.append(base)
    return out


def import_graph() -> tuple[dict[str, set[str]], list[str]]:
    """(module -> project modules it imports, ["module:line imports X inside a function", ...])."""
    files = module_files()
    known = set(files)
    graph, nested = {m: set() for m in files}, []
    for mod, f in files.items():
        tree = ast.parse(f.read_text(), filename=str(f))
        is_package = f.name == "__init__.py"

        def visit(node, in_function):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    for dep in imported_modules(child, mod, is_package, known):
                        if dep != mod:
                            graph[mod].add(dep)
                            where = f"{f.relative_to(ROOT)}:{child.lineno} imports {dep} inside a function"
                            # a script may import the packages late, never another script
                            lazy_ok = mod.startswith(SCRIPTS + ".") and not dep.startswith(SCRIPTS + ".")
                            if in_function and not lazy_ok and where not in nested:
                                nested.append(where)
                inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                visit(child, inner)

        visit(tree, False)
    return graph, nested


def unit(module: str, packages: set[str]) -> str:
    """The subpackage a module belongs to (`dsjax.hf.load` -> `dsjax.hf`); a package's own
    modules and the top-level packages stand for themselves (`dsjax.config`, `sharding`)."""
    parts = module.split(".")
    if len(parts) > 2 or (len(parts) == 2 and module in packages):
        return ".".join(parts[:2])
    return module


def subpackage_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph with each subpackage's modules merged into one node (no self-edges)."""
    packages = {m for m, f in module_files().items() if f.name == "__init__.py"}
    out: dict[str, set[str]] = {}
    for a, deps in graph.items():
        ua = unit(a, packages)
        out.setdefault(ua, set()).update(u for b in deps if (u := unit(b, packages)) != ua)
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (depth-first search, white/grey/black)."""
    state, stack = {}, []

    def dfs(u):
        state[u] = "grey"
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == "grey":
                return stack[stack.index(v):] + [v]
            if v not in state and (c := dfs(v)):
                return c
        stack.pop()
        state[u] = "black"
        return None

    for u in sorted(graph):
        if u not in state and (c := dfs(u)):
            return c
    return None


def test_graph_reads_every_module():
    graph, _ = import_graph()
    assert {"pallas_kernels", "sharding", "dsjax", "dsjax.train.loop", "dsjax.hf.load"} <= set(graph)
    # the reader sees real edges of each import form
    assert "dsjax.hf" in graph["dsjax.train.loop"]  # from dsjax.hf import name
    assert "dsjax.config" in graph["dsjax.train.loop"]  # from dsjax import module as C
    assert "sharding.rules" in graph["dsjax.model.layers"]


def test_graph_reads_the_benchmark_scripts():
    graph, _ = import_graph()
    assert {"benchmarks.train_step", "benchmarks.step_bytes", "benchmarks._step_common"} <= set(graph)
    assert "benchmarks.step_bytes" in graph["benchmarks.train_step"]  # from step_bytes import name
    assert "benchmarks.train_step" in graph["benchmarks.finetune"]
    assert "dsjax.plan" in graph["benchmarks.step_bytes"]  # inside a function
    assert "pallas_kernels.moe" in graph["benchmarks.moe"]  # not the script of the same name


def test_no_import_cycle():
    graph, _ = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_import_cycle_between_subpackages():
    graph = subpackage_graph(import_graph()[0])
    assert {"dsjax.hf", "dsjax.train", "dsjax.model", "dsjax.config", "sharding.rules"} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle between subpackages: " + " -> ".join(cycle)


def test_packages_layer_pallas_kernels_sharding_dsjax():
    graph, _ = import_graph()
    bad = sorted(f"{a} imports {b}" for a, deps in graph.items() for b in deps
                 if b.split(".")[0] != a.split(".")[0] and b.split(".")[0] not in MAY_IMPORT[a.split(".")[0]])
    assert not bad, "imports against the layering pallas_kernels <- sharding <- dsjax:\n" + "\n".join(bad)


def test_project_modules_are_imported_at_module_level():
    _, nested = import_graph()
    assert not nested, "function-level imports hide dependencies:\n" + "\n".join(nested)


def test_find_cycle_reports_the_loop():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
