"""The package's shape: every import points down the package order (the README's "Layout":
the errors and data at the bottom, then the driver calls, the IR, the spec's syntax and
checks, the passes, the targets, the front end, the pipeline, codegen, build, the runtime,
context parallelism, the tools, the CLI), no import cycles (every import counts: module level, inside functions
and under TYPE_CHECKING; the targets' packages, which fadsl.targets loads through importlib,
are read like any module), and target knowledge only in fadsl/targets (no string outside it
names a target or an architecture in code)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "fadsl"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str) -> set[str]:
    """The fadsl modules that module ``name`` imports (a package's ``from . import x`` counts
    as importing x when x is a module)."""
    path = MODULES[name]
    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                target = ".".join(parts + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in MODULES else target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in MODULES and m != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


# The package order, bottom first: a module may import its own layer and those before it.
# (fadsl/__init__.py, the public API, is the top and imports anything.)
LAYERS = (
    ("fadsl.errors", "fadsl._data", "fadsl._version", "fadsl.atomic"),
    ("fadsl.cudadriver",),  # the driver API: TMA descriptors (targets) and launches (runtime)
    ("fadsl.ir",),
    ("fadsl.spec",),  # the spec's syntax nodes and the checks the targets' validation shares
    ("fadsl.passes",),  # generic over a target's sync model, handed to them by the pipeline
    ("fadsl.targets",),
    ("fadsl.frontend",),
    ("fadsl.pipeline",),
    ("fadsl.codegen",),
    ("fadsl.build",),
    ("fadsl.runtime", "fadsl.fp8"),  # fadsl.fp8: the 8-bit calls' quantize, rotate (torch alone)
    ("fadsl.distributed",),  # context parallelism over torch.distributed, on the runtime's calls
    ("fadsl.tools",),
    ("fadsl.cli",),
    ("fadsl",),
)


def layer_of(module: str) -> int:
    """The layer of ``module``: the one of its longest listed package prefix."""
    found = [
        (len(prefix), n)
        for n, prefixes in enumerate(LAYERS)
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    ]
    assert found, f"{module} is in no layer: add it to LAYERS"
    return max(found)[1]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """'a -> b' for each import of a module from a higher layer."""
    return [
        f"{module} -> {imported}"
        for module in sorted(graph)
        for imported in sorted(graph[module])
        if layer_of(imported) > layer_of(module)
    ]


def test_imports_point_down_the_package_order():
    graph = {name: imports_of(name) for name in MODULES}
    assert upward_imports(graph) == []


def test_the_order_check_finds_an_upward_import():
    """An injected import of the runtime by a target, and of the front end by the IR."""
    graph = {name: set(imports_of(name)) for name in MODULES}
    graph["fadsl.targets.sm90.host.tma"].add("fadsl.runtime.driver")
    graph["fadsl.ir.kernel"].add("fadsl.frontend.lower")
    assert upward_imports(graph) == [
        "fadsl.ir.kernel -> fadsl.frontend.lower",
        "fadsl.targets.sm90.host.tma -> fadsl.runtime.driver",
    ]


def test_every_module_has_a_layer():
    for name in MODULES:
        layer_of(name)


def test_no_import_cycles():
    graph = {name: imports_of(name) for name in MODULES}
    assert cycles(graph) == []


def test_the_cycle_check_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_the_import_reader_sees_imports_inside_functions_and_type_checking():
    assert "fadsl.runtime.custom_op" in imports_of("fadsl.runtime.attention")  # in a method
    assert "fadsl.spec.checks" in imports_of("fadsl.targets")  # under TYPE_CHECKING


TARGET_WORDS = re.compile(r"\bsm_?\d+a?(?!\d)|\bhopper\b|\bampere\b", re.IGNORECASE)


def strings_in_code(path: Path):
    """(line, text) of each string constant that is not a docstring."""
    tree = ast.parse(path.read_text())
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) not in docstrings:
                yield node.lineno, node.value


def test_target_knowledge_lives_in_the_targets_package():
    """No string outside fadsl/targets names a target or an architecture: what differs between
    instruction sets is asked of the target (its capabilities, launch, report)."""
    found = []
    for name, path in MODULES.items():
        if name.startswith("fadsl.targets"):
            continue
        for line, text in strings_in_code(path):
            if TARGET_WORDS.search(text):
                found.append(f"{path.relative_to(ROOT)}:{line}: {text!r}")
    assert found == []


TARGET_PACKAGE = re.compile(r"^fadsl\.targets\.sm\d")


def target_package_imports(graph: dict[str, set[str]]) -> list[str]:
    """'a -> b' for each import of a target's own package (fadsl.targets.sm*) by a module
    outside fadsl.targets: the rest of fadsl asks the Target (fadsl.targets.get) instead."""
    return [
        f"{module} -> {imported}"
        for module in sorted(graph)
        if not module.startswith("fadsl.targets")
        for imported in sorted(graph[module])
        if TARGET_PACKAGE.match(imported)
    ]


def test_only_the_targets_import_a_targets_package():
    graph = {name: imports_of(name) for name in MODULES}
    assert target_package_imports(graph) == []


def test_the_target_package_check_finds_an_import():
    graph = {name: set(imports_of(name)) for name in MODULES}
    graph["fadsl.tools.tiletrace"].add("fadsl.targets.sm90.caps")
    graph["fadsl.targets.launch"].add("fadsl.targets.sm90.caps")  # (inside: allowed)
    assert target_package_imports(graph) == ["fadsl.tools.tiletrace -> fadsl.targets.sm90.caps"]


def test_what_the_runtime_asks_of_a_targets_settings_is_typed():
    """Config.features: the runtime's questions (fadsl.ir.TargetConfig's attributes) are
    fields of each target's settings class with the same types, and a target without
    settings answers as a plain forward kernel; no module outside fadsl/targets reads
    ``Config.ext`` (it asks ``Config.features``)."""
    import dataclasses
    import typing

    from fadsl.ir import TargetConfig
    from fadsl.pipeline import compile_source
    from fadsl.targets.sm90.config import Sm90Config

    asked = typing.get_type_hints(TargetConfig)
    fields = {f.name: f for f in dataclasses.fields(Sm90Config)}
    hints = typing.get_type_hints(Sm90Config)
    assert asked and all(name in fields and hints[name] == asked[name] for name in asked)
    plain = compile_source((ROOT / "examples" / "fa2_kernel1.fa").read_text(), "k.fa")
    cfg = plain.kernel.config
    assert cfg.ext is None and not cfg.features.varlen and cfg.features.kv_cache == -1
    readers = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for name, path in MODULES.items()
        if not name.startswith(("fadsl.targets", "fadsl.ir"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr == "ext"
    ]
    assert readers == []


# The packages whose types must have names of their own (a name means one concept): all.
NAMED_ONCE = tuple(sorted({".".join(name.split(".")[:2]) for name in MODULES if "." in name}))


def class_definitions(sources: dict[str, str]) -> dict[str, list[str]]:
    """Each class name -> the modules (of ``sources``: module -> text) that define it."""
    found: dict[str, list[str]] = {}
    for module, text in sorted(sources.items()):
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, []).append(module)
    return found


def names_defined_twice(sources: dict[str, str]) -> dict[str, list[str]]:
    return {name: found for name, found in class_definitions(sources).items() if len(found) > 1}


def test_no_type_name_is_defined_twice_in_the_package():
    """A type of the IR, the passes, a target or any other package has a name of its own: the sm90 backward's
    warp roles, loop phases, wait parities and staged tiles are not the IR's Role, Phase,
    Parity and Buffer; the async model's GenericAccess and AccessInterval are not the IR's
    Access and Op; the forward's CommittedWgmma is not the backward's WgmmaGroup; the tile
    trace's TraceLayout is not the backward plan's Layout."""
    sources = {
        name: path.read_text() for name, path in MODULES.items() if name.startswith(NAMED_ONCE)
    }
    assert {p for p in NAMED_ONCE if any(m.startswith(p) for m in sources)} == set(NAMED_ONCE)
    assert names_defined_twice(sources) == {}


def test_the_name_check_finds_a_type_defined_twice():
    sources = {
        "fadsl.ir.kernel": "class Access:\n    pass\n",
        "fadsl.passes.asyncmodel.model": "class Access:\n    pass\nclass Span: ...\n",
        "fadsl.targets.sm90.caps": "def f():\n    class Span: ...\n",
    }
    assert names_defined_twice(sources) == {
        "Access": ["fadsl.ir.kernel", "fadsl.passes.asyncmodel.model"],
        "Span": ["fadsl.passes.asyncmodel.model", "fadsl.targets.sm90.caps"],
    }
