"""Fit TinyLM under FSDP2Strategy(compile=True) over four sequence lengths with dynamo's limit at 2 graphs.

Run in its own process by test_compile_fallbacks.py (the in-process group's store would outlive the test and hold
a port). Writes the fallback counts, the logged `compile/fallbacks` and the warnings seen to argv[1] as JSON.
"""

import functools
import json
import sys
import warnings

import lightning as L
import torch
import torch._dynamo

from lightning_ffpa import compile_fallbacks
from lightning_ffpa._compat import torch as torch_compat
from lightning_ffpa.compile_fallbacks import CompileFallbackWarning
from lightning_ffpa.parallel import FSDP2Strategy
from tests.parallel._fit_tiny import TinyLM


def main(out: str) -> None:
    torch_compat.raise_recompile_limit = lambda limit=64: None  # keep the limit of 2 set below
    torch.compile = functools.partial(torch.compile, backend="eager")
    torch._dynamo.config.recompile_limit = 2
    batches = [(torch.randint(0, 512, (1, n), generator=torch.Generator().manual_seed(n)),) for n in (8, 12, 16, 20)]
    strategy = FSDP2Strategy(compile=True, activation_checkpointing="none", param_dtype="fp32", reduce_dtype="fp32")
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=4, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.fit(TinyLM(), torch.utils.data.DataLoader(batches, batch_size=None))
    json.dump({"counts": compile_fallbacks.counts(), "total": compile_fallbacks.total(),
               "logged": float(trainer.logged_metrics.get("compile/fallbacks", -1)),
               "warnings": [str(w.message) for w in seen if w.category is CompileFallbackWarning]}, open(out, "w"))


if __name__ == "__main__":
    from lightning_ffpa.parallel import close_process_group

    main(sys.argv[1])
    close_process_group()  # as a script with its own Trainer should: no gloo teardown race at exit
