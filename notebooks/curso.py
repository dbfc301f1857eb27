"""Lo que comparten los cuadernos: el modo rápido, dónde están los datos y una carpeta para lo que escriben.

- ``ATENCION_RAPIDO=1``: presupuestos pequeños (menos pasos de entrenamiento, menos oraciones), para que
  cada cuaderno corra en menos de un minuto; así los ejecuta la prueba ``tests/test_notebooks.py``.
- ``ATENCION_DATOS``: la carpeta con ``multi30k/``, ``tinyshakespeare/`` y ``sst2/``. Sin ella, la
  primera carpeta ``shared/data`` que haya por encima del repositorio (``../shared/data``, como en
  los benchmarks).
- Lo que un cuaderno escribe (corpus, modelos) va a una carpeta temporal que se borra al cerrar el
  kernel, nunca al repositorio.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

RAIZ = Path(__file__).resolve().parents[1]
RAPIDO = os.environ.get("ATENCION_RAPIDO", "") not in ("", "0")
_temporal: list[tempfile.TemporaryDirectory] = []


def segun_modo(normal, rapido):
    """``rapido`` en el modo rápido (ATENCION_RAPIDO=1), ``normal`` si no."""
    return rapido if RAPIDO else normal


def datos(nombre: str) -> Path:
    """La carpeta del conjunto ``nombre`` (p. ej. "tinyshakespeare"): bajo $ATENCION_DATOS o bajo la
    primera ``shared/data`` por encima del repositorio; un error de una línea si no está."""
    if os.environ.get("ATENCION_DATOS"):
        raices = [Path(os.environ["ATENCION_DATOS"])]
    else:
        raices = [carpeta / "shared" / "data" for carpeta in RAIZ.parents]
    for raiz in raices:
        if (raiz / nombre).is_dir():
            return raiz / nombre
    donde = "$ATENCION_DATOS" if os.environ.get("ATENCION_DATOS") else "shared/data por encima del repositorio"
    raise FileNotFoundError(f"no encuentro {nombre}/ en {donde}: define ATENCION_DATOS=/ruta/a/data")


def carpeta_temporal(prefijo: str) -> Path:
    """Una carpeta nueva para lo que escribe el cuaderno; se borra cuando termina el kernel."""
    carpeta = tempfile.TemporaryDirectory(prefix=f"atencion-{prefijo}-")
    _temporal.append(carpeta)
    return Path(carpeta.name)
