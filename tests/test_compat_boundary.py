"""Private names of torch, transformers, Lightning and ffpa-attn are used only in `lightning_ffpa/_compat/`.

Walks the AST of every file of `lightning_ffpa/` and `benchmarks/` (compat package excepted) and reports:
- an import of a private module or name of those libraries (`import torch._dynamo`,
  `from transformers.modeling_flash_attention_utils import _pad_input`, `from lightning.x._y import z`);
- an attribute that starts with `_` on a name bound to one of those libraries (`torch._C`, `nn._foo`);
- the known private attributes of their objects, on any object or through `getattr`/`setattr`/`hasattr`
  (`trainer._logger_connector`, `config._attn_implementation`, `model._init_weights`, ...);
- `AttentionInterface.register` / `AttentionMaskInterface.register` / `ALL_MASK_ATTENTION_FUNCTIONS.register`
  called directly (registration goes through `_compat.transformers`).
- a private op of ffpa-attn (`torch.ops.ffpa_attn._fwd_cute`, through an alias of `torch.ops.ffpa_attn`, through
  `getattr`/`hasattr`, or named in a string such as `"ffpa_attn._fwd_cute.default"`): ffpa-attn's public surface
  is `ffpa_attn_func`, and its `_*_cute` ops go through `_compat.ffpa`.
Other op names under `torch.ops` (`torch.ops.aten._scaled_dot_product_flash_attention`) are registry keys, not
Python API, and are allowed.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMPAT = ROOT / "lightning_ffpa" / "_compat"
LIBRARIES = ("torch", "transformers", "lightning", "lightning_fabric", "pytorch_lightning")
# Private attributes of library objects (Lightning trainer/strategy/module, HF config/model, torch mesh).
KNOWN_PRIVATE_ATTRS = frozenset({
    "_accelerator_connector", "_logger_connector", "_checkpoint_connector", "_device_mesh", "_setup_distributed",
    "_data_parallel_size", "_materialize_distributed_module", "_optimizers_to_device", "_attn_implementation",
    "_from_config", "_init_weights", "_experts_implementation", "_global_mapping", "_flatten",
    "_current_graph_task_id",
    "_subcommands_action", "_choices_actions", "_ChoicesPseudoAction",  # LightningCLI's parser (jsonargparse)
})
# torch.ops namespaces of other packages whose `_` ops are private to that package (`_compat/ffpa.py` owns them).
PRIVATE_OP_NAMESPACES = frozenset({"ffpa_attn"})
_PRIVATE_OP_STRING = re.compile(rf"\b(?:{'|'.join(sorted(PRIVATE_OP_NAMESPACES))})(?:\.|::)_[A-Za-z]")
REGISTRIES = frozenset({"AttentionInterface", "AttentionMaskInterface", "ALL_MASK_ATTENTION_FUNCTIONS",
                        "ALL_ATTENTION_FUNCTIONS"})


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _is_library(module: str) -> bool:
    return module.split(".")[0] in LIBRARIES


def _dotted(node: ast.AST) -> str | None:
    """`torch.ops.ffpa_attn` for that attribute chain; None when it does not start at a name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _op_namespace(dotted: str | None, aliases: set[str]) -> bool:
    """Whether `dotted` is `torch.ops.<private-op namespace>` or a local name bound to it."""
    if dotted is None:
        return False
    parts = dotted.split(".")
    return dotted in aliases or (len(parts) >= 2 and parts[-2] == "ops" and parts[-1] in PRIVATE_OP_NAMESPACES)


def violations(source: str, filename: str = "<src>") -> list[str]:
    """Every private-library use in `source`, as 'file:line: what'."""
    tree = ast.parse(source, filename)
    bound: dict[str, str] = {}  # local name -> the library path it stands for
    op_aliases: set[str] = set()  # local names bound to `torch.ops.ffpa_attn`
    found: list[str] = []

    def report(node: ast.AST, what: str) -> None:
        found.append(f"{filename}:{node.lineno}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_library(alias.name):
                    if any(_private(p) for p in alias.name.split(".")):
                        report(node, f"import {alias.name}")
                    local = alias.asname or alias.name.split(".")[0]
                    bound[local] = alias.name if alias.asname else local
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and _is_library(node.module):
            if any(_private(p) for p in node.module.split(".")):
                report(node, f"from {node.module} import ...")
            for alias in node.names:
                if _private(alias.name):
                    report(node, f"from {node.module} import {alias.name}")
                bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Assign) and _op_namespace(_dotted(node.value), set()):
            op_aliases.update(t.id for t in node.targets if isinstance(t, ast.Name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain, base = [node.attr], node.value
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            chain.reverse()
            root = base.id if isinstance(base, ast.Name) else None
            if node.attr in KNOWN_PRIVATE_ATTRS:
                report(node, f"private attribute .{node.attr}")
            elif root in bound and _private(node.attr) and "ops" not in chain[:-1] and (
                    bound[root] != "torch.ops"):
                report(node, f"{root}.{'.'.join(chain)}")
            if _private(node.attr) and _op_namespace(_dotted(node.value), op_aliases):
                report(node, f"{_dotted(node) or node.attr} (ffpa-attn's private ops: use lightning_ffpa._compat.ffpa)")
            if node.attr == "register" and isinstance(node.value, ast.Name) and node.value.id in REGISTRIES:
                report(node, f"{node.value.id}.register (use lightning_ffpa._compat.transformers)")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
                "getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2:
            name = node.args[1]
            if isinstance(name, ast.Constant) and name.value in KNOWN_PRIVATE_ATTRS:
                report(node, f"{node.func.id}(..., {name.value!r})")
            elif (isinstance(name, ast.Constant) and isinstance(name.value, str) and _private(name.value)
                  and _op_namespace(_dotted(node.args[0]), op_aliases)):
                report(node, f"{node.func.id}(..., {name.value!r}) (use lightning_ffpa._compat.ffpa)")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _PRIVATE_OP_STRING.search(
                node.value):
            report(node, f"string naming {_PRIVATE_OP_STRING.search(node.value).group(0)}... "
                         f"(use lightning_ffpa._compat.ffpa)")
    return found


def _checked_files() -> list[Path]:
    files = [*(ROOT / "lightning_ffpa").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]
    return sorted(p for p in files if COMPAT not in p.parents)


def test_private_library_names_live_only_in_compat():
    files = _checked_files()
    assert len(files) > 40 and any(p.name == "strategy.py" for p in files)  # the walk found the package
    found = [v for p in files for v in violations(p.read_text(), str(p.relative_to(ROOT)))]
    assert not found, "private library names outside lightning_ffpa/_compat/:\n" + "\n".join(found)


@pytest.mark.parametrize("snippet", [
    "import torch._dynamo\n",
    "import torch\ntorch._dynamo.reset()\n",
    "import torch\nx = torch._C._current_graph_task_id()\n",
    "from torch._ops import OpOverload\n",
    "from transformers.modeling_flash_attention_utils import _pad_input\n",
    "from lightning.fabric.utilities.init import _materialize_distributed_module\n",
    "from torch import nn\nnn._private_helper\n",
    "def f(trainer):\n    return trainer._logger_connector.should_update_logs\n",
    "def f(cfg):\n    cfg._attn_implementation = 'ffpa'\n",
    "def f(m):\n    return getattr(m, '_device_mesh', None)\n",
    "def f(m):\n    return getattr(m.config, '_experts_implementation', None)\n",
    "def f(cls, c):\n    return cls._from_config(c)\n",
    "from transformers import AttentionInterface\nAttentionInterface.register('x', print)\n",
    "import torch\ntorch.ops.ffpa_attn._fwd_cute(q, k, v, 1.0, 1, 1)\n",
    "import torch\nop = torch.ops.ffpa_attn._varlen_fwd_cute.default\n",
    "import torch\nops = torch.ops.ffpa_attn\nops._bwd_cute(do, q, k, v, o, lse, 1.0, 1, 0)\n",
    "import torch\nok = hasattr(torch.ops.ffpa_attn, '_fwd_cute')\n",
    "op = resolve_op('ffpa_attn._fwd_cute.default')\n",
    "def f():\n    'Counts ffpa_attn::_fwd_cute calls.'\n",
])
def test_a_planted_violation_fails(tmp_path, snippet):
    planted = tmp_path / "planted.py"
    planted.write_text(snippet)
    assert violations(planted.read_text(), str(planted)), snippet


@pytest.mark.parametrize("snippet", [
    "import torch\nop = torch.ops.aten._scaled_dot_product_flash_attention\n",
    "import torch\nop = torch.ops._c10d_functional.reduce_scatter_tensor.default\n",
    "class A:\n    def f(self):\n        return self._cache\n",
    "from lightning_ffpa._compat import torch as torch_compat\ntorch_compat.raise_recompile_limit()\n",
    "import torch\ntorch.compiler.reset()\n",
    "from ffpa_attn import ffpa_attn_func\n",
    "import torch\nop = torch.ops.lightning_ffpa.ref_dense_fwd.default\n",
    "def f():\n    'Both backends call the same `torch.ops.ffpa_attn` kernels.'\n",
    "from lightning_ffpa._compat import ffpa as ffpa_compat\nops = ffpa_compat.forward_ops()\n",
])
def test_allowed_uses_pass(snippet):
    assert violations(snippet) == []
