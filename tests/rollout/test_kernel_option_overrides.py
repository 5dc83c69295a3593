"""Kernel-option overrides: validation (names, values, the two unsafe options), JSON loading, and that
the attention entry point the engine calls hands the override to flex."""

import json

import pytest
import torch

from lightning_ffpa.rollout import attention as attn


@pytest.fixture(autouse=True)
def _clean():
    attn.reset_kernel_options()
    yield
    attn.reset_kernel_options()


def test_override_replaces_builtin_per_head_dim_phase_and_dtype():
    builtin_512 = attn.kernel_options(512, True)
    attn.set_kernel_options(256, True, {"BLOCK_N": 32, "num_stages": 3, "num_warps": 4, "SPLIT_KV": 2})
    assert attn.kernel_options(256, True) == {"BLOCK_N": 32, "num_stages": 3, "num_warps": 4, "SPLIT_KV": 2}
    assert attn.kernel_options(256, False) is None  # prefill untouched
    assert attn.kernel_options(256, True, torch.float32) is None  # other dtype untouched
    assert attn.kernel_options(512, True) == builtin_512
    attn.set_kernel_options(512, True, None)  # None is an override too: flex's defaults
    assert attn.kernel_options(512, True) is None and builtin_512 is not None
    got = attn.kernel_options(256, True)
    got["BLOCK_N"] = 128  # callers get copies
    assert attn.kernel_options(256, True)["BLOCK_N"] == 32
    attn.reset_kernel_options()
    assert attn.kernel_options(512, True) == attn.builtin_kernel_options(512, True)


@pytest.mark.parametrize("option", attn.UNSAFE_OPTIONS)
def test_unsafe_options_are_refused_by_name(option):
    with pytest.raises(ValueError, match=option):
        attn.set_kernel_options(256, True, {"num_stages": 2, option: True})
    assert attn.kernel_option_overrides() == []


@pytest.mark.parametrize("decode,options,match", [
    (True, {"BLOCK_SIZE_N": 64}, "BLOCK_SIZE_N"),  # typo
    (False, {"SPLIT_KV": 2}, "SPLIT_KV"),  # a decode-only knob in prefill
    (True, {"num_stages": 0}, "num_stages=0"),
    (True, {"BLOCK_N": 64.0}, "BLOCK_N=64.0"),
    (True, {"num_warps": True}, "num_warps=True"),
    (True, {"USE_TMA": 1}, "USE_TMA=1"),
    (True, [("BLOCK_N", 64)], "dict or None"),
])
def test_bad_overrides_name_the_option(decode, options, match):
    with pytest.raises(ValueError, match=match):
        attn.set_kernel_options(256, decode, options)


def test_bad_head_dim_is_refused():
    with pytest.raises(ValueError, match="head_dim"):
        attn.set_kernel_options(0, True, {"BLOCK_N": 32})


def test_load_from_result_json_and_list_all_or_nothing(tmp_path):
    entries = [{"head_dim": 256, "decode": True, "dtype": "bfloat16", "options": {"BLOCK_N": 64, "num_stages": 2}},
               {"head_dim": 512, "decode": True, "dtype": "bfloat16", "options": None}]
    result = tmp_path / "rollout_attention.json"
    result.write_text(json.dumps({"benchmark": "rollout_attention", "rows": [], "summary": {"kernel_options": entries}}))
    assert attn.load_kernel_options(result) == entries
    assert attn.kernel_options(256, True) == {"BLOCK_N": 64, "num_stages": 2}
    assert attn.kernel_options(512, True) is None
    assert sorted(attn.kernel_option_overrides(), key=lambda e: e["head_dim"]) == entries  # round trip
    attn.reset_kernel_options()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([entries[0], {"head_dim": 512, "decode": True, "options": {"ROWS_GUARANTEED_SAFE": True}}]))
    with pytest.raises(ValueError, match="ROWS_GUARANTEED_SAFE"):
        attn.load_kernel_options(bad)
    assert attn.kernel_option_overrides() == []  # nothing applied when one entry is bad


def test_paged_attention_passes_the_override_to_flex():
    """The engine builds StepContext without options; the override must still reach flex."""
    seen = []

    def fake_flex(q, k, v, **kw):
        seen.append(kw["kernel_options"])
        return torch.zeros_like(q)

    q = torch.zeros(2, 4, 1, 256)
    k = v = torch.zeros(1, 2, 8, 256)
    ctx = attn.StepContext({None: None}, decode=True, flex=fake_flex)
    module = torch.nn.Module()
    attn.paged_attention(module, q, k, v, ctx, sliding_window=None)
    attn.set_kernel_options(256, True, {"BLOCK_N": 32, "num_warps": 8}, torch.float32)
    attn.paged_attention(module, q, k, v, ctx, sliding_window=None)
    assert seen == [attn.builtin_kernel_options(256, True, torch.float32), {"BLOCK_N": 32, "num_warps": 8}]


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_compiled_flex_honours_decode_override_on_gpu():
    """An override reaches the compiled kernel: tiles that cannot fit shared memory fail, a fitting set matches."""
    import sys
    from pathlib import Path

    from torch.nn.attention.flex_attention import flex_attention

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from benchmarks.rollout_attention import LayerKind, build_cases

    kind = LayerKind("full", 512, 1, None, 1)
    with torch.inference_mode():
        k, v, (case,) = build_cases(kind, [300], 4, 1, 128, 128, 8, torch.bfloat16, "cuda", 2)
        module = torch.nn.Module()

        def run():
            torch.compiler.reset()
            ctx = attn.StepContext({None: case.block_mask}, decode=True,
                                   flex=torch.compile(flex_attention, dynamic=False))
            return attn.paged_attention(module, case.query, k, v, ctx, scaling=1.0, sliding_window=None)[0]

        attn.set_kernel_options(512, True, {"BLOCK_N": 128, "num_stages": 3})  # ~800 KB of K/V tiles
        with pytest.raises(Exception):  # noqa: B017 - Triton's resource error type varies across versions
            run()
        attn.set_kernel_options(512, True, {"BLOCK_N": 32, "num_stages": 2, "num_warps": 4})
        out = run()
    assert torch.isfinite(out).all() and (out[case.num_real:] == 0).all()
    assert (out[:case.num_real].float() - case.ref[:case.num_real]).abs().max() < 5e-3


def test_builtin_block_n_is_clamped_to_divide_the_decode_kv_block():
    assert attn.builtin_kernel_options(256, True, torch.bfloat16, kv_block=128)["BLOCK_N"] == 64
    assert attn.builtin_kernel_options(256, True, torch.bfloat16, kv_block=48)["BLOCK_N"] == 16
    assert attn.builtin_kernel_options(512, True, torch.bfloat16, kv_block=16)["BLOCK_N"] == 16
    assert attn.builtin_kernel_options(256, True, torch.bfloat16)["BLOCK_N"] == 64  # no KV block: as swept


def test_override_block_n_not_dividing_the_kv_block_fails_at_engine_start():
    from transformers import Gemma4ForCausalLM

    from lightning_ffpa.presets import build_text_config
    from lightning_ffpa.rollout.engine import EngineConfig, RolloutEngine

    model = Gemma4ForCausalLM(build_text_config("tiny")).eval()
    cfg = EngineConfig(page_size=8, num_pages=16, max_batch_size=2, max_seq_len=64, attention="dense")
    eng = RolloutEngine(model, cfg)
    assert eng.decode_path == "eager"  # compile_decode=None: off on CPU
    head_dim = eng.walker.specs[0].head_dim
    attn.set_kernel_options(head_dim, True, {"BLOCK_N": 16}, torch.float32)
    with pytest.raises(ValueError, match=r"`BLOCK_N=16`.*`kv_block_size=8`"):
        RolloutEngine(model, cfg)
    with pytest.raises(ValueError, match=r"`BLOCK_N=16`.*`kv_block_size=8`"):  # a block under the page: same check
        RolloutEngine(model, EngineConfig(**{**vars(cfg), "page_size": 16, "kv_block_size": 8}))
