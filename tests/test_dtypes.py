"""The one dtype parser: every spelling maps to its torch dtype, and a bad value is a ConfigError naming the option."""

import pytest
import torch

from lightning_ffpa.dtypes import auto_dtype, parse_dtype
from lightning_ffpa.errors import ConfigError


@pytest.mark.parametrize("names, dtype", [(("bf16", "bfloat16"), torch.bfloat16), (("fp16", "float16"), torch.float16),
                                          (("fp32", "float32"), torch.float32)])
def test_both_spellings_name_one_dtype(names, dtype):
    assert [parse_dtype("x", n) for n in names] == [dtype, dtype]
    assert parse_dtype("x", dtype) is dtype


def test_auto_is_the_device_choice_unless_the_option_forbids_it():
    assert parse_dtype("x", "auto") is auto_dtype()
    with pytest.raises(ConfigError) as err:
        parse_dtype("strategy.param_dtype", "auto", allow_auto=False)
    assert err.value.option == "strategy.param_dtype" and "auto" not in err.value.reason


def test_none_only_where_allowed_and_bad_names_list_the_choices():
    assert parse_dtype("x", None, allow_none=True) is None
    with pytest.raises(ConfigError, match="`model.dtype=None`"):
        parse_dtype("model.dtype", None)
    with pytest.raises(ConfigError, match=r"`model.dtype='bf17'`: must be one of \['auto', 'bf16'"):
        parse_dtype("model.dtype", "bf17")
    with pytest.raises(ConfigError):
        parse_dtype("x", torch.int8)
