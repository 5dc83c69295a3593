"""Pipelined decode (one-step-late readback) gives exactly the synchronous engine's outputs, and no engine
entry point runs the model with autograd recording (CPU; the dense reference path keeps it fast)."""

import pytest
import torch
from transformers import Gemma4ForCausalLM

from lightning_ffpa.presets import build_text_config
from lightning_ffpa.rollout.engine import EngineConfig, RolloutEngine
from lightning_ffpa.rollout.sampler import SamplingParams


@pytest.fixture(scope="module")
def gemma():
    torch.manual_seed(0)
    return Gemma4ForCausalLM(build_text_config("tiny")).eval()


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 512, (int(k),), generator=g).tolist() for k in torch.randint(3, 14, (n,), generator=g)]


def _cfg(**kw):
    base = dict(page_size=4, num_pages=64, max_batch_size=4, max_seq_len=64, max_prefill_tokens=64,
                attention="dense")
    return EngineConfig(**{**base, **kw})


def _run(model, prompts, new, eos, **kw):
    eng = RolloutEngine(model, _cfg(**kw), eos_token_ids=eos)
    seqs = eng.generate(prompts, new)
    eng.page_table.flush()
    eng.page_table.check_invariants()
    assert eng.page_table.num_free_pages == eng.config.num_pages - 1
    assert all(s.num_pending == 0 for s in seqs)
    return [(s.output, s.logprobs, s.finish_reason) for s in seqs], eng


def _eos_from_free_run(model, prompts, new):
    """Pick EOS ids that greedy decoding really emits mid-completion, from a run without EOS."""
    free, _ = _run(model, prompts, new, None, pipeline=False)
    eos = {free[0][0][3], free[2][0][7]}
    return free, eos


def _truncate(out, eos):
    toks, lps, _ = out
    for i, t in enumerate(toks):
        if t in eos:
            return toks[: i + 1], lps[: i + 1], "stop"
    return toks, lps, "length"


@pytest.mark.parametrize("extra", [{}, {"num_pages": 14}], ids=["roomy", "preempting"])
def test_eos_one_step_late_equals_synchronous(gemma, extra):
    prompts = _prompts(7)  # more prompts than batch slots: finishing rows let waiting ones in
    free, eos = _eos_from_free_run(gemma, prompts, 20)
    sync, _ = _run(gemma, prompts, 20, eos, pipeline=False, **extra)
    late, eng = _run(gemma, prompts, 20, eos, pipeline=True, **extra)
    # Tokens and stop reasons are exact; logprobs agree to fp32 rounding (rows batch differently).
    expect = [_truncate(o, eos) for o in free]  # stops exactly at the first EOS, extra token discarded
    for got, ref, want in zip(late, sync, expect):
        assert (got[0], got[2]) == (ref[0], ref[2]) == (want[0], want[2])
        torch.testing.assert_close(torch.tensor(got[1]), torch.tensor(ref[1]), rtol=0, atol=1e-5)
    assert any(r == "stop" for _, _, r in late) and any(r == "length" for _, _, r in late)
    assert eng.stats["syncs"] > 0  # admissions after a late-seen stop went through a sync
    if extra:
        assert eng.stats["preemptions"] > 0


def test_last_rows_stopping_on_eos_leave_nothing_in_flight(gemma):
    prompts = _prompts(1, seed=2)
    free, _ = _run(gemma, prompts, 12, None, pipeline=False)
    eos = {free[0][0][4]}  # the only row stops while its next step is already queued
    late, eng = _run(gemma, prompts, 12, eos, pipeline=True)
    assert late[0][0] == _truncate(free[0], eos)[0] and late[0][2] == "stop"
    assert eng.stats["decode_steps"] == free[0][0].index(free[0][0][4]) + 1  # one extra, discarded step


def test_pipelined_sampling_is_seeded_like_synchronous(gemma):
    prompts = _prompts(3, seed=1)
    params = SamplingParams(temperature=0.9, top_k=20)
    outs = []
    for pipeline in (False, True, True):
        eng = RolloutEngine(gemma, _cfg(pipeline=pipeline))
        seqs = eng.generate(prompts, 10, params, generator=torch.Generator().manual_seed(5))
        outs.append([s.output for s in seqs])
    # without EOS no step is wasted, so both modes draw the same noise in the same order
    assert outs[0] == outs[1] == outs[2]


def test_each_step_is_issued_before_the_previous_one_is_read(gemma, monkeypatch):
    from lightning_ffpa.rollout import engine as engine_mod

    eng = RolloutEngine(gemma, _cfg())
    issued_at_read = []
    apply = engine_mod._Readback.apply

    def spy(self, sched):
        issued_at_read.append(eng.stats["decode_steps"])
        return apply(self, sched)

    monkeypatch.setattr(engine_mod._Readback, "apply", spy)
    eng.generate(_prompts(3), 8)  # no EOS: one prefill, then 7 decode steps, the last read by the final sync
    assert eng.stats["decode_steps"] == 7 and eng.stats["syncs"] == 1
    # prefill read at 0 issued; decode step k (1-based) is read once step k+1 is queued; step 7 at the sync
    assert issued_at_read == [0, 2, 3, 4, 5, 6, 7, 7]


def test_entry_points_never_record_autograd(gemma, monkeypatch):
    assert all(p.requires_grad for p in gemma.parameters())  # a training model's params
    eng = RolloutEngine(gemma, _cfg())
    seen = []
    forward = eng.walker.logits

    def spy(*args, **kwargs):
        logits = forward(*args, **kwargs)
        seen.append((torch.is_grad_enabled(), torch.is_inference_mode_enabled(), logits.grad_fn))
        return logits

    monkeypatch.setattr(eng.walker, "logits", spy)
    eng.generate(_prompts(2), 6)
    assert seen and all(s == (False, True, None) for s in seen)
    # capture_all is CUDA-only; pretend so and check the graph builder is reached in inference mode
    captured = []
    monkeypatch.setattr(eng, "on_cuda", True)
    monkeypatch.setattr(eng, "_graph", lambda b, s: captured.append((b, torch.is_grad_enabled(),
                                                                      torch.is_inference_mode_enabled())))
    eng.capture_all(SamplingParams(temperature=0.5))
    assert captured == [(b, False, True) for b in eng.buckets]


def test_decode_step_traces_as_one_graph_with_the_same_outputs(monkeypatch):
    """What `compile_decode` compiles on CUDA, traced by dynamo on CPU (eager backend: no codegen)."""
    import torch._dynamo.testing

    torch.manual_seed(0)
    model = Gemma4ForCausalLM(build_text_config("tiny")).eval()
    prompts = _prompts(3, seed=4)
    cfg = dict(page_size=16, num_pages=16, max_batch_size=4, max_seq_len=64, attention="flex")
    plain = [s.output for s in RolloutEngine(model, _cfg(**cfg)).generate(prompts, 6)]
    eng = RolloutEngine(model, _cfg(**cfg))
    torch._dynamo.reset()
    counts = torch._dynamo.testing.CompileCounter()  # counts graphs dynamo hands to the backend
    monkeypatch.setattr(eng, "_step", torch.compile(eng._decode_step, backend=counts, dynamic=False))
    assert [s.output for s in eng.generate(prompts, 6)] == plain
    assert counts.frame_count == 1  # one bucket, one graph: no graph breaks, no recompiles across steps


def _decode_batches(eng, monkeypatch) -> list[int]:
    """Spy: the batch (bucket) of every decode step the engine runs."""
    seen, step = [], eng._step
    monkeypatch.setattr(eng, "_step", lambda pos, slots, *a: seen.append(len(pos)) or step(pos, slots, *a))
    return seen


@pytest.mark.parametrize("buckets, used", [(None, {1, 2, 4}), ([], {4}), ([2], {2, 4})])
def test_decode_buckets_pad_a_shrinking_batch_to_the_chosen_sizes_with_the_same_tokens(gemma, monkeypatch,
                                                                                         buckets, used):
    """Rows finish at different steps (EOS), so the batch shrinks: each step runs at the smallest chosen bucket that
    holds it (`max_batch_size` always one), and padding changes no token."""
    prompts = _prompts(4, seed=2)
    free, eos = _eos_from_free_run(gemma, prompts, 16)
    eng = RolloutEngine(gemma, _cfg(decode_buckets=buckets), eos_token_ids=eos)
    batches = _decode_batches(eng, monkeypatch)
    seqs = eng.generate(prompts, 16)
    assert set(batches) == used and batches == sorted(batches, reverse=True)
    for s, f in zip(seqs, free):
        want_tokens, want_lps, reason = _truncate(f, eos)
        assert (s.output, s.finish_reason) == (want_tokens, reason)
        torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(want_lps), atol=1e-5, rtol=1e-5)
    captured = []
    monkeypatch.setattr(eng, "on_cuda", True)  # capture_all is CUDA-only: it captures the chosen buckets alone
    monkeypatch.setattr(eng, "_graph", lambda b, s: captured.append(b))
    eng.capture_all(SamplingParams())
    assert captured == eng.buckets == sorted(used)


@pytest.mark.parametrize("bad", [[0], [5], "4", [True], [2.0]])
def test_decode_buckets_out_of_range_is_one_error_naming_the_option(bad):
    from lightning_ffpa.errors import ConfigError

    with pytest.raises(ConfigError, match=r"engine\.decode_buckets.*max_batch_size=4"):
        _cfg(decode_buckets=bad).check()
