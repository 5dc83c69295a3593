"""Load NeMo-Automodel's FFPA attention backend from its wheel, one file at a time, without installing the package.

Owns: reading one source file out of a ``nemo_automodel`` wheel into a temporary folder, importing it under a
private module name, checking it exposes the HF registration contract (``ffpa_attention_forward`` and
``ffpa_mask``), registering it in transformers' attention/mask interfaces under a name of ours, and recording
why another file of the wheel (the Gemma4 CP ring) does or does not load the same way.
Does not own any timing or comparison (``nemo_backend.py``) and ships none of NeMo's code: the file is read
from the wheel the caller points at, at run time.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import sys
import tempfile
import traceback
import zipfile
from pathlib import Path
from types import ModuleType

BACKEND_FILE = "nemo_automodel/components/attention/ffpa_attention.py"
CP_RING_FILE = "nemo_automodel/components/models/gemma4_moe/cp_attention.py"
REGISTERED_NAME = "nemo_ffpa"  # never "ffpa": that is ours, and both live in one registry
CONTRACT = ("ffpa_attention_forward", "ffpa_mask")
DEFAULT_WHEEL = Path(__file__).resolve().parents[1] / ".whl" / "nemo_automodel-0.7.0-py3-none-any.whl"
GET_WHEEL = ("python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "
             "--platform manylinux_2_28_x86_64 -d .whl nemo-automodel==0.7.0")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_member(wheel: str | Path, member: str) -> bytes:
    """The bytes of `member` inside `wheel` (a clear error naming both when either is missing)."""
    wheel = Path(wheel)
    if not wheel.is_file():
        raise FileNotFoundError(f"`--nemo-wheel {wheel}`: no such file; get it with: {GET_WHEEL}")
    with zipfile.ZipFile(wheel) as zf:
        try:
            return zf.read(member)
        except KeyError:
            raise FileNotFoundError(f"`--nemo-wheel {wheel}`: the wheel has no {member}") from None


def package_imports(source: bytes) -> list[str]:
    """Every ``nemo_automodel.*`` module the file imports (top level or inside functions), in file order."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("nemo_automodel"):
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("nemo_automodel")]
    return list(dict.fromkeys(found))


def load_file(wheel: str | Path, member: str, module_name: str) -> ModuleType:
    """Extract `member` to a temp folder and import it as `module_name` (its own imports resolve normally)."""
    source = read_member(wheel, member)
    folder = Path(tempfile.mkdtemp(prefix="nemo_wheel_"))
    path = folder / Path(member).name
    path.write_bytes(source)
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    return module


def load_backend(wheel: str | Path) -> tuple[ModuleType, dict]:
    """NeMo's FFPA backend module from `wheel`, and what was loaded (wheel, hashes, its package imports)."""
    module = load_file(wheel, BACKEND_FILE, "nemo_ffpa_attention")
    missing = [name for name in CONTRACT if not callable(getattr(module, name, None))]
    if missing:
        raise AttributeError(f"`--nemo-wheel {wheel}`: {BACKEND_FILE} lacks {missing} (the HF registration contract)")
    source = read_member(wheel, BACKEND_FILE)
    info = {"wheel": str(wheel), "wheel_sha256": _sha256(Path(wheel).read_bytes()), "file": BACKEND_FILE,
            "file_sha256": _sha256(source), "package_imports": package_imports(source),
            "registered_as": REGISTERED_NAME}
    return module, info


def register(module: ModuleType) -> None:
    """Register NeMo's attention and mask functions as ``nemo_ffpa`` (its own `register_ffpa_attention` would
    take the name "ffpa", which is ours)."""
    from lightning_ffpa._compat import transformers as hf_compat

    hf_compat.register_attention(REGISTERED_NAME, module.ffpa_attention_forward)
    hf_compat.register_mask(REGISTERED_NAME, module.ffpa_mask)


def fallbacks(module: ModuleType) -> list[str] | None:
    """Reasons NeMo's backend logged a fallback for since the last `reset_fallbacks` (None if it keeps no record)."""
    warned = getattr(module, "_FALLBACK_WARNED", None)
    return None if warned is None else sorted(warned)


def reset_fallbacks(module: ModuleType) -> None:
    """Forget the logged fallback reasons (NeMo warns once per reason per process)."""
    warned = getattr(module, "_FALLBACK_WARNED", None)
    if warned is not None:
        warned.clear()


def _inits(wheel: str | Path, modules: list[str]) -> dict[str, list[str]]:
    """For each package `__init__.py` that importing `modules` executes: the NeMo modules it imports in turn."""
    out: dict[str, list[str]] = {}
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        for module in modules:
            parts = module.split(".")
            for i in range(1, len(parts)):
                init = "/".join(parts[:i]) + "/__init__.py"
                if init in names and init not in out:
                    out[init] = package_imports(zf.read(init))
    return out


def probe_cp_ring(wheel: str | Path) -> dict:
    """Whether NeMo's Gemma4 CP ring loads as one file, as the backend does; the exact error if not."""
    try:
        source = read_member(wheel, CP_RING_FILE)
    except FileNotFoundError as exc:
        return {"file": CP_RING_FILE, "loads": False, "error": str(exc)}
    imports = package_imports(source)
    record = {"file": CP_RING_FILE, "package_imports": imports, "package_inits_run": _inits(wheel, imports)}
    before = set(sys.modules)
    try:
        load_file(wheel, CP_RING_FILE, "nemo_gemma4_cp_attention")
        record["loads"] = True
    except Exception as exc:  # noqa: BLE001 - the failure itself is the finding
        record.update(loads=False, error=f"{type(exc).__name__}: {exc}",
                      where=traceback.format_exc().strip().splitlines()[-3].strip())
    finally:
        for name in set(sys.modules) - before:  # leave no half-imported NeMo modules behind
            if name.startswith(("nemo_automodel", "nemo_gemma4")):
                sys.modules.pop(name, None)
    return record
