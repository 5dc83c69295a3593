"""RolloutCallback's options: each bad value is one ConfigError naming `RolloutCallback.<option>`, raised when
the Callback is built or at setup, before any model or engine exists."""

import lightning as L
import pytest
import yaml

from lightning_ffpa.callbacks.rollout import RolloutCallback
from lightning_ffpa.errors import ConfigError
from lightning_ffpa.rl.module import GRPOModule
from lightning_ffpa.rl.prompts import PromptDataModule
from lightning_ffpa.rl.rewards import token_range_reward
from lightning_ffpa.rollout.engine import EngineConfig
from lightning_ffpa.rollout.sampler import SamplingParams

SMALL = dict(page_size=8, num_pages=16, max_batch_size=4, max_seq_len=32, attention="dense")


def _callback(engine=None, sampling=None, **kw):
    return RolloutCallback(kw.pop("reward_funcs", [token_range_reward]),
                           engine=EngineConfig(**{**SMALL, **(engine or {})}),
                           sampling=SamplingParams(**{"max_new_tokens": 4, **(sampling or {})}), **kw)


def _two_args(prompts, completions):
    return [0.0] * len(completions)


CASES = [
    (dict(num_generations=1), "RolloutCallback.num_generations"),
    (dict(sampling={"max_new_tokens": 0}), "RolloutCallback.sampling.max_new_tokens"),
    (dict(sampling={"temperature": -1.0}), "RolloutCallback.sampling.temperature"),
    (dict(sampling={"top_p": 0.0}), "RolloutCallback.sampling.top_p"),
    (dict(sampling={"top_p": 1.01}), "RolloutCallback.sampling.top_p"),
    (dict(sampling={"top_k": -2}), "RolloutCallback.sampling.top_k"),
    (dict(engine={"page_size": 0}), "RolloutCallback.engine.page_size"),
    (dict(engine={"num_pages": 1}), "RolloutCallback.engine.num_pages"),
    (dict(engine={"num_pages": 3}, sampling={"max_new_tokens": 20}),  # 1 + 20 tokens: 3 pages + page 0
     "RolloutCallback.engine.num_pages"),
    (dict(engine={"max_batch_size": 0}), "RolloutCallback.engine.max_batch_size"),
    (dict(engine={"max_seq_len": 30}), "RolloutCallback.engine.max_seq_len"),  # not a multiple of 8
    (dict(engine={"max_prefill_tokens": 0}), "RolloutCallback.engine.max_prefill_tokens"),
    (dict(engine={"attention": "sdpa"}), "RolloutCallback.engine.attention"),
    (dict(engine={"fuse_projections": "yes"}), "RolloutCallback.engine.fuse_projections"),
    (dict(engine={"kv_block_size": 3}), "RolloutCallback.engine.kv_block_size"),  # does not divide the page
    (dict(sampling={"max_new_tokens": 32}), "RolloutCallback.engine.max_seq_len"),  # no room for a prompt
    (dict(eos_token_ids=[-1]), "RolloutCallback.eos_token_ids"),
    (dict(pad_token_id=-1), "RolloutCallback.pad_token_id"),
    (dict(inference_dtype="bf17"), "RolloutCallback.inference_dtype"),
    (dict(weights="copy"), "RolloutCallback.weights"),
    (dict(reward_funcs=[]), "RolloutCallback.reward_funcs"),
    (dict(reward_funcs=["lightning_ffpa.rl.rewards:length_reward"]), "RolloutCallback.reward_funcs"),
    (dict(reward_funcs=[token_range_reward, _two_args]), "RolloutCallback.reward_funcs[1]"),
]


@pytest.mark.parametrize("kwargs, option", CASES, ids=[f"{c[1]}-{i}" for i, c in enumerate(CASES)])
def test_bad_option_is_one_config_error_naming_it(kwargs, option):
    with pytest.raises(ConfigError) as err:
        _callback(**kwargs)
    assert err.value.option == option
    assert str(err.value).startswith(f"`{option}=") and "\n" not in str(err.value)


def test_reward_signature_error_names_the_function_and_what_is_missing():
    with pytest.raises(ConfigError, match=r"_two_args.*missing completion_ids, \*\*kwargs"):
        _callback(reward_funcs=[_two_args])


def _fit(rollout, module=None, prompt_len=4):
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[rollout])
    module = module or GRPOModule(preset="tiny")
    trainer.fit(module, datamodule=PromptDataModule(num_random_prompts=4, prompt_len=prompt_len, batch_size=2))
    return module


def test_prompt_plus_completion_longer_than_max_seq_len_fails_at_setup_before_any_model():
    rollout = _callback(engine={"max_seq_len": 16}, sampling={"max_new_tokens": 8}, num_generations=2)
    module = GRPOModule(preset="tiny")
    with pytest.raises(ConfigError, match=r"^`RolloutCallback.engine.max_seq_len=16`: .* 10 \+ 8 = 18 \(the longest"):
        _fit(rollout, module, prompt_len=10)
    assert module.model is None and rollout.engine is None  # nothing was built


@pytest.mark.parametrize("engine, option", [({"compile_decode": True}, "RolloutCallback.engine.compile_decode"),
                                            ({"compile_mode": "default"},  # compile_decode None: eager on CPU
                                             "RolloutCallback.engine.compile_mode")])
def test_options_the_device_rules_out_fail_at_setup_before_any_model(engine, option):
    """On CPU the decode step cannot compile: refused by the pre-flight, not after the policy and copy are built."""
    rollout = _callback(engine=engine, num_generations=2)
    module = GRPOModule(preset="tiny")
    with pytest.raises(ConfigError) as err:
        _fit(rollout, module)
    assert err.value.option == option
    assert module.model is None and rollout.engine is None


def test_drift_check_without_lora_is_refused_before_any_model():
    """The check covers the LoRA refresh; without adapters it would hash nothing and pass."""
    rollout = _callback(num_generations=2, verify_no_drift=True)
    module = GRPOModule(preset="tiny")
    with pytest.raises(ConfigError, match=r"^`RolloutCallback.verify_no_drift=True`: .* no LoRA adapters"):
        _fit(rollout, module)
    assert module.model is None


def test_rollout_temperature_must_match_the_policy_temperature():
    rollout = _callback(sampling={"temperature": 0.7}, num_generations=2)
    module = GRPOModule(preset="tiny", temperature=1.0)
    with pytest.raises(ConfigError, match=r"^`RolloutCallback.sampling.temperature=0.7`: must equal"):
        _fit(rollout, module)
    assert module.model is None


def test_engine_refuses_zero_new_tokens():
    """The engine itself: max_new_tokens=0 used to generate one token (the prefill's)."""
    import torch
    import transformers

    from lightning_ffpa.presets import build_text_config
    from lightning_ffpa.rollout.engine import RolloutEngine

    torch.manual_seed(0)
    engine = RolloutEngine(transformers.Gemma4ForCausalLM(build_text_config("tiny")), EngineConfig(**SMALL))
    with pytest.raises(ConfigError, match="^`sampling.max_new_tokens=0`"):
        engine.generate([[3, 4, 5]], 0)
    assert [len(s.output) for s in engine.generate([[3, 4, 5]], 1)] == [1]
    with pytest.raises(ConfigError, match=r"^`engine.max_seq_len=32`: .* 3 \+ 30 = 33"):
        engine.generate([[3, 4, 5]], 30)  # used to stop at 32 tokens without a word
    with pytest.raises(ConfigError, match="^`engine.page_size=0`"):
        RolloutEngine(engine.model, EngineConfig(**{**SMALL, "page_size": 0}))


def test_yaml_sections_reach_the_typed_configs(tmp_path):
    """Through the CLI: dataclass sections, a dotted reward path, and a bad value's ConfigError as the cause."""
    from pathlib import Path

    from lightning_ffpa.cli import FFPACLI

    cfg = yaml.safe_load((Path(__file__).resolve().parents[2] / "configs" / "tiny_grpo.yaml").read_text())

    def build(cfg):
        path = tmp_path / "c.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return FFPACLI(model_class=None, datamodule_class=None, subclass_mode_model=True, subclass_mode_data=True,
                       args=["--config", str(path), "--trainer.logger=false"], run=False,
                       auto_configure_optimizers=False)

    (rollout,) = [c for c in build(cfg).trainer.callbacks if isinstance(c, RolloutCallback)]
    assert rollout.reward_funcs == [token_range_reward]
    assert rollout.engine_config.page_size == 8 and rollout.sampling.max_new_tokens == 6
    cfg["trainer"]["callbacks"][-1]["init_args"]["sampling"]["max_new_tokens"] = 0  # RolloutCallback: last
    with pytest.raises(ValueError) as err:
        build(cfg)
    cause = err.value
    while cause is not None and not isinstance(cause, ConfigError):
        cause = cause.__cause__ or cause.__context__
    assert cause is not None and cause.option == "RolloutCallback.sampling.max_new_tokens"


def test_kv_pool_larger_than_free_memory_is_one_error_naming_num_pages(monkeypatch):
    """A pool that cannot fit fails before it is allocated (it was a CUDA OOM inside the cache), naming the option
    as the user spelled it; the device's free memory is faked so the real engine path runs on CPU."""
    import torch
    import transformers

    from lightning_ffpa.presets import build_text_config
    from lightning_ffpa.rollout import engine as engine_mod
    torch.manual_seed(0)
    model = transformers.Gemma4ForCausalLM(build_text_config("tiny"))
    ok = engine_mod.RolloutEngine(model, EngineConfig(**SMALL))
    allocated = sum(t.numel() * t.element_size() for pools in (ok.cache.k, ok.cache.v) for t in pools.values())
    need = ok.config.pool_bytes(ok.walker.specs, ok.dtype)  # full layers' pools and the sliding layers' own
    assert need == allocated and ok.num_sliding_pages == 13  # 4 slots' 16-token windows: 3 pages of 8 each
    monkeypatch.setattr(engine_mod, "free_device_bytes", lambda device: need // 2)
    with pytest.raises(ConfigError, match=r"^`engine.num_pages=16`: the KV pools need .* at most 7 pages fit"):
        engine_mod.RolloutEngine(model, EngineConfig(**SMALL))
    engine_mod.RolloutEngine(model, EngineConfig(**{**SMALL, "num_pages": 7}))  # the advice holds...
    with pytest.raises(ConfigError, match=r"at most 7 pages fit"):
        engine_mod.RolloutEngine(model, EngineConfig(**{**SMALL, "num_pages": 8}))  # ...and is the most that fits
    monkeypatch.setattr(engine_mod, "free_device_bytes", lambda device: need)
    engine_mod.RolloutEngine(model, EngineConfig(**SMALL))  # exactly enough is allowed


def _room(monkeypatch, free_of, before_fit=True):
    """Fake the device's free memory as `free_of(policy, copy, pool)` bytes for the Callback and the engine, where
    `policy` is the pre-flight's lower bound for the tiny GRPO policy; without `before_fit` only the build-time
    check runs (the policy then is resident, so `free` means what is left beside it)."""
    import torch

    from lightning_ffpa.callbacks import rollout as callback_mod
    from lightning_ffpa.hf_module import resolve_dtype
    from lightning_ffpa.lora import unwrap_peft
    from lightning_ffpa.rollout import engine as engine_mod
    from lightning_ffpa.rollout.kv_cache import pool_bytes
    from lightning_ffpa.rollout.walker import DecoderWalker

    module = GRPOModule(preset="tiny")
    meta = module.build_model("meta")
    itemsize = resolve_dtype(module.hparams.get("dtype", "auto")).itemsize  # the CPU fit's dtype: the copy's too
    policy = sum(p.numel() for p in meta.parameters()) * itemsize
    base = unwrap_peft(meta)
    with torch.device("meta"):  # the copy the Callback builds: the base's class and config, no LoRA layers
        base = type(base)(base.config)
    copy = sum(p.numel() for p in base.parameters()) * itemsize
    pool = pool_bytes(DecoderWalker(base).specs, SMALL["num_pages"], SMALL["page_size"], torch.float32)
    free = free_of(policy, copy, pool)
    for mod in (callback_mod, engine_mod):
        monkeypatch.setattr(mod, "free_device_bytes", lambda device: free)
    if not before_fit:
        monkeypatch.setattr(RolloutCallback, "_check_room_before_fit", lambda self, trainer, pl_module: None)


def test_preflight_names_the_inference_copy_before_any_model_when_policy_and_copy_cannot_fit(monkeypatch):
    _room(monkeypatch, lambda policy, copy, pool: policy + copy // 2)
    module = GRPOModule(preset="tiny")
    with pytest.raises(ConfigError, match=r"^`RolloutCallback.inference_dtype=None`: the inference copy .* beside the "
                                          r"policy \(at least .* keeps its own full copy .* `RolloutCallback.weights: "
                                          r"shared` reads"):
        _fit(_callback(num_generations=2, weights="merged"), module)
    assert module.model is None  # refused before the policy was built


def test_preflight_names_num_pages_when_only_the_pool_cannot_fit(monkeypatch):
    _room(monkeypatch, lambda policy, copy, pool: policy + copy + pool // 2)
    module = GRPOModule(preset="tiny")
    with pytest.raises(ConfigError, match=r"^`RolloutCallback.engine.num_pages=16`: .* at most 8 pages fit"):
        _fit(_callback(num_generations=2), module)
    assert module.model is None


def test_build_check_names_num_pages_when_the_pool_cannot_fit_beside_the_resident_policy(monkeypatch):
    _room(monkeypatch, lambda policy, copy, pool: copy + pool // 2, before_fit=False)
    rollout = _callback(num_generations=2)
    with pytest.raises(ConfigError, match=r"^`RolloutCallback.engine.num_pages=16`: the engine's own weights .* after "
                                          r"the policy; at most 8 pages fit"):
        _fit(rollout)
    assert rollout.engine is None and rollout.sync is None  # refused before the copy was built


def test_build_check_names_the_inference_copy_when_it_cannot_fit(monkeypatch):
    _room(monkeypatch, lambda policy, copy, pool: copy // 2, before_fit=False)
    with pytest.raises(ConfigError, match=r"^`RolloutCallback.inference_dtype=None`: .* keeps its own full copy"):
        _fit(_callback(num_generations=2, weights="merged"))
    # A full fine-tune trains every weight: shared, the engine still owns a copy of each, and says so
    with pytest.raises(ConfigError, match=r"^`RolloutCallback.inference_dtype=None`: the engine's own weights .* "
                                          r"copied \(trained by the policy\) .* LoRA instead of training every"):
        _fit(_callback(num_generations=2))


def test_callback_fits_when_policy_copy_and_pool_fit_exactly(monkeypatch):
    _room(monkeypatch, lambda policy, copy, pool: policy + copy + pool)
    assert _fit(_callback(num_generations=2)).global_step == 1


def test_a_lora_policy_refused_for_a_merged_copy_fits_with_shared_weights(monkeypatch):
    """LoRA: the merged copy is the whole base, refused before any model is built; shared, the engine owns only the
    adapter buffers, so the same free memory runs the fit (the real 31B must not be refused for a copy it no longer
    makes)."""
    from lightning_ffpa.callbacks import rollout as callback_mod

    seen = []
    real = callback_mod.RolloutCallback._check_room

    def spy(self, plan, dtype, device, free, policy=0):
        seen.append((plan.mode, plan.own_bytes, plan.aliased_bytes, policy))
        return real(self, plan, dtype, device, free, policy)

    monkeypatch.setattr(callback_mod.RolloutCallback, "_check_room", spy)
    _room(monkeypatch, lambda policy, copy, pool: policy + copy // 2)
    lora = {"r": 2, "target_modules": ["q_proj", "o_proj"]}
    merged = GRPOModule(preset="tiny", lora=lora)
    with pytest.raises(ConfigError, match=r"^`RolloutCallback.inference_dtype=None`: the inference copy"):
        _fit(_callback(num_generations=2, weights="merged"), merged)
    assert merged.model is None
    plain = GRPOModule(preset="tiny").build_model("meta")
    params = sum(p.numel() for p in plain.parameters())
    (mode, own, aliased, policy), = seen
    assert (mode, own, aliased) == ("merged", params * 4, 0)  # adapters are not in the copy
    assert policy > params * 4  # ... but they are in the policy (fp32 on the CPU fit)

    seen.clear()
    rollout = _callback(num_generations=2)
    assert _fit(rollout, GRPOModule(preset="tiny", lora=lora)).trainer.global_step == 1
    (mode, own, aliased, _), (mode2, own2, aliased2, _) = seen  # pre-flight on meta, then at build
    assert mode == mode2 == "shared" and own == own2 and aliased == aliased2 == params * 4
    assert 0 < own < params * 4 // 20  # the adapters' A and B buffers only
    assert rollout.weights_path.startswith("shared: ") and rollout.sync.stats["own_bytes"] == own


def test_preflight_counts_a_float8_base_at_one_byte_a_weight(monkeypatch):
    """`lora.base_dtype: fp8` halves the 31B base (57 -> 28 GiB); the pre-flight counted it at `model.dtype` and
    refused a full-depth GRPO fit on an 80 GB H100 that fits (benchmarks/results/grpo_full_depth_fp8base_1024_h100_oom.json's
    first try). Free memory here is the old estimate's policy plus the pool: refused at `model.dtype` sizes."""
    _room(monkeypatch, lambda policy, copy, pool: policy + pool)
    module = GRPOModule(preset="tiny", lora={"r": 4, "target_modules": "all-linear", "base_dtype": "fp8"})
    assert _fit(_callback(num_generations=2), module).global_step == 1
    with pytest.raises(ConfigError, match=r"beside the policy"):  # the same room, the base at model.dtype
        _fit(_callback(num_generations=2), GRPOModule(preset="tiny", lora={"r": 4, "target_modules": "all-linear"}))


def test_grpo_with_lora_on_the_expert_stacks_fits_and_its_rollouts_run_the_adapted_experts(monkeypatch, caplog):
    """`target_parameters` on tiny-moe: the engine reads the adapted expert stacks in place, as the rest of the base,
    and owns only their adapters (applied unmerged); the fit runs and the base does not drift (`verify_no_drift`).
    The room check's meta model (run here: free memory faked as ample) does not repeat the adapters' line."""
    _room(monkeypatch, lambda policy, copy, pool: 1 << 50)
    rollout = _callback(num_generations=2, verify_no_drift=True)
    module = GRPOModule(preset="tiny-moe", lora={"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"],
                                                 "target_parameters": ["experts.gate_up_proj", "experts.down_proj"]})
    with caplog.at_level("INFO"):
        assert _fit(rollout, module).global_step == 1
    assert caplog.text.count("run their adapters unmerged") == 1, caplog.text
    assert "expert LoRA A and B buffers" in rollout.weights_path and "merged" not in rollout.weights_path
    assert "read from the policy's tensors" in rollout.weights_path
    assert rollout.drift_report is not None
