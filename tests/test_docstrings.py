"""The examples in the public API's docstrings run and print what they say (so the API reference cannot lie).

The public API is what the site's API reference documents: the names of ``rlkit.__all__``, ``rlkit.widgets``
and the ``__all__`` of the modules the guides use, and :mod:`rlkit.config.fields`. The examples run in a fresh
process: ``rlkit.launch``'s example replaces the clusters of its process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULES = ["rlkit", "rlkit.widgets", "rlkit.config", "rlkit.data", "rlkit.algos", "rlkit.diagnostics", "rlkit.runtime"]

RUNNER = textwrap.dedent(
    """
    import doctest, importlib, inspect, json, sys
    sys.path.insert(0, sys.argv[1])
    import tests.conftest  # this checkout's widgets as rlkit.widgets
    finder, seen, results = doctest.DocTestFinder(), set(), []
    objects = [importlib.import_module("rlkit.config.fields")]
    for name in json.loads(sys.argv[2]):
        module = importlib.import_module(name)
        objects += [getattr(module, item) for item in module.__all__]
    for obj in objects:
        if not (inspect.isclass(obj) or inspect.isfunction(obj) or inspect.ismodule(obj)):
            continue
        for test in finder.find(obj, getattr(obj, "__qualname__", obj.__name__), module=inspect.getmodule(obj)):
            if test.examples and test.name not in seen:
                seen.add(test.name)
                runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
                runner.run(test)
                results.append([test.name, runner.failures, len(test.examples)])
    print(json.dumps(results))
    """
)


def test_the_public_apis_docstring_examples_run():
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, str(ROOT), json.dumps(MODULES)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    *printed, last = done.stdout.strip().splitlines()
    results = json.loads(last)
    failed = [name for name, failures, _ in results if failures]
    assert failed == [], "docstring examples that failed:\n" + "\n".join(printed)[-5000:]
    names = {name for name, _, _ in results}
    expected = {"launch", "GRPOConfig", "grpo_advantages", "pass_at_k", "RolloutCorrectionConfig.preset"}
    assert expected <= names, f"the examples found: {sorted(names)}"
