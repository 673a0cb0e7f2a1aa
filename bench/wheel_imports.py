"""Which third-party packages a staged set of wheels needs at import time that neither they nor the GPU image have
(an offline check before a lease; prints, not a test).

    python bench/wheel_imports.py SITE MODULE... [--image torch transformers ...]

SITE is a folder the staged wheels were unzipped into (``unzip -o wheel.whl -d SITE`` for each); each MODULE is
an entry point (e.g. ``verl.trainer.main_ppo``). From each, every import that runs when the module is imported
(module level, including inside ``try`` and ``if`` blocks, not inside functions) is followed through the
modules found in SITE; imports of packages that are neither in SITE, the standard library nor ``--image``
(the packages the image has; GPU.md lists them) are printed with the module that needs them, "optional" when
the import sits in a ``try`` block that catches ImportError/ModuleNotFoundError or under an ``if``. Imports
inside functions (lazy ones) are not seen: a clean report is necessary, not sufficient.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

IMAGE = ("torch", "transformers", "accelerate", "tokenizers", "safetensors", "pandas", "numpy", "huggingface_hub",
         "yaml", "regex", "requests", "tqdm", "packaging", "filelock", "fsspec", "jinja2", "sympy", "networkx",
         "triton", "psutil", "typing_extensions", "dateutil", "pytz", "setuptools", "pkg_resources", "markupsafe",
         "certifi", "urllib3", "idna", "charset_normalizer", "mpmath", "hf_xet", "nvidia")
"""What the H200 image has besides the standard library (GPU.md: torch 2.11, transformers 5.17, accelerate,
tokenizers, safetensors, pandas, and their own requirements)."""


def module_file(site: Path, name: str) -> Path | None:
    parts = name.split(".")
    for candidate in (site.joinpath(*parts).with_suffix(".py"), site.joinpath(*parts, "__init__.py")):
        if candidate.is_file():
            return candidate
    return None


def imports(path: Path, package: str) -> list[tuple[str, bool]]:
    """(absolute module name, optional) for each import in ``path`` outside functions and classes' bodies."""
    tree = ast.parse(path.read_text(errors="replace"))
    found: list[tuple[str, bool]] = []

    def visit(nodes, optional: bool) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                found.extend((alias.name, optional) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([node.module] if node.module else []))
                found.append((base, optional))
                found.extend((f"{base}.{alias.name}", optional) for alias in node.names)
            elif isinstance(node, ast.Try):
                catches = {ast.unparse(h.type) if h.type else "" for h in node.handlers}
                guarded = optional or bool(catches & {"ImportError", "ModuleNotFoundError", "Exception", ""})
                visit(node.body, guarded)
                for handler in node.handlers:
                    visit(handler.body, optional)
                visit(node.orelse + node.finalbody, optional)
            elif isinstance(node, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(node.test):
                    visit(node.body + node.orelse, True)  # conditional: counted as optional

    visit(tree.body, False)
    return found


def missing(site: Path, entries: list[str], image: set[str]) -> dict[str, list[str]]:
    """Top-level package -> the modules that import it, for packages found nowhere."""
    known = set(sys.stdlib_module_names) | image
    todo, seen, needs = [(e, False) for e in entries], set(), {}
    while todo:
        name, optional = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = module_file(site, name)
        if path is None:
            top = name.split(".")[0]
            if top not in known and not (site / top).exists() and not (site / f"{top}.py").exists():
                needs.setdefault(f"{top}{' (optional)' if optional else ''}", []).append(name)
            continue
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        todo.extend((n, optional or o) for n, o in imports(path, package))
    return needs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", type=Path)
    parser.add_argument("modules", nargs="+")
    parser.add_argument("--image", nargs="*", default=list(IMAGE))
    args = parser.parse_args()
    needs = missing(args.site, args.modules, set(args.image))
    required = {k: v for k, v in needs.items() if not k.endswith("(optional)")}
    print(f"{len(required)} package(s) needed and not staged: {sorted(required)}")
    for package, where in sorted(needs.items()):
        print(f"  {package}: {sorted(where)[:3]}")


if __name__ == "__main__":
    main()
