"""Imports run one way: the pure layout at the bottom, then kernels and model, the engine, the AFD
ranks and processes, the frontend, and the user-facing API, server and benchmarks on top. Read
from the source (every import statement, also those inside functions), so a lazy upward import
fails too."""

from __future__ import annotations

import ast
from pathlib import Path

import afdserve

PACKAGE = Path(afdserve.__file__).parent
LAYERS = {  # module prefix -> layer; a module may import only its own layer and those below
    "afdserve.layout": 0,
    "afdserve.config": 0,
    "afdserve.config_args": 0,  # flags and keywords from the config dataclasses (no torch)
    "afdserve.kernels": 1,
    "afdserve.kernels.metadata": 1.0,  # the attention metadata every implementation reads
    "afdserve.kernels.reference": 1.1,  # plain torch: the CPU path, the oracles, the formats
    "afdserve.kernels.triton": 1.2,  # Triton kernels of the dense layers and the wire
    "afdserve.kernels.moe": 1.3,  # the routed experts' kernels
    "afdserve.kernels.ops": 1.4,  # the dispatch the model calls
    "afdserve.kernels.a2e": 1.4,  # the A2E wire format, plain torch or its Triton kernels
    "afdserve.model": 2,
    "afdserve.model.config": 2.0,  # ModelConfig, the cache interface, the model's parts
    "afdserve.model.quantization": 2.0,
    "afdserve.model.cache": 2.0,
    "afdserve.model.parts": 2.0,
    "afdserve.model.layers": 2.1,  # blocks every family builds from
    "afdserve.model.families": 2.2,  # one folder per architecture, and their registry
    "afdserve.model.fixtures": 2.3,  # tiny checkpoints, the byte tokenizer, the bundled model
    # Leaf fixtures a family's own tiny builder (parts.Family.make_tiny) writes with.
    "afdserve.model.fixtures.byte_tokenizer": 2.0,
    "afdserve.model.fixtures.fp8_checkpoint": 2.1,
    "afdserve.model.fixtures.seeded": 2.0,
    "afdserve.model.checkpoint": 2.4,  # reading a model dir: hub, preflight, loader
    "afdserve.model.presets": 2.5,
    "afdserve.engine": 3,
    "afdserve.afd": 4,
    "afdserve.afd.dataplane": 4.0,  # both sides of every transport, and the FFN half's step
    "afdserve.afd.step": 4.1,  # the control planes across ranks, the FFN driver
    "afdserve.afd.ranks": 4.2,  # one rank of any role, its process and messages
    "afdserve.frontend": 4.5,  # clients of one process or of a world, output processing
    "afdserve.llm": 5,
    "afdserve.planner": 5,  # deployment predictions from a measured profile and the model's sizes
    "afdserve.server": 6,
    "afdserve.bench": 6,
    "afdserve.cli": 7,
}


def _layer(module: str) -> float | None:
    best = None
    for prefix, layer in LAYERS.items():
        if module == prefix or module.startswith(prefix + "."):
            if best is None or len(prefix) > len(best[0]):
                best = (prefix, layer)
    return None if best is None else best[1]


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
    return [n for n in names if n.startswith("afdserve")]


def test_layer_table_covers_every_module():
    modules = [
        "afdserve." + ".".join(p.relative_to(PACKAGE).with_suffix("").parts)
        for p in PACKAGE.rglob("*.py")
        if p.name != "__init__.py" or p.parent != PACKAGE
    ]
    assert [m for m in modules if _layer(m) is None] == []


def test_no_upward_imports():
    upward = []
    for path in PACKAGE.rglob("*.py"):
        if path == PACKAGE / "__init__.py":
            continue  # the package root re-exports the API lazily
        module = "afdserve." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        module = module.removesuffix(".__init__")
        mine = _layer(module)
        for imported in _imports(path):
            theirs = _layer(imported)
            if theirs is not None and theirs > mine:
                upward.append(f"{module} (layer {mine}) imports {imported} (layer {theirs})")
    assert upward == []


def _module_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (`from afdserve.x import y` counts as x.y
    when y is a module, else as x)."""
    paths = {
        p: "afdserve." + ".".join(p.relative_to(PACKAGE).with_suffix("").parts)
        for p in PACKAGE.rglob("*.py")
    }
    modules = {m.removesuffix(".__init__") for m in paths.values()}
    graph: dict[str, set[str]] = {}
    for path, module in paths.items():
        module = module.removesuffix(".__init__")
        if module == "afdserve":
            continue  # the package root re-exports the API lazily
        edges = graph.setdefault(module, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    edges.add(full if full in modules else node.module)
            elif isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names)
        edges &= modules
        edges.discard(module)
    return graph


def test_no_import_circles():
    """No two modules import each other, directly or around a circle, lazily or not."""
    graph = _module_graph()
    circles, state = [], {}

    def visit(module: str, trail: list[str]) -> None:
        state[module] = "open"
        for other in sorted(graph.get(module, ())):
            if state.get(other) == "open":
                circles.append(" -> ".join(trail[trail.index(other) :] + [module, other]))
            elif other not in state:
                visit(other, trail + [module])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
    assert circles == []


FAMILY_NAMES = ("deepseek", "qwen", "mixtral", "v4")
FAMILY_BLIND = ("engine", "afd", "frontend", "llm.py")


def test_engine_and_frontend_name_no_family():
    """What a family keeps per sequence reaches the engine through its cache layout
    (model/cache.py): the rank side, the AFD ranks, the frontend and the offline API name no
    family, in code or in comments."""
    named = []
    for place in FAMILY_BLIND:
        root = PACKAGE / place
        for path in [root] if root.is_file() else sorted(root.rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                words = set(line.lower().replace("-", "_").replace("/", " ").split())
                if any(w.strip("`'\".,:;()[]").startswith(FAMILY_NAMES) for w in words):
                    named.append(f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}")
    assert named == []


def test_model_reaches_kernels_through_ops():
    """The model calls kernels through `ops` (and reads the attention metadata types) only."""
    allowed = ("afdserve.kernels.ops", "afdserve.kernels.metadata")
    past = []
    for path in (PACKAGE / "model").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{alias.name}" for alias in node.names]
                if node.module != "afdserve.kernels":
                    names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            past += [
                f"{path.relative_to(PACKAGE)} imports {name}"
                for name in names
                if name.startswith("afdserve.kernels") and name not in allowed
            ]
    assert past == []
