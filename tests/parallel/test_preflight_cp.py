"""The pre-flight refuses context-parallel layouts that would train a wrong model or fail mid-run, naming the
option, before any process is spawned."""

import lightning as L
import pytest

from lightning_ffpa.callbacks import FFPAAttention
from lightning_ffpa.data import TextDataModule
from lightning_ffpa.module import Gemma4LM
from lightning_ffpa.parallel import FSDP2Strategy
from lightning_ffpa.validation import check_parallel_layout


def _trainer(callbacks=()):
    return L.Trainer(accelerator="cpu", devices=2, strategy=FSDP2Strategy(context_parallel_size=2), logger=False,
                     enable_checkpointing=False, callbacks=list(callbacks))


def test_cp_without_the_attention_callback_is_refused():
    """Without the ring each rank attends only within its own chunks: the loss is wrong, with no error."""
    dm = TextDataModule(max_seq_length=64, batch_size=2, val_fraction=0.0)
    with pytest.raises(ValueError, match=r"^`context_parallel_size=2` needs the `lightning_ffpa.callbacks.FFPAAttention`"):
        check_parallel_layout(_trainer(), Gemma4LM(preset="tiny"), dm)
    check_parallel_layout(_trainer([FFPAAttention()]), Gemma4LM(preset="tiny"), dm)


def test_cp_padding_must_cut_into_chunks():
    dm = TextDataModule(max_seq_length=200, batch_size=2, val_fraction=0.0, pad_to_multiple_of=10)
    with pytest.raises(ValueError, match=r"^`data.pad_to_multiple_of=10` must be a multiple of 2 x context_paral"):
        check_parallel_layout(_trainer([FFPAAttention()]), Gemma4LM(preset="tiny"), dm)
    packed = TextDataModule(max_seq_length=200, batch_size=2, val_fraction=0.0, pack=True)
    check_parallel_layout(_trainer([FFPAAttention()]), Gemma4LM(preset="tiny"), packed)  # packed rows: full length
