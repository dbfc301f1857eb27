"""Writing files so that nothing the user has is ever half-overwritten."""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path
from typing import Callable

from .errors import AtencionError, MissingFileError


def _cannot_write(path: Path, err: OSError) -> AtencionError:
    return AtencionError(f"{path}: cannot write ({err.strerror or err}); nothing there was replaced")


def _out_of_space(directory: Path) -> bool:
    """Whether the file system of ``directory`` is (nearly) full: libraries that write files
    themselves (safetensors, CTranslate2, ONNX) report a full disk with their own error types."""
    try:
        stats = os.statvfs(directory)
    except OSError:
        return False
    return stats.f_bavail * stats.f_frsize < 1 << 16


def _library_failure(path: Path, err: Exception) -> Exception:
    if _out_of_space(path.parent):
        return _cannot_write(path, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    return err


def atomic_write(path: str | os.PathLike, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp)`` on a temporary name in the same directory, then rename it to ``path``.
    A failed write (a full disk, no permission) leaves ``path`` as it was and raises an
    AtencionError that names ``path``, not the temporary file."""
    path = Path(path)
    if path.is_dir():
        raise AtencionError(f"{path}: is a directory; expected a file name")
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as err:
        raise _cannot_write(path, err) from None
    except Exception as err:
        failure = _library_failure(path, err)
        if failure is err:
            raise
        raise failure from None
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    atomic_write(path, lambda tmp: tmp.write_bytes(data))


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def atomic_directory(path: str | os.PathLike, fill: Callable[[Path], None]) -> None:
    """Fill a temporary directory, then put it in place of ``path`` (replacing an older one).
    A failure or a Ctrl-C leaves ``path`` as it was (the older one is put back if it comes
    between the two renames); a kill leaves hidden ``.NAME.tmp-PID`` (and, between the two
    renames, ``.NAME.old-PID``) that :func:`clean_stale_temporaries` tidies up."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    old = path.with_name(f".{path.name}.old-{os.getpid()}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        fill(tmp)
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
    except BaseException as err:  # KeyboardInterrupt too: the finally below would delete the older one
        if old.exists() and not path.exists():
            os.replace(old, path)
        if not isinstance(err, Exception):
            raise
        if isinstance(err, OSError):
            raise _cannot_write(path, err) from None
        failure = _library_failure(path, err)
        if failure is err:
            raise
        raise failure from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def remove_directory(path: str | os.PathLike) -> None:
    """Delete the directory ``path``: first renamed to a hidden ``.NAME.del-PID`` (one step), then
    removed, so that a Ctrl-C or a kill midway never leaves a half-deleted directory under its
    name, only a temporary that :func:`clean_stale_temporaries` removes."""
    path = Path(path)
    doomed = path.with_name(f".{path.name}.del-{os.getpid()}")
    try:
        os.replace(path, doomed)
    except OSError:
        doomed = path  # gone already, or not renamable: remove what can be
    shutil.rmtree(doomed, ignore_errors=True)


_TEMPORARY = re.compile(r"\.(?P<name>.+)\.(?P<kind>tmp|old|del)-(?P<pid>\d+)")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return pid != 0


def clean_stale_temporaries(directory: str | os.PathLike) -> list[str]:
    """Remove the temporary files and directories that a killed process left in ``directory``
    (names ``.NAME.tmp-PID`` / ``.NAME.old-PID`` / ``.NAME.del-PID`` of a process that is gone).
    An ``.old`` copy whose NAME is missing (a kill between the two renames) is put back as NAME.
    Returns what was removed or restored."""
    directory = Path(directory)
    done = []
    if not directory.is_dir():
        return done
    for entry in sorted(directory.iterdir()):
        match = _TEMPORARY.fullmatch(entry.name)
        if match is None or _alive(int(match["pid"])):
            continue
        target = directory / match["name"]
        if match["kind"] == "old" and not target.exists():
            os.replace(entry, target)
            done.append(f"restored {target}")
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        done.append(f"removed {entry}")
    return done


# paths given on the command line: the right kind, checked before any work -------------------

def need_file(path: str | os.PathLike, what: str) -> Path:
    """``path`` as an existing file; ``what`` names it (e.g. "--input")."""
    path = Path(path)
    if path.is_dir():
        raise AtencionError(f"{what} {path}: is a directory; expected a file")
    if not path.exists():
        raise MissingFileError(f"{what} {path}: file not found")
    return path


def need_dir(path: str | os.PathLike, what: str) -> Path:
    """``path`` as an existing directory."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise AtencionError(f"{what} {path}: is a file; expected a directory")
    if not path.exists():
        raise MissingFileError(f"{what} {path}: directory not found")
    return path


def need_output_file(path: str | os.PathLike, what: str) -> Path:
    """``path`` as a file that can be (re)written: not a directory, in a directory that exists."""
    path = Path(path)
    if path.is_dir():
        raise AtencionError(f"{what} {path}: is a directory; expected a file name")
    parent = path.parent
    if not parent.is_dir():
        raise AtencionError(f"{what} {path}: {parent} is not an existing directory")
    if not os.access(parent, os.W_OK):
        raise AtencionError(f"{what} {path}: the directory {parent} is not writable")
    return path


def need_output_dir(path: str | os.PathLike, what: str, empty: bool = True) -> Path:
    """``path`` as a directory to write into: new, or (``empty``) an existing empty one."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise AtencionError(f"{what} {path}: is a file; expected a directory")
    if empty and path.is_dir() and any(path.iterdir()):
        raise AtencionError(f"{what} {path}: exists and is not empty; choose a new or empty directory "
                            f"(nothing was overwritten)")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise AtencionError(f"{what} {path}: {parent} is a file, not a directory")
            break
    return path


def read_json(path: str | os.PathLike, what: str):
    """The JSON value in ``path``; FileNotFoundError or ValueError naming the file and ``what`` it is."""
    import json

    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"{path}: {what} not found")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        column = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
        raise AtencionError(f"{path}: not a valid JSON {what} (line {line} column {column}: "
                            f"byte 0x{data[err.start]:02x} is not valid UTF-8)") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:  # its message names the line and column
        raise AtencionError(f"{path}: not a valid JSON {what} ({err})") from None
    except ValueError as err:  # an integer too long for int() (sys.get_int_max_str_digits)
        raise AtencionError(f"{path}: not a valid JSON {what} ({err})") from None
    except RecursionError:
        raise AtencionError(f"{path}: not a valid JSON {what} (arrays or objects nested too deeply)") from None


def shown_json(value, limit: int = 60) -> str:
    """``value`` as JSON spells it, cut to ``limit`` characters and "…": how a message quotes a
    value read from a file, never the file's whole content back."""
    import json

    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[:limit] + "…"


def json_line(path: str | os.PathLike, key: str) -> int | str:
    """The line number where ``"key":`` first appears in the JSON file ``path`` (for messages)."""
    try:
        for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
            if f'"{key}"' in line:
                return number
    except (OSError, UnicodeDecodeError):
        pass
    return "?"
