"""`FSDP2Strategy(replicate_frozen=...)`: a LoRA's frozen base stays out of FSDP2, whole and tied, and the fit,
its checkpoint and its resume are those of the sharded base (the real strategy and module on CPU: one process,
and two ranks under torchrun for `True`)."""


import socket
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from transformers import Gemma4ForCausalLM

from lightning_ffpa.parallel import FSDP2Strategy
from lightning_ffpa.presets import build_text_config

from ._fit_replicated import fit as _fit
from ._fit_replicated import seeded_weights
from ._launch import torchrun_json


@pytest.mark.timeout(300)
def test_auto_keeps_the_frozen_base_whole_and_tied_and_trains_as_the_sharded_base(one_process, pretrained, tmp_path):
    sharded, s_strategy = _fit(pretrained, tmp_path / "shard", False)
    dist.destroy_process_group()
    whole, w_strategy = _fit(pretrained, tmp_path / "auto", "auto")
    assert not s_strategy.frozen_placement["replicated"]  # "auto" on a mesh of one, the base in param_dtype:
    placed = w_strategy.frozen_placement
    assert placed["replicated"] and placed["reason"] == "auto: a mesh of one device" and placed["params"] > 0
    assert sharded.layout["sharded_frozen"] > 0 and whole.layout["sharded_frozen"] == 0
    assert whole.layout["sharded_trainable"] == whole.layout["trainable"] > 0  # the adapters stay with FSDP2
    assert sharded.layout["tied"] and whole.layout["tied"]  # lm_head is the embedding after materialisation
    assert whole.losses == pytest.approx(sharded.losses, abs=1e-5), (whole.losses, sharded.losses)
    # The checkpoint resumes into the same layout and goes on as an uninterrupted run does.
    dist.destroy_process_group()
    last = str(tmp_path / "auto" / "ckpt" / "last.ckpt")
    resumed, _ = _fit(pretrained, tmp_path / "auto", "auto", steps=4, ckpt_path=last)
    dist.destroy_process_group()
    straight, _ = _fit(pretrained, tmp_path / "straight", "auto", steps=4)
    assert resumed.layout["sharded_frozen"] == 0 and straight.losses[:3] == whole.losses
    assert resumed.losses == straight.losses[3:], (resumed.losses, straight.losses)
    # A checkpoint saved with the base sharded (the default before "auto") resumes into the whole base.
    dist.destroy_process_group()
    moved, _ = _fit(pretrained, tmp_path / "shard", "auto", steps=4,
                    ckpt_path=str(tmp_path / "shard" / "ckpt" / "last.ckpt"))
    assert moved.layout["sharded_frozen"] == 0
    assert moved.losses == pytest.approx(straight.losses[3:], abs=1e-5), (moved.losses, straight.losses)


def test_bad_values_name_the_option():
    with pytest.raises(ValueError, match="replicate_frozen='yes'"):
        FSDP2Strategy(replicate_frozen="yes")
    with pytest.raises(ValueError, match="replicate_frozen=True.*cpu_offload=True"):
        FSDP2Strategy(replicate_frozen=True, cpu_offload=True)


@pytest.mark.parametrize("mode, offload, mesh, dtype, want", [
    ("auto", False, 1, torch.bfloat16, (True, "auto: a mesh of one device")),
    ("auto", True, 1, torch.bfloat16, (False, "auto: cpu_offload keeps weights in host memory")),
    ("auto", False, 8, torch.bfloat16, (False, "auto: a mesh of 8 devices, where sharding the base saves memory")),
    ("auto", False, 1, torch.float32, (False, "auto: the frozen base is float32 and param_dtype bfloat16")),
    (True, False, 8, torch.bfloat16, (True, "replicate_frozen=true")),
    (False, False, 1, torch.bfloat16, (False, "replicate_frozen=false")),
])
def test_the_plan_says_why(mode, offload, mesh, dtype, want):
    """"auto" keeps the frozen base whole only where that costs nothing and changes no numerics."""
    from lightning_ffpa.parallel.strategy import plan_replicate_frozen

    frozen = list(torch.nn.Linear(4, 4, dtype=dtype).requires_grad_(False).parameters())
    assert plan_replicate_frozen(mode, offload, mesh, frozen, torch.bfloat16) == want
    assert plan_replicate_frozen(mode, offload, mesh, [], torch.bfloat16) == (False, "no frozen parameters")


def test_frozen_weights_in_another_dtype_than_the_compute_dtype_are_refused():
    from lightning_ffpa.parallel.fsdp import frozen_params

    model = torch.nn.Linear(4, 4).requires_grad_(False)
    with pytest.raises(ValueError, match=r"replicate_frozen.*\['torch.float32'\].*param_dtype"):
        frozen_params(model, torch.bfloat16, cpu_offload=False)
    with pytest.raises(ValueError, match="replicate_frozen.*cpu_offload=True"):
        frozen_params(model, None, cpu_offload=True)
    assert frozen_params(model, torch.float32, cpu_offload=False) == set(model.parameters())


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_true_on_two_ranks_keeps_the_base_whole_on_each_and_trains_as_the_sharded_base(pretrained, tmp_path):
    got = torchrun_json(Path(__file__).with_name("_fit_replicated.py"), tmp_path / "out.json", 2, 29811,
                        pretrained, "false,true", timeout=380)
    sharded, whole = got["false"], got["true"]
    assert sharded["layout"]["sharded_frozen"] > 0 and not sharded["layout"]["frozen_whole"]
    assert whole["layout"]["sharded_frozen"] == 0 and whole["layout"]["frozen_whole"] and whole["layout"]["tied"]
    assert whole["layout"]["sharded_trainable"] == whole["layout"]["trainable"] > 0
    assert whole["losses"] == pytest.approx(sharded["losses"], abs=1e-5), (whole["losses"], sharded["losses"])


@pytest.mark.gpu
def test_on_cuda_with_compiled_layers_the_step_matches_and_the_base_is_not_copied():
    """CUDA, bf16 base, compiled layers (as the strategy builds them on a GPU): the same loss and adapter
    gradients as the sharded base, and a peak lower by at least the root unit's gathered copy."""
    import transformers
    from peft import LoraConfig, get_peft_model

    from lightning_ffpa._compat.transformers import from_config
    from lightning_ffpa.parallel import parallelize
    from lightning_ffpa.parallel.dims import ParallelDims
    from lightning_ffpa.parallel.strategy import materialize

    if not dist.is_initialized():
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    mesh = ParallelDims(1, 1).build_mesh("cuda")
    cfg = build_text_config("tiny", vocab_size=65536)  # a root unit large enough to see in the peak

    def step(replicate: bool):
        torch.manual_seed(0)
        with torch.device("meta"):
            model = from_config(transformers.Gemma4ForCausalLM, cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"]))
        parallelize(model, mesh, activation_checkpointing="full", compile=True, replicate_frozen=replicate,
                    mp_policy=FSDP2Strategy(param_dtype="bf16").mp_policy())
        materialize(model, torch.device("cuda"))
        seeded_weights(model, seed=0, scale=0.02)
        ids = torch.randint(0, cfg.vocab_size, (1, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                 for p in model.parameters() if p.requires_grad]
        return loss.item(), grads, torch.cuda.max_memory_allocated() - base

    loss, grads, peak = step(False)
    loss_r, grads_r, peak_r = step(True)
    root = cfg.vocab_size * cfg.hidden_size * 2  # the embedding (= lm_head) in bf16
    assert loss_r == pytest.approx(loss, rel=1e-3)
    assert all(torch.allclose(a.float(), b.float(), rtol=2e-2, atol=1e-3) for a, b in zip(grads, grads_r))
    assert peak_r <= peak - root // 2, (peak, peak_r, root)



def test_auto_keeps_an_fp8_base_whole_on_any_mesh():
    """`model.lora.base_dtype: fp8` is never sharded: "auto" keeps it whole even where it would shard a bf16 base
    (an explicit `false` is refused by the module, naming the option: tests/model/test_fp8_base_ckpt.py)."""
    from lightning_ffpa.parallel.strategy import plan_replicate_frozen

    frozen = list(torch.nn.Linear(4, 4, dtype=torch.bfloat16).requires_grad_(False).parameters())
    want = (True, "auto: model.lora.base_dtype fp8 keeps the float8 base whole")
    assert plan_replicate_frozen("auto", False, 8, frozen, torch.bfloat16, fp8_base=True) == want
    assert plan_replicate_frozen("auto", False, 8, frozen, torch.bfloat16)[0] is False


class _OwnLoraModule(L.LightningModule):
    """A user's module: peft LoRA of its own, and a `lora` hyper-parameter of its own meaning (a switch)."""

    def __init__(self, lora: bool = True):
        super().__init__()
        self.save_hyperparameters()
        self.net = None

    def configure_model(self):
        from peft import LoraConfig, get_peft_model

        if self.net is None:
            torch.manual_seed(0)
            self.net = get_peft_model(Gemma4ForCausalLM(build_text_config("tiny")),
                                      LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))

    def training_step(self, batch, batch_idx):
        return self.net(input_ids=batch[0], labels=batch[0], use_cache=False).loss

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.01)


@pytest.mark.timeout(120)
def test_a_users_own_lora_hyper_parameter_is_not_read_as_the_products(one_process, tmp_path):
    """`FSDP2Strategy` read any `hparams["lora"]` as lightning-ffpa's options (`lora.get`): a module with
    `lora=True` died on every rank with an AttributeError. Only a mapping of LoRA options counts."""
    from torch.utils.data import DataLoader, TensorDataset

    data = DataLoader(TensorDataset(torch.randint(0, 512, (4, 16), generator=torch.Generator().manual_seed(0))),
                      batch_size=2)
    strategy = FSDP2Strategy(param_dtype="fp32", reduce_dtype="fp32", replicate_frozen="auto")
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path)
    trainer.fit(_OwnLoraModule(), data)
    assert trainer.global_step == 2 and strategy.frozen_placement["params"] > 0
