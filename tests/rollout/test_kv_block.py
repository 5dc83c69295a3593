"""`EngineConfig.kv_block_size`: decode masks in KV blocks smaller than a page give the same tokens, list fewer
blocks, and bad values are one error naming the option."""

import pytest
import torch
from transformers import Gemma4ForCausalLM

from lightning_ffpa.errors import ConfigError
from lightning_ffpa.presets import build_text_config
from lightning_ffpa.rollout.engine import EngineConfig, RolloutEngine


@pytest.fixture(scope="module")
def gemma():
    torch.manual_seed(0)
    return Gemma4ForCausalLM(build_text_config("tiny")).eval()


def _prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(2, 512, (n,), generator=g).tolist() for n in (5, 19, 11)]


def _engine(model, **kw):
    base = dict(page_size=16, num_pages=16, max_batch_size=4, max_seq_len=64, max_prefill_tokens=64,
                attention="flex")  # flex's eager path: the one that reads the blocks the masks list
    return RolloutEngine(model, EngineConfig(**{**base, **kw}))


@pytest.mark.parametrize("page_size, kv_block_size, block", [(128, None, 64), (64, None, 64), (16, None, 16),
                                                             (48, None, 16), (256, None, 64), (128, 128, 128)])
def test_default_block_is_the_largest_divisor_of_the_page_up_to_64(page_size, kv_block_size, block):
    assert EngineConfig(page_size=page_size, kv_block_size=kv_block_size).decode_block == block


@pytest.mark.parametrize("kw, option", [(dict(page_size=8, max_seq_len=64), "engine.page_size"),
                                        (dict(page_size=128, max_seq_len=128, kv_block_size=8), "engine.kv_block_size")])
def test_cuda_tile_rule_is_checked_from_the_device_alone(kw, option):
    """Flex decode tiles need multiples of 16 on CUDA; the check needs only the device, so the Callback's
    pre-flight runs it before a model exists (no GPU needed here)."""
    cuda = torch.device("cuda")
    with pytest.raises(ConfigError) as err:
        EngineConfig(**kw).check_device(cuda)
    assert err.value.option == option
    assert EngineConfig(**kw).check_device(torch.device("cpu")) is False  # CPU: any divisor, eager step
    assert EngineConfig(page_size=128, max_seq_len=128, kv_block_size=16).check_device(cuda) is True


@pytest.mark.parametrize("value", [0, 3, 32, True, 8.0])
def test_bad_kv_block_size_is_one_error_naming_it(value):
    with pytest.raises(ConfigError, match=r"^`engine\.kv_block_size=") as err:
        EngineConfig(page_size=16, max_seq_len=64, kv_block_size=value).check()
    assert "\n" not in str(err.value)


def test_sub_page_blocks_give_the_same_tokens_and_list_fewer_blocks(gemma):
    whole = _engine(gemma, kv_block_size=16)
    sub = _engine(gemma, kv_block_size=4)
    want = whole.generate(_prompts(), 7)
    got = sub.generate(_prompts(), 7)
    assert [s.output for s in got] == [s.output for s in want]
    torch.testing.assert_close(torch.tensor([s.logprobs for s in got]), torch.tensor([s.logprobs for s in want]),
                               rtol=0, atol=1e-5)
    # The last page is read up to the newest token's block: position 20 reads 2 blocks of 16, or 6 of 4.
    for eng, block, listed in ((whole, 16, 2), (sub, 4, 6)):
        mask = eng.logical[None]
        assert mask.BLOCK_SIZE == (block, block)
        assert int(mask.kv_num_blocks[0, 0, 20 // block] + mask.full_kv_num_blocks[0, 0, 20 // block]) == listed

