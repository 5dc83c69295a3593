"""FSDP2 with activation checkpointing resumes from a single-file checkpoint (`save_distributed_checkpoint:
false`) through the console script, to the weights of the run that was never interrupted. Lightning looked
the weights up under module paths that carry `parallelize`'s wrapper levels, which the saved file does not."""

from __future__ import annotations

import torch
from _console import ROOT, run

FIT = (f"lightning-ffpa fit --config {ROOT / 'configs' / 'tiny_fsdp2.yaml'} --trainer.enable_checkpointing true "
       "--trainer.strategy.init_args.save_distributed_checkpoint false --trainer.log_every_n_steps 1")


def _weights(path):
    return torch.load(path, map_location="cpu", weights_only=False)["state_dict"]


def test_a_single_file_checkpoint_resumes_to_the_uninterrupted_weights(tmp_path):
    whole = run(f"{FIT} --trainer.max_steps 4 --trainer.default_root_dir {tmp_path / 'whole'}", tmp_path)
    assert whole.returncode == 0, whole.stderr[-2000:]
    first = run(f"{FIT} --trainer.max_steps 2 --trainer.default_root_dir {tmp_path / 'cut'}", tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    resumed = run(f"{FIT} --trainer.max_steps 4 --trainer.default_root_dir {tmp_path / 'cut'} "
                  f"--ckpt_path {tmp_path / 'cut' / 'checkpoints' / 'epoch=0-step=2.ckpt'}", tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    want = _weights(tmp_path / "whole" / "checkpoints" / "epoch=0-step=4.ckpt")
    got = _weights(tmp_path / "cut" / "checkpoints" / "epoch=0-step=4.ckpt")
    assert want.keys() == got.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)


def _dcp_weights(folder, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / f"{folder.parent.parent.name}.pt"
    dcp_to_torch_save(folder, out)
    return torch.load(out, map_location="cpu", weights_only=False)["state_dict"]


def test_compiled_layers_resume_from_a_dcp_folder_to_the_uninterrupted_weights(tmp_path):
    """The recipes compile each layer (`compile: true`), which names its weights with `_orig_mod`: every resume
    failed with missing and unexpected keys (a DCP folder), or missing optimizer state (a single file)."""
    fit = (f"lightning-ffpa fit --config {ROOT / 'configs' / 'tiny_fsdp2.yaml'} --trainer.enable_checkpointing true "
           "--trainer.strategy.init_args.compile true --trainer.log_every_n_steps 1")
    whole = run(f"{fit} --trainer.max_steps 4 --trainer.default_root_dir {tmp_path / 'whole'}", tmp_path)
    assert whole.returncode == 0, whole.stderr[-2000:]
    first = run(f"{fit} --trainer.max_steps 2 --trainer.default_root_dir {tmp_path / 'cut'}", tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    resumed = run(f"{fit} --trainer.max_steps 4 --trainer.default_root_dir {tmp_path / 'cut'} "
                  f"--ckpt_path {tmp_path / 'cut' / 'checkpoints' / 'epoch=0-step=2.ckpt'}",
                  tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    want = _dcp_weights(tmp_path / "whole" / "checkpoints" / "epoch=0-step=4.ckpt", tmp_path)
    got = _dcp_weights(tmp_path / "cut" / "checkpoints" / "epoch=0-step=4.ckpt", tmp_path)
    assert want.keys() == got.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)


def test_a_single_files_optimizer_state_is_named_without_compiles_level():
    from lightning_ffpa._compat.lightning import _without_wrapper_names

    state = {"state": {"m.layers.0._orig_mod._checkpoint_wrapped_module.w": 1, "m.head.w": 2},
             "param_groups": [{"lr": 0.1, "params": ["m.layers.0._orig_mod._checkpoint_wrapped_module.w", "m.head.w"]}]}
    assert _without_wrapper_names(state) == {"state": {"m.layers.0.w": 1, "m.head.w": 2},
                                             "param_groups": [{"lr": 0.1, "params": ["m.layers.0.w", "m.head.w"]}]}
