"""The layer rules of docs/architecture.md, checked by reading the package's imports."""

import os
import subprocess
import sys
import textwrap

import pytest
from sparsecomm_lab.imports import scan_package, violations

import sparsecomm

PACKAGE = os.path.dirname(sparsecomm.__file__)


def test_the_package_keeps_its_import_rules():
    found = violations(scan_package(PACKAGE))
    assert not found, "\n".join(found)


def _fake_package(tmp_path, files):
    root = tmp_path / "sparsecomm"
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    for folder in [root, *[p for p in root.rglob("*") if p.is_dir()]]:
        (folder / "__init__.py").touch()
    return str(root)


@pytest.mark.parametrize("files, expected", [
    ({"transport/comm.py": "from ..methods import base\n", "methods/base.py": ""}, "a higher layer"),
    ({"core/cost.py": "def f():\n    from ..methods import base\n", "methods/base.py": ""}, "a higher layer"),
    ({"methods/a.py": "from .b import X\nregister_method('a')\n",
      "methods/b.py": "X = 1\nregister_method('b')\n"}, "method module sparsecomm.methods.a imports method module"),
    ({"transport/x.py": "from .y import _hidden\n", "transport/y.py": "_hidden = 1\n"}, "private name _hidden"),
    ({"transport/x.py": "from . import y\n", "transport/y.py": "from . import x\n"}, "import cycle"),
    ({"cli/x.py": "def run():\n    from sparsecomm_lab import campaign\n"}, "a lab module"),
    ({"__init__.py": "import sparsecomm_lab.training\n"}, "a lab module"),
    ({"app/x.py": ""}, "lies in no layer"),
])
def test_the_checker_catches_each_kind_of_breach(tmp_path, files, expected):
    found = violations(scan_package(_fake_package(tmp_path, files)))
    assert any(expected in line for line in found), found


def test_import_sparsecomm_loads_no_lab_module_and_no_optional_dependency():
    """``import sparsecomm`` (and every public library subpackage) in a fresh interpreter loads no module
    of the lab (sparsecomm_lab), not the command line, and neither pillow, tqdm nor matplotlib
    (counted beyond what ``import torch`` loads itself: torch.hub imports tqdm when it is installed)."""
    code = textwrap.dedent("""
        import sys
        import torch
        before = set(sys.modules)
        import sparsecomm, sparsecomm.selectors, sparsecomm.selection, sparsecomm.launch, sparsecomm.simulator
        import sparsecomm.integration, sparsecomm.methods, sparsecomm.transport, sparsecomm.core
        sparsecomm.methods.load_all()
        print("\\n".join(sorted(set(sys.modules) - before)))
    """)
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert "sparsecomm.selectors" in loaded and "sparsecomm.methods.spardl" in loaded
    unwanted = [m for m in loaded if m.split(".")[0] in ("PIL", "tqdm", "matplotlib")
                or m.startswith(("sparsecomm_lab", "sparsecomm.cli"))]
    assert unwanted == []


def test_shared_modules_and_split_methods_are_allowed(tmp_path):
    files = {"methods/base.py": "X = 1\n", "methods/a.py": "from .base import X\nregister_method('a')\n",
             "methods/s/__init__.py": "from .part import Y\nregister_method('s')\n", "methods/s/part.py": "Y = 2\n"}
    assert violations(scan_package(_fake_package(tmp_path, files))) == []


def test_the_imports_command_lists_edges_draws_mermaid_and_exits_clean(capsys):
    from sparsecomm.cli import main

    assert main(["imports"]) == 0
    listed = capsys.readouterr().out
    assert "methods -> transport" in listed and "breach" not in listed
    assert main(["imports", "--mermaid"]) == 0
    chart = capsys.readouterr().out
    assert chart.startswith("flowchart TB") and "subgraph core" in chart and "methods --> transport" in chart


def test_the_wheel_holds_the_library_and_not_the_lab(tmp_path):
    """``pip wheel`` of the tracked files (a clean copy: a checkout's build/ folder may hold files the
    source no longer has) packs the library alone: no lab module, no test helper."""
    import shutil
    import zipfile

    root = os.path.dirname(PACKAGE)
    listed = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True)
    if listed.returncode:
        pytest.skip("not a git checkout")
    source = tmp_path / "src"
    for rel in listed.stdout.split():
        if os.path.exists(os.path.join(root, rel)):
            (source / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(os.path.join(root, rel), source / rel)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path), str(source)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("sparsecomm-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "sparsecomm/methods/spardl/__init__.py" in names
    assert not [n for n in names if n.startswith(("sparsecomm_lab", "lab/", "tests/", "docs/", "benchmarks/"))]
