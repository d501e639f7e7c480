"""The house rules of the package's layout (docs/layout.md), read from the source with `ast` (no spawn, no
model): no module over 800 lines, module docstrings of a few lines (the contracts are in docs/modules/), the
rules and the runtime importing nothing of the planning side, and every autoshard name or file a comment,
docstring or docs page quotes existing."""

from __future__ import annotations

import ast
import builtins
import io
import re
import tokenize
from functools import cache
from pathlib import Path

import autoshard

ROOT = Path(autoshard.__file__).parent
MODULES = sorted(ROOT.rglob("*.py"))
MAX_LINES = 800
MAX_DOCSTRING_LINES = 12


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT.parent))


@cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def test_no_module_over_800_lines():
    long = {_rel(p): n for p in MODULES if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these by what they do (docs/layout.md): {long}"


def test_module_docstrings_say_what_the_module_is_for_in_a_few_lines():
    """Every module opens with a docstring of at most 12 lines; the details belong in docs/."""
    missing = [_rel(p) for p in MODULES if ast.get_docstring(_tree(p)) is None and p.read_text().strip()]
    long = {_rel(p): n for p in MODULES
            if (n := len((ast.get_docstring(_tree(p), clean=False) or "").strip().splitlines())) > MAX_DOCSTRING_LINES}
    assert not missing, f"modules without a docstring: {missing}"
    assert not long, f"module docstrings over {MAX_DOCSTRING_LINES} lines (move the details to docs/): {long}"


def _imports(path: Path, *, module_level: bool) -> set[str]:
    """The modules `path` imports (and `module.name` of every name imported from one); inside functions too
    unless `module_level`."""
    nodes = _tree(path).body if module_level else ast.walk(_tree(path))
    out = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return out


def _module_path(name: str) -> Path | None:
    base = ROOT.parent / name.replace(".", "/")
    return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.exists()), None)


def test_rules_and_runtime_import_nothing_of_the_planning_side():
    """The runtime imports nothing from autoshard.passes; the rules (which planner and runtime both read)
    import no pass, not the cost model nor the SymPy cost table, and nothing they reach at module level
    imports SymPy or OR-Tools."""
    bad = []
    for room, refused in (("runtime", ("autoshard.passes",)),
                          ("rules", ("autoshard.passes", "autoshard.cost_table", "sympy", "ortools"))):
        for path in sorted((ROOT / room).glob("*.py")):
            bad += [(f"{room}/{path.name}", dep) for dep in sorted(_imports(path, module_level=False))
                    if any(dep == r or dep.startswith(r + ".") for r in refused)]
    assert not bad, bad
    seen, todo = set(), [f"autoshard.rules.{p.stem}" for p in (ROOT / "rules").glob("*.py")]
    while todo:
        name = todo.pop()
        path = _module_path(name)
        if name in seen or path is None:
            continue
        seen.add(name)
        for dep in _imports(path, module_level=True):
            if dep.split(".")[0] in ("sympy", "ortools"):
                bad.append((name, dep))
            elif dep.startswith("autoshard."):
                todo.append(dep)
    assert not bad, f"the rules reach SymPy / OR-Tools: {bad}"


# -- the names comments and docstrings quote ------------------------------------------------------------------

def _members(node: ast.AST) -> set[str]:
    """The names a module or class body defines: functions, classes, assignments, imports; a class also
    its `self.x = ...` attributes."""
    out = set()
    for child in node.body:
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(child.name)
        elif isinstance(child, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in child.targets if isinstance(child, ast.Assign) else [child.target]:
                out |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(child, (ast.Import, ast.ImportFrom)):
            out |= {(a.asname or a.name).split(".")[0] for a in child.names}
        elif isinstance(child, (ast.If, ast.Try)):
            out |= _members(ast.Module(body=child.body + getattr(child, "orelse", []), type_ignores=[]))
    if isinstance(node, ast.ClassDef):
        out |= {t.attr for f in ast.walk(node) if isinstance(f, (ast.Assign, ast.AnnAssign))
                for t in (f.targets if isinstance(f, ast.Assign) else [f.target])
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    return out


@cache
def _modules_named() -> dict[str, list[Path]]:
    """Every module and package of autoshard by its last name (`cost`, `planner`) and its dotted path
    (`passes.cost.cost`, `autoshard.ir`)."""
    out: dict[str, list[Path]] = {}
    for path in MODULES:
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        for i in range(len(parts)):
            out.setdefault(".".join(parts[i:]), []).append(path)
    return out


@cache
def _classes() -> dict[str, list[ast.ClassDef]]:
    out: dict[str, list[ast.ClassDef]] = {}
    for path in MODULES:
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.ClassDef):
                out.setdefault(node.name, []).append(node)
    return out


@cache
def _defined() -> frozenset[str]:
    """Every name defined, imported or taken as a parameter anywhere in autoshard, the builtins, and torch's
    functions and tensor / module methods (`nonzero()`, `named_parameters()`)."""
    import torch

    names = set(dir(builtins)) | set(dir(torch)) | set(dir(torch.Tensor)) | set(dir(torch.nn.Module))
    for path in MODULES:
        for node in ast.walk(_tree(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names |= {(a.asname or a.name).split(".")[-1] for a in node.names}
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
    return frozenset(names)


@cache
def _strings() -> frozenset[str]:
    """Every string constant of the code (a logger's name, `autoshard.cache`, is quoted as one)."""
    return frozenset(n.value for p in MODULES for n in ast.walk(_tree(p))
                     if isinstance(n, ast.Constant) and isinstance(n.value, str))


def _resolves(scope: ast.AST, rest: list[str]) -> bool:
    """`rest` (attribute names) names something inside `scope` (a module or class)."""
    if not rest:
        return True
    members = _members(scope)
    if rest[0] not in members:
        return False
    inner = [n for n in scope.body if isinstance(n, ast.ClassDef) and n.name == rest[0]]
    return not inner or len(rest) == 1 or any(_resolves(c, rest[1:]) for c in inner) or any(
        c.bases for c in inner)  # a member of a base class is not looked for


# other projects that autoshard has a module named after (engines/): `torchtitan.train` is theirs
PROJECTS = ("torchtitan", "megatron", "accelerate")


def _exists(name: str) -> bool | None:
    """Whether a quoted dotted name exists; None where it does not look like an autoshard name. The first part
    is a module (`cost.block_time`, `passes.cost.state`), a class (`Plan.load`), or a variable named after its
    class (`layout.recompute`: a `Layout`'s field)."""
    if name.endswith(".py"):  # a file of autoshard, or of another project (`pretrain_gpt.py`): not told apart
        return any(_rel(p).endswith("/" + name) for p in MODULES) or None
    parts = name.split(".")
    if parts[0] in PROJECTS or name in _strings() or len(parts) == 1:
        return None
    modules, classes = _modules_named(), _classes()
    found = None
    for i in range(len(parts), 0, -1):  # the longest leading module path
        head = ".".join(parts[:i])
        if head in modules:
            found = any(_resolves(_tree(p), parts[i:]) or ".".join(parts[:i + 1]) in modules for p in modules[head])
            break
    for cls in {parts[0], "".join(w.capitalize() for w in parts[0].split("_"))} & set(classes):
        found = found or any(_resolves(c, parts[1:]) or c.bases for c in classes[cls])
    return found


QUOTED = re.compile(r"`([A-Za-z_][\w.]*[\w])(\()?")


DOCS = sorted((ROOT.parent / "docs").rglob("*.md"))


def _texts(path: Path):
    """(line, text) of every comment and docstring of a module, or of every line of a docs page."""
    if path.suffix == ".md":
        yield from enumerate(path.read_text().splitlines(), 1)
        return
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(_tree(path)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield (node.body[0].lineno, doc)


def stale_names(path: Path) -> list[str]:
    """The quoted names of `path` that do not exist; a bare `function()` only in the code (the docs quote
    other projects' calls: `Accelerator()`)."""
    out = []
    for line, text in _texts(path):
        for match in QUOTED.finditer(text):
            name, called = match.group(1), match.group(2)
            found = _exists(name)
            if found is False or (found is None and called and "." not in name and path.suffix == ".py"
                                  and name not in _defined()):
                out.append(f"{_rel(path)}:{line}: `{name}`")
    return out


PATH = re.compile(r"(?<![\w/.])((?:autoshard/|tests/|bench/|docs/)?(?:passes|runtime|rules|models|commands|engines|tests|bench|docs)"
                  r"/[\w/]+\.(?:py|md))\b(?! of )")  # "x.md of vLLM": another project's file


def stale_paths(path: Path) -> list[str]:
    """The repository files a comment, docstring or docs page of `path` names (`passes/solve/ranges.py`,
    relative to the repository, to autoshard/ or to docs/) that do not exist; `engines/NAME.py` is a pattern."""
    out = []
    for line, text in _texts(path):
        for match in PATH.finditer(text):
            name = match.group(1)
            if not Path(name).stem.isupper() and not any((base / name).exists()
                                                         for base in (ROOT.parent, ROOT, ROOT.parent / "docs")):
                out.append(f"{_rel(path)}:{line}: {name}")
    return out


def test_the_files_comments_docstrings_and_docs_name_exist():
    stale = [s for p in MODULES + DOCS for s in stale_paths(p)]
    assert not stale, "files named that do not exist (fix the comment):\n" + "\n".join(stale)


def test_the_names_comments_docstrings_and_docs_quote_exist():
    """Every backquoted `module.name` that starts with an autoshard module (or class), in the code and in
    docs/, and every quoted `function()` in the code, names something that exists: a comment or a page naming
    a function that was renamed or removed fails."""
    stale = [s for p in MODULES + DOCS for s in stale_names(p)]
    assert not stale, "quoted names that do not exist (fix the comment):\n" + "\n".join(stale)


def test_the_name_check_tells_stale_from_live():
    """The check above on names it must take or refuse: a renamed module (`solve.py` is passes/solve/planner.py
    now), a moved function, a field of a variable named after its class, another project's name."""
    assert _exists("planner.predict") and _exists("passes.cost.state.dp_bucket_params") and _exists("Plan.load")
    assert _exists("layout.recompute") and _exists("ranges.range_search") and _exists("planner.py")
    assert _exists("solve.predict") is False and _exists("cost.node_stem") is False
    assert _exists("Plan.no_such_field") is False
    assert _exists("torchtitan.train") is None and _exists("np.where") is None and _exists("autoshard.cache") is None
