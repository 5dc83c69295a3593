"""An export run from another folder finds what the fit read through relative paths: the fit's `data.tokenizer`
(the export never found it: datamodules save no hyper-parameters) and its `model.pretrained` (a relative name was
asked of the Hub from the export's folder). Through the installed console scripts, as a user runs them."""

from __future__ import annotations

import pytest
import torch
from _console import run
from transformers import AutoTokenizer, Gemma4ForCausalLM

from lightning_ffpa.presets import build_text_config
from tests.data.conftest import PLAIN_TEMPLATE, save_tokenizer


@pytest.mark.slow
def test_export_from_another_folder_takes_the_fits_relative_tokenizer_and_pretrained(tmp_path):
    fit_dir, elsewhere = tmp_path / "fit", tmp_path / "elsewhere"
    fit_dir.mkdir(), elsewhere.mkdir()
    save_tokenizer(fit_dir / "tok", PLAIN_TEMPLATE)
    torch.manual_seed(0)
    Gemma4ForCausalLM(build_text_config("tiny")).save_pretrained(fit_dir / "pre")
    fit = run("lightning-ffpa fit --config tiny --trainer.max_steps 2 --trainer.limit_val_batches 0 "
              "--data.init_args.tokenizer tok --model.init_args.pretrained pre --trainer.default_root_dir runs/x",
              fit_dir)
    assert fit.returncode == 0, fit.stderr[-3000:]
    ckpt = fit_dir / "runs" / "x" / "checkpoints" / "last.ckpt"
    recorded = torch.load(ckpt, map_location="cpu", weights_only=False)["fit_sources"]["data.tokenizer"]
    assert recorded == str(fit_dir / "tok")  # absolute: found from any folder without the fit's cwd
    # another tokenizer evaluating the checkpoint: its ids would mean other text (validate ran and scored it)
    other = run(f"lightning-ffpa validate --config tiny --trainer.limit_val_batches 1 --ckpt_path {ckpt} "
                f"--model.init_args.pretrained {fit_dir / 'pre'}", elsewhere)
    assert other.returncode == 2 and other.stderr.strip().startswith(
        "error: `data.init_args.tokenizer='byte'`: is not the tokenizer"), other.stderr[-2000:]
    out = run(f"lightning-ffpa-export {ckpt} exported", elsewhere)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "no tokenizer" not in out.stdout + out.stderr
    ids = AutoTokenizer.from_pretrained(elsewhere / "exported")("the cat sat").input_ids
    assert ids == AutoTokenizer.from_pretrained(fit_dir / "tok")("the cat sat").input_ids
