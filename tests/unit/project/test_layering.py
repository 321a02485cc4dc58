"""The layering of src/islands, read from the source with ast (no imports run):

1. no import cycles between files (module-level and function-local imports both count);
2. each layer imports only from itself and the layers below it (docs/architecture.md, "Layers"):
   islands.spec < components < islands.loop < islands.tasks < islands.config < islands.app < the CLI;
   the benchmarks live outside the package and nothing here imports them;
3. imports inside functions are kept to heavy optional modules (ALLOWED_LOCAL), never used to dodge a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[3] / "src"

# Layer of each top-level name under islands; a module may import its own layer and lower ones.
LAYERS = {
    "spec": 0,
    "version": 0,
    "_deprecated": 0,  # the table of deprecated aliases; it imports their new homes by name, when one is used
    "runtime": 1,
    "sync": 1,
    "compress": 1,
    "aggregate": 1,
    "faults": 1,
    "checkpoint": 1,
    "memory": 1,
    "parallel": 1,
    "measure": 1,
    "models": 1,
    "data": 1,
    "testbed": 1,
    "practices": 1,
    "inner": 1,
    "outer": 1,
    "robust": 1,
    "control": 1,  # the public namespaces over components
    "optim": 1,  # optimizers islands adds to torch's (Muon + AdamW as one optimizer)
    "dashboard": 1,  # the live page over a run directory (reads live/*.jsonl and run.json)
    "report": 1,  # the static results site (reads results/ and the practice registry)
    "observe": 1,  # loggers and the Logging callback (duck-typed on the trainer; below the app that wires them)
    "loop": 2,
    "integrations": 2,  # the framework callbacks (HF Trainer, Lightning): an outer strategy from their hooks
    "tasks": 3,
    "config": 4,
    "app": 5,
    "plan": 5,  # islands plan: builds the job as the app does, then predicts (docs/plan.md)
    "cli": 6,
    "cli_more": 6,
    "cli_ps": 6,
    "cli_cross": 6,
    "cli_run": 6,
    "cli_export": 6,
    "cli_plan": 6,
    "__main__": 6,
    "__init__": 6,
}
# Modules heavy or optional enough to import where they are used, not at the top of a module
# (islands.checkpoint.codec.kernels: the codec's numba loops, ~0.5 s to compile-import, for processes that save).
ALLOWED_LOCAL = {
    "islands.checkpoint.codec.kernels",
    "islands.compress.kernels",  # the outer compressors' numba loops, same reason
    "islands.compress.kernels_quant",  # int8/int4 numba loops, same reason
    "islands.compress.kernels_dct",  # dct-topk's inverse, numba, same reason
    "transformers",
    "tensorboard",
    "torch.utils.tensorboard",
    "mlflow",
    "wandb",
    "plotly",
    "matplotlib",
    "rich",
    "numba",
    "zipnn",
    "torchft",
    "sklearn",
    "tokenizers",
    "datasets",
    "scipy",
    "safetensors",
    "zstandard",
    "xxhash",
}


def modules() -> dict[str, Path]:
    out = {}
    for f in (SRC / "islands").rglob("*.py"):
        out[".".join(f.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")] = f
    return out


def _targets(node: ast.AST, module: str, is_pkg: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            pkg = module.split(".") if is_pkg else module.split(".")[:-1]
            base = ".".join(pkg[: len(pkg) - (node.level - 1)] + ([node.module] if node.module else []))
        return [base] + [f"{base}.{a.name}" for a in node.names]
    return []


def imports(path: Path, module: str) -> list[tuple[str, bool, int]]:
    """(imported name, inside a function, line) for every import in the file."""
    tree = ast.parse(path.read_text())
    out = []

    def visit(node: ast.AST, local: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            for t in _targets(child, module, path.name == "__init__.py"):
                out.append((t, inner, child.lineno))
            visit(child, inner)

    visit(tree, False)
    return out


def resolve(name: str, mods: dict[str, Path]) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS["__init__"] if len(parts) == 1 else LAYERS[parts[1]]


def graph() -> dict[str, set[str]]:
    mods = modules()
    g: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        for name, _, _ in imports(f, m):
            t = resolve(name, mods)
            if t and t != m and not (m.startswith(t + ".") and mods[t].name == "__init__.py"):
                g[m].add(t)
    return g


def test_every_module_has_a_layer():
    unknown = sorted({m.split(".")[1] for m in modules() if "." in m and m.split(".")[1] not in LAYERS})
    assert not unknown, f"add these to LAYERS (and docs/architecture.md): {unknown}"


def test_no_import_cycles():
    g = graph()
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def connect(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in g:
        if v not in index:
            connect(v)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_each_layer_imports_only_itself_and_below():
    mods = modules()
    bad = []
    for m, f in mods.items():
        for name, _, line in imports(f, m):
            if name.split(".")[0] == "islands_bench":
                bad.append(f"{f.relative_to(SRC)}:{line} imports the benchmarks ({name})")
            t = resolve(name, mods)
            if t is None or t == "islands" or t == m:
                continue
            if layer(t) > layer(m):
                bad.append(f"{f.relative_to(SRC)}:{line} ({m}, layer {layer(m)}) imports {t} (layer {layer(t)})")
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_imports_inside_functions_are_heavy_optional_modules_only():
    mods = modules()
    bad = []
    for m, f in mods.items():
        for name, local, line in imports(f, m):
            allowed = name.split(".")[0] in ALLOWED_LOCAL or any(
                name == a or name.startswith(a + ".") for a in ALLOWED_LOCAL
            )
            if local and not allowed and resolve(name, mods) is not None:
                bad.append(f"{f.relative_to(SRC)}:{line} imports {name} inside a function")
            elif local and not allowed and name.split(".")[0] != "islands":
                top = name.split(".")[0]
                if top not in (
                    "torch",
                    "numpy",
                    "os",
                    "sys",
                    "json",
                    "time",
                    "math",
                    "io",
                    "subprocess",
                    "importlib",
                    "typing",
                    "dataclasses",
                    "pathlib",
                    "shutil",
                    "signal",
                    "socket",
                    "tempfile",
                    "threading",
                    "random",
                    "copy",
                    "pickle",
                    "hashlib",
                    "statistics",
                ):
                    bad.append(f"{f.relative_to(SRC)}:{line} imports {name} inside a function")
    assert not bad, f"{len(bad)} function-local imports outside ALLOWED_LOCAL:\n" + "\n".join(bad)


# Inside islands.checkpoint (docs/architecture.md, "Checkpointing"): errors < codec < store < policy < the CLI and
# the package's public face (its __init__), each importing only its own rank and lower ones.
CHECKPOINT_RANKS = {"errors": 0, "codec": 1, "store": 2, "policy": 3, "cli": 4, "": 4}


def checkpoint_rank(module: str) -> int:
    part = module.removeprefix("islands.checkpoint").lstrip(".").split(".")[0]
    assert part in CHECKPOINT_RANKS, f"{module}: add its part to CHECKPOINT_RANKS (and docs/architecture.md)"
    return CHECKPOINT_RANKS[part]


def test_checkpoint_is_codec_then_store_then_policy():
    mods = modules()
    inside = {m: f for m, f in mods.items() if m == "islands.checkpoint" or m.startswith("islands.checkpoint.")}
    assert {"islands.checkpoint.codec", "islands.checkpoint.store", "islands.checkpoint.policy"} <= set(inside)
    bad = []
    for m, f in inside.items():
        by_line: dict[int, set[str]] = {}
        for name, _, line in imports(f, m):
            t = resolve(name, mods)
            if t is not None and (t == "islands.checkpoint" or t.startswith("islands.checkpoint.")):
                by_line.setdefault(line, set()).add(t)
        for line, targets in by_line.items():
            # `from islands.checkpoint.codec import blob_header` imports the submodule, not the package's face
            targets = {t for t in targets if not any(o.startswith(t + ".") for o in targets)}
            for t in sorted(targets - {m}):
                if checkpoint_rank(t) > checkpoint_rank(m):
                    bad.append(f"{f.relative_to(SRC)}:{line} ({m}) imports {t}, a later part of islands.checkpoint")
    assert not bad, "imports against codec < store < policy:\n" + "\n".join(bad)


# Inside the components' layer, an order too (issue #33): the world and its comms at the bottom, what launches
# processes above the testbed it places them on, then the compressors, aggregators and checkpoints that strategies
# use, the strategies (sync), and last what is built from strategies. A component imports only its own sub-layer
# and those below it; `islands.runtime.launch` counts as its own component (it starts the world, which never
# imports it).
SUBLAYERS = {
    "runtime": 0,
    "data": 0,
    "optim": 0,
    "practices": 0,
    "testbed": 1,  # network namespaces and shaped links; its etcd cluster runs the elastic store
    "runtime.launch": 2,  # starts ranks, optionally inside testbed hosts
    "compress": 3,
    "aggregate": 3,
    "faults": 3,
    "checkpoint": 3,
    "measure": 3,
    "memory": 3,
    "control": 3,
    "report": 3,
    "dashboard": 3,
    "models": 4,
    "observe": 4,
    "robust": 4,
    "sync": 5,
    "parallel": 6,
    "outer": 6,
    "inner": 7,
}


def component(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) < 2 or LAYERS.get(parts[1]) != 1:
        return None
    return "runtime.launch" if parts[1:3] == ["runtime", "launch"] else parts[1]


def test_every_component_has_a_sublayer():
    missing = sorted({c for m in modules() if (c := component(m)) is not None and c not in SUBLAYERS})
    assert not missing, f"add these to SUBLAYERS (and docs/architecture.md): {missing}"


def test_components_import_only_their_sublayer_and_below():
    bad = []
    for m, targets in graph().items():
        here = component(m)
        for t in targets:
            there = component(t)
            if here is None or there is None or here == there:
                continue
            if SUBLAYERS[there] > SUBLAYERS[here]:
                bad.append(f"{m} ({here}, sub-layer {SUBLAYERS[here]}) imports {t} ({there}, {SUBLAYERS[there]})")
    assert not bad, "imports against the components' order:\n" + "\n".join(sorted(bad))


def test_no_module_islands_runs_with_dash_m_is_imported_by_its_own_packages():
    """`python -m islands.x.y` imports the packages islands and islands.x first; had they imported islands.x.y on the
    way, runpy executes it a second time and warns on stderr (the parameter server's processes did, session 33)."""
    import re

    g, mods = graph(), modules()
    run = {m for f in mods.values() for m in re.findall(r'"-m",\s*"(islands\.[\w.]+)"', f.read_text())}
    assert "islands.sync.outer.ps_process" in run  # the pattern finds what it is for

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo.extend(g.get(m, ()))
        return seen

    for target in sorted(run & set(mods)):
        parts = target.split(".")
        packages = [".".join(parts[:i]) for i in range(1, len(parts))]
        imported = set().union(*(reach(p) for p in packages))
        assert target not in imported, f"{target} is imported by its packages ({packages}): runpy would run it twice"
