"""The `unsloth_lora` rows of benchmarks/full_depth_lora.py: the same full-depth LoRA run through Unsloth.

Owns what the row tries, in order, each step recorded in `tried` with its outcome: the installed versions of
Unsloth and what it pulls in (`importlib.metadata`, nothing imported), `import unsloth` (before transformers and
peft, as Unsloth requires, so its patches apply; a process that imported them first is refused, untimed), a local checkpoint directory of the model's config, a word
tokenizer and no weights but the final norm (so `from_pretrained` initialises every other weight for real,
on the GPU, through HF's own init), `FastModel.from_pretrained` (bf16, 16-bit LoRA, no quantisation),
`FastModel.get_peft_model` (r=16, lora_alpha 32, every linear layer of the decoder, the row's
`use_gradient_checkpointing`: "unsloth", its offloaded checkpointing and its default, or True, plain), then the timed steps: Unsloth's forward with labels (its compiled loss), backward, clip 1.0,
fused AdamW. A step that fails ends the row with the exact error (type, message, traceback tail): nothing is
estimated. Does not own processes or the summary (full_depth_lora.py), nor the step statistics (lora_step.py).
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

# Unsloth patches these as it is imported; one imported before it runs unpatched ("Unsloth should be imported before
# transformers... may run slower"). So this file imports none of them at module level, nor does full_depth_lora.py.
PATCHED_BY_UNSLOTH = ("transformers", "peft", "trl")
# What Unsloth 2026.10.x, trl and datasets install beside themselves (their wheel metadata); the row records
# which are present, so one failed import says what a device image lacks.
DISTRIBUTIONS = ("unsloth", "unsloth_zoo", "torch", "transformers", "peft", "trl", "accelerate", "datasets",
                 "bitsandbytes", "xformers", "triton", "torchao", "cut_cross_entropy", "requests", "tyro",
                 "pyarrow", "pandas", "dill", "multiprocess", "xxhash", "httpx", "fsspec", "psutil", "regex")
# The rows, by Unsloth's `use_gradient_checkpointing`: its offloaded checkpointing (its default), or plain.
GRADIENT_CHECKPOINTING: dict[str, str | bool] = {"unsloth_lora": "unsloth", "unsloth_lora_gc": True}
# Every linear layer of a Gemma4 text decoder layer (full layers with k_eq_v have no v_proj; peft skips them).
LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for name in DISTRIBUTIONS:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def checkpoint_dir(spec: dict[str, Any], root: Path) -> Path:
    """Config, tokenizer and a one-tensor safetensors file: `from_pretrained` initialises the rest."""
    import torch
    from safetensors.torch import save_file

    from benchmarks.grpo_vs_trl import word_tokenizer
    from benchmarks.lora_step import config_overrides
    from lightning_ffpa.presets import build_text_config

    cfg = build_text_config(spec["preset"], **config_overrides(spec))
    cfg.architectures = ["Gemma4ForCausalLM"]
    cfg.dtype = spec["dtype"]
    cfg.save_pretrained(root)
    word_tokenizer(cfg.vocab_size).save_pretrained(root)
    save_file({"model.norm.weight": torch.ones(cfg.hidden_size, dtype=getattr(torch, spec["dtype"]))},
              str(root / "model.safetensors"), metadata={"format": "pt"})
    return root


def measure_unsloth(spec: dict[str, Any]) -> dict[str, Any]:
    """The row: every step tried with its outcome; an `error` with the exact exception when one fails."""
    tried: list[dict[str, Any]] = []
    row: dict[str, Any] = dict(tried=tried, versions=versions())

    def attempt(step: str, fn):
        t0 = time.perf_counter()
        try:
            value = fn()
        except BaseException as err:  # noqa: BLE001 - SystemExit from a dependency check counts too
            tried.append(dict(step=step, ok=False, s=round(time.perf_counter() - t0, 1)))
            row["error"] = f"{step}: {type(err).__name__}: {err}"[:1500]
            row["traceback_tail"] = traceback.format_exc()[-2500:]
            raise _Stop from err
        tried.append(dict(step=step, ok=True, s=round(time.perf_counter() - t0, 1)))
        return value

    early = sorted(m for m in PATCHED_BY_UNSLOTH if m in sys.modules)
    row["imported_before_unsloth"] = early  # [] in the row's own process, where Unsloth comes first
    if early:  # refused, not timed: an unpatched Unsloth would be a slower baseline than its users get
        row["error"] = f"import unsloth: {', '.join(early)} already imported in this process; Unsloth must come first"
        return row
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local directory; no hub look-ups
    os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")  # its usage ping downloads from the hub
    os.environ.setdefault("UNSLOTH_COMPILE_LOCATION", tempfile.mkdtemp(prefix="unsloth_compiled_"))
    try:
        unsloth = attempt("import unsloth", lambda: __import__("unsloth"))
        row["unsloth_version"] = getattr(unsloth, "__version__", None)
        _run(spec, row, attempt)
    except _Stop:
        pass
    return row


class _Stop(Exception):
    """A step failed; its error is in the row."""


def _run(spec: dict[str, Any], row: dict[str, Any], attempt) -> None:
    import torch
    from unsloth import FastModel

    from benchmarks.lora_step import static_memory, step_stats, sync
    from lightning_ffpa._compat import transformers as hf_compat
    from lightning_ffpa.callbacks.throughput import train_flops_per_batch

    cuda = torch.cuda.is_available() and not spec["smoke"]
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    path = attempt("write checkpoint dir", lambda: checkpoint_dir(spec, Path(tempfile.mkdtemp(prefix="fdl_unsloth_"))))
    dtype = getattr(torch, spec["dtype"])
    model, _ = attempt("FastModel.from_pretrained", lambda: FastModel.from_pretrained(
        model_name=str(path), max_seq_length=spec["seq"], dtype=dtype, load_in_4bit=False, load_in_8bit=False,
        load_in_16bit=True, full_finetuning=False, fix_tokenizer=False, use_exact_model_name=True,
        device_map={"": 0} if cuda else "cpu"))
    stacks = {"target_parameters": spec["lora"]["target_parameters"]} if spec["lora"].get("target_parameters") else {}
    model = attempt("FastModel.get_peft_model", lambda: FastModel.get_peft_model(
        model, r=spec["lora"]["r"], lora_alpha=spec["lora"]["lora_alpha"], lora_dropout=0.0, bias="none",
        target_modules=LINEAR, use_gradient_checkpointing=GRADIENT_CHECKPOINTING[spec["row"]], random_state=0,
        **stacks))  # a MoE recipe's expert stacks (26B-A4B), as peft names them
    hf = model.get_base_model()
    # `from_pretrained` must have initialised the weights the file lacks: no all-zero or non-finite matrix
    row["matrices_not_initialised"] = sum(1 for p in hf.parameters() if p.dim() == 2 and not p.requires_grad
                                          and (not bool(p.isfinite().all()) or not bool(p.any())))
    row.update(model_class=type(hf).__qualname__, attn_implementation=hf_compat.config_attn_implementation(hf.config),
               static_memory=static_memory(model),
               lora_modules=sum(1 for n, _ in model.named_modules() if n.endswith(".lora_A")))
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-5, fused=cuda or None)
    ids = torch.randint(0, hf.config.vocab_size, (1, spec["seq"]), device=device,
                        generator=torch.Generator(device).manual_seed(0))
    model.train()
    losses, times = [], []

    def step() -> float:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    for i in range(spec["warmup"]):  # compile and optimizer states happen here
        losses.append(attempt(f"warm-up step {i}", step))

    def timed() -> None:
        sync(device)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        for _ in range(spec["steps"]):
            t0 = time.perf_counter()
            losses.append(step())  # .item() syncs
            times.append(time.perf_counter() - t0)

    attempt("timed steps", timed)
    row.update(losses=losses, **step_stats(times, spec["seq"], train_flops_per_batch(hf, 1, spec["seq"]), device))
