"""GPU smoke: the benchmark's rows (FSDP2 + SAC + compile + chunked loss, ffpa) train finitely at tiny size."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]


_COMPILE_BUG = pytest.mark.xfail(strict=True, reason="known: compiled SAC layers graph-break on H200 (ffpa gate under dynamo, flex BlockMask without q_indices); benchmarks/results/logs/gpu_tests_parallel_rollout.log")


@pytest.mark.gpu
@pytest.mark.timeout(420)
@_COMPILE_BUG
def test_benchmark_rows_run_tiny(tmp_path):
    out = tmp_path / "tt.json"
    cmd = [sys.executable, str(_ROOT / "benchmarks" / "train_throughput.py"), "--preset", "tiny", "--layers", "4",
           "--seqs", "512", "--warmup", "1", "--steps", "2", "--out", str(out)]
    proc = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=str(_ROOT)), capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    errors = {r["row"]: r["error"] for r in rows if "error" in r}
    assert not errors, errors
    ours = next(r for r in rows if r["row"] == "ours")
    assert any(k.startswith("ffpa") and v for k, v in ours["dispatch"].items()), ours["dispatch"]


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("attn", ["sdpa", pytest.param("ffpa", marks=_COMPILE_BUG)])
def test_compiled_sac_layers_match_eager_without_graph_breaks(attn):
    import torch
    import torch._dynamo.utils
    import transformers

    from lightning_ffpa.parallel import parallelize
    from lightning_ffpa.presets import build_text_config

    if attn == "ffpa":
        from lightning_ffpa.attention import register_ffpa

        register_ffpa()
    torch.manual_seed(0)
    cfg = build_text_config("tiny")
    cfg._attn_implementation = attn
    model = transformers.Gemma4ForCausalLM(cfg).cuda()
    ref = transformers.Gemma4ForCausalLM(cfg).cuda()
    ref.load_state_dict(model.state_dict())
    parallelize(model, None, activation_checkpointing="selective", compile=True)
    torch._dynamo.utils.counters.clear()
    ids = torch.randint(0, 512, (2, 256), device="cuda")
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    ref_loss = ref(input_ids=ids, labels=ids, use_cache=False).loss
    ref_loss.backward()
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    torch.testing.assert_close(loss, ref_loss, atol=1e-4, rtol=1e-4)
    got = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        key = next(k for k in got if k.replace("._orig_mod", "").replace("._checkpoint_wrapped_module", "") == name)
        torch.testing.assert_close(got[key].grad, p.grad, atol=2e-3, rtol=2e-2, msg=name)


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

    attention_cb = FFPAAttention(log_every_n_steps=1)
    trainer = L.Trainer(
        accelerator="gpu", devices=1, max_steps=6, log_every_n_steps=1, enable_checkpointing=False,
        strategy=FSDP2Strategy(param_dtype="bf16", reduce_dtype="fp32", compile=None),
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
