"""Parallelism: the FSDP2 strategy (dp x cp mesh), the SAC policy and the public `parallelize` recipe."""

from lightning_ffpa.parallel.checkpointing import default_save_ops, resolve_op, sac_context_fn
from lightning_ffpa.parallel.fp8 import Float8Training
from lightning_ffpa.parallel.fsdp import causal_lm_hidden_states, find_decoder_layers, parallelize
from lightning_ffpa.parallel.strategy import FSDP2Strategy, close_process_group

__all__ = ["FSDP2Strategy", "close_process_group", "parallelize", "find_decoder_layers", "causal_lm_hidden_states",
           "sac_context_fn", "default_save_ops", "resolve_op", "Float8Training"]
