"""FSDP2 on 2 CPU processes (gloo): ModelCheckpoint writes DCP folders; resuming from one reproduces the
loss curve bitwise, and the HF export reads the folder (written by 2 ranks) without a process group.

Two `lightning-ffpa fit` runs with `devices: 2` (Lightning launches the second rank): one uninterrupted run
that also writes a DCP checkpoint at step 3 (mid-epoch), and one that resumes from that folder.
"""

from __future__ import annotations

import pytest
import torch
from _helpers import read_steps, recorder, start_fit, tiny_config, wait_ok, write_config

STRATEGY = {"class_path": "lightning_ffpa.parallel.FSDP2Strategy",
            "init_args": {"param_dtype": "fp32", "reduce_dtype": "fp32", "activation_checkpointing": "none"}}
STEPS, EVERY = 6, 3

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(420),
]


def _config(root, log):
    cfg = tiny_config(root / "ckpt", max_steps=STEPS, every_n_train_steps=EVERY, callbacks=[recorder(log)],
                      data={"num_samples": 8})  # 2 ranks x batch 2: 2 steps per epoch
    cfg["trainer"].update(devices=2, strategy=STRATEGY)
    return cfg


def test_dcp_checkpoint_resume_and_export(tmp_path, record_property):
    ref_log, res_log = tmp_path / "ref.log", tmp_path / "resume.log"
    wait_ok(start_fit(write_config(tmp_path / "ref.yaml", _config(tmp_path, ref_log))), timeout=300)
    folder = tmp_path / "ckpt" / f"epoch=1-step={EVERY}.ckpt"
    assert folder.is_dir() and (folder / ".metadata").is_file(), sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert len(list(folder.glob("*.distcp"))) == 2  # one shard file per rank: nothing gathered on rank 0

    resume_root = tmp_path / "resume"
    resume_root.mkdir()
    wait_ok(start_fit(write_config(resume_root / "fit.yaml", _config(resume_root, res_log)),
                      "--ckpt_path", str(folder)), timeout=300)
    ref, resumed = read_steps(ref_log), read_steps(res_log)
    assert sorted(resumed) == list(range(EVERY + 1, STEPS + 1))
    lost = [s for s in resumed if resumed[s] != ref[s]]
    record_property("hardening", "fault")
    record_property("case", "FSDP2 (2 ranks, gloo): resume from a DCP ModelCheckpoint folder mid-epoch")
    record_property("data_lost", len(lost))
    assert not lost, f"steps whose (loss, batch) differ from the uninterrupted run: {lost}"

    # export: DCP folder -> HF safetensors, against torch's own DCP -> torch.save converter
    import warnings

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import Gemma4ForCausalLM

    from lightning_ffpa.export import export

    with warnings.catch_warnings(record=True) as said:  # torch's "assuming ... a single process": it is one
        warnings.simplefilter("always")
        export(folder, tmp_path / "hf")
    assert not [w for w in said if "single process" in str(w.message)]
    hf = Gemma4ForCausalLM.from_pretrained(tmp_path / "hf").eval()
    dcp_to_torch_save(str(folder), str(tmp_path / "full.pt"))
    full = torch.load(tmp_path / "full.pt", weights_only=True)["state_dict"]
    ref_model = Gemma4ForCausalLM(hf.config).eval()
    missing, unexpected = ref_model.load_state_dict(
        {k.removeprefix("model."): v for k, v in full.items() if k.startswith("model.")}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
    ref_model.tie_weights()
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(hf(input_ids=ids).logits, ref_model(input_ids=ids).logits)
