"""The engine's logprobs are those of the policy: at Gemma4-31B's attention shapes (head_dim 256 and 512, 32
query heads, 16 and 4 KV heads, K=V on the full layer), an HF forward over prompt + the engine's tokens gives
the logprobs the engine recorded (fp32, CPU, flex's eager path). GRPO's importance ratio divides by these.

The MLP, vocabulary and window are shrunk so the test is fast and the window engages (40 + 24 tokens against
a 32-token window, 16-token pages); the embedding's init is small so the next-token distribution is not
saturated by the tied embedding (a saturated one has logprob 0 everywhere and would hide a wrong attention).
"""

import pytest
import torch
from transformers import Gemma4ForCausalLM

from lightning_ffpa.presets import build_text_config
from lightning_ffpa.rollout.engine import EngineConfig, RolloutEngine
from lightning_ffpa.rollout.sampler import SamplingParams

PROMPT, NEW, PAGE, WINDOW = 40, 24, 16, 32


def _model():
    cfg = build_text_config("gemma4-31b", num_hidden_layers=2, intermediate_size=512, vocab_size=4096,
                            sliding_window=WINDOW)
    assert cfg.layer_types == ["sliding_attention", "full_attention"]
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 5e-4 if "embed" in name else 0.02)
            elif "norm" in name:
                p.fill_(1.0)
    model.generation_config.eos_token_id = None
    return model, cfg


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_p=1.0)],
                         ids=["greedy", "sampled"])
def test_engine_logprobs_match_hf_at_31b_attention_shapes(sampling):
    model, cfg = _model()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, cfg.vocab_size, (PROMPT,), generator=g).tolist() for _ in range(2)]
    pages = -(-(PROMPT + NEW) // PAGE)
    eng = RolloutEngine(model, EngineConfig(page_size=PAGE, num_pages=2 * pages + 2, max_batch_size=2,
                                            max_seq_len=pages * PAGE, max_prefill_tokens=256))
    seqs = eng.generate(prompts, NEW, sampling, generator=torch.Generator().manual_seed(2))
    for prompt, seq in zip(prompts, seqs):
        full = torch.tensor([prompt + seq.output])
        with torch.no_grad():
            logits = model(input_ids=full, use_cache=False).logits[0, PROMPT - 1:-1].float()
        hf = torch.log_softmax(logits, -1).gather(1, full[0, PROMPT:, None])[:, 0]
        assert hf.max() < -1.0  # not saturated: attention moves these numbers
        torch.testing.assert_close(torch.tensor(seq.logprobs), hf, atol=1e-4, rtol=0)
