"""A Hugging Face model directory, read as an atencion model where it lies: config.json (with a
``model_type``), model.safetensors or a sharded model.safetensors.index.json, and the tokenizer's
files (read by data/hf_tokenizer.py). nn/model_dir.py calls ``read_config`` and ``read_model``
for every directory whose config.json has a ``model_type`` (its READERS), so every command takes
one.

The family is config.json's ``model_type`` (the ``MODEL_TYPE`` each module of interop names), the
class its ``architectures`` (one of that module's classes in IMPORTERS: a language model, a
masked language model, a translator or a ``*ForSequenceClassification``). transformers reads the
config, with its defaults for the keys a file leaves out; the weights are read by safetensors,
memory-mapped, one tensor at a time, and handed to the family's ``import_state`` under their
Hugging Face names: its name map makes the atencion tensors, which become the model's
parameters as they are, in their stored dtype (nn/model_dir.py's ``model_from_tensors``). No
transformers model is built. A family whose module has no ``import_state`` (only a ``from_X``
importer) is loaded by transformers' ``from_pretrained`` and converted by ``from_hf``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from importlib import import_module
from pathlib import Path
from types import ModuleType

from torch import Tensor, nn

from ..config import ModelConfig
from ..errors import AtencionError
from ..nn.model_dir import CONFIG_FILE, INDEX_FILE, check_size, model_from_tensors, weights_files
from . import IMPORTERS, from_hf
from .hf_config import read_checked


class Checkpoint(Mapping):
    """The tensors of a directory's safetensors file(s), each read from the memory-mapped file
    when asked for, as stored. A name the file lacks is looked for as transformers finds it:
    under LayerNorm's old names (``gamma``, ``beta``), without the base model's prefix (a
    checkpoint saved from the base model: GPT-2's ``h.0.…`` for ``transformer.h.0.…``) and under
    the name it is tied to (``tied``, the family's TIED)."""

    def __init__(self, directory: Path, tied: dict[str, str]):
        from safetensors import safe_open

        files = weights_files(directory)
        self.where = files[0] if len(files) == 1 else directory / INDEX_FILE
        self.tied = tied
        self.files: dict[str, object] = {}  # tensor name → the open file that holds it
        for path in files:
            try:
                handle = safe_open(str(path), framework="pt")
                names = list(handle.keys())
            except Exception as err:  # safetensors raises its own error types for damaged files
                raise AtencionError(f"{path}: not a readable safetensors file ({err})") from None
            self.files.update(dict.fromkeys(names, handle))

    def _find(self, name: str, seen: frozenset = frozenset()) -> str | None:
        stem, _, last = name.rpartition(".")
        old = {"weight": "gamma", "bias": "beta"}.get(last)
        for candidate in (name, f"{stem}.{old}" if old else None):
            for form in (candidate, candidate.partition(".")[2] if candidate else None):
                if form and form in self.files:
                    return form
        if name in self.tied and name not in seen:
            return self._find(self.tied[name], seen | {name})
        return None

    def __getitem__(self, name: str) -> Tensor:
        found = self._find(name)
        if found is None:
            raise KeyError(name)
        return self.files[found].get_tensor(found)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._find(name) is not None

    def __iter__(self) -> Iterator[str]:
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)


def families() -> dict[str, ModuleType]:
    """model_type → the interop module that converts it (each module of IMPORTERS that names its
    ``MODEL_TYPE``: one, or a tuple of the model types it reads)."""
    found = {}
    for name in dict.fromkeys(module for module, _ in IMPORTERS.values()):
        module = import_module(f".{name}", __package__)
        types = getattr(module, "MODEL_TYPE", ())
        found.update(dict.fromkeys((types,) if isinstance(types, str) else types, module))
    return found


def supported() -> list[str]:
    """Every model_type a directory may have: those of ``families`` and, through transformers,
    those of the classes IMPORTERS converts whose module names none."""
    known = set(families())
    classes = [name for name, (module, _) in IMPORTERS.items()
               if not hasattr(import_module(f".{module}", __package__), "MODEL_TYPE")]
    if classes:
        import transformers

        known |= {getattr(transformers, name).config_class.model_type
                  for name in classes if hasattr(transformers, name)}
    return sorted(known)


def _family(directory: Path) -> tuple[ModuleType | None, str]:
    """The interop module of the directory's model_type and the class it was saved as (the first
    of ``architectures``; without one, the family's first class); the module is None for a class
    that IMPORTERS converts but whose module reads no checkpoint. Anything else is refused,
    naming the model_type (or class) and what is supported."""
    path = directory / CONFIG_FILE
    config = read_checked(path)
    model_type = config["model_type"]
    architecture = (config.get("architectures") or [None])[0]
    known = families()
    if model_type not in known:
        if architecture in IMPORTERS:
            return None, architecture
        raise AtencionError(f"{path}: model_type {model_type!r} is not supported; supported: "
                            f"{', '.join(supported())}")
    family = known[model_type].__name__.rpartition(".")[2]
    classes = [name for name, (module, _) in IMPORTERS.items() if module == family]
    architecture = architecture or classes[0]
    if architecture not in classes:
        raise AtencionError(f"{path}: architectures {architecture!r} is not supported for model_type {model_type!r}; "
                            f"supported: {', '.join(classes)}")
    return known[model_type], architecture


def _hf_config(directory: Path):
    """transformers' config of the directory, with its defaults for the keys the file leaves out."""
    try:
        from transformers import AutoConfig
    except ImportError:
        raise AtencionError(f"{directory}: reading a Hugging Face model directory needs transformers "
                            f"(pip install transformers)") from None
    try:
        with _quiet_transformers():
            return AutoConfig.from_pretrained(str(directory), local_files_only=True)
    except Exception as err:  # a value only transformers reads: its own error types (StrictDataclassError, …)
        raise AtencionError(f"{directory / CONFIG_FILE}: transformers cannot read it ({_reason(err)})") from None


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Within: transformers logs errors only, and shows no progress bar. Its warnings and load
    reports run to many lines on stderr; what atencion refuses it names in one line of its own."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        hf_logging.enable_progress_bar()


def _reason(err: Exception) -> str:
    """The last line of a transformers error, cut short: its messages run to several lines."""
    lines = str(err).strip().splitlines()
    reason = lines[-1].strip() if lines else type(err).__name__
    return reason if len(reason) <= 200 else reason[:200] + "…"


def _import_config(module: ModuleType, directory: Path, architecture: str) -> ModelConfig:
    """The family's ``import_config`` of the directory; its refusals name the file they are about."""
    path = directory / CONFIG_FILE
    try:
        return module.import_config(_hf_config(directory), architecture)
    except AtencionError as err:
        if str(path) in str(err):
            raise
        raise AtencionError(f"{path}: {err}") from None


def read_config(directory: Path) -> ModelConfig:
    """The atencion ModelConfig of the Hugging Face model in ``directory``, without its weights."""
    module, architecture = _family(directory)
    if module is None or not hasattr(module, "import_state"):
        return read_model(directory).cfg
    return _import_config(module, directory, architecture)


def read_model(directory: Path) -> nn.Module:
    """The atencion model (in eval mode) of the Hugging Face model in ``directory``, its
    parameters the checkpoint's tensors in their stored dtype."""
    module, architecture = _family(directory)
    if module is None or not hasattr(module, "import_state"):
        return _through_transformers(directory, architecture)
    cfg = _import_config(module, directory, architecture)
    state = Checkpoint(directory, getattr(module, "TIED", {}))
    check_size(cfg, sum(path.stat().st_size for path in weights_files(directory)), state.where,
               directory / CONFIG_FILE)  # before the family's name map lists every layer's tensors
    try:
        cfg, tensors = module.import_state(cfg, state)
    except KeyError as err:
        raise AtencionError(f"{state.where}: no tensor {err.args[0]!r}, which a {architecture} of "
                            f"{directory / CONFIG_FILE} has; the files come from different models") from None
    return model_from_tensors(cfg, tensors, state.where, directory / CONFIG_FILE).eval()


def _through_transformers(directory: Path, architecture: str) -> nn.Module:
    """A class whose module reads no checkpoint: transformers' model, loaded and converted. A
    tensor the class has and the file lacks (which transformers would leave random), or one the
    file has and the class does not, is refused naming both files."""
    import transformers

    weights_files(directory)  # a missing file or shard is named before transformers looks
    try:
        with _quiet_transformers():
            hf_model, info = getattr(transformers, architecture).from_pretrained(
                str(directory), local_files_only=True, output_loading_info=True)
    except Exception as err:  # transformers' own error types for a value only it reads
        reason = ("its weights have other sizes than its config.json gives" if "mismatched_sizes" in str(err)
                  else _reason(err))
        raise AtencionError(f"{directory}: transformers cannot load its {architecture} ({reason})") from None
    unread = {key: sorted(info.get(key) or []) for key in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if any(unread.values()):
        found = "; ".join(f"{key.replace('_', ' ')} {names[:3]}" for key, names in unread.items() if names)
        raise AtencionError(f"{directory}: its weights do not match the {architecture} of its "
                            f"{CONFIG_FILE} ({found})")
    try:
        return from_hf(hf_model).eval()
    except AtencionError as err:
        raise AtencionError(f"{directory}: {err}") from None
