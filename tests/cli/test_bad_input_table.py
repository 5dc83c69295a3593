"""The bad-input table, through the installed console scripts: each row exits 2, prints exactly one line
(`error: ...` naming the option) on stderr and nothing on stdout, and writes no file.

Each row runs `lightning-ffpa` / `lightning-ffpa-export` in a fresh folder holding the tiny configs
(`fit.yaml` = configs/tiny.yaml at CPU size, `grpo.yaml` = configs/tiny_grpo.yaml) and a few prepared
files; the folder's tree (names, sizes, mtimes) must be the same after the command. Most of a fresh
process's time is imports (Lightning, torch: ~5 s a row, ~8 minutes for the table), so each row runs the
installed script in a process forked from a preloader that imported them once (`_console.Preloaded`), two at
a time; `test_preloaded_rows_match_fresh_processes` runs a few rows both ways and compares.
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import yaml
from _console import ROOT, Preloaded, run, snapshot

from tests.data.conftest import PLAIN_TEMPLATE, save_tokenizer

F = "lightning-ffpa fit --config fit.yaml"
G = "lightning-ffpa fit --config grpo.yaml"
E = "lightning-ffpa-export"

# (command line, text the one `error:` line must contain: the option as the user spelled it)
ROWS = [
    (f"{F} --trainer.max_stepz=3", "--trainer.max_stepz"),
    (f"{F} --model.init_args.learning_rat 0.1", "model.init_args.learning_rat"),
    (f"{F} --trainer.max_steps abc", "trainer.max_steps"),
    (f"{F} --model.init_args.config_overrides 5", "model.init_args.config_overrides"),
    (f"{F} stray_word", "stray_word"),
    ("lightning-ffpa --config fit.yaml", "subcommand"),
    ("lightning-ffpa fit --config missing.yaml", "--config"),
    ("lightning-ffpa fit --config emptydir", "--config"),
    ("lightning-ffpa fit --config bad.yaml", "--config"),
    (f"{F} --model.class_path no.such.Module", "model.class_path"),
    (f"{F} --trainer.callbacks+=no.such.Callback", "trainer.callbacks"),
    (f"{F} --model.init_args.attn_implementation flash9", "attn_implementation"),
    (f"{F} --model.init_args.attn_implementation flex_attention", "model.attn_implementation"),  # CPU
    (f"{F} --model.init_args.loss_impl fast", "model.init_args.loss_impl"),
    (f"{F} --model.init_args.dtype fp8", "model.init_args.dtype"),
    (f"{F} --model.init_args.preset gemma4-999b", "preset"),
    (f"{F} --model.init_args.pretrained /nonexistent/gemma4", "model.pretrained"),
    (f"{F} --model.init_args.pretrained adapter", "/adapter'`: is a LoRA adapter folder"),
    (f"{F} --model.init_args.pretrained oddcfg", "/oddcfg'`: could not be loaded"),
    (f"{F} --model.init_args.lora '{{r: 2, lora_alpha: 4, target_modules: [nope_proj]}}'", "target_modules"),
    (f"{F} --model.init_args.lora '{{r: 2, lora_alpha: 4, target_parameters: [experts.down_proj]}}'",
     "model.lora.target_parameters"),  # the dense tiny model has no expert stacks
    (f"{F} --trainer.precision fp8", "trainer.precision"),
    (f"{F} --trainer.accumulate_grad_batches 0", "trainer.accumulate_grad_batches"),
    (f"{F} --trainer.val_check_interval 0", "trainer.val_check_interval"),
    (f"{G} --trainer.val_check_interval 5", "trainer.val_check_interval"),  # GRPO has no validation loop
    (f"{G} --trainer.limit_val_batches 2", "trainer.limit_val_batches"),
    (f"{F} --trainer.max_steps -5", "max_steps"),
    (f"{F} --trainer.devices 0", "devices"),
    (f"{F} --trainer.accelerator nope", "`trainer.accelerator='nope'`: not an accelerator Lightning knows"),
    (f"{F} --trainer.accelerator tpu", "`trainer.accelerator='tpu'`: `XLAAccelerator` can not run"),  # no torch_xla
    (f"{F} --ckpt_path /nonexistent/last.ckpt", "ckpt_path"),
    (f"{F} --ckpt_path garbage.ckpt", "ckpt_path"),
    (f"{F} --ckpt_path hpc", "ckpt_path"),
    (f"{F} --data.init_args.train_file /nonexistent/train.txt", "data.init_args.train_file"),
    (f"{F} --data.init_args.tokenizer /nonexistent/tok", "data.init_args.tokenizer"),
    (f"{F} --data.init_args.batch_size 0", "data.init_args.batch_size"),
    (f"{F} --data.init_args.pad_to_multiple_of 0", "data.init_args.pad_to_multiple_of"),
    (f"{F} --model.init_args.warmup_steps -10", "model.warmup_steps"),
    (f"{F} --model.init_args.learning_rate -1", "model.learning_rate"),
    (f"{F} --model.init_args.weight_decay -1", "model.weight_decay"),
    (f"{F} --model.init_args.min_lr_ratio 2", "model.min_lr_ratio"),
    (f"{F} --model.init_args.betas [0.9,1.5]", "model.betas"),
    (f"{F} --model.init_args.loss_chunk_size 0", "model.loss_chunk_size"),
    (f"{F} --model.init_args.lora '{{r: 0}}'", "model.lora.r"),
    (f"{F} --model.init_args.config_overrides '{{num_hidden_layerz: 2}}'", "num_hidden_layerz"),
    (f"{F} --model.init_args.config_overrides '{{num_hidden_layers: two}}'", "model.config_overrides"),
    ("lightning-ffpa test --config fit.yaml", "test_dataloader"),
    ("lightning-ffpa validate --config fit.yaml", "trainer.limit_val_batches"),  # fit.yaml: limit_val_batches 0
    ("lightning-ffpa validate --config fit.yaml --trainer.limit_val_batches 1 --ckpt_path last", "ckpt_path='last'"),
    ("lightning-ffpa validate --config fit.yaml --trainer.limit_val_batches 1 --data.init_args.val_fraction 0",
     "`data.init_args.val_fraction` is 0"),
    (f"{G} --trainer.callbacks.init_args.reward_weights [1,2]", "RolloutCallback.reward_weights"),
    ("lightning-ffpa validate --config grpo.yaml", "(GRPOModule) has no validation step"),  # and names the route:
    ("lightning-ffpa validate --config grpo.yaml --ckpt_path last", "`--model.init_args.pretrained` at the folder"),
    # options the rest of the data options leave unread were ignored without a word
    (f"{F} --data.init_args.text_field body", "`data.init_args.text_field='body'`: names a field of records"),
    (f"{F} --data.init_args.pack true --data.init_args.pad_to_multiple_of 64",
     "`data.init_args.pad_to_multiple_of=64`: pads unpacked batches"),
    # validate read its data inside the Trainer: an IndexError traceback, or the error after Lightning's lines
    ("lightning-ffpa validate --config fit.yaml --trainer.limit_val_batches 1 --data.init_args.tokenizer bigtok",
     "`data.init_args.tokenizer='bigtok'`: has 600 tokens, more than the model's vocab_size=512"),
    ("lightning-ffpa validate --config fit.yaml --trainer.limit_val_batches 1 --data.init_args.max_seq_length 4096",
     "`data.init_args.max_seq_length=4096`: exceeds the model's max_position_embeddings"),
    ("lightning-ffpa validate --config tiny_fsdp2", "`data.init_args.num_val_samples` is 0"),
    ("lightning-ffpa test --config grpo.yaml", "has no `test_dataloader`, so `test` has nothing to run on"),
    (f"{F} --trainer.strategy lightning_ffpa.parallel.FSDP2Strategy --trainer.strategy.replicate_frozen often",
     "replicate_frozen"),
    (f"{F} --trainer.strategy lightning_ffpa.parallel.FSDP2Strategy --trainer.strategy.context_parallel_size 0",
     "context_parallel_size"),
    (f"{F} --trainer.strategy lightning_ffpa.parallel.FSDP2Strategy --trainer.strategy.replicate_frozen true "
     "--trainer.strategy.param_dtype bf16 --model.init_args.lora '{r: 2, lora_alpha: 4, target_modules: [q_proj]}'",
     "replicate_frozen"),
    (f"{F} --trainer.strategy lightning_ffpa.parallel.FSDP2Strategy --trainer.strategy.fp8 rowwise",
     "`fp8='rowwise'`: needs a CUDA GPU with FP8"),  # CPU, no fp8_emulate
    (f"{F} --trainer.strategy lightning_ffpa.parallel.FSDP2Strategy --trainer.strategy.fp8 fp4", "fp8"),
    (f"{F} --model.init_args.lora '{{r: 2, target_modules: [q_proj], base_dtype: fp16}}'", "base_dtype"),
    (f"{G} --model.init_args.config_overrides '{{num_hidden_layers: 0}}'",
     "`model.config_overrides.num_hidden_layers=0`: must be >= 1"),
    (f"{G} --model.init_args.config_overrides '{{hidden_size: 0}}'", "`model.config_overrides.hidden_size=0`"),
    (f"{G} --model.init_args.config_overrides '{{num_attention_heads: 3}}'",
     "`model.config_overrides.num_attention_heads=3`: must be a multiple"),
    # the Callback's attention is the one that runs: its option is checked and named (model's, before)
    (f"{F} --trainer.callbacks+=lightning_ffpa.callbacks.FFPAAttention --trainer.callbacks.attn_implementation "
     "flex_attention", "`FFPAAttention.attn_implementation='flex_attention'`: cannot train on CPU"),
    (f"{F} --data.init_args.pack false --trainer.callbacks+=lightning_ffpa.callbacks.FFPAAttention "
     "--trainer.callbacks.attn_implementation flash_attention_2", "`FFPAAttention.attn_implementation='flash_att"),
    (f"{F} --trainer.callbacks+=lightning_ffpa.callbacks.FFPAAttention --trainer.callbacks.attn_implementation "
     "flash_attention_2", "`FFPAAttention.attn_implementation='flash_attention_2'`: cannot keep packed documents"),
    (f"{F} --model.init_args.max_seq_length 8", "`model.max_seq_length=8`: is shorter than the data's rows"),
    (f"{F} --model.init_args.betas '[0.9, 1.0]'", "`model.betas=[0.9, 1.0]`: must be two numbers in [0, 1)"),
    (f"{G} --trainer.callbacks.init_args.model_attr foo", "`RolloutCallback.model_attr='foo'`: GRPOModule has no"),
    (f"{G} --trainer.callbacks.init_args.model_attr entropy", "`RolloutCallback.model_attr='entropy'`: is MeanMetric"),
    (f"{F} --model.init_args.lora '{{r: 2, target_modules: [q_proj], modules_to_save: [lm_head]}}' "
     "--model.init_args.lora.modules_to_save null", "`--model.init_args.lora '{modules_to_save: null}'`"),
    (f"{F} --model.init_args.lora '{{r: 2, target_modules: [q_proj], base_dtype: fp8, use_dora: true}}'",
     "`model.lora.base_dtype='fp8'`: does not work with `use_dora`"),
    (f"{F} --model.init_args.lora '{{r: 2, target_modules: [q_proj, lm_head], base_dtype: fp8}}'",
     "`model.lora.base_dtype='fp8'`: cannot store lm_head's base in float8"),  # tied to the embedding
    (f"{F} --trainer.strategy lightning_ffpa.parallel.FSDP2Strategy --trainer.strategy.replicate_frozen false "
     "--model.init_args.lora '{r: 2, target_modules: [q_proj], base_dtype: fp8}'",
     "`model.lora.base_dtype='fp8'`: keeps the float8 base whole"),
    (f"{F} --trainer.strategy lightning_ffpa.parallel.FSDP2Strategy --trainer.strategy.fp8 tensorwise "
     "--trainer.strategy.fp8_emulate true --model.init_args.lora '{r: 2, lora_alpha: 4, target_modules: [q_proj]}'",
     "`fp8='tensorwise'`: converts the weights of a full fine-tune"),
    # nested init args of a class held in a Union with `str` (Trainer.strategy): the class's own error, not `str`'s
    (f"{F} --trainer.strategy lightning_ffpa.parallel.FSDP2Strategy --trainer.strategy.init_args.compile maybe",
     "`trainer.strategy.init_args.compile='maybe'`: expected bool"),
    (f"{F} --trainer.strategy lightning_ffpa.parallel.FSDP2Strategy --trainer.strategy.init_args.bogus 1",
     "`trainer.strategy.init_args.bogus='1'`: is not an argument of FSDP2Strategy"),
    (f"{F} --trainer.strategy.init_args.compile true", "set `trainer.strategy.class_path` first"),
    ("lightning-ffpa cp no_such_recipe out.yaml", "recipe"),
    ("lightning-ffpa cp tiny afile", "dest"),
    # Lightning's refusal named `Fabric(...)` and ModelParallelStrategy, neither of which the user wrote
    (f"{F} --trainer.strategy lightning_ffpa.parallel.FSDP2Strategy --trainer.precision 16-mixed",
     "`trainer.precision='16-mixed'`: is not one the FSDP2 strategy supports"),
    # both were ignored without a word: one-file saves are synchronous; a full fine-tune has no frozen weights
    (f"{F} --trainer.strategy lightning_ffpa.parallel.FSDP2Strategy --trainer.strategy.init_args.async_save true "
     "--trainer.strategy.init_args.save_distributed_checkpoint false", "`async_save=True`: writes DCP folders"),
    (f"{F} --trainer.strategy lightning_ffpa.parallel.FSDP2Strategy --trainer.strategy.init_args.replicate_frozen true",
     "`trainer.strategy.init_args.replicate_frozen=True`: has nothing to replicate"),
    # Lightning's Throughput asserted window_size > 1 mid-fit (a traceback, exit 1); a negative peak logged MFU < 0
    (f"{F} --trainer.callbacks+=lightning_ffpa.callbacks.TokenThroughput --trainer.callbacks.init_args.window_size 1",
     "`TokenThroughput.window_size=1`: must be >= 2"),
    (f"{F} --trainer.callbacks+=lightning_ffpa.callbacks.TokenThroughput --trainer.callbacks.init_args.peak_flops=-1e12",
     "`TokenThroughput.peak_flops=-1000000000000.0`: must be > 0"),
    (f"{G} --trainer.callbacks.init_args.num_generations 1", "num_generations"),
    (f"{G} --trainer.callbacks.init_args.reward_funcs=[no_such_module:reward]", "reward_funcs"),
    (f"{G} --trainer.callbacks.init_args.reward_funcs '[lightning_ffpa.rl.rewards:token_range_reward]'",
     "reward_funcs`: `lightning_ffpa.rl.rewards:token_range_reward` is the old `module:function` form"),
    (f"{G} --trainer.callbacks.init_args.engine.max_seq_len 4", "engine.max_seq_len"),
    (f"{G} --trainer.callbacks.init_args.engine.page_size 0", "engine.page_size"),
    (f"{G} --trainer.callbacks.init_args.engine.attention sparse", "engine.attention"),
    (f"{G} --trainer.callbacks.init_args.engine.compile_mode reduce-overhead", "engine.compile_mode"),
    (f"{G} --trainer.callbacks.init_args.engine.compile_decode true", "engine.compile_decode"),  # CPU
    (f"{G} --trainer.callbacks.init_args.engine.kv_block_size 3", "engine.kv_block_size"),
    (f"{G} --trainer.callbacks.init_args.sampling.max_new_tokens 0", "sampling.max_new_tokens"),
    (f"{G} --trainer.callbacks.init_args.sampling.top_p 0", "sampling.top_p"),
    (f"{G} --trainer.callbacks.init_args.sampling '{{max_new_tokens: 40}}'", "engine.max_seq_len"),
    (f"{G} --trainer.callbacks.init_args.inference_dtype fp8", "inference_dtype"),
    (f"{G} --trainer.callbacks.init_args.weights copy", "weights"),
    (f"{G} --trainer.callbacks.init_args.max_seq_len 4", "trainer.callbacks.init_args.max_seq_len"),  # old flat option
    (f"{G} --trainer.callbacks.init_args.bogus 1", "trainer.callbacks.init_args.bogus"),
    (f"{G} --model.init_args.beta 0.1", "beta"),
    (f"{G} --model.init_args.preset nope", "model.preset"),
    (f"{G} --model.init_args.dtype fp8", "model.init_args.dtype"),
    (f"{G} --model.init_args.lora '{{r: 0}}'", "model.lora.r"),
    (f"{G} --model.init_args.lora_rank -1", "model.init_args.lora_rank"),  # the old option is gone: `lora`
    (f"{G} --model.init_args.learning_rate 0", "model.learning_rate"),
    (f"{G} --model.init_args.clip_eps 0", "model.clip_eps"),
    (f"{G} --model.init_args.clip_eps_high 0.1", "`model.clip_eps_high=0.1`: must be >= `model.clip_eps=0.2`"),
    (f"{G} --model.init_args.old_logprobs sampler", "model.init_args.old_logprobs"),
    (f"{G} --model.init_args.sampler_is_cap 0.5", "model.sampler_is_cap"),
    (f"{G} --model.init_args.old_logprobs engine", "model.sampler_is_cap"),  # the engine ratio needs no weight
    (f"{G} --model.init_args.config_overrides '{{bogus_field: 1}}'", "model.config_overrides.bogus_field"),
    (f"{G} --model.init_args.loss_type ppo", "model.init_args.loss_type"),
    (f"{G} --model.init_args.num_iterations 0", "model.num_iterations"),
    (f"{G} --model.init_args.max_tokens_per_microbatch 9", "model.max_tokens_per_microbatch"),  # < 4 + 6 tokens
    (f"{G} --model.init_args.overlong_penalty 2.0", "model.overlong_penalty"),  # shaping off: it scaled nothing
    (f"{G} --trainer.gradient_clip_val 1.0", "trainer.gradient_clip_val"),  # the module clips: its own option
    (f"{G} --data.init_args.batch_size 0", "data.init_args.batch_size"),
    (f"{G} --data.init_args.prompt_len 0", "data.init_args.prompt_len"),
    (f"{G} --data.init_args.vocab_size 1", "data.init_args.vocab_size"),
    (f"{G} --data.init_args.path /nonexistent/prompts.jsonl", "data.init_args.path"),
    (f"{E} /nonexistent/last.ckpt out", "ckpt"),
    (f"{E} garbage.ckpt out", "ckpt"),
    (f"{E} fake.ckpt afile/sub", "out"),
    (f"{E} fake.ckpt nonempty", "`out='nonempty'`"),  # the argument's name
    (f"{E} fake.ckpt afile", "`out='afile'`: cannot be created"),  # was torch's "[Errno 20] Not a directory"
    (f"{E} fake.ckpt /proc/x6", "`out='/proc/x6'`: cannot be created in /proc"),  # was "[Errno 2] No such file"
    ("lightning-ffpa cp tiny newdir/", "`dest='newdir/'`: names a folder (a trailing slash) that does not exist"),
    (f"{E} fake.ckpt out --dtype float64", "--dtype"),
    (f"{E} fake.ckpt out --max-shard-size lots", "--max_shard_size"),  # named as --help spells it
    (f"{E} fake.ckpt out --max_shard_size 0MB", "`--max_shard_size='0MB'`: must be a size above zero"),
    (f"{E} fake.ckpt out --max_shard_size=-5GB", "`--max_shard_size='-5GB'`: must be a size above zero"),
    (f"{E} fake.ckpt out --max_shard_size -5GB", "`--max_shard_size`: expected one argument"),  # not the whole line
    (f"{E} fake.ckpt out --config /nonexistent", "--config"),
    (f"{E} fake.ckpt out --config afile", "--config"),
    (f"{E} fake.ckpt out --merge-lora", "--merge_lora"),
    # checked by the components (data rows, prompt lengths, module vs callback) in the pre-flight, before fit writes
    (f"{F} --data.init_args.max_seq_length 4096", "data.init_args.max_seq_length"),  # vs max_position_embeddings
    ("lightning-ffpa fit --config tiny_fsdp2 --data.init_args.seq_length 4096", "data.init_args.seq_length"),
    (f"{F} --data.init_args.batch_size 100000", "data.init_args.batch_size"),  # data.setup: needs the row count
    (f"{G} --data.init_args.num_random_prompts 1", "data.init_args.batch_size"),  # data.setup: row count
    (f"{G} --trainer.callbacks.init_args.engine.max_seq_len 8", "engine.max_seq_len"),  # callback setup: prompts
    (f"{G} --model.init_args.temperature 0.5", "sampling.temperature"),  # callback setup: vs module temperature
    (f"{G} --trainer.callbacks.init_args.engine.bogus 1", "engine.bogus"),  # a dataclass: no `init_args`
    # issue 46: inputs that exited 0 having done nothing (or the wrong thing), or ended in a traceback
    (f"{F} --trainer.max_steps 0", "`trainer.max_steps=0`: trains nothing"),
    (f"{F} --trainer.limit_train_batches 0", "`trainer.limit_train_batches=0`: trains nothing"),
    (f"{F} --trainer.limit_train_batches 0.0", "`trainer.limit_train_batches=0.0`: trains nothing"),
    (f"{F} --trainer.max_epochs -1 --trainer.max_steps -1", "with `trainer.max_steps=-1` the run never ends"),
    (f"{F} --trainer.precision 16-mixed", "`trainer.precision='16-mixed'`: float16 mixed precision needs a CUDA"),
    (f"{F} --seed_everything 4294967296", "`seed_everything=4294967296`: must be in 0..4294967295"),
    (f"{F} --seed_everything -1", "`seed_everything=-1`"),
    (f"{F} --ckpt_path best", "`ckpt_path='best'`: there is no best checkpoint yet"),
    (f"{F} --trainer.default_root_dir afile", "`trainer.default_root_dir='afile'`: is a file"),
    (f"{F} --trainer.default_root_dir afile/runs", "`trainer.default_root_dir='afile/runs'`: is under the file"),
    (f"{F} --trainer.default_root_dir /sys/lightning-ffpa-runs", "trainer.default_root_dir='/sys/lightning-ffpa-runs'"),
    (f"{F} --model.init_args.learning_rate -3e-3", "write `--model.init_args.learning_rate=-3e-3`"),
    (f"{F} --config dup.yaml", "`--config='dup.yaml'`: the key `max_steps` appears twice in `trainer` (lines 2 and 3)"),
    (f"{F} --trainer dup_trainer.yaml", "`trainer`: the key `max_steps` appears twice"),  # jsonargparse's loader
    (f"{F} --config empty.yaml", "`--config='empty.yaml'`: is empty"),
    (f"{F} --config section.yaml", "`--config='section.yaml'`: section `trainer` names the file 'other.yaml', which"),
    ("lightning-ffpa fit --config binary.yaml", "`--config='binary.yaml'`: is not a text (UTF-8) YAML file"),
    (f"{F} --data.init_args.tokenizer stubtok", "`data.init_args.tokenizer='stubtok'`: has no vocabulary"),
    # a fresh trial: a run that would write over an earlier one's checkpoints, and GRPO options that ran silently
    (f"{F} --trainer.default_root_dir earlier", "`trainer.default_root_dir='earlier'` holds the checkpoints of an"),
    (f"{G} --model.init_args.mask_truncated_completions true", "`model.mask_truncated_completions=True`: no token"),
    (f"{G} --trainer.callbacks.init_args.pad_token_id 100000", "`RolloutCallback.pad_token_id=100000`"),
    (f"{G} --trainer.callbacks.init_args.eos_token_ids [100000]", "`RolloutCallback.eos_token_ids=[100000]`"),
    (f"{G} --trainer.callbacks.init_args.tokenizer /nonexistent/tok", "`RolloutCallback.tokenizer='/nonexistent/tok'`"),
    (f"{G} --model.init_args.num_iterations 3", "`trainer.max_steps=20`: must be a multiple of `model.num_iterations=3`"),
    (f"{G} --model.init_args.num_iterations 4 --trainer.max_steps 4", "`ModelCheckpoint.every_n_train_steps=10`"),
    (f"{G} --model.init_args.max_empty_batches 0", "model.max_empty_batches"),
    (f"{G} --trainer.callbacks.init_args.engine.count_routed_experts true",
     "`RolloutCallback.engine.count_routed_experts=True`: the model has no MoE layers"),  # was after the logger's files
    (f"{F} --model.init_args.attn_implementation flash_attention_2 --data.init_args.pack false",
     "`model.attn_implementation='flash_attention_2'`: "
     "needs a CUDA GPU"),  # it passed, then failed mid-fit after the logger's files were written
    (f"{F} --model.init_args.attn_implementation lightning_ffpa_paged", "`model.attn_implementation='lightning_ffpa_"
     "paged'`: is unknown"),  # the rollout engine's, for its KV cache
    # a later trial: Lightning refused this only after the model summary and the run's config.yaml
    (f"{F} --trainer.logger false", "`trainer.logger=False`: `trainer.callbacks` has StepLearningRateMonitor"),
    ("lightning-ffpa", "give a subcommand: one of fit, validate, test, predict, recipes, cp"),  # listed Lightning's
    (f"{F} --model.init_args.lora '{{r:4,target_modules:[q_proj]}}'", "`--model.init_args.lora='{r:4,target_modules:"
     "[q_proj]}'`: a YAML flow mapping needs a space after each colon"),  # jsonargparse: "Expected a path"
    (f"{F} --trainer.callbacks+=lightning_ffpa.callbacks.FFPAAttention "
     "--trainer.callbacks.init_args.attn_implementation bogus", "`FFPAAttention.attn_implementation='bogus'`: is "
     "unknown"),  # HF's ValueError after the model was built, exit 1
    ("lightning-ffpa recipe", "`recipe`: not a subcommand; one of fit, validate, test, predict, recipes, cp"),  # same
    # a chat template's `raise_exception` and a template that is not Jinja: jinja2 tracebacks, exit 1
    (f"{F} --data.init_args.train_file sys.jsonl --data.init_args.tokenizer rolestok --data.init_args.val_fraction 0",
     "`data.init_args.train_file='sys.jsonl'`: line 1: the chat template of `data.init_args.tokenizer` refused it: "
     "Conversation roles must alternate"),
    (f"{F} --data.init_args.train_file sys.jsonl --data.init_args.tokenizer jinjatok --data.init_args.val_fraction 0",
     "`data.init_args.tokenizer='jinjatok'`: its chat template is not valid Jinja (template line 1)"),
    # a row with both a text and a chat trained on the text, unmasked, without a word
    (f"{F} --data.init_args.train_file both.jsonl", "`data.init_args.train_file='both.jsonl'`: line 1 has both `text` "
     "and `messages`"),
]


def _fit_config() -> dict:
    cfg = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    cfg["trainer"].update(max_steps=2, limit_val_batches=0)
    cfg["data"]["init_args"].update(batch_size=2, max_seq_length=32)
    return cfg


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    """The files every row starts from (copied per row)."""
    root = tmp_path_factory.mktemp("template")
    (root / "fit.yaml").write_text(yaml.safe_dump(_fit_config()))
    shutil.copy(ROOT / "configs" / "tiny_grpo.yaml", root / "grpo.yaml")
    (root / "bad.yaml").write_text("trainer: [unclosed\n")
    (root / "dup.yaml").write_text("trainer:\n  max_steps: 3\n  max_steps: 4\n")
    (root / "dup_trainer.yaml").write_text("max_steps: 3\nmax_steps: 4\n")
    (root / "empty.yaml").write_text("")
    (root / "section.yaml").write_text("trainer: other.yaml\n")
    (root / "binary.yaml").write_bytes(bytes(range(256)) * 4)
    # a tokenizer folder without its vocabulary file: AutoTokenizer builds the 5 special tokens alone
    (root / "stubtok").mkdir()
    specials = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"}
    (root / "stubtok" / "tokenizer_config.json").write_text(json.dumps({**specials, "tokenizer_class": "GemmaTokenizer"}))
    (root / "stubtok" / "special_tokens_map.json").write_text(json.dumps(specials))
    _save_wordlevel_tokenizer(root / "bigtok", 600)  # more ids than the tiny model's 512
    refuses_system = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('Conversation roles must "
                      "alternate') }}{% endif %}")
    save_tokenizer(root / "rolestok", refuses_system + PLAIN_TEMPLATE)
    save_tokenizer(root / "jinjatok", "{% for m in messages %}{{ m['content'] }")
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    (root / "sys.jsonl").write_text(json.dumps({"messages": chat}) + "\n")
    (root / "both.jsonl").write_text(json.dumps({"text": "a text", "messages": chat[1:]}) + "\n")
    (root / "garbage.ckpt").write_bytes(b"not a checkpoint\n" * 64)
    (root / "afile").write_text("a file where a folder is expected\n")
    (root / "emptydir").mkdir()
    (root / "adapter").mkdir()  # what `lightning-ffpa-export` writes beside the base: no config.json
    (root / "adapter" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    (root / "oddcfg").mkdir()  # a config.json transformers knows no model type of
    (root / "oddcfg" / "config.json").write_text(json.dumps({"hidden_size": 8}))
    (root / "nonempty").mkdir()
    (root / "nonempty" / "keep.txt").write_text("mine\n")
    (root / "earlier" / "checkpoints").mkdir(parents=True)  # an earlier run's (the names are what counts)
    for name in ("epoch=0-step=2.ckpt", "last.ckpt"):
        (root / "earlier" / "checkpoints" / name).write_bytes(b"an earlier run's checkpoint\n")
    # the smallest checkpoint export reads: weights + the hyper-parameters that rebuild the config
    torch.save({"state_dict": {"model.lm_head.weight": torch.zeros(2, 2)}, "hyper_parameters": {"preset": "tiny"}},
               root / "fake.ckpt")
    return root


def _save_wordlevel_tokenizer(folder: Path, size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(size)}, unk_token="w2"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="w0", eos_token="w1", unk_token="w2").save_pretrained(folder)


WORKERS = 2  # preloaders, one per CPU core of CI


def _row_dir(template: Path, tmp_path_factory, i: int) -> Path:
    cwd = tmp_path_factory.mktemp(f"row{i}")
    shutil.copytree(template, cwd, dirs_exist_ok=True)
    return cwd


@pytest.fixture(scope="module")
def results(template, tmp_path_factory, request) -> dict[str, tuple]:
    """Every selected row run once, two at a time: {command: (process, tree before, tree after)}."""
    selected = {item.callspec.params["command"] for item in request.session.items
                if item.module is request.module and "command" in getattr(getattr(item, "callspec", None), "params", {})}
    rows = [(i, row) for i, row in enumerate(ROWS) if row[0] in selected]
    if not rows:
        return {}
    preloaders = [Preloaded(tmp_path_factory.mktemp("preloader")) for _ in range(min(WORKERS, len(rows)))]
    idle = list(preloaders)

    def one(i_row):
        i, (command, _) = i_row
        cwd = _row_dir(template, tmp_path_factory, i)
        before = snapshot(cwd)
        preloader = idle.pop()  # each thread holds one preloader at a time (list.pop/append are atomic)
        try:
            proc = preloader.run(command, cwd, timeout=240)
        finally:
            idle.append(preloader)
        return command, (proc, before, snapshot(cwd))

    try:
        with ThreadPoolExecutor(max_workers=len(preloaders)) as pool:
            return dict(pool.map(one, rows))
    finally:
        for p in preloaders:
            p.close()


def test_table_is_large_and_unique():
    commands = [c for c, _ in ROWS]
    assert len(ROWS) >= 40 and len(set(commands)) == len(commands)
    assert {c.split()[0] for c, _ in ROWS} == {"lightning-ffpa", "lightning-ffpa-export"}
    assert sum(c.startswith(G) for c, _ in ROWS) >= 5  # GRPO options (configs/tiny_grpo.yaml)


# one row of each kind: a fit parse error, a fit pre-flight error (components built), GRPO, export
FRESH = [ROWS[0][0], f"{F} --data.init_args.batch_size 100000", f"{G} --model.init_args.clip_eps 0",
         f"{E} fake.ckpt out --dtype float64"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_preloaded_rows_match_fresh_processes(template, tmp_path_factory):
    """A row forked from the preloader gives what a fresh process of the installed script gives."""
    assert set(FRESH) <= {c for c, _ in ROWS}
    preloader = Preloaded(tmp_path_factory.mktemp("preloader"))
    try:
        forked = [preloader.run(c, _row_dir(template, tmp_path_factory, i), timeout=240) for i, c in enumerate(FRESH)]
    finally:
        preloader.close()
    dirs = [_row_dir(template, tmp_path_factory, i) for i in range(len(FRESH))]
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        fresh_runs = list(pool.map(lambda c_d: run(c_d[0], c_d[1], timeout=240), zip(FRESH, dirs)))
    for proc, fresh in zip(forked, fresh_runs):
        assert fresh.returncode == 2 and fresh.stderr.startswith("error: "), fresh.stderr[-3000:]
        assert (proc.returncode, proc.stdout, proc.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("command, option", ROWS, ids=[c.split(maxsplit=1)[-1][:70] for c, _ in ROWS])
def test_bad_input_exits_2_with_one_line_naming_the_option(results, command, option):
    proc, before, after = results[command]
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stderr[-3000:]}"
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    assert option in lines[0], lines[0]
    assert proc.stdout == "", proc.stdout[-2000:]
    written = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not written, f"files written or changed: {written}"
