"""Under torchrun (2 gloo ranks): a LoRA fit with `save_frozen_weights: false` under FSDP2Strategy, the base
sharded, stopped at step 2 (a DCP folder) and resumed to 4, against a straight 4-step fit.

argv: out.json, pretrained_dir. Rank 0 writes {"equal": bool, "differ": [...], "record": the checkpoint's
frozen-base record, "shards": the folder's shard files}.
"""

import json
import os
import sys
from pathlib import Path

import torch
from test_frozen_weights_ckpt import N, _fit, _fsdp2

from lightning_ffpa.checkpoint.frozen import read_frozen_record


def main(out: str, pretrained: str) -> None:
    root, ranks = Path(out).parent, int(os.environ["WORLD_SIZE"])
    straight, _ = _fit(root / "straight", 2 * N, strategy=_fsdp2(True, False), pretrained=pretrained, devices=ranks)
    _fit(root / "cut", N, strategy=_fsdp2(True, False), pretrained=pretrained, devices=ranks)
    cut = root / "cut" / "ckpt" / f"epoch=0-step={N}.ckpt"
    resumed, _ = _fit(root / "cut", 2 * N, strategy=_fsdp2(True, False), pretrained=pretrained, ckpt_path=cut,
                         devices=ranks)
    if int(os.environ["RANK"]) == 0:
        differ = [k for want, got in ((straight.weights, resumed.weights), (straight.moments, resumed.moments))
                  for k in want if k not in got or not torch.equal(want[k], got[k])]
        json.dump({"equal": not differ and bool(straight.moments), "differ": differ[:5],
                   "record": read_frozen_record(cut), "shards": sorted(p.name for p in cut.glob("*.distcp"))},
                  open(out, "w"))


if __name__ == "__main__":
    from lightning_ffpa.errors import exit_quickly

    exit_quickly()  # a rank's exit skips the interpreter's exit-time walks of the heap (~1.3 s)
    main(*sys.argv[1:])
