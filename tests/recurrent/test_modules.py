"""The recurrent cache's modules and the handover protocol: no import circle, each module imports alone, and the
protocol in ``hf_knorm/attention/taps.py`` declares every member the attention reads from a handed-over layer."""

import ast
import itertools
import os
import subprocess
import sys
from pathlib import Path

import grimp
import pytest
from typing_extensions import get_protocol_members

import hf_knorm
from hf_knorm.attention.taps import SparseWindowStateHandover, StateHandover, WindowStateHandover
from hf_knorm.recurrent.sparse_cache import SparseWindowStateLayer
from hf_knorm.recurrent.state import RecurrentStateLayer
from hf_knorm.recurrent.window_cache import WindowStateLayer

PACKAGE = Path(hf_knorm.__file__).parent
RECURRENT = sorted(f"hf_knorm.recurrent.{path.stem}" for path in (PACKAGE / "recurrent").glob("*.py")
                   if path.stem != "__init__")
HANDOVER_MODULES = ["hf_knorm.attention.taps"] + RECURRENT
READERS = {"interface.py": StateHandover, "window.py": WindowStateHandover, "taps.py": StateHandover,
           "sparse.py": SparseWindowStateHandover, "window_parts.py": WindowStateHandover}
"""The attention modules that read a handed-over layer, and the protocol that must declare what each reads (the window
reads a windowed layer's members; the interface and the taps only what every layer has)."""


def test_no_module_of_the_handover_imports_one_that_imports_it():
    """Function-level imports count: a circle deferred into a function is a circle (grimp reads every import)."""
    graph = grimp.build_graph("hf_knorm", cache_dir=None)
    circles = [(a, b) for a, b in itertools.permutations(HANDOVER_MODULES, 2)
               if graph.find_shortest_chain(importer=a, imported=b) and graph.find_shortest_chain(importer=b,
                                                                                               imported=a)]
    assert not circles, f"import circles: {circles}"


@pytest.mark.parametrize("module", HANDOVER_MODULES)
def test_each_module_imports_alone_in_a_fresh_interpreter(module):
    """Only the module and what it imports is loaded: ``hf_knorm/__init__.py`` (which imports every module in its
    own order) is replaced by a package of the same path that runs nothing."""
    script = (
        "import importlib, sys, types\n"
        f"package = types.ModuleType('hf_knorm'); package.__path__ = [{str(PACKAGE)!r}]\n"
        "sys.modules['hf_knorm'] = package\n"
        f"importlib.import_module({module!r})\n"
        "loaded = sorted(name for name in sys.modules if name.startswith('hf_knorm.'))\n"
        "print(' '.join(loaded))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env=dict(os.environ, PYTHONPATH=str(PACKAGE.parent)))
    assert result.returncode == 0, result.stderr[-3000:]
    assert module in result.stdout.split()


def _members_read(path: Path) -> set[str]:
    """Every ``handover.NAME`` and ``getattr(handover, "NAME", ...)`` in a module's source."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "handover":
            names.add(node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and isinstance(node.args[0], ast.Name) and node.args[0].id == "handover"
              and isinstance(node.args[1], ast.Constant)):
            names.add(node.args[1].value)
    return names


@pytest.mark.parametrize("reader", sorted(READERS))
def test_the_protocol_declares_every_member_the_attention_reads(reader):
    read = _members_read(PACKAGE / "attention" / reader)
    assert read, f"{reader} reads nothing from a handover: the test reads the wrong name"
    undeclared = read - get_protocol_members(READERS[reader])
    assert not undeclared, (f"{reader} reads {sorted(undeclared)} from a handover; declare them in "
                            f"hf_knorm/attention/taps.py's {READERS[reader].__name__}")


def test_the_layers_provide_what_the_protocol_declares():
    pure, windowed = RecurrentStateLayer(0), WindowStateLayer(0, 3)
    assert isinstance(pure, StateHandover) and pure.window == 0
    assert not isinstance(pure, WindowStateHandover)  # a pure state keeps no sinks: the window refuses it first
    assert isinstance(windowed, WindowStateHandover) and windowed.window == 3
    assert not isinstance(windowed, SparseWindowStateHandover) and windowed.sparse == 0 == pure.sparse
    sparse = SparseWindowStateLayer(0, 3, 2)
    assert isinstance(sparse, SparseWindowStateHandover) and (sparse.window, sparse.sparse) == (3, 2)
