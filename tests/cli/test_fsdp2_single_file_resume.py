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
