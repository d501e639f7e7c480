"""Layering (DESIGN.md "Arrows point one way"): the runtime loads neither SymPy nor OR-Tools.

Two checks: every runtime module but `pipeline` is imported in a fresh interpreter and
`sys.modules` holds no sympy / ortools; and no autoshard module the runtime reaches (statically,
through module-level imports, `pipeline` included) imports them. `pipeline` is only checked
statically because torch.distributed.pipelining itself imports torch._dynamo, which loads SymPy."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import autoshard

ROOT = Path(autoshard.__file__).parent
RUNTIME = sorted(p.stem for p in (ROOT / "runtime").glob("*.py") if p.stem != "__init__")
FORBIDDEN = ("sympy", "ortools")


def test_runtime_imports_neither_sympy_nor_ortools():
    modules = ", ".join(f"autoshard.runtime.{m}" for m in RUNTIME if m != "pipeline")
    code = (f"import sys, autoshard, autoshard.api, {modules}; "
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def _module_imports(name: str) -> set[str]:
    """Modules `name` imports at module level (not inside functions)."""
    path = ROOT.parent / (name.replace(".", "/") + ".py")
    if not path.exists():
        path = ROOT.parent / name.replace(".", "/") / "__init__.py"
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names
                    if (ROOT.parent / f"{node.module}.{a.name}".replace(".", "/")).with_suffix(".py").exists()}
    return out


def test_no_autoshard_module_the_runtime_reaches_imports_them():
    seen, todo, bad = set(), [f"autoshard.runtime.{m}" for m in RUNTIME], []
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for dep in _module_imports(name):
            if dep.split(".")[0] in FORBIDDEN:
                bad.append((name, dep))
            elif dep.startswith("autoshard") and dep != "autoshard":
                todo.append(dep)
    assert not bad, bad
    assert "autoshard.ir" in seen and "autoshard.cost_table" not in seen

