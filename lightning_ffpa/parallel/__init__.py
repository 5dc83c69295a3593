"""Parallelism: the FSDP2 strategy, the run's `ParallelDims` (dp x cp x ep mesh), expert parallelism, the SAC policy
and the public `parallelize` recipe."""

from lightning_ffpa.parallel.checkpointing import default_save_ops, resolve_op, sac_context_fn
from lightning_ffpa.parallel.dims import ParallelDims
from lightning_ffpa.parallel.fp8 import Float8Training
from lightning_ffpa.parallel.fsdp import causal_lm_hidden_states, find_decoder_layers, parallelize
from lightning_ffpa.parallel.strategy import FSDP2Strategy, close_process_group

__all__ = ["FSDP2Strategy", "ParallelDims", "close_process_group", "parallelize", "find_decoder_layers", "causal_lm_hidden_states",
           "sac_context_fn", "default_save_ops", "resolve_op", "Float8Training"]
