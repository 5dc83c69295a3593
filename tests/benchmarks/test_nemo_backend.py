"""benchmarks/nemo_backend.py: NeMo's FFPA backend loaded from its wheel, compared with ours (CPU smoke + loader).

The smoke test needs the real nemo_automodel 0.7.0 wheel under .whl/ (an ignored folder; `nemo_wheel.GET_WHEEL`
fetches it) and is skipped without it. The loader tests build a small stand-in wheel with the same
registration contract, so the loader is exercised in every checkout; the stand-in is no part of any result.
"""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(_ROOT))

from benchmarks import nemo_wheel  # noqa: E402

# A stand-in with NeMo's contract: attention (module, q, k, v, mask, dropout, scaling, softcap, **kw) -> ([B,S,H,D],
# None) and an HF mask function; it logs fallbacks in _FALLBACK_WARNED like the real file.
_STAND_IN = '''
import torch
_FALLBACK_WARNED = set()

def ffpa_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
              **kwargs):
    return None if attention_mask is None or bool(attention_mask.all()) else attention_mask

def ffpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None,
                           **kwargs):
    _FALLBACK_WARNED.add("stand_in")
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                                           enable_gqa=True)
    return out.transpose(1, 2), None
'''


def _wheel(tmp_path, source: str | None, member: str = nemo_wheel.BACKEND_FILE) -> Path:
    path = tmp_path / "nemo_automodel-0.0.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("nemo_automodel/__init__.py", "")
        if source is not None:
            zf.writestr(member, source)
    return path


def test_loader_registers_a_stand_in_under_its_own_name(tmp_path):
    from benchmarks.nemo_backend import SMOKE_SHAPE, numerics_row
    from lightning_ffpa._compat import transformers as hf_compat
    from lightning_ffpa.attention import backend, kernels

    module, info = nemo_wheel.load_backend(_wheel(tmp_path, _STAND_IN))
    nemo_wheel.register(module)
    backend.register_ffpa()
    assert {"nemo_ffpa", "ffpa"} <= hf_compat.attention_names()
    assert info["registered_as"] == "nemo_ffpa" and info["package_imports"] == [] and len(info["file_sha256"]) == 64
    with kernels.force_kernel("reference"):
        row = numerics_row(module, 64, "dense", SMOKE_SHAPE, torch.device("cpu"))
    assert "error" not in row, row
    assert row["nemo_path"] == {"nemo_fallbacks": ["stand_in"]}  # what the loaded file logged is what we record
    assert row["ours_path"]["dispatch"]["ffpa-dense"] == 1 and row["ours_path"]["kernels"]["reference"] == 1
    for pair in ("ours_vs_fp32", "nemo_vs_fp32", "ours_vs_nemo"):
        assert 0 < row["max_abs_diff"][pair]["out"] < 0.02, row["max_abs_diff"]
        assert row["max_abs_diff"][pair]["dq"] < 0.1 * row["ref_max_abs"]["dq"]


def test_loader_names_what_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no nemo_automodel/components/attention/ffpa_attention.py"):
        nemo_wheel.load_backend(_wheel(tmp_path, None))
    with pytest.raises(AttributeError, match=r"lacks \['ffpa_mask'\]"):
        nemo_wheel.load_backend(_wheel(tmp_path, "def ffpa_attention_forward(*a, **k): pass\n"))
    with pytest.raises(FileNotFoundError, match="pip download"):
        nemo_wheel.load_backend(tmp_path / "absent.whl")
    ring = "from nemo_automodel.components.distributed.fsdp_patches import patch\n"
    probe = nemo_wheel.probe_cp_ring(_wheel(tmp_path, ring, member=nemo_wheel.CP_RING_FILE))
    assert probe["loads"] is False and probe["error"].startswith("ModuleNotFoundError"), probe
    assert probe["package_imports"] == ["nemo_automodel.components.distributed.fsdp_patches"]
    assert "nemo_automodel" not in sys.modules  # the probe leaves no half-imported package behind


@pytest.mark.timeout(120)
@pytest.mark.skipif(not nemo_wheel.DEFAULT_WHEEL.is_file(), reason=f"no NeMo wheel; {nemo_wheel.GET_WHEEL}")
def test_cpu_smoke_with_the_real_wheel(tmp_path):
    out = tmp_path / "nb.json"
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, str(_ROOT / "benchmarks" / "nemo_backend.py"), "--smoke", "--seqs", "128",
           "--nemo-sliding", "sdpa", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["nemo"]["wheel_sha256"] == "37b8397a73c17e4a8bffd0cd3becc0507abecc1ebfea3b3eb6468eed57ba6674"
    assert result["nemo"]["package_imports"] == []  # the backend file imports no other NeMo module
    ops = [r for r in result["rows"] if r["part"] == "op"]
    assert len(ops) == 8  # 2 impls x 2 layouts x 2 modes
    for r in ops:
        if r["impl"] == "ours":
            assert r["ms"] > 0 and r["iters"] == 2 and r["kernels"]["reference"] > 0 and "fallback" not in r, r
            assert r["dispatch"]["ffpa-varlen" if r["layout"] == "padded" else "ffpa-dense"] > 0
        else:  # no ffpa_attn on CPU: NeMo logs its fallback, and the row says so
            assert r["nemo_fallbacks"] == ["ffpa_unavailable"] and "fell back" in r["fallback"], r
            assert "ms" in r or "error" in r
    numerics = [r for r in result["rows"] if r["part"] == "numerics"]
    assert {r["layout"] for r in numerics} == {"dense", "padded"}
    for r in numerics:
        assert r["max_abs_diff"]["ours_vs_fp32"]["out"] < 0.02 and r["max_abs_diff"]["ours_vs_fp32"]["dq"] > 0
    steps = {r["row"]: r for r in result["rows"] if r["part"] == "step"}
    assert steps["ours"]["tokens_per_s"] > 0 and steps["ours"]["dispatch"]["ffpa-dense"] == 2
    assert steps["nemo"]["tokens_per_s"] > 0 and steps["nemo"]["nemo_fallbacks"] == ["dtype"]  # fp32 on CPU
    assert steps["nemo"]["attn"] == "nemo_ffpa" and steps["nemo"]["optim"] == steps["ours"]["optim"] == "product"
    # Ratios of rows that fell back are withheld, and the notes say why.
    assert result["summary"]["ours_vs_nemo_backend_step_tps_64"] is None
    assert "dtype" in result["summary_notes"]["ours_vs_nemo_backend_step_tps_64"]
    assert "ours_vs_nemo_backend_fwdbwd_8k" in result["summary"]
    ring = result["nemo_cp_ring"]
    assert ring["loads"] is False and "No module named 'nemo_automodel'" in ring["error"]
    assert "nemo_automodel.components.distributed.fsdp_patches" in ring["package_imports"]


@pytest.mark.gpu
@pytest.mark.skipif(not nemo_wheel.DEFAULT_WHEEL.is_file(), reason=f"no NeMo wheel; {nemo_wheel.GET_WHEEL}")
def test_both_backends_run_ffpa_on_cuda():
    """On the H200: at 1k both backends take FFPA (no fallback) and agree with the fp32 reference."""
    from benchmarks.nemo_backend import GPU_SHAPE, numerics_row
    from lightning_ffpa.attention import backend

    module, _ = nemo_wheel.load_backend(nemo_wheel.DEFAULT_WHEEL)
    nemo_wheel.register(module)
    backend.register_ffpa()
    for layout in ("dense", "padded"):
        row = numerics_row(module, 1024, layout, GPU_SHAPE, torch.device("cuda"))
        assert "error" not in row and row["nemo_path"] == {"nemo_fallbacks": []}, row
        assert row["ours_path"]["kernels"]["cutedsl"] == 1, row
        for pair, diffs in row["max_abs_diff"].items():
            assert diffs["out"] < 0.02 and diffs["dq"] < 0.05 * row["ref_max_abs"]["dq"], (pair, diffs)


def test_append_to_a_file_that_is_no_result_is_one_line_naming_out(tmp_path):
    out = tmp_path / "nb.json"
    out.write_text("not json")
    proc = subprocess.run([sys.executable, "benchmarks/nemo_backend.py", "--smoke", "--append", "--out", str(out)],
                          cwd=_ROOT, capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith(f"error: `--out='{out}'`: not JSON") and out.read_text() == "not json"
