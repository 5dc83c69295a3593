"""FFPAAttention: installs the backend on the HF model at CP=1, refuses CP>1 without the ring, reports."""

from collections import Counter
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import transformers
from lightning.pytorch.loggers import Logger
from torch.utils.data import DataLoader, TensorDataset
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import lightning_ffpa.attention as attention
from lightning_ffpa._compat.transformers import find_hf_model
from lightning_ffpa.callbacks import FFPAAttention, TokenThroughput
from lightning_ffpa.callbacks.attention import context_parallel_size
from lightning_ffpa.callbacks.throughput import forward_flops_per_batch, train_flops_per_batch
from lightning_ffpa.errors import ConfigError, InputError
from lightning_ffpa.presets import build_text_config


class _Wrapper(L.LightningModule):
    """A user's module: the HF model sits one level down, built in configure_model."""

    def __init__(self):
        super().__init__()
        self.net = None

    def configure_model(self):
        if self.net is None:
            torch.manual_seed(0)
            self.net = torch.nn.ModuleDict({"lm": transformers.Gemma4ForCausalLM(build_text_config("tiny"))})

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        return self.net["lm"](input_ids=ids, labels=ids, use_cache=False).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.fixture
def fake_backend(monkeypatch):
    """Stand-in for the attention package's interface: 'ffpa' = SDPA with a counter."""
    counts = Counter()

    def counted(module, *args, **kwargs):
        counts["ffpa-dense" if module.head_dim == 512 else "sdpa"] += 1
        return sdpa_attention_forward(module, *args, **kwargs)

    def register_ffpa(**kwargs):
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

        AttentionInterface.register("ffpa", counted)
        ALL_MASK_ATTENTION_FUNCTIONS.register("ffpa", sdpa_mask)  # the real backend may have registered its own

    real_register = getattr(attention, "register_ffpa", None)
    monkeypatch.setattr(attention, "register_ffpa", register_ffpa, raising=False)
    monkeypatch.setattr(attention, "dispatch_counts", lambda: dict(counts), raising=False)
    monkeypatch.setattr(attention, "reset_dispatch_counts", counts.clear, raising=False)
    yield counts
    if real_register is not None:
        real_register()  # leave transformers' registry with the real "ffpa" for later tests


class _Recorder(Logger):
    """Every `log_metrics` call, as (step, metrics)."""

    def __init__(self):
        super().__init__()
        self.rows: list[tuple[int, dict]] = []

    name, version = "recorder", 0

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))

    def log_hyperparams(self, *args, **kwargs):
        pass


def _attention_rows(recorder: _Recorder) -> list[tuple[int, float]]:
    return [(step, m["attention/ffpa-dense"]) for step, m in recorder.rows if "attention/ffpa-dense" in m]


def _fit(module, callbacks, steps=4, logger=False):
    data = TensorDataset(torch.randint(0, 512, (8, 16), generator=torch.Generator().manual_seed(0)))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=logger, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                        callbacks=callbacks)
    trainer.fit(module, DataLoader(data, batch_size=2))
    return trainer


def test_installs_ffpa_on_nested_model_and_logs_counts(fake_backend, capsys):
    module = _Wrapper()
    callback, recorder = FFPAAttention(log_every_n_steps=1), _Recorder()
    _fit(module, [callback], logger=recorder)
    lm = module.net["lm"]
    assert find_hf_model(module) is lm
    assert lm.config._attn_implementation == "ffpa"
    # 4 steps x 2 full layers at head_dim 512, and 2 sliding layers
    assert fake_backend["ffpa-dense"] == 8 and fake_backend["sdpa"] == 8
    assert _attention_rows(recorder) == [(0, 2.0), (1, 4.0), (2, 6.0), (3, 8.0)]  # on train/loss's steps
    assert "ffpa-dense=8" in callback.summary()


class _PolicyAndReference(L.LightningModule):
    """A frozen reference built before the trained policy, neither named `model`."""

    def __init__(self, freeze_ref: bool = True):
        super().__init__()
        torch.manual_seed(0)
        self.ref = transformers.Gemma4ForCausalLM(build_text_config("tiny")).requires_grad_(not freeze_ref)
        self.policy = transformers.Gemma4ForCausalLM(build_text_config("tiny"))

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        return self.policy(input_ids=ids, labels=ids, use_cache=False).loss

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.01)


class _LogsLoss(_Wrapper):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train/loss", loss)
        return loss


def test_counts_land_on_the_step_of_train_loss(fake_backend, tmp_path):
    """`attention/*` rows were written at `global_step`, one step after `train/loss` of the same batch (Lightning
    writes `self.log` metrics at the batches that stepped before this one): each count now shares its step."""
    import csv

    from lightning.pytorch.loggers import CSVLogger

    logger = CSVLogger(tmp_path, name="run", version=0)
    _fit(_LogsLoss(), [FFPAAttention(log_every_n_steps=1)], steps=3, logger=logger)
    rows = list(csv.DictReader(open(tmp_path / "run" / "version_0" / "metrics.csv")))
    steps = lambda key: [int(r["step"]) for r in rows if r.get(key)]  # noqa: E731
    assert steps("train/loss") == [0, 1, 2] and steps("attention/ffpa-dense") == [0, 1, 2], rows


def test_installs_on_the_trained_model_beside_a_frozen_one(fake_backend):
    """The first HF model found was configured (the frozen reference), and the counts of its no-grad calls
    read as the policy's; the only trained model is chosen now."""
    module = _PolicyAndReference()
    _fit(module, [FFPAAttention()], steps=1)
    assert find_hf_model(module) is module.policy
    assert module.policy.config._attn_implementation == "ffpa"
    assert fake_backend["ffpa-dense"] == 2


def test_two_trained_models_are_refused_by_name():
    with pytest.raises(ValueError, match=r"2 HF models with trainable parameters .*`ref`, `policy`.*`self.model`"):
        find_hf_model(_PolicyAndReference(freeze_ref=False))


def test_summary_names_the_fallbacks_and_their_reasons():
    """The end-of-fit line said `sdpa=4` and no more: a full layer whose head_dim FFPA does not take ran SDPA, and
    only the warnings said why. The real backend, on the CPU."""
    class _OddHeadDim(_PolicyAndReference):
        def __init__(self):
            L.LightningModule.__init__(self)
            torch.manual_seed(0)
            self.policy = transformers.Gemma4ForCausalLM(build_text_config("tiny", global_head_dim=48))

    callback = FFPAAttention()
    _fit(_OddHeadDim(), [callback], steps=1)
    assert "(fallbacks by reason: " in callback.summary() and "head_dim=2" in callback.summary()


def test_a_model_attention_the_callback_replaces_is_said(fake_backend, caplog):
    """`model.attn_implementation: eager` beside the Callback ran ffpa, and nothing said the choice was dropped."""
    import logging

    module = _Wrapper()
    module.hparams.update(attn_implementation="eager")
    module.configure_model()
    module.net["lm"].config._attn_implementation = "eager"  # as the module's option built it
    with caplog.at_level(logging.INFO):
        _fit(module, [FFPAAttention()], steps=1)
    assert "installs attn_implementation='ffpa' in place of `model.attn_implementation='eager'`" in caplog.text


def test_an_attention_the_users_model_was_built_with_is_said_when_replaced(fake_backend, caplog):
    """A model of the user's own built with eager attention (no module option) was switched to ffpa silently."""
    import logging

    module = _Wrapper()
    module.configure_model()
    module.net["lm"].config._attn_implementation = "eager"
    with caplog.at_level(logging.INFO):
        _fit(module, [FFPAAttention()], steps=1)
    assert "installs attn_implementation='ffpa' in place of the model's attn_implementation='eager'" in caplog.text


def test_counts_are_logged_at_their_own_interval_and_nowhere_between(fake_backend):
    """`log_every_n_steps: 3` with the trainer logging every step: through `pl_module.log` the step-3 value was
    written again at steps 4 and 5 (stale counts); now only the 3rd and 6th optimizer steps have one, each the count
    then (at Lightning's logging step for those batches, 2 and 5)."""
    recorder = _Recorder()
    _fit(_Wrapper(), [FFPAAttention(log_every_n_steps=3)], steps=6, logger=recorder)
    assert _attention_rows(recorder) == [(2, 6.0), (5, 12.0)]


def test_transformers_own_attention_logs_no_counts_that_read_as_nothing_ran(fake_backend):
    """With `attn_implementation: sdpa` transformers' SDPA runs every layer, uncounted: logging `attention/sdpa=0`
    every step said it never ran (a fresh trial's finding)."""
    module = _Wrapper()
    callback = FFPAAttention(log_every_n_steps=1, attn_implementation="sdpa")
    trainer = _fit(module, [callback], steps=2)
    assert module.net["lm"].config._attn_implementation == "sdpa"
    assert not [k for k in trainer.callback_metrics if k.startswith("attention/")]
    assert "transformers' 'sdpa' ran every layer" in callback.summary()


def test_token_throughput_logs_counts_only_where_the_backend_counted(fake_backend, caplog):
    """TokenThroughput alone on transformers' SDPA logged `attention/sdpa=0` (and every other path 0) each step
    while SDPA ran every layer; it now says once that nothing went through the backend. Beside FFPAAttention
    (which does not log here) it logs the backend's counts."""
    with caplog.at_level("INFO"):
        trainer = _fit(_Wrapper(), [TokenThroughput(window_size=2)], steps=2)
    assert not [k for k in trainer.callback_metrics if k.startswith("attention/")]
    said = [r.getMessage() for r in caplog.records if "no attention call went through" in r.getMessage()]
    assert len(said) == 1 and "the model's attention is 'sdpa'" in said[0]
    trainer = _fit(_Wrapper(), [FFPAAttention(log_every_n_steps=0), TokenThroughput(window_size=2)], steps=2)
    assert trainer.callback_metrics["attention/ffpa-dense"] > 0


def test_a_reused_callback_installs_again_on_the_next_fit(fake_backend):
    module = _Wrapper()
    callback = FFPAAttention(log_every_n_steps=0)
    _fit(module, [callback], steps=1)
    lm = module.net["lm"]
    lm.set_attn_implementation("sdpa")  # the user compares against sdpa in between
    fake_backend.clear()
    _fit(module, [callback], steps=1)
    assert lm.config._attn_implementation == "ffpa"
    assert fake_backend["ffpa-dense"] == 2


def test_counts_are_logged_once_per_optimizer_step(fake_backend):
    module = _Wrapper()
    data = TensorDataset(torch.randint(0, 512, (8, 16), generator=torch.Generator().manual_seed(0)))
    recorder = _Recorder()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=recorder, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                        accumulate_grad_batches=2, callbacks=[FFPAAttention(log_every_n_steps=1)])
    trainer.fit(module, DataLoader(data, batch_size=2))
    assert _attention_rows(recorder) == [(0, 4.0), (1, 8.0)]  # 4 micro-batches, 2 optimizer steps


def test_cp_size_from_strategy_or_mesh():
    trainer = SimpleNamespace(strategy=SimpleNamespace(context_parallel_size=4))
    assert context_parallel_size(trainer, SimpleNamespace()) == 4
    assert context_parallel_size(SimpleNamespace(strategy=object()), SimpleNamespace(_device_mesh=None)) == 1


def test_bad_option():
    with pytest.raises(ValueError, match=r"^`FFPAAttention\.log_every_n_steps=-1`: must be >= 0$"):
        FFPAAttention(log_every_n_steps=-1)


def test_throughput_counts_real_tokens_and_flops(fake_backend):
    module = _Wrapper()
    monitor = TokenThroughput(window_size=2)
    _fit(module, [FFPAAttention(log_every_n_steps=0), monitor], steps=3)
    from lightning.pytorch.trainer.states import RunningStage

    tp = monitor._throughputs[RunningStage.TRAINING]
    assert tp._lengths[-1] == 3 * 2 * 16  # real tokens: every token has a label here
    assert tp._flops[-1] == train_flops_per_batch(module.net["lm"], 2, 16)
    assert not hasattr(module, "flops_per_batch")  # set for Lightning's hook only: no stale value for a later fit


def test_throughput_flops_follow_the_batch_and_the_stage(fake_backend):
    """A second fit at another length counts its own FLOPs; validation counts the forward only."""
    from lightning.pytorch.trainer.states import RunningStage

    module = _Wrapper()
    module.validation_step = lambda batch, batch_idx: None
    for seq in (16, 32):
        monitor = TokenThroughput(window_size=2)
        data = DataLoader(TensorDataset(torch.randint(0, 512, (8, seq))), batch_size=2)
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                            limit_val_batches=1, val_check_interval=2, callbacks=[monitor])
        trainer.fit(module, data, data)
        lm = module.net["lm"]
        assert monitor._throughputs[RunningStage.TRAINING]._flops[-1] == train_flops_per_batch(lm, 2, seq)
        assert monitor._throughputs[RunningStage.VALIDATING]._flops[-1] == forward_flops_per_batch(lm, 2, seq)


def test_real_backend_reference_kernel_runs():
    module = _Wrapper()
    callback = FFPAAttention(log_every_n_steps=1)
    with attention.force_kernel("reference"):  # fp32 on CPU would otherwise fall back (visibly) to sdpa
        _fit(module, [callback], steps=1)
    counts = attention.dispatch_counts()
    assert counts["ffpa-dense"] == 2, counts  # one step, 2 full layers at head_dim 512
    assert "ffpa-dense=2" in callback.summary()


class _Evaluated(_Wrapper):
    def validation_step(self, batch, batch_idx):
        return self.training_step(batch, batch_idx)

    test_step = validation_step

    def predict_step(self, batch, batch_idx):
        return self.net["lm"](input_ids=batch[0], use_cache=False).logits


def test_validate_test_and_predict_run_the_real_backend_under_inference_mode():
    """Lightning evaluates under torch.inference_mode: its position ids are inference tensors (no version counter),
    which the packed-document check used to read (RuntimeError on trainer.test/validate/predict)."""
    module = _Evaluated()
    data = DataLoader(TensorDataset(torch.randint(0, 512, (4, 16), generator=torch.Generator().manual_seed(0))),
                      batch_size=2)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, inference_mode=True, callbacks=[FFPAAttention()])
    with attention.force_kernel("reference"):
        trainer.validate(module, data)
        trainer.test(module, data)
        logits = trainer.predict(module, data)
        counts = attention.dispatch_counts()
    assert len(logits) == 2 and torch.isfinite(logits[0]).all()
    assert counts.get("ffpa-dense", 0) > 0, counts


def test_cp_above_one_installs_the_ring_on_the_hf_model(fake_backend, monkeypatch, caplog):
    import logging
    import sys
    import types

    calls = []
    fake_ring = types.ModuleType("lightning_ffpa.cp.ring")
    fake_ring.install_ring = lambda model, cp_mesh, sliding_backend: calls.append(
        (model, cp_mesh, sliding_backend)) or SimpleNamespace(stats={"block_dense": 3, "shift": 1,
                                                                       "recompute_shift": 1})
    monkeypatch.setitem(sys.modules, "lightning_ffpa.cp.ring", fake_ring)
    module = _Wrapper()
    module.hparams.update(attn_implementation="eager")
    module.configure_model()
    module.net["lm"].config._attn_implementation = "eager"  # as the module's option built it
    cp_mesh = object()
    trainer = SimpleNamespace(strategy=SimpleNamespace(context_parallel_size=2,
                                                       parallel_dims=SimpleNamespace(cp_mesh=cp_mesh)))
    callback = FFPAAttention(log_every_n_steps=1)
    with caplog.at_level(logging.INFO):
        callback.setup(trainer, module, "fit")
    # the ring replaced `model.attn_implementation: eager` silently at CP > 1 (said at CP = 1)
    assert "installs the FFPA ring (context_parallel_size=2) in place of `model.attn_implementation='eager'`" in (
        caplog.text)
    assert calls == [(module.net["lm"], cp_mesh, "auto")]  # the default sliding path: FA4 where it runs, else Flex
    assert module.net["lm"].config._attn_implementation == "sdpa"  # the ring's own installer takes over from here
    assert "ring CP=2" in callback.summary() and "ring-block_dense=3" in callback.summary()
    assert "ring-recompute_shift=1" in callback.summary()
    # At CP > 1 no `attention/*` metric reached the logger (the ring's counts were read from the backend's path
    # counters, which it never increments); its forward counts are logged now, the recompute's exchanges are not.
    recorder = _Recorder()
    trainer.global_step, trainer.is_global_zero, trainer.loggers = 1, True, [recorder]
    trainer.fit_loop = SimpleNamespace(_should_accumulate=lambda: False,
                                       epoch_loop=SimpleNamespace(_batches_that_stepped=0))
    callback.on_train_batch_end(trainer, module, None, None, 0)
    assert recorder.rows == [(0, {"attention/ring-block_dense": 3.0, "attention/ring-shift": 1.0})]
    # TokenThroughput writing the counts (`FFPAAttention(log_every_n_steps: 0)`) read the backend's counters too,
    # and said no attention call was counted: it logs the Callback's training counts
    trainer.callbacks = [callback]
    assert TokenThroughput()._dispatch_metrics(trainer, module) == {"attention/ring-block_dense": 3.0,
                                                                     "attention/ring-shift": 1.0}


def test_the_sliding_choice_lasts_for_its_run_only():
    """The backend's sliding kernel is process state: the Callback sets its own for the run and gives the one
    before back at teardown, so a later run without it (or with another choice) starts from the process's."""
    from lightning_ffpa.attention import backend

    attention.register_ffpa(sliding="flex")
    seen = []

    class _Look(L.Callback):
        def on_train_batch_start(self, *args):
            seen.append(backend.config().sliding)

    _fit(_Wrapper(), [FFPAAttention(log_every_n_steps=0), _Look()], steps=1)  # default: auto, FA4 tried first
    assert seen == ["fa4"] and backend.config().sliding == "flex"


class _WithValidation(_Wrapper):
    def validation_step(self, batch, batch_idx):
        (ids,) = batch
        return self.net["lm"](input_ids=ids, labels=ids, use_cache=False).loss


def test_logged_counts_leave_out_the_sanity_check_and_validation(fake_backend):
    """The logged `attention/*` counts mixed validation's calls (and the sanity check's) into the training ones
    (a fresh trial read 20 calls at step 2 where training made 16); the end-of-fit line still counts every call."""
    data = TensorDataset(torch.randint(0, 512, (8, 16), generator=torch.Generator().manual_seed(0)))
    recorder, callback = _Recorder(), FFPAAttention(log_every_n_steps=2)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=recorder, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                        val_check_interval=2, limit_val_batches=1, num_sanity_val_steps=1, callbacks=[callback])
    trainer.fit(_WithValidation(), DataLoader(data, batch_size=2), DataLoader(data, batch_size=2))
    assert _attention_rows(recorder) == [(1, 4.0), (3, 8.0)]  # 2 full layers a training forward
    # the sanity check and two validation runs, one batch each: 3 x 2 more calls in the summary
    assert fake_backend["ffpa-dense"] == 14 and "ffpa-dense=14" in callback.summary()


def test_two_attention_callbacks_are_refused():
    """Two (or one listed twice) installed, counted and logged everything twice, without a word."""
    callback = FFPAAttention()
    for callbacks in ([FFPAAttention(), FFPAAttention()], [callback, callback]):
        with pytest.raises(InputError, match=r"^`trainer.callbacks` holds 2 FFPAAttention Callbacks; keep one$"):
            _fit(_Wrapper(), callbacks, steps=1)


@pytest.mark.parametrize("attn", ["flex_attention", "flash_attention_2"])
def test_an_attention_that_cannot_train_on_cpu_is_refused_at_setup(attn):
    """The CLI refused these before launch; a Python user's Trainer got a deep traceback at the first backward
    (Flex) or from transformers (flash-attn). The Callback's setup now says it in one line."""
    with pytest.raises(ConfigError, match=rf"^`FFPAAttention.attn_implementation={attn!r}`: .*(CPU|CUDA GPU)"):
        _fit(_Wrapper(), [FFPAAttention(attn_implementation=attn)], steps=1)


def test_the_end_of_fit_line_says_whose_counts_it_holds_on_several_ranks(caplog, monkeypatch):
    """On two ranks the line read `sdpa=16`, the same as one rank's run: it is rank 0's count, and says so."""
    callback = FFPAAttention()
    monkeypatch.setattr(callback, "summary", lambda: "FFPAAttention (attn_implementation=ffpa): sdpa=16")
    with caplog.at_level("INFO"):
        callback.on_fit_end(SimpleNamespace(world_size=2), None)
        callback.on_fit_end(SimpleNamespace(world_size=1), None)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("FFPAAttention")]
    assert lines == ["FFPAAttention (attn_implementation=ffpa): sdpa=16 [rank 0's calls, of 2 ranks]",
                     "FFPAAttention (attn_implementation=ffpa): sdpa=16"]


class _OnTheBackend(_WithValidation):
    """The model on the "ffpa" backend with no FFPAAttention installing it (the model's own option)."""

    def configure_model(self):
        super().configure_model()
        attention.register_ffpa()
        self.net["lm"].set_attn_implementation("ffpa")


def test_token_throughput_alone_logs_the_training_counts_only(fake_backend, monkeypatch):
    """Without FFPAAttention, TokenThroughput's `attention/*` counted the sanity check's and validation's calls
    (step 0 read 3 forwards' calls where training had run one) and logged paths that never ran as 0; the counts
    mean what FFPAAttention logs now: training forwards only, paths that ran."""
    monkeypatch.setattr(attention, "dispatch_counts", lambda: {"flex": 0, **fake_backend})
    data = TensorDataset(torch.randint(0, 512, (8, 16), generator=torch.Generator().manual_seed(0)))
    recorder = _Recorder()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=recorder, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                        val_check_interval=2, limit_val_batches=1, num_sanity_val_steps=1,
                        callbacks=[TokenThroughput(window_size=2)])
    trainer.fit(_OnTheBackend(), DataLoader(data, batch_size=2), DataLoader(data, batch_size=2))
    assert _attention_rows(recorder) == [(0, 2.0), (1, 4.0), (2, 6.0), (3, 8.0)]  # 2 full layers a forward
    assert not [k for _, m in recorder.rows for k in m if k == "attention/flex"]
    assert fake_backend["ffpa-dense"] == 14  # the sanity check and two validation runs counted 6 more


class _LogsValLoss(_WithValidation):
    def validation_step(self, batch, batch_idx):
        loss = super().validation_step(batch, batch_idx)
        self.log("val/loss", loss)
        return loss


def test_validation_throughput_is_logged_once_per_run_whatever_log_every_n_steps(fake_backend):
    """Lightning logs `validate/*` on the validation batches where `batch_idx % log_every_n_steps` hits: the tiny
    recipe (8 validation batches, logging every 10 steps) never logged it. It is one row per validation run now,
    the run's totals over its time, at the step `val/loss` lands on."""
    module = _LogsValLoss()
    data = DataLoader(TensorDataset(torch.randint(0, 512, (8, 16), generator=torch.Generator().manual_seed(0))),
                      batch_size=2)
    recorder = _Recorder()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=recorder, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=10,
                        val_check_interval=2, limit_val_batches=3, num_sanity_val_steps=1,
                        callbacks=[TokenThroughput(window_size=2)])
    trainer.fit(module, data, data)
    trainer.validate(module, data, verbose=False)
    runs = [(step, m) for step, m in recorder.rows if any(k.startswith("validate/") for k in m)]
    # two runs in fit (not the sanity check), then `validate`: each on its `val/loss` row's step
    assert [step for step, _ in runs] == [step for step, m in recorder.rows if "val/loss" in m] == [1, 3, 4]
    forward = forward_flops_per_batch(module.net["lm"], 2, 16)
    for _, m in runs:
        assert (m["validate/batches"], m["validate/samples"], m["validate/lengths"]) == (3, 6, 3 * 32)
        assert m["validate/flops"] == pytest.approx(3 * forward)
        assert m["validate/items_per_sec"] == pytest.approx(m["validate/lengths"] / m["validate/time"])
        assert m["validate/device/flops_per_sec"] == pytest.approx(3 * forward / m["validate/time"])


class _Tests(_LogsValLoss):
    def test_step(self, batch, batch_idx):
        return self.validation_step(batch, batch_idx)


def test_test_throughput_is_logged_once_per_run_too(fake_backend):
    """`test/*` had the gap `validate/*` had: logged only on the batches where `log_every_n_steps` hits."""
    module = _Tests()
    data = DataLoader(TensorDataset(torch.randint(0, 512, (8, 16), generator=torch.Generator().manual_seed(0))),
                      batch_size=2)
    recorder = _Recorder()
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=recorder, enable_progress_bar=False,
                        enable_model_summary=False, log_every_n_steps=10, limit_test_batches=3,
                        callbacks=[TokenThroughput(window_size=2)])
    trainer.test(module, data, verbose=False)
    runs = [m for _, m in recorder.rows if any(k.startswith("test/") for k in m)]
    assert len(runs) == 1
    assert (runs[0]["test/batches"], runs[0]["test/samples"], runs[0]["test/lengths"]) == (3, 6, 3 * 32)
    assert runs[0]["test/flops"] == pytest.approx(3 * forward_flops_per_batch(module.net["lm"], 2, 16))
