"""`ParallelDims` (sizes, layout, one-line errors) and expert parallelism: 2 gloo ranks with the experts split over
them train the tiny MoE Gemma4 like the same ranks without EP (losses and gradients)."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lightning_ffpa.errors import ConfigError
from lightning_ffpa.parallel import FSDP2Strategy, ParallelDims
from lightning_ffpa.parallel.dims import check_expert_parallel
from lightning_ffpa.presets import build_text_config

from ._launch import torchrun_json

_SCRIPT = Path(__file__).with_name("_fit_moe_ep.py")


def test_layout_without_and_with_expert_parallelism():
    plain = ParallelDims.resolve(8, context_parallel_size=2)
    assert (plain.dp, plain.cp, plain.ep, plain.world_size) == (4, 2, 1, 8)
    assert plain.mesh_dim_names == ("data_parallel", "context_parallel") and plain.mesh_shape == (4, 2)
    ep = ParallelDims.resolve(8, expert_parallel_size=4)
    assert (ep.dp, ep.cp, ep.ep, ep.dp_mod_ep) == (8, 1, 4, 2)
    # EP splits data parallelism: the expert groups (dp / ep of them) outside, the experts' ranks inside
    assert ep.mesh_dim_names == ("dp_mod_ep", "expert_parallel", "context_parallel") and ep.mesh_shape == (2, 4, 1)


@pytest.mark.timeout(60)
def test_dims_read_back_from_a_mesh(tmp_path):
    """`from_mesh`: this class's meshes give their sizes back; any other mesh is all data-parallel (FSDP2 shards
    over it flattened, as `parallelize` always did); a ring's own 1-D mesh is all context-parallel. One-rank gloo
    group on CPU."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path}/store")
    try:
        built = ParallelDims(1, 1)
        mesh = built.build_mesh("cpu")
        assert mesh.mesh_dim_names == ("data_parallel", "context_parallel")
        again = ParallelDims.from_mesh(mesh)
        assert (again.dp, again.cp, again.ep) == (1, 1, 1) and again.cp_mesh.size() == 1
        assert again.fsdp_mesh.mesh_dim_names == ("dp_cp",) and again.dp_mesh.size() == 1
        other = ParallelDims.from_mesh(init_device_mesh("cpu", (1, 1), mesh_dim_names=("data_parallel", "tp")))
        assert (other.dp, other.cp) == (1, 1) and other.fsdp_mesh.ndim == 1 and other.dp_mesh is other.fsdp_mesh
        with pytest.raises(RuntimeError, match="without a 'context_parallel' dimension"):
            other.cp_mesh  # noqa: B018
        ring = ParallelDims.from_mesh(init_device_mesh("cpu", (1,), mesh_dim_names=("context_parallel",)))
        assert (ring.dp, ring.cp) == (1, 1) and ring.cp_mesh.size() == 1
        with pytest.raises(RuntimeError, match="no expert-parallel dimension"):
            built.ep_mesh  # noqa: B018
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world, kwargs, message", [
    (8, dict(context_parallel_size=3), r"^`context_parallel_size=3`: does not divide the world size 8 "),
    (8, dict(data_parallel_size=2, context_parallel_size=2),
     r"^`data_parallel_size=2`: times `context_parallel_size=2` is 4, not the world size 8 "),
    (6, dict(expert_parallel_size=4), r"^`expert_parallel_size=4`: does not divide the data-parallel size 6 "),
    (4, dict(expert_parallel_size=2, context_parallel_size=2),
     r"^`expert_parallel_size=2`: cannot be combined with `context_parallel_size=2` yet"),
])
def test_bad_sizes_name_the_option(world, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ParallelDims.resolve(world, **kwargs)


def test_expert_parallel_needs_a_moe_model_whose_experts_it_divides():
    check_expert_parallel(1, build_text_config("tiny"))  # EP off: any model
    check_expert_parallel(2, build_text_config("tiny-moe"))  # 4 experts, 2 per rank
    with pytest.raises(ConfigError, match=r"^`expert_parallel_size=2`: needs a MoE model .* is dense"):
        check_expert_parallel(2, build_text_config("tiny"))
    with pytest.raises(ConfigError, match=r"^`expert_parallel_size=3`: does not divide the model's num_experts=4"):
        check_expert_parallel(3, build_text_config("tiny-moe"))


def test_the_strategy_checks_expert_parallel_size_before_any_process_starts():
    with pytest.raises(ConfigError, match=r"^`expert_parallel_size=0`: must be a positive int"):
        FSDP2Strategy(expert_parallel_size=0)
    with pytest.raises(ConfigError, match=r"^`expert_parallel_size=2`: cannot be combined with `context_parallel"):
        FSDP2Strategy(expert_parallel_size=2, context_parallel_size=2)
    strategy = FSDP2Strategy(expert_parallel_size=2)
    assert strategy.expert_parallel_size == 2
    # the pre-flight (and setup_environment) reads the module's config and LoRA options before the model is built
    with pytest.raises(ConfigError, match="needs a MoE model"):
        strategy.resolve_dims(2, SimpleNamespace(config=build_text_config("tiny")))
    moe = SimpleNamespace(config=build_text_config("tiny-moe"), hparams={"lora": {"r": 2}})
    assert strategy.resolve_dims(2, moe).ep == 2  # LoRA on attention and dense MLPs: the experts stay whole stacks
    moe.hparams["lora"]["target_parameters"] = ["experts.gate_up_proj"]
    with pytest.raises(ConfigError, match=r"not supported with LoRA on the expert stacks"):
        strategy.resolve_dims(2, moe)
    assert strategy.resolve_dims(2, SimpleNamespace()).ep == 2  # no config yet: parallelize checks the model


_TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="EP=2 on GPUs needs 2")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("nproc, port, experts, accelerator", [
    pytest.param(2, 29781, "grouped_mm", "cpu", marks=pytest.mark.slow),
    pytest.param(4, 29785, "eager", "cpu", marks=pytest.mark.slow),
    pytest.param(2, 29789, "grouped_mm", "gpu", marks=[pytest.mark.gpu, _TWO_GPUS]),
])
def test_ep2_trains_like_ep1(tmp_path, nproc, port, experts, accelerator):
    """Same checkpoint, ranks and data: EP=2 (each rank owns 2 of the 4 experts of each MoE layer, tokens
    all-to-all'd) against EP=1 (FSDP2 over every weight), on 2 gloo ranks (one expert group; grouped GEMMs for
    the experts, as HF's default) and on 4 (two groups holding the same experts, whose gradients are summed;
    HF's eager experts, the loop); on 2 GPUs (NCCL, compiled layers around the eager dispatch) too. Two AdamW steps with the gradient norm clipped (as the
    recipes do, over both meshes' gradients): the losses, and each step's clipped gradients of the expert stacks
    (gathered whole) and of the routers, agree; the first loss is HF's own (eager experts)."""
    from transformers import Gemma4ForCausalLM

    torch.manual_seed(0)
    ref = Gemma4ForCausalLM(build_text_config("tiny-moe", num_hidden_layers=2))
    ref.save_pretrained(tmp_path / "tiny-moe")
    clip = 0.05  # below the gradients' norm at both steps: every gradient is scaled
    resume = nproc == 2 and accelerator == "cpu"  # one case checks checkpoints: saved under EP=2, loaded under both
    runs = torchrun_json(_SCRIPT, tmp_path / "ep.json", nproc, port, tmp_path / "tiny-moe", experts, accelerator,
                         clip, *([tmp_path / "ckpt"] if resume else []), timeout=240)
    one, two = runs["1"], runs["2"]
    assert one["first_batch"] == two["first_batch"]
    ref.config._attn_implementation = "eager"
    ref.config._experts_implementation = "eager"
    want = ref(**{k: torch.tensor(v) for k, v in two["first_batch"].items()}).loss.item()
    assert two["losses"][0] == pytest.approx(want, abs=1e-5 if accelerator == "cpu" else 1e-4)  # HF ran on CPU
    assert one["mesh_dims"] == ["data_parallel", "context_parallel"] and one["ep_modules"] == 0
    assert two["mesh_dims"] == ["dp_mod_ep", "expert_parallel", "context_parallel"]
    assert two["ep_modules"] == 2 and (two["stack_rows"], two["stack_local_rows"]) == (4, 2)
    assert len(two["stats"]) == nproc
    path = "grouped_mm" if experts == "grouped_mm" else "loop"
    for rank_stats in two["stats"]:  # each rank sent tokens to the other's experts and kept some for its own
        assert all(s["rows_sent"] > 0 and s["rows_kept"] > 0 for s in rank_stats), two["stats"]
        assert all(s[path] == s["forwards"] > 0 for s in rank_stats), two["stats"]
    assert len(one["losses"]) == len(two["losses"]) == 2
    for a, b in zip(one["losses"], two["losses"]):
        assert a == pytest.approx(b, abs=1e-5)
    assert len(one["grads"]) == len(two["grads"]) == 2
    assert one["grad_norms"] == pytest.approx([clip] * 2, rel=1e-5)  # clipped to the global norm, on both meshes
    assert two["grad_norms"] == pytest.approx([clip] * 2, rel=1e-5)
    for step, (g1, g2) in enumerate(zip(one["grads"], two["grads"])):
        assert sorted(g1) == sorted(g2) and any("experts.gate_up_proj" in n for n in g1)
        for name in g1:
            want, got = torch.tensor(g1[name]), torch.tensor(g2[name])
            assert want.abs().max() > 0, name
            # fp32 sums in another order; the second step's gradients also carry the first AdamW step's rounding
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4 * float(want.abs().max()),
                                       msg=lambda m, n=name, s=step: f"step {s} {n}: {m}")
    if resume:  # the EP=2 run's DCP checkpoint (expert stacks on the EP mesh) resumes the same under EP=1 and EP=2
        one, two = runs["resumed_1"], runs["resumed_2"]
        assert len(one["losses"]) == len(two["losses"]) == 2  # steps 3 and 4: weights, then AdamW's moments
        assert one["losses"] == pytest.approx(two["losses"], abs=1e-5)
        assert two["losses"][0] != pytest.approx(runs["2"]["losses"][0], abs=1e-3)  # trained weights were loaded


def test_frozen_base_line_counts_the_expert_stacks_apart(caplog):
    """Under expert parallelism with LoRA on attention, the start-up line said every frozen parameter was
    "sharded by FSDP2", expert stacks included, which expert parallelism splits itself."""
    import logging

    import transformers

    from lightning_ffpa.lora import apply_lora

    model = apply_lora(transformers.Gemma4ForCausalLM(build_text_config("tiny-moe")),
                       {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]})
    strategy = FSDP2Strategy(expert_parallel_size=2)
    strategy._parallel_dims = SimpleNamespace(ep=2)
    strategy._device_mesh = SimpleNamespace(size=lambda: 2)
    strategy._lightning_module = SimpleNamespace(hparams={})
    frozen = [p for p in model.parameters() if not p.requires_grad]
    with caplog.at_level(logging.INFO):
        strategy.place_frozen(model)
    stacks = 2 * sum(1 for m in model.modules() if type(m).__name__.endswith("Experts"))
    assert stacks and strategy.frozen_placement["params"] == len(frozen) - stacks
    assert f"; {stacks} frozen expert stacks (" in caplog.text and "expert_parallel_size=2 instead" in caplog.text
