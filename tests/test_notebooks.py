"""The course notebooks (notebooks/*.ipynb, in Spanish) run top to bottom in their quick mode
(ATENCION_RAPIDO=1) on the project's Python, each within a time limit; every notebook asserts
what it shows, so a failing cell fails here. And they are committed without outputs.

The kernel is this process's own Python (sys.executable), through a kernel spec written to a
temporary directory, so the notebooks import the atencion of this checkout (src/ first on
PYTHONPATH) and nothing installed elsewhere."""

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
PATHS = sorted(NOTEBOOKS.glob("*.ipynb"))
LIMIT_S = 180          # per notebook, all its cells together: three times the quick mode's one-minute budget
KERNEL = "atencion-tests"
DATA = {"06_la_familia.ipynb": ["tinyshakespeare"], "07_adaptar_y_escalar.ipynb": ["tinyshakespeare"],
        "08_atencion_eficiente_y_mas_alla.ipynb": ["fsdd"]}
MISSING = [name for name in ("nbclient", "nbformat", "ipykernel") if importlib.util.find_spec(name) is None]


def _curso():
    """notebooks/curso.py, which tells the notebooks where the data are (the same rule here)."""
    spec = importlib.util.spec_from_file_location("curso", NOTEBOOKS / "curso.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_eight_notebooks_of_the_chapter_are_there():
    names = [path.name for path in PATHS]
    assert names[:8] == ["01_atencion_a_mano.ipynb", "02_transformer_por_dentro.ipynb",
                         "03_entrenar_un_traductor.ipynb", "04_mirar_la_atencion.ipynb",
                         "05_antes_del_transformer.ipynb", "06_la_familia.ipynb", "07_adaptar_y_escalar.ipynb",
                         "08_atencion_eficiente_y_mas_alla.ipynb"]


@pytest.mark.parametrize("path", PATHS, ids=lambda path: path.stem)
def test_a_committed_notebook_has_no_outputs_and_no_execution_counts(path):
    notebook = json.loads(path.read_text(encoding="utf-8"))
    dirty = [index for index, cell in enumerate(notebook["cells"])
             if cell["cell_type"] == "code" and (cell.get("outputs") or cell.get("execution_count") is not None)]
    assert not dirty, (f"{path.name}: cells {dirty} hold outputs or execution counts; clear them before committing "
                       f"(Jupyter: Edit → Clear Outputs of All Cells)")


@pytest.mark.parametrize("path", PATHS, ids=lambda path: path.stem)
def test_every_notebook_is_in_the_table_of_notebooks_readme(path):
    assert f"({path.name})" in (NOTEBOOKS / "README.md").read_text(encoding="utf-8")


@pytest.fixture
def kernel(tmp_path, monkeypatch):
    """A kernel spec for this very Python, found through JUPYTER_PATH; quick mode and this
    checkout's src/ in the environment the kernel inherits."""
    spec = tmp_path / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "atencion (tests)", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    monkeypatch.setenv("ATENCION_RAPIDO", "1")
    # one torch thread: a kernel of two threads beside any other busy process runs several times slower
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))
    return KERNEL


@pytest.mark.skipif(bool(MISSING), reason=f"{', '.join(MISSING)} not installed (pip install -r requirements-test.txt)")
@pytest.mark.parametrize("path", PATHS, ids=lambda path: path.stem)
def test_a_notebook_runs_top_to_bottom_in_quick_mode(path, kernel):
    import nbformat
    from nbclient import NotebookClient

    curso = _curso()
    for name in DATA.get(path.name, []):
        try:
            curso.datos(name)
        except FileNotFoundError as error:
            pytest.skip(f"{path.name} reads {name}/: {error}")
    notebook = nbformat.read(path, as_version=4)
    start = time.monotonic()
    client = NotebookClient(notebook, kernel_name=kernel, resources={"metadata": {"path": str(NOTEBOOKS)}},
                            timeout_func=lambda cell: max(1, int(LIMIT_S - (time.monotonic() - start))))
    client.execute()
    seconds = time.monotonic() - start
    print(f"{path.name}: {seconds:.0f} s in quick mode")
