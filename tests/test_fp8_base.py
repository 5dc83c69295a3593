"""`model.lora.base_dtype: fp8` (`lightning_ffpa.fp8_base`): the rowwise quantisation's error against bf16's, LoRA
forward and backward against the dequantised weight, the base's bytes (stored and saved for backward), the counted
matmul path, the refusals, and the export (HF `from_pretrained` of it against the module's own forward). CPU
exercises the dequantise path; the scaled_mm path's tests are marked gpu."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from lightning_ffpa import fp8_base
from lightning_ffpa.errors import ConfigError
from lightning_ffpa.fp8_base import (
    FP8_DTYPE,
    Float8BaseLinear,
    dequantize,
    quantize_lora_bases,
    quantize_rowwise,
)
from lightning_ffpa.lora import lora_hparam
from lightning_ffpa.module import Gemma4LM

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _rows(out=64, inp=96, seed=0) -> torch.Tensor:
    """Rows of very different magnitudes (1e-3 .. 1e2): a tensorwise scale would flush the small ones."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out, inp, generator=g) * torch.logspace(-3, 2, out).unsqueeze(1)


def test_rowwise_error_is_within_e4m3_rounding_of_each_rows_own_scale_and_bf16_is_finer():
    w = _rows()
    q, scale = quantize_rowwise(w)
    assert q.dtype == FP8_DTYPE and scale.dtype == torch.float32 and scale.shape == (64,)
    err = (dequantize(q, scale, torch.float32) - w).abs()
    amax = w.abs().amax(1, keepdim=True)
    # e4m3: 3 mantissa bits (half an ulp is 2^-4 of the value) down to 2^-6, subnormal steps of 2^-9 below it
    assert (err <= 2 ** -4 * w.abs() + 2 ** -10 * scale.unsqueeze(1)).all()
    per_row = err.amax(1, keepdim=True) / amax  # each channel's error relative to its own amax
    assert per_row.max() <= 2 ** -4 and per_row.min() > 0
    bf16 = ((w.bfloat16().float() - w).abs().amax(1, keepdim=True) / amax)
    assert (bf16 <= 2 ** -8).all() and (per_row > bf16).all()  # the price, per channel: at most 2^4 x bf16's bound
    zero = quantize_rowwise(torch.zeros(2, 16))
    assert torch.equal(zero[1], torch.ones(2)) and not zero[0].float().any()  # a zero row: scale 1, no NaN


def test_the_cast_saturates_and_the_amax_maps_to_the_float8_maximum():
    w = torch.tensor([[1.0, -3.0, 0.5], [1e-30, 2e-30, -4e-30]])
    q, scale = quantize_rowwise(w)
    assert q.float().abs().amax(1).tolist() == [448.0, 448.0] and torch.isfinite(q.float()).all()
    assert torch.allclose(scale, torch.tensor([3.0, 4e-30]) / 448)


def _peft(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(48, 64), nn.ReLU(), nn.Linear(64, 32)).to(dtype)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["0", "2"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.1)
    return model


def test_lora_forward_and_backward_equal_those_over_the_dequantised_weight():
    fp8, ref = _peft(), _peft()
    report = quantize_lora_bases(fp8)
    assert report["converted"] == 2 and report["was_dtype"] == "float32"
    for m8, mr in zip(fp8.modules(), ref.modules()):  # the reference: the same W0, dequantised, in a plain Linear
        if isinstance(m8, Float8BaseLinear):
            mr.weight.data = dequantize(m8.weight, m8.weight_scale, torch.float32)
    x = torch.randn(5, 7, 48, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    before = fp8_base.path_counts().get("dequantize", 0)
    y, yr = fp8(x), ref(xr)
    assert fp8_base.path_counts()["dequantize"] == before + 2  # one count per base matmul, the CPU path
    torch.testing.assert_close(y, yr, rtol=0, atol=1e-6)
    (y.square().sum()).backward()
    (yr.square().sum()).backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-6, atol=1e-6)
    grads = {n: p.grad for n, p in fp8.named_parameters() if p.requires_grad}
    want = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
    assert grads.keys() == {n for n in want if "lora_" in n} and len(grads) == 4  # adapters only train
    for n in grads:
        torch.testing.assert_close(grads[n], want[n], rtol=1e-5, atol=1e-6, msg=n)
    assert all(p.grad is None for m in fp8.modules() if isinstance(m, Float8BaseLinear) for p in m.parameters())


def _num_lora_layers(module) -> int:
    from peft.tuners.lora import LoraLayer

    return sum(isinstance(m, LoraLayer) for m in module.modules())


def test_the_base_halves_against_bf16_and_backward_saves_only_its_float8_bytes():
    def base_bytes(model):
        return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".base_layer." in n)

    lora = {"r": 4, "target_modules": ALL}
    bf16 = Gemma4LM(preset="tiny", dtype="bfloat16", lora=lora)
    fp8 = Gemma4LM(preset="tiny", dtype="bfloat16", lora={**lora, "base_dtype": "fp8"})
    for m in (bf16, fp8):
        m.configure_model()
    ratio = base_bytes(fp8.model) / base_bytes(bf16.model)
    assert 0.5 < ratio <= 0.5 + 4 / (2 * 64)  # 1 byte a weight, plus one fp32 scale a row of >= 64 weights
    assert fp8.fp8_base["converted"] == _num_lora_layers(fp8) == 26  # the full layers share k and v (no v_proj)
    # What autograd keeps of one base matmul: the float8 W0 and its scales, never a dequantised copy.
    layer = Float8BaseLinear.from_linear(nn.Linear(256, 128, bias=False).bfloat16())
    saved = []
    x = torch.randn(3, 256, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        layer(x)
    assert sum(t.numel() * t.element_size() for t in saved) == 256 * 128 + 128 * 4


def test_a_dtype_cast_moves_the_float8_base_but_keeps_its_dtype():
    model = _peft()
    quantize_lora_bases(model)
    model.to(torch.bfloat16)  # what a `bf16-true` precision plugin does to the module
    base = model.base_model.model[0]
    assert base.base_layer.weight.dtype == FP8_DTYPE and base.base_layer.weight_scale.dtype == torch.float32
    assert base.lora_A["default"].weight.dtype == torch.bfloat16
    assert fp8_base.scale_of(base.base_layer.weight) is base.base_layer.weight_scale


def test_bad_values_are_refused_naming_the_option():
    with pytest.raises(ConfigError, match=r"^`model\.lora\.base_dtype='fp16'`: must be one of model, fp8$"):
        lora_hparam({"r": 4, "base_dtype": "fp16"})
    with pytest.raises(ConfigError, match=r"^`model\.lora\.base_dtype='fp8'`: .*target_parameters"):
        lora_hparam({"r": 4, "base_dtype": "fp8", "target_parameters": ["experts.down_proj"]})
    with pytest.raises(ConfigError, match=r"^`model\.lora\.base_dtype='fp8'`: .*use_dora"):
        lora_hparam({"r": 4, "base_dtype": "fp8", "use_dora": True})
    assert lora_hparam({"r": 4, "base_dtype": "fp8"}) == {"r": 4, "base_dtype": "fp8"}
    assert lora_hparam({"r": 4, "base_dtype": "model"}) == {"r": 4}  # the default is not stored
    torch.manual_seed(0)
    emb = get_peft_model(nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8)),
                         LoraConfig(r=2, target_modules=["0", "1"]))
    with pytest.raises(ConfigError, match=r"^`model\.lora\.base_dtype='fp8'`: stores Linear LoRA targets only; "
                                          r".*0 adapts a Embedding"):
        quantize_lora_bases(emb)
    tied = get_peft_model(nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 10, bias=False)),
                          LoraConfig(r=2, target_modules=["1"]))
    tied.base_model.model[1].base_layer.weight = tied.base_model.model[0].weight  # a head tied to the embedding
    with pytest.raises(ConfigError, match=r"cannot store .*1's base in float8: its weight is tied"):
        quantize_lora_bases(tied)


def test_a_gpu_without_fp8_is_refused_before_the_build_and_cpu_says_its_path(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ConfigError, match=r"^`model\.lora\.base_dtype='fp8'`: needs FP8 tensor cores .*A100 has 8\.0"):
        fp8_base.check_device({"r": 4, "base_dtype": "fp8"}, cuda)
    fp8_base.check_device({"r": 4}, cuda)  # no fp8 base: nothing to refuse
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fp8_base.matmul_path(cuda)[0] == "scaled_mm"
    assert fp8_base.matmul_path(torch.device("cpu"))[0] == "dequantize"
    module = Gemma4LM(preset="tiny", dtype="float32", lora={"r": 4, "target_modules": ["q_proj"],
                                                           "base_dtype": "fp8"})
    monkeypatch.setattr(type(module), "device", property(lambda self: cuda))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    with pytest.raises(ConfigError, match="needs FP8 tensor cores"):
        module.configure_model()
    assert module.model is None  # refused before anything was built


def test_export_writes_weights_hf_loads_to_the_modules_own_logits(tmp_path, capsys):
    import lightning as L
    from transformers import Gemma4ForCausalLM

    from lightning_ffpa.export import command

    L.seed_everything(0)
    module = Gemma4LM(preset="tiny", dtype="float32", lora={"r": 4, "target_modules": ALL, "base_dtype": "fp8"})
    module.configure_model()
    with torch.no_grad():
        for n, p in module.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.05)
    trainer = L.Trainer(accelerator="cpu", max_steps=0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.strategy.connect(module)
    trainer.save_checkpoint(tmp_path / "m.ckpt")
    command(str(tmp_path / "m.ckpt"), str(tmp_path / "hf"), merge_lora=True)
    n = _num_lora_layers(module)
    assert (f"dequantised {n} float8 base weights (model.lora.base_dtype fp8) to float32; merged LoRA into {n} "
            "weights") in capsys.readouterr().out
    hf = Gemma4ForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="sdpa").eval()
    assert all(p.dtype == torch.float32 for p in hf.parameters())
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    module.model.eval()
    with torch.no_grad():
        want, got = module.model(input_ids=ids).logits, hf(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)  # W0 + s*B@A merged in fp32 against x@W0 + s*(x@A)@B
    # Unmerged: the dequantised base beside the adapter, which peft loads over it.
    from peft import PeftModel

    command(str(tmp_path / "m.ckpt"), str(tmp_path / "hf2"))
    base = Gemma4ForCausalLM.from_pretrained(tmp_path / "hf2", attn_implementation="sdpa")
    peft = PeftModel.from_pretrained(base, tmp_path / "hf2" / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(peft(input_ids=ids).logits, want, rtol=0, atol=1e-5)


def test_the_first_call_of_each_path_is_reported_and_a_cuda_fallback_warns(monkeypatch):
    from lightning_ffpa.attention import counters

    said = []
    monkeypatch.setattr("lightning.pytorch.utilities.rank_zero_info", said.append)
    counters.reset(fp8_base.COUNTER)
    layer = Float8BaseLinear.from_linear(nn.Linear(32, 16))
    for _ in range(3):
        layer(torch.randn(2, 32))
    assert fp8_base.path_counts() == {"dequantize": 3}
    assert said == ["lora.base_dtype fp8: a base matmul ran on the dequantize path (W0 dequantised to the compute "
                    "dtype: no FP8 tensor cores on this device)"]
    with pytest.warns(UserWarning, match="ran on the dequantize_fallback path .*not bf16"):
        fp8_base._report_first("dequantize_fallback")


def test_the_scaled_mm_paths_layouts_and_scales_on_torchs_cpu_scaled_mm():
    """The scaled_mm path's operands (x rowwise, W0ᵀ column-major with its row scales) through torch's CPU
    `_scaled_mm`: what the CUDA kernel gets, checked here too; its backward for the input dequantises W0."""
    torch.manual_seed(0)
    q, scale = quantize_rowwise(_rows(64, 96) * 0.01)
    x = torch.randn(5, 7, 96, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(5, 7, 64, dtype=torch.bfloat16)
    try:
        y = fp8_base._BaseMatmul.apply(x, q, scale, True)
    except (RuntimeError, NotImplementedError) as err:  # a torch without the CPU kernel
        pytest.skip(f"torch {torch.__version__} has no CPU rowwise _scaled_mm: {err}")
    (dx,) = torch.autograd.grad(y, x, dy)
    w = dequantize(q, scale, torch.float32)
    want_y, want_dx = x.detach().float() @ w.t(), dy.float() @ w
    assert y.dtype == dx.dtype == torch.bfloat16 and y.shape == (5, 7, 64) and dx.shape == (5, 7, 96)
    # x in e4m3: a few percent; a wrong layout or scale would be off by far more
    assert (y.float() - want_y).norm() / want_y.norm() < 0.05
    assert (dx.float() - want_dx).norm() / want_dx.norm() < 0.01  # bf16 rounding only: dy is not cast to float8


@pytest.mark.gpu
def test_scaled_mm_path_matches_the_dequantise_path_on_an_fp8_gpu():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs CUDA capability >= 8.9")
    torch.manual_seed(0)
    layer = Float8BaseLinear.from_linear(nn.Linear(1024, 2048, bias=False, device="cuda", dtype=torch.bfloat16))
    x = torch.randn(4, 128, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(4, 128, 2048, device="cuda", dtype=torch.bfloat16)
    before = dict(fp8_base.path_counts())
    y = layer(x)
    assert fp8_base.path_counts().get("scaled_mm", 0) == before.get("scaled_mm", 0) + 1
    (dx,) = torch.autograd.grad(y, x, dy)
    w = dequantize(layer.weight, layer.weight_scale, torch.float32)
    want_y, want_dx = x.detach().float() @ w.t(), dy.float() @ w
    # x rowwise e4m3 in the forward: errors of a few percent of the output's scale; dx reads W0 dequantised
    assert (y.float() - want_y).norm() / want_y.norm() < 0.05
    assert (dx.float() - want_dx).norm() / want_dx.norm() < 0.01
