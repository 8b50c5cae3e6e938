"""The package's imports run one way: each part of ntp_ds imports only the parts listed before it, lowest first, as
docs/design.md lists them ("Parts and data flow"), and no module imports itself back through others. Every import
counts: those inside functions and those for type checking only are dependencies too."""

import ast
from pathlib import Path

import ntp_ds

ROOT = Path(ntp_ds.__file__).resolve().parent

PARTS = [
    ("envs", ("ntp_ds.envs",)),
    ("layout", ("ntp_ds.layout",)),
    ("batch", ("ntp_ds.batch",)),
    ("comm", ("ntp_ds.comm",)),
    ("control", ("ntp_ds.control",)),
    ("models", ("ntp_ds.models",)),
    ("engine", ("ntp_ds.engine",)),
    ("recovery", ("ntp_ds.recovery",)),
    ("supervise", ("ntp_ds.supervise",)),
    ("testing", ("ntp_ds.testing",)),
    ("schema", ("ntp_ds.schema", "ntp_ds.overrides")),
    ("sim", ("ntp_ds.sim",)),
    ("goodput", ("ntp_ds.goodput",)),
    ("handle", ("ntp_ds", "ntp_ds.fault_tolerant")),
    ("app", ("ntp_ds.run", "ntp_ds.train", "ntp_ds.cli", "ntp_ds.report")),
]
"""Lowest first. `handle`: the package's own `initialize` and the public handle (`FaultTolerantEngine`); `app`: the
`ntp-ds` commands."""


def module_name(path: Path) -> str:
    parts = ["ntp_ds", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def part_of(module: str) -> int:
    """The index in PARTS of the part that holds `module` (the longest prefix that names it)."""
    best = None
    for i, (_, prefixes) in enumerate(PARTS):
        for prefix in prefixes:
            if module == prefix or (module.startswith(prefix + ".") and prefix != "ntp_ds"):
                if best is None or len(prefix) > best[1]:
                    best = (i, len(prefix))
    if best is None:
        raise AssertionError(f"{module} belongs to no part: add it to PARTS here and to docs/design.md's list")
    return best[0]


def imports_of(module: str) -> set[str]:
    """The ntp_ds modules `module` imports, anywhere in its file. `from package import name` counts as an import of
    the submodule where `name` is one, else of the package itself (its __init__)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "ntp_ds"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            if base.split(".")[0] != "ntp_ds":
                continue
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return found - {module}


GRAPH = {m: imports_of(m) for m in MODULES}


def test_every_import_runs_down_the_parts():
    upward = [f"{m} ({PARTS[part_of(m)][0]}) imports {t} ({PARTS[part_of(t)][0]})"
              for m, targets in sorted(GRAPH.items()) for t in sorted(targets) if part_of(t) > part_of(m)]
    assert not upward, "imports from a lower part to a higher one:\n" + "\n".join(upward)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_imports_itself_back():
    assert not circles(GRAPH), f"import circles: {circles(GRAPH)}"


def test_the_walk_sees_an_upward_import_and_a_circle():
    # The checks themselves: an import from the lowest part into the highest, and two modules importing each other.
    assert part_of("ntp_ds.layout.units") < part_of("ntp_ds.run.trainer")
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert "ntp_ds.comm.wire" in GRAPH["ntp_ds.engine.engine"], "the walk finds the engine's import of the wire"
    assert "ntp_ds.engine.initialize" in GRAPH["ntp_ds"], "and imports inside functions"


def test_test_modules_share_helpers_not_each_other():
    # What tests share lives in tests/helpers/ (and tests/conftest.py), not in another test module.
    tests = Path(__file__).resolve().parent
    borrowed = []
    for path in sorted(tests.rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            borrowed += [f"{path.relative_to(tests)} imports {n}" for n in names
                         if n.startswith("tests.") and n.rpartition(".")[2].startswith("test_")]
    assert not borrowed, "\n".join(borrowed)


def test_environment_variables_are_named_in_one_module():
    # Every variable ntp_ds reads or sets is spelled once, in ntp_ds/envs.py; other modules use its constants.
    from ntp_ds import envs

    names = {v for k, v in vars(envs).items() if k.isupper() and isinstance(v, str)}
    spelled = [f"{m}:{node.lineno} {node.value}" for m, path in sorted(MODULES.items()) if m != "ntp_ds.envs"
               for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.Constant) and node.value in names]
    assert not spelled, "\n".join(spelled)


STORE_ROOTS = ("launch", "sentinel", "job", "run", "heartbeat", "node", "alarm", "fence", "fault", "join", "decision",
               "membership", "pg", "left", "drain", "recovery")
"""The first component of every key ntp_ds keeps in the job's store (ntp_ds/control/keys.py)."""


def _spells_a_store_key(node) -> bool:
    """A string constant (an f-string's literal pieces included) that starts with a store key's root and a slash
    (the exit and fence logs' one-word names are also JSON fields elsewhere: not looked for)."""
    if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
        return False
    root, slash, _ = node.value.partition("/")
    return bool(slash) and root in STORE_ROOTS


def test_store_keys_are_named_in_one_module():
    # Every key ntp_ds keeps in the job's store is spelled once, in ntp_ds/control/keys.py; the nccl_model's
    # communicators keep keys of their own under a prefix of their own (not the job's).
    spelled = [f"{m}:{node.lineno}" for m, path in sorted(MODULES.items())
               if m not in ("ntp_ds.control.keys", "ntp_ds.testing.nccl_communicator")
               for node in ast.walk(ast.parse(path.read_text())) if _spells_a_store_key(node)]
    assert not spelled, "\n".join(spelled)


def test_the_store_key_check_sees_a_key_spelled_elsewhere():
    spelled = [n for n in ast.walk(ast.parse('k = f"membership/{g}/acks"\nj = "join/requests"\n'
                                             'ok = f"time/{b}_s"\nfine = f"{name}/count"\n')) if _spells_a_store_key(n)]
    assert len(spelled) == 2
