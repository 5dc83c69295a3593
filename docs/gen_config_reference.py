"""Generate docs/configuration.md and the README's config table from the code and configs/*.yaml.

Owns the reference pages only. Each class's options come from its `__init__` signature (type hints and
defaults) and the "Args:" section of its docstring, read with `docstring_parser`, the parser LightningCLI
uses for `--help`. So this page and `lightning-ffpa fit --help` cannot disagree. The config table comes from
each YAML's header comment and its `class_path` entries.

    python docs/gen_config_reference.py           # rewrite docs/configuration.md and the README table
    python docs/gen_config_reference.py --check   # exit 1 if either is stale
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import sys
import typing
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "configuration.md"
README = ROOT / "README.md"
BEGIN = "<!-- BEGIN GENERATED: configs (python docs/gen_config_reference.py) -->"
END = "<!-- END GENERATED: configs -->"

# (YAML key where the class goes, import path). Every class a shipped config can name from this package.
CLASSES: list[tuple[str, str]] = [
    ("model", "lightning_ffpa.module.Gemma4LM"),
    ("model", "lightning_ffpa.rl.module.GRPOModule"),
    ("data", "lightning_ffpa.data.TextDataModule"),
    ("data", "lightning_ffpa.data.MockDataModule"),
    ("data", "lightning_ffpa.data.PromptDataModule"),
    ("trainer.strategy", "lightning_ffpa.parallel.FSDP2Strategy"),
    ("trainer.callbacks", "lightning_ffpa.callbacks.FFPAAttention"),
    ("trainer.callbacks", "lightning_ffpa.callbacks.TokenThroughput"),
    ("trainer.callbacks", "lightning_ffpa.callbacks.rollout.RolloutCallback"),
    ("trainer.callbacks", "lightning_ffpa.callbacks.nonfinite.NonFiniteGuard"),
    ("trainer.callbacks", "lightning_ffpa.callbacks.preemption.DeferredRequeue"),
    ("trainer.callbacks", "lightning_ffpa.callbacks.preemption.StopOnSigterm"),
    ("trainer.callbacks", "lightning_ffpa.checkpoint.RunLock"),
    ("trainer.plugins", "lightning_ffpa.checkpoint.AtomicCheckpointIO"),
]
# Options that a class above takes as one mapping of fields: (where in the YAML, what it is, import path).
NESTED: list[tuple[str, str, str]] = [
    ("trainer.callbacks[RolloutCallback].init_args.engine", "the paged engine's sizes and switches",
     "lightning_ffpa.rollout.engine.EngineConfig"),
]


# How the `lightning-ffpa` command behaves (lightning_ffpa/cli.py, lightning_cli.py, errors.py, recipes.py).
COMMAND_LINE = [
    "## The command line",
    "",
    "- **Recipes by name.** `--config` takes a YAML path or the name of a recipe shipped in the package",
    "  (`--config gemma4_ffpa` or `--config gemma4_ffpa.yaml`; a file of that name in the current folder wins).",
    "  `lightning-ffpa recipes` lists them; `lightning-ffpa cp NAME DEST` copies one out for editing (DEST is a",
    "  file or an existing folder; an existing file is kept unless `--force`). The files are the repository's",
    "  `configs/`, which the package links as `lightning_ffpa/configs/` (one copy).",
    "- **Exit codes.** `lightning-ffpa` and `lightning-ffpa-export` exit 0 on success and 2 on a bad input",
    "  (3 when `NonFiniteGuard` stops a diverged `fit`, also with one `error:` line). A",
    "  bad input prints exactly one line, ``error: `option=value`: reason`` (or the component's own wording),",
    "  and nothing else: what the command printed while checking its input is dropped. Checked before any",
    "  model is built or file is written: the parser (unknown options, types, choices, class paths, the",
    "  config file), every constructor's own checks (unwrapped from jsonargparse's Union messages), Trainer",
    "  options (Lightning's checks, plus ranges Lightning accepts and fails on later, e.g.",
    "  `accumulate_grad_batches=0`), the pre-flight checks (`ckpt_path`, LoRA targets, layout) and missing",
    "  or unwritable paths. A disk that fills up is also reported in one line. Bugs keep their traceback",
    "  (exit 1).",
    "- **`--debug`** (or `LIGHTNING_FFPA_DEBUG=1`) shows the full traceback for a bad input too, and all the",
    "  output before it (exit code still 2); ranks the command launches inherit it.",
    "- **In Python:** `lightning_ffpa.cli.build(args, run=True)` builds the same CLI and returns it",
    "  (`cli.trainer`, `cli.model`); with `run=False` it only parses and instantiates, and `args` has no",
    "  subcommand (`build([\"--config\", \"tiny\"], run=False)`). `cli.main(args)` is the console script",
    "  (returns the exit code).",
    "- **The screen.** With `trainer.max_steps` set, the progress bar counts optimizer steps of `max_steps`",
    "  (`Epoch 0, step 120/300`). The model summary lists layers and parameters without a FLOPs column",
    "  (Lightning counts FLOPs only with an `example_input_array`, and not through the FFPA and flex ops;",
    "  `TokenThroughput` logs model FLOPs and MFU). A run ends with one line naming the step it reached,",
    "  its last checkpoint and its log folder.",
    "- **What is logged** (every `trainer.log_every_n_steps` optimizer steps, to `trainer.logger`; under GRPO with",
    "  `num_iterations > 1` the step axis counts rollout batches, [rollout.md](rollout.md)): `train/loss`",
    "  (the step's last micro-batch, on rank 0: Lightning logs rank 0's value of an unsynced metric; the",
    "  gradient itself is the mean over every rank's tokens), `train/ppl`, `train/grad_norm` (all gradients",
    "  together, before clipping, reduced over FSDP2's shards), `val/loss` and `val/ppl` (over every rank and",
    "  per labelled token, so `val/loss` is log `val/ppl`; `test/loss` likewise), the learning rate per",
    "  parameter group (`lr-AdamW/pg1`, `pg2`: the SFT recipes' `StepLearningRateMonitor`, once a step; with",
    "  `warmup_steps > 0` the first step runs at 0, as transformers' warmup schedule starts). `TokenThroughput` adds",
    "  `train/device/*` (tokens, FLOPs and MFU of rank 0) and `train/*` (the whole job: every rank's samples, tokens",
    "  and FLOPs summed, one small all-reduce on the steps that log), `device/peak_memory_gb`",
    "  and, once per validation run whatever `log_every_n_steps` (not the sanity check), `validate/*` on the step",
    "  of that run's `val/loss`: its totals (`validate/time`, `batches`, and the job's `samples`, `lengths`,",
    "  `flops`), the job's rates over the run (`validate/items_per_sec`, `samples_per_sec`, `flops_per_sec`) and",
    "  rank 0's (`validate/device/*`, with `validate/device/mfu`); `test` likewise (`test/*`, once per run), and",
    "  once they ran, the counted matmul paths: `experts/grouped_mm` or `experts/loop` (MoE experts with unmerged",
    "  adapters) and `fp8_base/<path>` (the float8 frozen base); no per-expert load is logged yet;",
    "  `FFPAAttention` adds `attention/<path>` ([attention.md](attention.md#how-to-see-what-ran)).",
    "- **The optimizer is the model's.** There is no `--optimizer` or `--lr_scheduler` (LightningCLI's",
    "  `auto_configure_optimizers` is off): `Gemma4LM.configure_optimizers` builds AdamW (no decay on norms and",
    "  biases) with a linear warmup then a cosine decay, set by `model.init_args.learning_rate`, `warmup_steps`,",
    "  `min_lr_ratio`, `weight_decay` and `betas`; `GRPOModule` takes `learning_rate`. Either option is refused",
    "  in one line that names these. Another optimizer needs a model class that overrides `configure_optimizers`.",
    "- **Options are spelled in full.** An abbreviation (`--trainer.max_step` for `max_steps`) is an unknown",
    "  option, not the option it starts (argparse's `allow_abbrev` is off).",
    "- **What `validate`, `test` and `predict` evaluate.** `--ckpt_path last` (this run's",
    "  `<default_root_dir>/checkpoints/last.ckpt`, as `fit` finds it) or a checkpoint file; `last` that finds",
    "  nothing, `hpc` with no HPC checkpoint, and `best` (the best save of a fit in the same process, so never",
    "  in a fresh one) are refused in one line. Without `--ckpt_path` the model is evaluated as built, which is",
    "  legitimate (a base model's `pretrained` weights, or a random-init baseline, ln(vocab) for the loss) but",
    "  easy to do by mistake after a fit, so the command says so among its start-up lines:",
    "  `validate: no --ckpt_path, so the model is evaluated as built: random init of preset 'tiny' (...)` or",
    "  `...: the pretrained weights of <path>`. A `validate` that `trainer.limit_val_batches` cut short (the `tiny`",
    "  recipe caps it at 8 batches for the fit's periodic validation) ends with `validate: scored 8 of the 12",
    "  validation batches (...)`.",
    "",
]


def _import(path: str) -> type:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _md(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def options(cls: type) -> list[dict[str, str]]:
    """One dict per `__init__` argument: name, type, default, description (from the docstring's Args)."""
    from docstring_parser import parse, parse_from_object

    docs = {}
    for source in (cls.__init__.__doc__, cls.__doc__):
        if source:
            docs.update({p.arg_name: p.description or "" for p in parse(source).params if p.arg_name not in docs})
    if dataclasses.is_dataclass(cls):  # a field's docstring follows it
        docs.update({p.arg_name: p.description or "" for p in parse_from_object(cls).params if p.arg_name not in docs})
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # noqa: BLE001 - unresolvable forward refs: keep the annotation text as written
        hints = {}
    out = []
    for name, param in inspect.signature(cls.__init__).parameters.items():
        if name == "self" or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        annotation = param.annotation
        typ = "" if annotation is inspect.Parameter.empty else (
            annotation if isinstance(annotation, str) else inspect.formatannotation(annotation))
        if typ.isidentifier() and name in hints and typing.get_origin(hints[name]) is typing.Literal:
            typ = inspect.formatannotation(hints[name])  # a Literal alias (e.g. ACMode): show its values
        default = "required" if param.default is inspect.Parameter.empty else repr(param.default)
        default = default.replace(str(ROOT) + "/", "")  # package paths, not this checkout's location
        out.append({"name": name, "type": typ, "default": default, "help": docs.get(name, "")})
    return out


def render_reference() -> str:
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated by `python docs/gen_config_reference.py` from the classes' signatures and docstrings. -->",
        "",
        "Each class below can be named in a YAML config with `class_path` and set with `init_args`, or overridden",
        "on the command line, e.g. `--model.init_args.learning_rate 1e-5`. The CLI prints the same text:",
        "`lightning-ffpa fit --model.help Gemma4LM` (or `GRPOModule`), `--data.help TextDataModule`,",
        "`--trainer.callbacks.help RolloutCallback`: a class's short name or its full path",
        "(`--trainer.callbacks.help lightning_ffpa.callbacks.FFPAAttention`). Lightning's own `trainer:` options are",
        "in the [Trainer docs](https://lightning.ai/docs/pytorch/stable/common/trainer.html).",
        "",
        "Model options are one vocabulary: `Gemma4LM` and `GRPOModule` build their model through the same code",
        "(`lightning_ffpa.hf_module.HFModule`) from `pretrained`, `preset`, `config_overrides`, `attn_implementation`,",
        "`dtype` and `lora`. `lora` takes peft `LoraConfig` fields, e.g.",
        "`--model.init_args.lora '{r: 16, lora_alpha: 32, target_modules: [q_proj, v_proj]}'` or",
        "`--model.init_args.lora.r 16 --model.init_args.lora.target_modules '[q_proj, v_proj]'` (peft needs the",
        "targets). On the MoE model (`gemma4-26b-a4b`, `tiny-moe`) the experts are 3-D parameters, not Linears:",
        "`lora.target_parameters: [experts.gate_up_proj, experts.down_proj]` puts adapters on them (peft's",
        "parameter LoRA: no `lora_dropout`, no DoRA), beside `target_modules`; `lightning-ffpa-export --merge_lora`",
        "merges them expert by expert into HF's layout. `lora.expert_adapters` says how they run: `unmerged` (the",
        "default) adds s (x A_e^T) B_e^T to each expert's rows inside the experts' grouped GEMMs",
        "(`lightning_ffpa/experts.py`; what ran is counted, `experts.path_counts()`), `folded` is peft's own way,",
        "W + s B A written into a copy of every stack on each forward. GRPO rollouts serve them: the engine reads",
        "the policy's stacks and adds the adapters the same way ([rollout.md](rollout.md)). `lora.base_dtype: fp8` stores the targets'",
        "frozen base in float8 with a",
        "scale per row ([performance.md](performance.md#fp8-frozen-base-for-lora)).",
        "A `target_modules` or `target_parameters` name that matches nothing (peft",
        "itself only warns) is an error naming the option, as is any other bad value (an unknown",
        "`config_overrides` field, a negative `warmup_steps`,",
        "`lora.r: 0`, ...), before any model is built. With an explicit",
        "`--ckpt_path` (a file, or the folder FSDP2Strategy saves), the model options come from the checkpoint, so",
        "a `model` option that differs from it is an error naming both values; `--resume_model_from_checkpoint true`",
        "takes the checkpoint's. With `--ckpt_path last` the model is built from this run's options, but its",
        "module class, architecture options and `dtype` must be the checkpoint's, and the optimizer resumes its",
        "saved param groups and schedule: a `learning_rate`, `weight_decay`, `betas`, `warmup_steps` or",
        "`min_lr_ratio` that differs from the checkpoint's is refused by name, since it would be ignored (or jump",
        "the schedule mid-run); `validate`, `test` and `predict` compare the class and architecture only.",
        "A checkpoint also records a digest of its",
        "data's tokenizer (the vocabulary and the special ids): `validate`, `test`, `predict` or a resume with",
        "another tokenizer is refused naming `data.init_args.tokenizer`, however either was spelled.",
        "",
        *COMMAND_LINE,
    ]
    for key, path in CLASSES:
        cls = _import(path)
        summary = _md((inspect.getdoc(cls) or "").split("\n\n")[0])
        lines += [f"## `{path}`", "", f"{summary} YAML: `{key}` (`class_path: {path}`).", ""]
        rows = [f"| `{o['name']}` | `{_md(o['type'])}` | `{_md(o['default'])}` | {_md(o['help'])} |"
                for o in options(cls)]
        lines += ["| argument | type | default | description |", "|---|---|---|---|", *rows] if rows else ["No arguments."]
        lines.append("")
    for where, what, path in NESTED:
        cls = _import(path)
        field = where.rsplit(".", 1)[-1]
        lines += [f"## `{path}`", "", f"{what[0].upper()}{what[1:]}: YAML `{where}`, a mapping of these fields; one "
                  f"field on the command line: `--trainer.callbacks.init_args.{field}.FIELD VALUE`.", ""]
        lines += ["| field | type | default | description |", "|---|---|---|---|"]
        lines += [f"| `{o['name']}` | `{_md(o['type'])}` | `{_md(o['default'])}` | {_md(o['help'])} |"
                  for o in options(cls)]
        lines.append("")
    return "\n".join(lines)


def _class_name(entry) -> str:
    if isinstance(entry, dict) and "class_path" in entry:
        return entry["class_path"].rsplit(".", 1)[-1]
    return "-" if entry in (None, False) else str(entry)


def render_config_table() -> str:
    """README table: one row per configs/*.yaml (header comment, model, data, strategy, callbacks, devices)."""
    rows = ["| config | what it is | model | data | strategy | callbacks | devices |", "|---|---|---|---|---|---|---|"]
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        text = path.read_text()
        header = []
        for line in text.splitlines():  # the opening comment, up to its first indented (command) line
            body = line[1:].removeprefix(" ") if line.startswith("#") else None
            if body is None or not body.strip() or body[0].isspace():
                break
            header.append(body.strip())
        what = " ".join(header)
        cfg = yaml.safe_load(text)
        trainer = cfg.get("trainer", {})
        callbacks = ", ".join(_class_name(c) for c in trainer.get("callbacks", []) or []) or "-"
        devices = f"{trainer.get('accelerator', 'auto')} x {trainer.get('devices', 1)}"
        if trainer.get("num_nodes", 1) != 1:
            devices += f" x {trainer['num_nodes']} nodes"
        rows.append(f"| [`{path.name}`](configs/{path.name}) | {_md(what)} | {_class_name(cfg.get('model'))} | "
                    f"{_class_name(cfg.get('data'))} | {_class_name(trainer.get('strategy'))} | {_md(callbacks)} | "
                    f"{devices} |")
    return f"{BEGIN}\n" + "\n".join(rows) + f"\n{END}"


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT))  # run as a script from docs/: make `benchmarks` importable
    from benchmarks.report.pages import replace_block, write_pages

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="exit 1 if docs/configuration.md or README.md is stale")
    args = p.parse_args(argv)
    pages = {OUT: render_reference(), README: replace_block(README.read_text(), render_config_table(), BEGIN, END)}
    return write_pages(pages, "python docs/gen_config_reference.py", check=args.check)


if __name__ == "__main__":
    sys.exit(main())
