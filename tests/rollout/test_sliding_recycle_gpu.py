"""GPU: sliding-window KV recycling under the compiled decode step and CUDA graphs, against HF.

A tiny Gemma4 with a 32-token window and 16-token pages (flex's decode tiles) decodes ten windows past prompts
shorter and longer than the window, on scrambled pages: fp32 is token-identical to HF greedy with logprobs close;
in bf16 the engine's logprobs differ from an HF forward over its own tokens by no more than HF's `generate` and
forward differ from each other (a few times over: the spread bf16 gives HF itself). The graphs are captured once and replayed
while the sliding table's pages are released and reused in place; a sliding pool short of two windows forces
preemption and recompute under the same graphs. The weights are drawn so the next-token distribution is not flat
(a flat one hides a wrong attention read, as in `test_logprob_parity.py`).
"""

import pytest
import torch
from _scramble import scrambled

from lightning_ffpa.presets import build_text_config
from lightning_ffpa.rollout.engine import EngineConfig, RolloutEngine
from lightning_ffpa.rollout.page_table import window_pages

pytestmark = pytest.mark.gpu

WINDOW, PAGE, NEW = 32, 16, 320
PER_SEQ = window_pages(WINDOW, PAGE, PAGE)
MAX_LEN = 384


def _model(dtype):
    from transformers import Gemma4ForCausalLM

    torch.manual_seed(0)
    model = Gemma4ForCausalLM(build_text_config("tiny", sliding_window=WINDOW)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.1 if "embed" in name else 0.02)
            elif "norm" in name:
                p.fill_(1.0)
    model.generation_config.eos_token_id = None
    return model.to("cuda", dtype)


def _prompts(lens=(5, 45, 17, 60), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 512, (n,), generator=g).tolist() for n in lens]


def _cfg(**kw):
    return EngineConfig(**{**dict(page_size=PAGE, num_pages=4 * (MAX_LEN // PAGE) + 2, max_batch_size=4,
                                  max_seq_len=MAX_LEN), **kw})


def _hf_logprobs(model, prompt, output):
    ids = torch.tensor([prompt + output], device="cuda")
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt):, None])[:, 0].cpu()


def _check_pages(eng):
    stats = eng.stats
    assert eng.decode_path == "compiled" and stats["graph_replays"] > 0 and stats["eager_decodes"] == 0
    assert 0 < stats["sliding_pages_per_seq_peak"] <= PER_SEQ < stats["kv_pages_per_seq_peak"]
    assert stats["sliding_pages_recycled"] > 0
    eng.pages.flush()
    eng.pages.check_invariants()
    assert all(t.num_free_pages == t.num_pages - 1 for t in eng.pages.tables)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("tight", [False, True], ids=["roomy", "tight_sliding_pool"])
def test_compiled_graphs_with_recycling_match_hf_greedy_fp32(tight):
    model = _model(torch.float32)
    prompts = _prompts()
    eng = scrambled(RolloutEngine(model, _cfg(num_sliding_pages=PER_SEQ + 2 if tight else None)))
    seqs = eng.generate(prompts, NEW)
    if tight:
        assert eng.stats["preemptions"] > 0
    for p, seq in zip(prompts, seqs):
        ref = model.generate(torch.tensor([p], device="cuda"), max_new_tokens=NEW, do_sample=False, pad_token_id=0)
        assert seq.output == ref[0, len(p):].tolist(), f"prompt {seq.seq_id} diverged"
        hf = _hf_logprobs(model, p, seq.output)
        assert hf.max() < -0.5  # not saturated: a wrong attention read would move these
        torch.testing.assert_close(torch.tensor(seq.logprobs), hf, atol=2e-3, rtol=0)
    _check_pages(eng)


def _hf_generate_logprobs(model, prompt):
    out = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):]
    logits = torch.stack(out.logits)[:, 0].float()  # (NEW, V)
    return tokens.tolist(), torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0].cpu()


@pytest.mark.timeout(900)
def test_compiled_graphs_with_recycling_bf16_logprobs_match_hf_on_its_tokens():
    model = _model(torch.bfloat16)
    prompts = _prompts(seed=1)
    eng = scrambled(RolloutEngine(model, _cfg()), seed=1)
    seqs = eng.generate(prompts, NEW)
    ours, noise = [], []
    for p, seq in zip(prompts, seqs):
        lp = torch.tensor(seq.logprobs)
        assert torch.isfinite(lp).all()
        ours.append((lp - _hf_logprobs(model, p, seq.output)).abs())
        tokens, generated = _hf_generate_logprobs(model, p)
        noise.append((generated - _hf_logprobs(model, p, tokens)).abs())
    ours, noise = torch.cat(ours), torch.cat(noise)
    # A released page read as live would put another sequence's (or page 0's) keys in the window: nats off, where
    # bf16 paths differ by hundredths: 0.044 mean on an H100 against HF's own generate-vs-forward 0.008
    # (benchmarks/results/logs/gpu_tests_16378be_h100.log), 0.032 against 0.010 on the CPU. The fp32 tests above
    # check the recycling token for token; this one bounds the bf16 drift absolutely.
    assert noise.mean() < 0.05 and ours.mean() < 0.1, (ours.mean(), noise.mean())
    assert ours.max() < 1.0, ours.max()
    _check_pages(eng)
