"""Step-level rows of the NeMo-backend comparison: the 6-layer 31B slice, ours' recipe, one process per row.

Owns building and timing one training-step row in a child process (``step_child``) and running every
(row, seq) as its own process (``step_rows``). The model, optimizer, loss and the recipe itself come from
``train_rows.py`` (``ROWS["ours"]``, ``build_model``, ``build_optimizer``, ``loss_fn``); the only change in
the "nemo" row is the HF attention name. Does not own the op-level rows, the summary or the CLI
(``nemo_backend.py``), nor loading NeMo's file (``nemo_wheel.py``).
"""

from __future__ import annotations

import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from benchmarks import nemo_wheel
from benchmarks.nemo_paths import fell_back, path_record, reset_paths, time_ms
from benchmarks.row_process import dump_stacks_on_signal, kill_row, progress_tail
from lightning_ffpa.attention import backend, kernels

STEP_ROWS = ("ours", "nemo")
LABELS = {"ours": "train_throughput's 'ours' recipe, attention = lightning_ffpa 'ffpa' (sliding layers: our Flex path)",
          "nemo": "the same recipe, attention = NeMo-Automodel's ffpa_attention_forward + ffpa_mask from its wheel "
                  "(sliding layers: NeMo's {sliding} route)"}
ENTRY = Path(__file__).resolve().parent / "nemo_backend.py"


def _step_spec(name: str, smoke: bool) -> dict:
    from benchmarks.train_rows import ROWS

    spec = dict(ROWS["ours"], attn="ffpa" if name == "ours" else nemo_wheel.REGISTERED_NAME)
    if smoke:
        spec["compile"] = False  # CPU smoke: no inductor compile in a fast test
    return spec


def step_child(args) -> dict:
    """One step row in this process: build, warm up, time `--steps` optimizer steps; returns the row."""
    from benchmarks import train_rows as tt
    from lightning_ffpa import saved_ops
    from lightning_ffpa._compat import torch as torch_compat
    from lightning_ffpa.parallel.dims import ParallelDims

    dump_stacks_on_signal()
    name, seq = args.child_row, args.child_seq
    spec = _step_spec(name, args.smoke)
    row = {"part": "step", "row": name, "seq": seq, **spec, "layers": args.layers, "preset": args.preset,
           "label": LABELS[name].format(sliding=args.nemo_sliding)}
    device = torch.device("cpu") if args.smoke else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.distributed.init_process_group("gloo" if args.smoke else "nccl", rank=0, world_size=1,
                                         store=torch.distributed.HashStore())

    mesh = ParallelDims(1).build_mesh(device.type)
    torch_compat.raise_recompile_limit(64)
    nemo = None
    forced = kernels.force_kernel("reference") if args.smoke else contextlib.nullcontext()
    try:
        with forced:
            if name == "nemo":
                nemo, row["nemo"] = nemo_wheel.load_backend(args.nemo_wheel)
                nemo_wheel.register(nemo)
                if device.type == "cuda" and not kernels.ffpa_available():
                    raise RuntimeError(f"FFPA CuTeDSL unavailable: {kernels.ffpa_unavailable_reason()}")
                saved_ops.register(kernels.forward_ops())  # the recipe's SAC must-save set, as in the "ours" row
            model = tt.build_model(spec, mesh, args.layers, device, args.preset)
            if nemo is not None:
                model.config.ffpa_sliding_attn_backend = row["nemo_sliding"] = args.nemo_sliding
            opt = tt.build_optimizer(spec, model)
            ids = torch.randint(0, model.config.vocab_size, (1, seq), device=device,
                                generator=torch.Generator(device=device).manual_seed(0))
            stats = torch_compat.dynamo_counters()
            stats.clear()
            losses, times = [], []
            for step in range(args.warmup_steps + args.steps):
                if step == args.warmup_steps:
                    reset_paths(nemo)
                    graphs_before = stats["stats"]["unique_graphs"]
                    if device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats(device)

                def one_step():
                    loss = tt.loss_fn(spec, model, ids)
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    losses.append(loss.detach())

                t = time_ms(one_step, device, 0, 1)["ms"]
                if step >= args.warmup_steps:
                    times.append(t)
            losses = [float(x) for x in losses]
            med = statistics.median(times)
            row.update(step_ms=med, step_ms_min=min(times), step_ms_max=max(times), steps=len(times),
                       tokens_per_s=seq / med * 1e3, first_loss=losses[0], last_loss=losses[-1],
                       graph_breaks=sum(stats["graph_break"].values()),
                       recompiles_timed=stats["stats"]["unique_graphs"] - graphs_before,
                       **path_record("nemo" if nemo else "ours", nemo))
            if nemo is None and fell_back(row, device):
                row["fallback"] = fell_back(row, device)
            row["dispatch"] = backend.dispatch_counts()  # ours' counters: all zero in the NeMo row
            if device.type == "cuda":
                row.update(peak_allocated_gb=torch.cuda.max_memory_allocated(device) / 2**30,
                           peak_reserved_gb=torch.cuda.max_memory_reserved(device) / 2**30)
            if not all(abs(x) < 1e4 for x in losses):  # also false for NaN
                row["error"] = f"non-finite loss {losses}"
    except Exception as exc:  # noqa: BLE001
        row["error"] = f"{type(exc).__name__}: {exc}"[:800]
        traceback.print_exc()
    finally:
        torch.distributed.destroy_process_group()
    return row


def step_rows(args, deadline: float):
    """Each (row, seq) in its own child process; yields its row (or the child's crash, exactly)."""
    for seq in args.step_seqs:
        for name in args.step_rows:
            left = deadline - time.monotonic()
            if left < 30:
                yield {"part": "step", "row": name, "seq": seq, "error": f"skipped: past --budget-s {args.budget_s:.0f}"}
                continue
            with tempfile.TemporaryDirectory() as tmp:
                part = Path(tmp) / "row.json"
                cmd = [sys.executable, str(ENTRY), "--child-row", name, "--child-seq", str(seq),
                       "--child-out", str(part), "--nemo-wheel", str(args.nemo_wheel), "--layers", str(args.layers),
                       "--preset", args.preset, "--warmup-steps", str(args.warmup_steps), "--steps",
                       str(args.steps), "--nemo-sliding", args.nemo_sliding, *(["--smoke"] if args.smoke else [])]
                # its own session: a timeout kills the child's group after it wrote its stacks to stderr
                proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        start_new_session=True)
                try:
                    _, err = proc.communicate(timeout=left)
                except subprocess.TimeoutExpired:
                    kill_row(proc)
                    _, err = proc.communicate()
                    sys.stderr.write(err[-6000:])
                    error = (f"child killed after {left:.0f}s (--budget-s {args.budget_s:.0f}); last printed: "
                             + " | ".join(progress_tail(err, 3)))
                else:
                    sys.stderr.write(err[-3000:])
                    if part.exists():
                        yield json.loads(part.read_text())
                        continue
                    tail = progress_tail(err, 1) or ["(no stderr)"]
                    error = f"child exited {proc.returncode}: {tail[0]}"
                yield {"part": "step", "row": name, "seq": seq, "error": error[:800]}


