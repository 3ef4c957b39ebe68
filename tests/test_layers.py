"""The layering of ``lowprec`` (docs/architecture.md), checked on the source with ``ast``.

* ``lowprec/kernels/`` imports nothing of lowprec but ``kernels/``;
* the generic modules of ``lowprec/formats/`` (``formats/*.py``) import only ``kernels/``
  and each other;
* a format folder (``lowprec/formats/<format>/``) imports only ``kernels/``, the generic
  ``formats/*.py`` modules and its own folder: never a sibling format, never a higher layer;
* ``lowprec/linear/`` reads the formats only through ``formats/*.py`` (a grouped path
  reads its own format's folder);
* ``lowprec/debug/`` is imported only by itself and ``compare/``, and never imports
  ``compare/``;
* the files of ``LowprecModule``'s mixins (``modules/roles.py``, ``scaling.py``, ...) are
  imported only from ``modules/``: the rest of lowprec reaches them through the class;
* the top level holds packages, plus ``__init__``, ``__main__`` and ``activations``;
* a module enters another top-level package through a package's ``__init__`` (the
  package's, or a format folder's), never one of its modules; the kernel library is the
  exception (its modules import Triton on import, so each is entered by name);
* no import cycles between modules.

Every import counts, at module level or inside a function, except those under
``if TYPE_CHECKING:`` (never run). A package's ``__init__`` that only re-exports has no edges
of its own, and an import of a name it re-exports is an edge to the module defining it; an
``__init__`` that defines functions or classes is checked like any module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "lowprec"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


MODULES = _modules()
PACKAGES = {name for name, p in MODULES.items() if p.name == "__init__.py"}


def _resolve(module: str, level: int, target: str | None) -> str:
    """Absolute name of ``from <level dots><target>`` inside ``module``."""
    if level == 0:
        return target or ""
    base = module.split(".") if module in PACKAGES else module.split(".")[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _imports(tree: ast.AST):
    """Import nodes, with those under ``if TYPE_CHECKING:`` left out."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return [n for n in ast.walk(tree)
            if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in skip]


def _raw_targets(module: str) -> list[tuple[str, str | None]]:
    """(module imported from, name imported or None) of every import of lowprec."""
    tree = ast.parse(MODULES[module].read_text())
    out = []
    for node in _imports(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names if a.name.split(".")[0] == "lowprec"]
        else:
            src = _resolve(module, node.level, node.module)
            if src.split(".")[0] == "lowprec":
                out += [(src, a.name) for a in node.names]
    return out


def _defining_module(package: str, name: str, seen=()) -> str:
    """The module a package's ``__init__`` takes ``name`` from (the package itself when it
    defines the name or the name is not found)."""
    if package in seen:
        return package
    for src, imported in _raw_targets(package):
        if imported == name:
            if src in PACKAGES:
                return _defining_module(src, name, seen + (package,))
            return src if src in MODULES else package
    return package


def edges(module: str) -> set[str]:
    """The lowprec modules ``module`` imports (see the module docstring)."""
    out = set()
    for src, name in _raw_targets(module):
        if name is not None and f"{src}.{name}" in MODULES:
            out.add(f"{src}.{name}")  # a submodule
        elif src in PACKAGES and name is not None:
            out.add(_defining_module(src, name))
        elif src in MODULES:
            out.add(src)
    out.discard(module)
    return out


def _is_kernels(m: str) -> bool:
    return m == "lowprec.kernels" or m.startswith("lowprec.kernels.")


def _format_folder(m: str) -> str | None:
    """The format folder ``m`` lies in (``"float8"``, ...), else None."""
    parts = m.split(".")
    if len(parts) >= 3 and parts[:2] == ["lowprec", "formats"] \
            and f"lowprec.formats.{parts[2]}" in PACKAGES:
        return parts[2]
    return None


def _is_generic_format(m: str) -> bool:
    """A generic ``formats/*.py`` module (not the package, not a format folder)."""
    parts = m.split(".")
    return len(parts) == 3 and parts[:2] == ["lowprec", "formats"] and m not in PACKAGES


def _defines_code(package: str) -> bool:
    """Whether a package's ``__init__`` defines functions or classes of its own (it is then
    a module like any other, not only a list of re-exports)."""
    tree = ast.parse(MODULES[package].read_text())
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
               for n in tree.body)


CODE_PACKAGES = {p for p in PACKAGES if _defines_code(p)}


def _sources():
    """Modules whose imports are checked: every module, and the packages' ``__init__`` that
    define code (a re-exporting ``__init__``'s imports are no edges of its own)."""
    return [m for m in MODULES if m not in PACKAGES or m in CODE_PACKAGES]


def test_kernels_import_only_kernels():
    bad = [(m, t) for m in _sources() if _is_kernels(m) for t in edges(m) if not _is_kernels(t)]
    assert not bad, f"kernels/ imports outside kernels/: {bad}"


def test_generic_format_modules_import_only_kernels_and_each_other():
    bad = [(m, t) for m in _sources() if _is_generic_format(m) for t in edges(m)
           if not (_is_kernels(t) or _is_generic_format(t))]
    assert not bad, f"generic formats/*.py modules import a format folder or a higher layer: {bad}"


def test_format_folders_import_only_their_own_folder_and_below():
    bad = []
    for m in _sources():
        fmt = _format_folder(m)
        if fmt is None:
            continue
        for t in edges(m):
            if not (_is_kernels(t) or _is_generic_format(t) or _format_folder(t) == fmt):
                bad.append((m, t))
    assert not bad, f"format folders import a sibling format or a higher layer: {bad}"


def test_linear_reads_formats_through_their_base():
    """``linear/`` reads the formats through their shared modules (``formats/*.py``: the
    quantizer and tensor bases, the traced forms' base): never a format's folder, except
    the grouped (MoE) paths, each over its own format's experts and kernels."""
    bad = [(m, t) for m in _sources() if _within(m, "lowprec.linear")
           and not m.startswith("lowprec.linear.grouped") for t in edges(m)
           if _format_folder(t) is not None]
    assert not bad, f"linear/ imports a format's folder: {bad}"
    # the check sees such imports where they are allowed
    assert any(_format_folder(t) == "nvfp4" for t in edges("lowprec.linear.grouped_nvfp4"))


def _within(m: str, package: str) -> bool:
    return m == package or m.startswith(package + ".")


def test_debug_sits_at_the_top():
    """``lowprec.debug`` hooks whole models from above: nothing imports it but ``compare/``
    (which records through its hooks), and it imports nothing of ``compare/``."""
    bad = [(m, t) for m in _sources() for t in edges(m)
           if _within(t, "lowprec.debug")
           and not (_within(m, "lowprec.debug") or _within(m, "lowprec.compare"))]
    bad += [(m, t) for m in _sources() if _within(m, "lowprec.debug") for t in edges(m)
            if _within(t, "lowprec.compare")]
    assert not bad, f"imports of lowprec.debug from below, or of compare/ from it: {bad}"


def _mixin_modules() -> set[str]:
    """The modules ``LowprecModule`` (``modules/base.py``) takes its mixins from."""
    base = "lowprec.modules.base"
    tree = ast.parse(MODULES[base].read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LowprecModule")
    bases = {ast.unparse(b) for b in cls.bases}
    return {src for src, name in _raw_targets(base)
            if name in bases and _within(src, "lowprec.modules")}


def test_lowprec_module_mixins_stay_inside_modules():
    """The files ``LowprecModule`` is split into by job are its own layout: the rest of
    lowprec imports the class (``modules/base.py``), never one of its mixins' files, so
    that they can be split or merged again without touching a caller."""
    mixins = _mixin_modules()
    assert {"lowprec.modules.roles", "lowprec.modules.scaling"} <= mixins  # the check sees them
    bad = [(m, t) for m in _sources() if not _within(m, "lowprec.modules")
           for t in edges(m) & mixins]
    assert not bad, f"imports of LowprecModule's mixin files from outside modules/: {bad}"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
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
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


#: the modules the top level holds besides its packages
TOP_LEVEL_MODULES = {"lowprec.__main__", "lowprec.activations"}


def test_top_level_holds_packages():
    """``lowprec/`` holds packages (recipe, gemm, linear, compile, memory, model, ...) and
    only ``__init__``, ``__main__`` and ``activations`` beside them."""
    top = {m for m in MODULES if m.count(".") == 1 and m not in PACKAGES}
    assert top == TOP_LEVEL_MODULES, f"modules at the top level: {sorted(top - TOP_LEVEL_MODULES)}"


def _top(m: str) -> str:
    return ".".join(m.split(".")[:2])


def _entered_past_init(module: str) -> list[str]:
    """The modules of other top-level packages ``module`` imports from directly rather than
    through a package's ``__init__`` (the kernel library excepted)."""
    bad = []
    for src, name in _raw_targets(module):
        if _top(src) in (_top(module), "lowprec", "lowprec.kernels") or src in TOP_LEVEL_MODULES:
            continue
        if src not in PACKAGES:
            bad.append(f"{src}" + (f".{name}" if name else ""))
    return bad


def test_packages_are_entered_through_their_init():
    """Another package's modules are its own layout: the rest of lowprec imports what a
    package's ``__init__`` exports (``from ..recipe import DelayedScaling``), so that its
    modules can be split or merged without touching a caller."""
    bad = {m: b for m in MODULES for b in [_entered_past_init(m)] if b}
    assert not bad, f"imports past a package's __init__: {bad}"


def test_entering_past_init_is_seen(tmp_path, monkeypatch):
    """The check above sees a deep import, and lets an ``__init__`` import or a kernel
    module pass."""
    monkeypatch.setitem(MODULES, "lowprec.linear.probe", tmp_path / "probe.py")
    (tmp_path / "probe.py").write_text(
        "from ..recipe.state import RecipeState\nfrom ..recipe import DelayedScaling\n"
        "from ..kernels.grid import cdiv\nfrom ..formats.float8 import Float8Tensor\n"
        "def f():\n    import lowprec.gemm.dispatch\n")
    assert _entered_past_init("lowprec.linear.probe") == ["lowprec.recipe.state.RecipeState",
                                                          "lowprec.gemm.dispatch"]


def test_no_import_cycles():
    graph = {m: edges(m) for m in _sources()}
    assert not _cycles(graph), f"import cycles: {_cycles(graph)}"


def test_packages_defining_code_are_checked():
    """``kernels/__init__`` defines functions: it is checked like any module; ``fused/__init__``
    only re-exports, so its imports are no edges of its own."""
    assert "lowprec.kernels" in CODE_PACKAGES and "lowprec.kernels" in _sources()
    assert "lowprec.fused" not in _sources()


@pytest.mark.parametrize("module, expected", [
    ("lowprec.formats.mxfp8.launch", "lowprec.kernels.grid"),
    ("lowprec.formats.float8.quantizer", "lowprec.formats.float8.launch"),
    ("lowprec.compare.probe", "lowprec.debug.hooks"),
])
def test_edges_see_imports(module, expected):
    """The checks above see module-level and function-level imports (a guard against a
    checker that finds nothing)."""
    assert expected in edges(module)


#: the built-in recipe classes (``lowprec.recipe``); ``Recipe``, their base, is a type
#: check any entry point may make of its argument
RECIPE_CLASSES = {"DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling",
                  "MXFP8BlockScaling", "NVFP4BlockScaling", "CustomRecipe"}
#: where a recipe's type decides anything: its definitions, and the state built from it
SWITCHES_ON_RECIPE_TYPE = {"lowprec.recipe.recipes", "lowprec.recipe.state"}


def _recipe_type_checks(tree: ast.AST) -> list[str]:
    """``isinstance(_, X)`` / ``type(_) is X`` of a built-in recipe class X, as source text."""
    found = []
    for node in ast.walk(tree):
        classes = []
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" \
                and len(node.args) == 2:
            arg = node.args[1]
            classes = arg.elts if isinstance(arg, ast.Tuple) else [arg]
        elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Call) \
                and getattr(node.left.func, "id", None) == "type":
            classes = node.comparators
        names = {getattr(c, "id", getattr(c, "attr", None)) for c in classes}
        if names & RECIPE_CLASSES:
            found.append(ast.unparse(node))
    return found


def test_one_place_switches_on_the_recipe_type():
    """Only ``recipe/recipes.py`` and ``recipe/state.py`` ask which built-in recipe a recipe
    is; everything else reads the quantizers (or ``state.stateful``)."""
    bad = {m: checks for m, p in MODULES.items() if m not in SWITCHES_ON_RECIPE_TYPE
           for checks in [_recipe_type_checks(ast.parse(p.read_text()))] if checks}
    assert not bad, bad


def test_recipe_type_checks_are_seen():
    tree = ast.parse("isinstance(r, (DelayedScaling, X))\ntype(r) is lowprec.CustomRecipe\n"
                     "isinstance(r, Recipe)\n")
    assert _recipe_type_checks(tree) == ["isinstance(r, (DelayedScaling, X))",
                                         "type(r) is lowprec.CustomRecipe"]


BACKWARD_MODE_STRINGS = {"default", "high_precision", "dequantized"}


def _backward_mode_string_compares(tree: ast.AST) -> list[str]:
    """Comparisons of a ``*mode`` expression with a backward mode's string (``==``,
    ``!=``, ``in`` a tuple of them), as source text."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        consts = set()
        for side in sides:
            elts = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
            consts |= {e.value for e in elts if isinstance(e, ast.Constant)}
        named = any(ast.unparse(s).endswith("mode") for s in sides)
        if named and consts & BACKWARD_MODE_STRINGS:
            found.append(ast.unparse(node))
    return found


def test_backward_mode_is_compared_as_enum_members():
    """``BackwardMode`` members, never their strings, in comparisons: one spelling, which a
    renamed member would break loudly."""
    bad = {m: found for m, p in MODULES.items()
           for found in [_backward_mode_string_compares(ast.parse(p.read_text()))] if found}
    assert not bad, bad


def test_backward_mode_string_compares_are_seen():
    tree = ast.parse('mode == "default"\nctx.backward_mode != "dequantized"\n'
                     'backward_mode in ("default", "x")\nmode == BackwardMode.DEFAULT\n'
                     'policy == "default"\n')
    assert _backward_mode_string_compares(tree) == [
        "mode == 'default'", "ctx.backward_mode != 'dequantized'",
        "backward_mode in ('default', 'x')"]
