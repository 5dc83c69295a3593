"""benchmarks/context_parallel.py: the CPU smoke through the real torchrun launcher, the gradient parity check,
and the summary's choice of the best Flex row and its null keys."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(_ROOT))

from benchmarks import context_parallel as cp  # noqa: E402
from benchmarks.cp_parity import grad_parity, param_group, parity_failures  # noqa: E402


def _grads(seed=0):
    g = torch.Generator().manual_seed(seed)
    names = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
             "model.layers.0.mlp.up_proj.weight", "model.layers.0.input_layernorm.weight", "model.norm.weight"]
    return {n: torch.randn(8, 4, generator=g) for n in names}


def test_param_groups():
    assert param_group("model.layers.3.self_attn.k_proj.weight") == "layers.3.self_attn"
    assert param_group("model.layers.3.post_feedforward_layernorm.weight") == "layers.3.norms"
    assert param_group("model.layers.12.mlp.down_proj.weight") == "layers.12.mlp"
    assert param_group("model.embed_tokens.weight") == "embed_tokens"
    assert param_group("model.norm.weight") == "final_norm"


def test_close_gradients_pass_and_a_wrong_one_is_named():
    ref = _grads()
    close = {n: g + 1e-6 * torch.randn_like(g) for n, g in ref.items()}
    ok = grad_parity(ref, close)
    assert ok["max_rel_l2"] < 1e-5 and ok["params_compared"] == 5
    assert parity_failures(1e-7, ok, loss_tol=1e-4, grad_rel_tol=1e-3) == []

    wrong = dict(close)
    wrong["model.layers.0.mlp.up_proj.weight"] = close["model.layers.0.mlp.up_proj.weight"] * 1.05  # 5% too big
    bad = grad_parity(ref, wrong)
    assert bad["worst_group"] == "layers.0.mlp"
    assert bad["max_rel_l2"] == pytest.approx(0.05, rel=1e-3)
    assert bad["groups"]["layers.0.self_attn"]["rel_l2"] < 1e-5  # the other groups stay clean
    why = parity_failures(1e-7, bad, loss_tol=1e-4, grad_rel_tol=1e-3)
    assert len(why) == 1 and "layers.0.mlp" in why[0]
    assert parity_failures(1e-2, ok, loss_tol=1e-4, grad_rel_tol=1e-3)[0].startswith("loss differs")
    assert parity_failures(float("nan"), ok, loss_tol=1e-4, grad_rel_tol=1e-3)  # NaN never passes


def test_missing_or_nonfinite_gradients_fail():
    ref = _grads()
    partial = {n: g for n, g in ref.items() if "norm.weight" != n.split("model.")[-1]}
    res = grad_parity(ref, partial)
    assert res["missing"] == ["model.norm.weight"] and math.isinf(res["max_rel_l2"])
    assert any("without a counterpart" in w for w in parity_failures(0.0, res, 1e-4, 1e-3))
    nan = dict(ref, **{"model.norm.weight": torch.full((8, 4), float("nan"))})
    assert parity_failures(0.0, grad_parity(ref, nan), 1e-4, 1e-3)


def _timed(name, seq, tps):
    return {"row": name, "seq": seq, "tokens_per_s": tps}


def test_summary_takes_the_best_flex_row_and_says_why_a_key_is_null():
    rows = [_timed("ffpa_ring", 32768, 300.0), _timed("flex_ring_opt0", 32768, 100.0),
            _timed("flex_ring_opt1", 32768, 150.0), {"row": "flex_ring_opt2", "seq": 32768, "error": "OOM"},
            {"row": "torch_native_cp_sdpa", "seq": 32768, "error": "NotImplementedError: attn_bias"}]
    summary, missing = cp.summarize(rows, [32768])
    assert summary["ffpa_ring_vs_flex_ring_tps_32k"] == 2.0 and summary["flex_ring_best_row_32k"] == "flex_ring_opt1"
    assert summary["ffpa_ring_vs_native_cp_tps_32k"] is None
    assert "attn_bias" in missing["ffpa_ring_vs_native_cp_tps_32k"]
    assert summary["ffpa_ring_vs_flex_ring_tps_64k"] is None and "not in this result" in missing[
        "ffpa_ring_vs_flex_ring_tps_64k"]
    assert summary["cp2_vs_cp1_grad_max_rel_diff"] is None and "no parity row" in missing["cp2_vs_cp1_grad_max_rel_diff"]
    assert set(missing) == {k for k, v in summary.items() if v is None}


def test_options_are_checked_before_any_row():
    from lightning_ffpa.errors import ConfigError

    with pytest.raises(ConfigError, match="multiple of 2 x --nproc"):
        cp.parse_args(["--seqs", "1001"])


@pytest.mark.timeout(120)
def test_cpu_smoke_runs_rows_as_two_rank_launches_with_parity(tmp_path):
    out = tmp_path / "cp.json"
    # A grad tolerance no real run meets: the recorded failure proves the check reads the measured numbers.
    cmd = [sys.executable, str(_ROOT / "benchmarks" / "context_parallel.py"), "--smoke", "--rows", "ffpa_ring",
           "--parity-variants", "ffpa_ring", "--grad-rel-tol", "1e-12", "--out", str(out), "--budget-s", "100"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=115)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {r["row"]: r for r in result["rows"]}
    assert set(rows) == {"parity_ffpa_ring", "ffpa_ring"}
    assert not [r.get("error") for r in rows.values() if r.get("error")]
    assert all(r["world"] == 2 and r["pid"] != os.getpid() for r in rows.values())
    assert rows["parity_ffpa_ring"]["pid"] != rows["ffpa_ring"]["pid"]  # one launch per row

    timed = rows["ffpa_ring"]
    assert len(timed["step_ms_all"]) == 5 and timed["step_ms_min"] <= timed["step_ms_median"] <= timed["step_ms_max"]
    assert timed["tokens_per_s"] == pytest.approx(256 / timed["step_ms_median"] * 1e3)
    assert timed["kernel_counts"]["reference"] > 0 and timed["ring_stats"]["sliding_halo"] > 0

    parity = rows["parity_ffpa_ring"]
    assert parity["loss_abs_diff"] <= 1e-4 and 0 < parity["grads"]["max_rel_l2"] < 1e-3
    assert parity["grads"]["params_compared"] > 10 and not parity["grads"]["missing"]
    assert parity["noise_floor"]["attn"] == "eager" and parity["noise_floor"]["grads"]["max_rel_l2"] < 1e-3
    assert len(parity["failures"]) == 1 and "relative L2" in parity["failures"][0]
    assert result["parity_failures"] == {"parity_ffpa_ring": parity["failures"]}

    s = result["summary"]
    assert s["cp2_vs_cp1_grad_max_rel_diff"] == parity["grads"]["max_rel_l2"]
    assert s["cp2_vs_cp1_loss_max_abs_diff"] == parity["loss_abs_diff"] and s["parity_seq"] == 128
    assert s["ffpa_ring_tokens_per_s_256"] == timed["tokens_per_s"]
    for key in ("ffpa_ring_vs_flex_ring_tps_32k", "ffpa_ring_vs_native_cp_tps_64k"):
        assert s[key] is None and result["summary_missing"][key]
