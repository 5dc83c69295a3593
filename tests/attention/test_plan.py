"""The attention plan: resolved once from the model option, the FFPAAttention callback and the CP size, and the
same object for the pre-flight checks, the callback and the module."""

from types import SimpleNamespace

import lightning as L
import pytest

from lightning_ffpa.attention.plan import AttentionPlan, plan_for, resolve_plan
from lightning_ffpa.callbacks import FFPAAttention
from lightning_ffpa.data import TextDataModule
from lightning_ffpa.errors import ConfigError
from lightning_ffpa.module import Gemma4LM
from lightning_ffpa.validation import check_parallel_layout


def _trainer(callbacks=()):
    return L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, callbacks=list(callbacks))


def test_resolution_rules():
    assert resolve_plan("ffpa") == AttentionPlan("ffpa")
    assert resolve_plan("ffpa", 1, FFPAAttention(attn_implementation="sdpa")).attn_implementation == "sdpa"
    ring = resolve_plan("sdpa", 2, FFPAAttention())
    assert ring.ring and ring.describe() == "ring CP=2"
    assert not resolve_plan("sdpa").ring and resolve_plan("sdpa").describe() == "attn_implementation=sdpa"
    with pytest.raises(ValueError, match=r"^`model.attn_implementation='ffpa'` is the direct backend"):
        resolve_plan("ffpa", 2)
    with pytest.raises(ValueError, match=r"^`context_parallel_size=4` needs the `lightning_ffpa.callbacks.FFPAAtt"):
        resolve_plan("sdpa", 4)
    # At CP > 1 the ring replaced the Callback's `sdpa` (a user's comparison) without a word; refused by name now.
    with pytest.raises(ConfigError, match=r"^`FFPAAttention.attn_implementation='sdpa'`: context_parallel_size=2 "
                                          r"runs the FFPA ring, which cannot run 'sdpa'"):
        resolve_plan("sdpa", 2, FFPAAttention(attn_implementation="sdpa"))


def test_packing_is_checked_against_what_runs():
    resolve_plan("sdpa", 2, FFPAAttention()).check_packing(True)  # the ring carries documents in its layout
    resolve_plan(None).check_packing(True)  # a model without the option: nothing to check
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register("plain_plan_test", sdpa_attention_forward)  # known to HF, keeps no documents apart
    with pytest.raises(ConfigError, match="data.pack"):
        resolve_plan("ffpa", 1, SimpleNamespace(attn_implementation="plain_plan_test")).check_packing(True)
    with pytest.raises(ConfigError, match="FFPAAttention.attn_implementation='no_such_attention'`: is unknown"):
        resolve_plan("ffpa", 1, SimpleNamespace(attn_implementation="no_such_attention"))


def test_one_plan_for_preflight_callback_and_module():
    callback = FFPAAttention(log_every_n_steps=0)
    trainer = _trainer([callback])
    model = Gemma4LM(preset="tiny", attn_implementation="ffpa")
    dm = TextDataModule(max_seq_length=32, batch_size=2, pack=True, val_fraction=0.0)
    check_parallel_layout(trainer, model, dm)
    plan = model.attention_plan
    callback.setup(trainer, model, "fit")  # no HF model yet: resolves and registers, installs later
    assert callback.plan is plan is plan_for(trainer, model, 1)
    assert plan.attn_implementation == "ffpa" and plan.from_callback
    # another trainer (a second fit) gets its own plan
    other = _trainer([FFPAAttention(attn_implementation="sdpa")])
    assert plan_for(other, model, 1).attn_implementation == "sdpa"


def test_module_checks_packing_against_the_callbacks_choice():
    """The callback replaces the model's option at CP=1, so the module's own data check reads the plan."""
    trainer = _trainer([FFPAAttention(attn_implementation="eager")])
    model = Gemma4LM(preset="tiny", attn_implementation="sdpa")
    plan_for(trainer, model, 1)
    assert model.attention_plan.attn_implementation == "eager"
