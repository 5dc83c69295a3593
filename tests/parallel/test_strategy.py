"""FSDP2Strategy: option validation, a 2-process gloo fit that matches the 1-process loss, and random weights
initialised on 2 gloo ranks as one process initialises them."""

from pathlib import Path

import pytest
import torch

from lightning_ffpa.errors import ConfigError
from lightning_ffpa.parallel import FSDP2Strategy, ParallelDims

from ._launch import torchrun_json

_SCRIPT = Path(__file__).with_name("_fit_tiny.py")
_INIT_SCRIPT = Path(__file__).with_name("_init_ranks.py")


def test_sizes_are_validated_with_the_option_name():
    with pytest.raises(ConfigError, match=r"^`context_parallel_size=3`: does not divide the world size 8 "):
        FSDP2Strategy(context_parallel_size=3).resolve_dims(8)
    with pytest.raises(ConfigError, match=r"^`data_parallel_size=2`: times `context_parallel_size=2` is 4, not the "
                                          r"world size 8 "):
        FSDP2Strategy(data_parallel_size=2, context_parallel_size=2).resolve_dims(8)
    dims = FSDP2Strategy(context_parallel_size=2).resolve_dims(8)
    assert (dims.dp, dims.cp, dims.ep) == (4, 2, 1)
    with pytest.raises(ValueError, match="context_parallel_size=0"):
        FSDP2Strategy(context_parallel_size=0)
    with pytest.raises(ValueError, match="activation_checkpointing='partial'"):
        FSDP2Strategy(activation_checkpointing="partial")
    with pytest.raises(ValueError, match="param_dtype='bf17'"):
        FSDP2Strategy(param_dtype="bf17")
    with pytest.raises(ValueError, match="sac_extra_save_ops.*nope"):
        FSDP2Strategy(sac_extra_save_ops=["aten.nope.default"])
    with pytest.raises(ValueError, match="`sac_save_mm='all'` needs `activation_checkpointing='selective'`"):
        FSDP2Strategy(activation_checkpointing="full", sac_save_mm="all")  # else silently not used
    FSDP2Strategy(activation_checkpointing="none")  # the default sac_save_mm is no choice of the user's
    s = FSDP2Strategy(sac_extra_save_ops=["aten.mm.default"], context_parallel_size=2)
    assert s.context_parallel_size == 2


def _fit(tmp_path, nproc, ac):
    out = tmp_path / f"fit_{nproc}_{ac}.json"
    return torchrun_json(_SCRIPT, out, nproc, 29500 + 10 * nproc + len(ac), ac, timeout=170)


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_two_process_fit_matches_single_process(tmp_path):
    one = _fit(tmp_path, 1, "selective")
    two = _fit(tmp_path, 2, "selective")
    assert two["mesh_dims"] == ["data_parallel", "context_parallel"]
    assert two["mesh_shape"] == [2, 1] and two["cp"] == 1
    assert two["sampler"] == {"num_replicas": 2, "rank": 0}
    assert len(one["losses"]) == 3
    assert one["losses"][-1] < one["losses"][0]  # training moved
    for a, b in zip(one["losses"], two["losses"]):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_random_init_on_two_cpu_ranks_matches_one_process(tmp_path):
    """A preset (random) model with LoRA built on 2 CPU ranks: each shard is its part of the whole tensor one
    process draws with the same seed (not the same draws on every rank), base weights and `lora_A` alike."""
    got = torchrun_json(_INIT_SCRIPT, tmp_path / "init.json", 2, 29871, timeout=180)
    assert got["lora_A"] and set(got["lora_A"]) & set(got["sharded"])
    assert "model.embed_tokens.base_layer.weight" in "".join(got["sharded"])
    assert got["differ"] == [], got["differ"]
    # peft's embedding init: A zero, B standard normal (they kept uninitialised memory under FSDP2)
    (a_max, _), (_, b_std) = (got["lora_embedding"][k] for k in sorted(got["lora_embedding"]))
    assert a_max == 0 and 0.5 < b_std < 2, got["lora_embedding"]


def test_cp_peers_read_the_same_samples():
    class _Dim:
        def __init__(self, size, rank):
            self._size, self._rank = size, rank

        def size(self):
            return self._size

        def get_local_rank(self):
            return self._rank

    s = FSDP2Strategy(context_parallel_size=2)
    # rank 3 of a (dp=2, cp=2) mesh: dp rank 1, cp rank 1 -> reads shard 1 of 2, like its CP peer rank 2
    s._parallel_dims = ParallelDims(2, 2)
    s._parallel_dims.mesh = {ParallelDims.DP: _Dim(2, 1), ParallelDims.CP: _Dim(2, 1)}
    assert s.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 1}


def test_trainer_rejects_bad_sizes_before_the_process_group_starts():
    import lightning as L
    import torch
    import torch.distributed as dist

    class Plain(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)

        def training_step(self, batch, batch_idx):
            return self.lin(batch).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=FSDP2Strategy(context_parallel_size=2), max_steps=1,
                        logger=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ConfigError, match="`context_parallel_size=2`: does not divide the world size 1"):
        trainer.fit(Plain(), torch.utils.data.DataLoader(torch.randn(4, 2)))
    assert not dist.is_initialized()


@pytest.mark.timeout(120)
def test_decoder_layers_reshard_after_forward_except_the_last(tmp_path):
    """FSDP2 swaps a unit's parameters back to their DTensor shards when it reshards after forward: between
    forward and backward, every decoder layer but the last is sharded with `reshard_after_forward=True`, none
    is with False, and the root (embeddings, head) stays gathered either way. One-rank gloo group on CPU."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from transformers import Gemma4ForCausalLM

    from lightning_ffpa.parallel import parallelize
    from lightning_ffpa.presets import build_text_config

    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path}/store")
    try:
        for reshard in (True, False):
            torch.manual_seed(0)
            model = parallelize(Gemma4ForCausalLM(build_text_config("tiny")), init_device_mesh("cpu", (1,)),
                                reshard_after_forward=reshard)
            logits = model(input_ids=torch.randint(0, 512, (1, 8))).logits
            sharded = [all(isinstance(p, DTensor) for p in layer.parameters()) for layer in model.model.layers]
            n = len(sharded)
            assert sharded == ([True] * (n - 1) + [False] if reshard else [False] * n), (reshard, sharded)
            assert not isinstance(model.model.embed_tokens.weight, DTensor)  # the root: gathered after forward
            logits.sum().backward()
            assert all(isinstance(p, DTensor) for p in model.parameters())  # all resharded after backward
    finally:
        dist.destroy_process_group()


_HEADS_SCRIPT = Path(__file__).with_name("_fit_heads.py")


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_trained_model_and_head_beside_a_frozen_one_stay_equal_on_every_rank(tmp_path):
    """A frozen reference built before the policy, and a value head beside it: FSDP2Strategy shards the trained
    model and the head, so the ranks, each on its own rows, end with the same weights."""
    ranks = torchrun_json(_HEADS_SCRIPT, tmp_path / "heads.json", 2, 29795, timeout=180)
    assert [r["policy_sharded"] for r in ranks] == [True, True]
    assert [r["ref_sharded"] for r in ranks] == [False, False]
    assert ranks[0]["policy_q"] == pytest.approx(ranks[1]["policy_q"], rel=1e-6)
    assert ranks[0]["value_head"] == pytest.approx(ranks[1]["value_head"], rel=1e-6)


def test_a_trainable_parameter_on_the_module_itself_is_refused_by_name():
    """FSDP2 shards modules: a bare parameter of the LightningModule would train per rank, unsynchronised."""
    import torch

    from lightning_ffpa.errors import InputError
    from lightning_ffpa.parallel.fsdp import shard_trainable_rest

    root = torch.nn.Module()
    root.temperature = torch.nn.Parameter(torch.ones(()))
    root.frozen = torch.nn.Parameter(torch.ones(()), requires_grad=False)  # never synced, never needs to be
    with pytest.raises(InputError, match=r"set on the LightningModule itself \(temperature\): put them in a submodule"):
        shard_trainable_rest(root, mesh=None)
    root.temperature.requires_grad_(False)
    assert shard_trainable_rest(root, mesh=None) == []


def test_materialize_draws_a_tied_embedding_once_and_keeps_its_pad_row_zero():
    """The tied lm_head was initialised after the embedding: its draw redrew the shared tensor, the zeroed pad row
    included (0.99 where a plain build has 0)."""
    from transformers import Gemma4ForCausalLM

    from lightning_ffpa.parallel.strategy import materialize
    from lightning_ffpa.presets import build_text_config

    config = build_text_config("tiny")
    with torch.device("meta"):
        model = Gemma4ForCausalLM(config)
    torch.manual_seed(0)
    materialize(model, torch.device("cpu"))
    embedding = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight is embedding
    assert config.pad_token_id is not None and not embedding[config.pad_token_id].any()
    assert embedding.std() > 0
