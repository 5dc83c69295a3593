"""Chunked token log-probs: values, entropies and gradients equal the full-logits path (softcap, temperature,
LoRA), and the (tokens x vocab) logits never exist: autograd saves nothing of that size and the peak memory of
a large-vocabulary forward+backward stays far below one full logits matrix."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from lightning_ffpa.rl.logprobs import chunked_token_logprobs, full_token_logprobs
from lightning_ffpa.rl.module import GRPOModule

LORA = {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "o_proj"]}


def _full(h, w, y, softcap, temperature):
    z = (h @ w.t()).double()
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    logp = torch.log_softmax(z / temperature, -1)
    return logp.gather(1, y[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("softcap, temperature, chunk", [(30.0, 1.0, 7), (None, 0.7, 16), (5.0, 1.3, 100)])
def test_chunked_logprobs_match_full_logits(softcap, temperature, chunk):
    torch.manual_seed(0)
    h = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(300, 16, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 300, (37,))
    g = torch.randn(37, dtype=torch.float64)
    logp, ent = chunked_token_logprobs(h, w, y, softcap=softcap, temperature=temperature, chunk_size=chunk)
    (logp.double() * g).sum().backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    ref, ref_ent = _full(h, w, y, softcap, temperature)
    (ref * g).sum().backward()
    torch.testing.assert_close(logp.double(), ref, atol=1e-5, rtol=1e-5)  # the chunk math runs in fp32
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(gh, h.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(gw, w.grad, atol=1e-5, rtol=1e-4)
    assert not ent.requires_grad


def test_module_logprobs_match_the_full_logits_path_with_lora():
    """GRPOModule's chunked log-probs (hidden states without the lm_head, Gemma4's softcap, temperature) equal
    HF's full logits on the completion tokens, and so do the LoRA gradients."""
    torch.manual_seed(0)
    module = GRPOModule(preset="tiny", config_overrides={"num_hidden_layers": 2}, lora=LORA, temperature=0.8,
                        logprob_chunk_size=5)
    module.configure_model()
    ids = torch.randint(3, 512, (3, 12))
    comp = torch.zeros_like(ids)
    comp[:, 4:] = 1
    comp[2, 9:] = 0  # a shorter completion
    attn = torch.ones_like(ids)
    attn[2, 9:] = 0
    batch = {"input_ids": ids, "attention_mask": attn, "completion_mask": comp}
    mask = comp[:, 1:].bool()
    logp, _ = module.token_logprobs(batch)
    (logp * mask).sum().backward()
    lora = {n: p.grad.clone() for n, p in module.model.named_parameters() if p.requires_grad}
    module.model.zero_grad()
    ref = full_token_logprobs(module.model, batch, 0.8)
    (ref * mask).sum().backward()
    torch.testing.assert_close(logp[mask], ref[mask], atol=1e-5, rtol=1e-5)
    assert logp[~mask].abs().max() == 0  # only completion tokens are scored
    assert lora and all(torch.allclose(lora[n], p.grad, atol=1e-5, rtol=1e-4)
                        for n, p in module.model.named_parameters() if p.requires_grad)


def test_autograd_saves_nothing_of_tokens_x_vocab():
    torch.manual_seed(0)
    m, v, hdim = 64, 4096, 8
    h = torch.randn(m, hdim, requires_grad=True)
    w = torch.randn(v, hdim, requires_grad=True)
    y = torch.randint(0, v, (m,))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        logp, _ = chunked_token_logprobs(h, w, y, softcap=30.0, chunk_size=8)
        full = torch.log_softmax(h @ w.t(), -1).gather(1, y[:, None])  # what the full path saves
    assert max(saved[:4]) == v * hdim  # the weight itself; per-token state is O(tokens)
    assert max(saved[4:]) == m * v  # the check can fail: the full path saves (tokens x vocab)
    logp.sum().backward()
    full.sum().backward()


_PEAK = textwrap.dedent("""
    import json, sys, torch
    from lightning_ffpa.rl.logprobs import chunked_token_logprobs
    torch.manual_seed(0)
    m, v, hdim, path = 512, 131072, 32, sys.argv[1]
    h = torch.randn(m, hdim, requires_grad=True)
    w = torch.randn(v, hdim) * 0.1
    y = torch.randint(0, v, (m,))
    g = torch.randn(m)
    torch.log_softmax(h[:4] @ w.t(), -1)  # warm up the allocator and kernels
    def status(field):  # kB
        return int(next(l for l in open("/proc/self/status") if l.startswith(field)).split()[1])
    open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) restarts from the current RSS: an earlier,
    before = status("VmRSS")  # higher transient (imports) cannot hide the path's growth
    if path == "chunked":
        logp, _ = chunked_token_logprobs(h, w, y, softcap=30.0, chunk_size=32)
    else:
        z = torch.tanh((h @ w.t()) / 30.0) * 30.0
        logp = torch.log_softmax(z, -1).gather(1, y[:, None])[:, 0]
    (logp * g).sum().backward()
    print(json.dumps({"peak_mib": (status("VmHWM") - before) / 1024}))
""")


def _peak_mib(path: str) -> float:
    # A fixed mmap threshold sends every large buffer to mmap, so a free returns it at once: glibc's default
    # threshold grows after the first free, and later chunk buffers then sit in a fragmented heap that the
    # resident size counts (68-137 MiB measured on one code, against 38 MiB with the threshold fixed).
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "2", "MALLOC_MMAP_THRESHOLD_": str(2**20)}
    proc = subprocess.run([sys.executable, "-c", _PEAK, path], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])["peak_mib"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_peak_memory_is_chunk_sized_at_a_large_vocabulary():
    """512 tokens x 131,072 vocab: one fp32 logits matrix is 256 MiB. The chunked forward+backward (32-token
    chunks: 16 MiB buffers, a few alive at once) grows the process's resident memory by under half of one such
    matrix (about 38 MiB measured); the full-logits path by several."""
    one_matrix = 512 * 131072 * 4 / 2**20
    chunked = _peak_mib("chunked")
    assert chunked < one_matrix / 2, chunked
    assert _peak_mib("full") > 2 * one_matrix, "the bound would not catch the full-logits path"
