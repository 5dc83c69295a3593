"""lightning_ffpa.lora's shared peft helpers: unwrap_peft, hf_name and merged_weight against peft itself."""

import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from lightning_ffpa.lora import PEFT_PREFIX, hf_name, merged_weight, unwrap_peft


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 5)


def _peft_model():
    torch.manual_seed(0)
    model = get_peft_model(_Tiny(), LoraConfig(r=2, lora_alpha=6, target_modules=["proj"]))
    with torch.no_grad():
        model.base_model.model.proj.lora_B["default"].weight.normal_()  # B = 0 at init would hide the update
    return model


def test_unwrap_peft_returns_the_wrapped_model_or_the_model_itself():
    plain = _Tiny()
    assert unwrap_peft(plain) is plain
    wrapped = _peft_model()
    assert isinstance(unwrap_peft(wrapped), _Tiny) and unwrap_peft(wrapped) is not wrapped


def test_hf_name_maps_every_peft_base_name_to_the_plain_model_name():
    model = _peft_model()
    plain = set(_Tiny().state_dict())
    mapped = {hf_name(n) for n in model.state_dict() if "lora_" not in n}
    assert all(n.startswith(PEFT_PREFIX) for n in model.state_dict())
    assert mapped == plain == {"proj.weight", "proj.bias"}


def test_merged_weight_equals_peft_merge_and_writes_in_place():
    model = _peft_model()
    layer = model.base_model.model.proj
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    base, scaling = layer.base_layer.weight.detach().clone(), layer.scaling["default"]
    got = merged_weight(base, a.detach(), b.detach(), scaling)
    want = model.merge_and_unload().proj.weight.detach()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert not torch.equal(got, base)
    out = torch.empty_like(base)
    ptr = out.data_ptr()
    merged_weight(base, a.detach(), b.detach(), scaling, out=out)
    assert out.data_ptr() == ptr and torch.equal(out, got)
