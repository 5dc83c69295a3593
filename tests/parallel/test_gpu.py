"""GPU smoke: the benchmark's rows (FSDP2 + SAC + compile + chunked loss, ffpa) train finitely at tiny size."""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.gpu
@pytest.mark.timeout(420)
def test_benchmark_rows_run_tiny(tmp_path):
    _require_ffpa()
    out = tmp_path / "tt.json"
    cmd = [sys.executable, str(_ROOT / "benchmarks" / "train_throughput.py"), "--preset", "tiny", "--layers", "4",
           "--seqs", "512", "--warmup", "1", "--steps", "5", "--rows", "ours", "ours_nocompile", "--out", str(out)]
    proc = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")]))), capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    errors = {r["row"]: r["error"] for r in rows if "error" in r}
    assert not errors, errors
    ours = next(r for r in rows if r["row"] == "ours")
    assert any(k.startswith("ffpa") and v for k, v in ours["dispatch"].items()), ours["dispatch"]
    # The compiled row counts like the eager one (one count per layer forward, recomputes excluded).
    nocompile = next(r for r in rows if r["row"] == "ours_nocompile")
    assert ours["dispatch"] == nocompile["dispatch"], (ours["dispatch"], nocompile["dispatch"])
    assert not ours.get("graph_breaks"), ours.get("graph_breaks")


def _require_ffpa():
    from lightning_ffpa.attention import kernels

    assert kernels.ffpa_available(), (f"FFPA CuTeDSL is not importable ({kernels.ffpa_unavailable_reason()}): "
                                      "run with the FFPA stack (source .device/b/env.sh)")


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("attn", ["sdpa", "ffpa"])
def test_compiled_sac_layers_match_eager_without_graph_breaks(attn):
    """bf16, so the full layers really take FFPA (fp32 would fall back to sdpa for the dtype)."""
    import torch
    import torch._dynamo.utils
    import transformers

    from lightning_ffpa import attention
    from lightning_ffpa.parallel import parallelize
    from lightning_ffpa.presets import build_text_config

    if attn == "ffpa":
        _require_ffpa()
        attention.register_ffpa()
    torch.manual_seed(0)
    cfg = build_text_config("tiny")
    cfg._attn_implementation = attn
    model = transformers.Gemma4ForCausalLM(cfg).cuda().bfloat16()
    ref = transformers.Gemma4ForCausalLM(cfg).cuda().bfloat16()
    ref.load_state_dict(model.state_dict())
    parallelize(model, None, activation_checkpointing="selective", compile=True)
    parallelize(ref, None, activation_checkpointing="selective")
    torch._dynamo.reset()
    stats = torch._dynamo.utils.counters
    stats.clear()
    ids = torch.randint(0, 512, (2, 256), device="cuda")
    runs = {}
    for name, m in (("compiled", model), ("eager", ref)):
        attention.reset_dispatch_counts()
        for step in range(3):
            m.zero_grad(set_to_none=True)
            loss = m(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            if name == "compiled" and step == 0:
                graphs = stats["stats"]["unique_graphs"]
        runs[name] = (loss.detach(), attention.dispatch_counts(), attention.kernel_counts())
        if name == "compiled":  # before the eager run, whose compiled flex callable adds graphs of its own
            assert not stats["graph_break"], dict(stats["graph_break"])
            assert stats["stats"]["unique_graphs"] == graphs, "compiled layers recompiled after the first step"
    (loss, counts, kernels), (ref_loss, ref_counts, ref_kernels) = runs["compiled"], runs["eager"]
    torch.testing.assert_close(loss, ref_loss, atol=2e-2, rtol=2e-2)
    assert counts == ref_counts and kernels == ref_kernels, (counts, ref_counts, kernels, ref_kernels)
    if attn == "ffpa":
        n_full, n_sliding = cfg.layer_types.count("full_attention"), cfg.layer_types.count("sliding_attention")
        assert counts["ffpa-dense"] == 3 * n_full and counts["flex"] == 3 * n_sliding, counts
        assert kernels["cutedsl"] == 3 * n_full, kernels
    # bf16 gradients of a tiny random model are noise-dominated (compiled vs eager differ by ~90% on CPU
    # too, while fp32 agrees exactly), so both are judged against an fp32 eager truth: the compiled
    # layers may not be further from it than eager bf16 is.
    truth_cfg = copy.deepcopy(cfg)
    truth_cfg._attn_implementation = "sdpa"
    truth = transformers.Gemma4ForCausalLM(truth_cfg).cuda()
    truth.load_state_dict({_clean(k): v.float() for k, v in ref.state_dict().items()})
    truth(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    grads = {}
    for tag, m in (("compiled", model), ("eager", ref), ("truth", truth)):
        grads[tag] = {_clean(n): p.grad.float() for n, p in m.named_parameters()}
    for name, g_t in grads["truth"].items():
        err_c = ((grads["compiled"][name] - g_t).norm() / (g_t.norm() + 1e-12)).item()
        err_e = ((grads["eager"][name] - g_t).norm() / (g_t.norm() + 1e-12)).item()
        assert err_c <= 1.5 * err_e + 0.05, (name, err_c, err_e)


def _clean(name: str) -> str:
    return name.replace("._orig_mod", "").replace("._checkpoint_wrapped_module", "")


@pytest.mark.gpu
@pytest.mark.timeout(420)
def test_trainer_fsdp2_ffpa_throughput_on_gpu(tmp_path):
    """The product path on one GPU: Gemma4LM on meta, FSDP2Strategy (bf16, SAC, compile), both callbacks."""
    import csv

    import lightning as L

    from lightning_ffpa.callbacks import FFPAAttention, TokenThroughput
    from lightning_ffpa.data import MockDataModule
    from lightning_ffpa.module import Gemma4LM
    from lightning_ffpa.parallel import FSDP2Strategy

    _require_ffpa()
    attention_cb = FFPAAttention(log_every_n_steps=1)
    trainer = L.Trainer(
        accelerator="gpu", devices=1, max_steps=6, log_every_n_steps=1, enable_checkpointing=False,
        strategy=FSDP2Strategy(param_dtype="bf16", reduce_dtype="fp32", compile=True),
        callbacks=[attention_cb, TokenThroughput(window_size=2)],
        logger=L.pytorch.loggers.CSVLogger(tmp_path), default_root_dir=tmp_path, enable_progress_bar=False,
    )
    module = Gemma4LM(preset="tiny", dtype="float32", attn_implementation="sdpa", loss_impl="plain", warmup_steps=1)
    trainer.fit(module, MockDataModule(vocab_size=512, seq_length=512, num_samples=64, batch_size=2))
    assert trainer.strategy.compile_layers
    assert "ffpa-dense=" in attention_cb.summary(), attention_cb.summary()
    rows = list(csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))))
    cols = set(rows[0])
    assert any(c.endswith("device/mfu") for c in cols), cols
    assert "device/peak_memory_gb" in cols
