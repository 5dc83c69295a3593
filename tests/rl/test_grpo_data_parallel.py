"""Data-parallel GRPO: a 2-rank gloo CPU fit (each rank generates and trains its share of the step's prompts;
rewards gathered, so `scale_rewards: batch` and DAPO's token normalisation are global) equals the 1-rank fit
on the same prompts and completions: losses and LoRA weights after 2 steps, under DDP and FSDP2; also when
dynamic sampling drops every group of one rank."""

from pathlib import Path

import pytest
import torch
from transformers import Gemma4ForCausalLM

from lightning_ffpa.presets import build_text_config
from tests.parallel._launch import torchrun_json

SCRIPT = Path(__file__).with_name("_fit_grpo_dp.py")


def _adapters(result: dict) -> dict[str, list[float]]:
    """Adapter values by name, wrapper levels (activation checkpointing under FSDP2) removed."""
    return {k.replace("._checkpoint_wrapped_module", ""): v for k, v in result["adapters"].items()}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny") / "tiny"
    Gemma4ForCausalLM(build_text_config("tiny", num_hidden_layers=2)).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def one_rank(pretrained, tmp_path_factory):
    return torchrun_json(SCRIPT, tmp_path_factory.mktemp("one") / "one.json", 1, 29751, "ddp", pretrained, timeout=180)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_ranks_equal_one_rank(strategy, pretrained, one_rank, tmp_path):
    one = one_rank
    two = torchrun_json(SCRIPT, tmp_path / "two.json", 2, 29753, strategy, pretrained, timeout=180)
    assert one["steps"] == two["steps"] == 2
    assert two["losses"] == pytest.approx(one["losses"], abs=1e-5, rel=1e-4)
    assert abs(one["losses"][1]) > 1e-2  # a step with a real loss: the comparison can fail
    a, b = _adapters(one), _adapters(two)
    assert a.keys() == b.keys() and a
    # Adam after 2 steps: the rank split changes the float summation order of the gradients only
    worst = max(abs(x - y) for k in a for x, y in zip(a[k], b[k]))
    moved = max(abs(x) for k in a if "lora_B" in k for x in a[k])  # B starts at 0: what training wrote
    assert worst < 1e-4 and moved > 1e-2, (worst, moved)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rank_whose_groups_all_drop_runs_a_zero_loss_step(pretrained, tmp_path):
    # Dynamic sampling drops every group of rank 1 (its prompts' completions tie): it keeps one group with no
    # loss token and runs as many forwards/backwards as rank 0 (its one part is halved to match rank 0's two
    # micro-batches: DDP all-reduces at each backward; before, rank 0 waited forever), so the 2-rank fit still
    # equals the 1-rank fit that drops the same groups.
    one = torchrun_json(SCRIPT, tmp_path / "one.json", 1, 29755, "ddp", pretrained, "drop_odd", timeout=180)
    two = torchrun_json(SCRIPT, tmp_path / "two.json", 2, 29757, "ddp", pretrained, "drop_odd", timeout=180)
    assert one["steps"] == two["steps"] == 2
    assert one["per_rank"][0]["dropped"] == [2.0, 2.0]  # the odd prompts' groups, on one rank
    rank0, rank1 = two["per_rank"]
    assert rank0["dropped"] == [0.0, 0.0] and min(rank0["loss_tokens"]) > 0
    assert rank1["dropped"] == [2.0, 2.0] and rank1["loss_tokens"] == [0, 0]  # all dropped: one group kept, no loss token
    assert two["losses"] == pytest.approx(one["losses"], abs=1e-5, rel=1e-4) and abs(one["losses"][1]) > 1e-3
    a, b = _adapters(one), _adapters(two)
    assert a.keys() == b.keys() and max(abs(x - y) for k in a for x, y in zip(a[k], b[k])) < 1e-4
