"""Sliding-window KV recycling: the sliding layers' own page pool keeps only what their window reads.

Decodes ten times longer than the window stay token-identical to HF greedy, with logprobs close, on scrambled
physical pages (fp32, CPU). A tiny Gemma4 with a 6-token window (not a whole number of pages) and 4-token pages;
one prompt is longer than the window, so its prefill writes tokens already out of the window. The first test runs flex's eager path: the
dense reference reads only the mask mod, not the masks' block lists, where a released page could leak in
(a full block skips the mask mod). The rest use the dense reference to stay fast. The pools' use is counted in
`engine.stats`; tight pools preempt and still give HF's tokens; bad sizes are one ConfigError naming the option.
"""

import pytest
import torch
from _scramble import scrambled
from transformers import Gemma4ForCausalLM

from lightning_ffpa.errors import ConfigError
from lightning_ffpa.presets import build_text_config
from lightning_ffpa.rollout import engine as engine_mod
from lightning_ffpa.rollout.engine import EngineConfig, RolloutEngine
from lightning_ffpa.rollout.page_pools import PagePools
from lightning_ffpa.rollout.page_table import PageTable, window_pages
from lightning_ffpa.rollout.scheduler import Scheduler, Sequence

WINDOW, PAGE, NEW = 6, 4, 60  # 60 new tokens: ten windows
PER_SEQ = window_pages(WINDOW, PAGE, PAGE)  # 3 pages: a query block's 4 positions and the 5 tokens before it
MAX_LEN = 84  # a multiple of PAGE that holds the longest prompt (21) + NEW


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Gemma4ForCausalLM(build_text_config("tiny", sliding_window=WINDOW)).eval()


def _prompts(lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 512, (n,), generator=g).tolist() for n in lens]


def _cfg(**kw):
    pages = MAX_LEN // PAGE
    return EngineConfig(**{**dict(page_size=PAGE, num_pages=2 * pages + 2, max_batch_size=2, max_seq_len=MAX_LEN,
                                  max_prefill_tokens=256), **kw})


def _hf(model, prompt, new=NEW):
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, pad_token_id=0)
        tokens = out[0, len(prompt):]
        logits = model(input_ids=out, use_cache=False).logits[0, len(prompt) - 1:-1].float()
    return tokens.tolist(), torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0]


@pytest.fixture(scope="module")
def reference(model):
    prompts = _prompts((5, 21, 3))
    return prompts, [_hf(model, p) for p in prompts]


def _generate_and_check(model, reference, cfg, n=2, seed=0):
    prompts, refs = reference
    eng = scrambled(RolloutEngine(model, cfg), seed)
    seqs = eng.generate(prompts[:n], NEW)
    for seq, (tokens, logprobs) in zip(seqs, refs):
        assert seq.output == tokens, f"prompt {seq.seq_id} diverged at {_first_diff(seq.output, tokens)}"
        torch.testing.assert_close(torch.tensor(seq.logprobs), logprobs, atol=1e-4, rtol=0)
    eng.pages.flush()
    eng.pages.check_invariants()
    assert all(t.num_free_pages == t.num_pages - 1 for t in eng.pages.tables)  # every page came back
    return eng


def _first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_ten_windows_of_decode_match_hf_on_scrambled_pages_and_sliding_kv_stays_one_window(model, reference):
    eng = _generate_and_check(model, reference, _cfg())
    assert eng.sliding_table is not None and eng.num_sliding_pages == 2 * PER_SEQ + 1  # derived: the batch's windows
    # The sliding pools hold the batch's windows; the full layers' pools every page of every sequence.
    for i, spec in enumerate(eng.walker.specs):
        pages = eng.num_sliding_pages if spec.window is not None else eng.config.num_pages
        assert eng.cache.k[i].shape[2] == pages * PAGE
    stats = eng.stats
    assert stats["sliding_pages_per_seq_peak"] == PER_SEQ  # O(window) per sequence...
    # ...while the full layers grow with length: the last of 21 + 60 tokens is sampled, never written
    written = (5 + NEW - 1, 21 + NEW - 1)
    assert stats["kv_pages_per_seq_peak"] == -(-written[1] // PAGE) == 20
    assert stats["sliding_pages_peak"] <= 2 * PER_SEQ < stats["kv_pages_peak"]
    # Every page a sequence took, but its last window: the long prompt never took the 3 pages its prefill left
    # behind (positions 0..11 are before its first query block's reach), whose writes went to page 0.
    taken = -(-written[0] // PAGE) + -(-written[1] // PAGE) - 3
    assert stats["sliding_pages_recycled"] == taken - 2 * PER_SEQ


def test_without_a_sliding_pool_every_layer_keeps_every_page(model, reference):
    """`num_sliding_pages=0`: the layout before recycling (one table for every layer), same tokens."""
    eng = _generate_and_check(model, reference, _cfg(num_sliding_pages=0, attention="dense"), seed=1)
    assert eng.sliding_table is None and eng.num_sliding_pages == 0
    assert len({t.shape[2] for t in eng.cache.k.values()}) == 1
    assert eng.stats["sliding_pages_peak"] == eng.stats["sliding_pages_recycled"] == 0


@pytest.mark.parametrize("tight", ["sliding", "full"])
def test_tight_pools_preempt_and_still_match_hf(model, reference, tight):
    """Three prompts through two slots; a sliding pool of 4 usable pages (two windows need 6) or a full pool of
    29 (the first two sequences need 16 + 20) forces recompute preemption, each prefill of prompt + output
    longer than the window."""
    kw = {"num_sliding_pages": PER_SEQ + 2} if tight == "sliding" else {"num_pages": 30}
    kw["attention"] = "dense"
    prompts, refs = reference
    eng = scrambled(RolloutEngine(model, _cfg(**kw)), seed=2)
    seqs = eng.generate(prompts, NEW)
    assert eng.stats["preemptions"] > 0
    for seq, (tokens, logprobs) in zip(seqs, refs):
        assert seq.output == tokens, f"prompt {seq.seq_id} diverged at {_first_diff(seq.output, tokens)}"
        torch.testing.assert_close(torch.tensor(seq.logprobs), logprobs, atol=1e-4, rtol=0)
    eng.pages.flush()
    eng.pages.check_invariants()
    assert eng.stats["sliding_pages_peak"] <= eng.num_sliding_pages - 1


def test_admission_waits_for_room_in_the_sliding_pool():
    """The full pool has room for both prompts; the sliding pool holds one window: the second waits for the first
    to finish, and is not preempted into a loop."""
    full = PageTable(64, PAGE, 3, 16)
    sliding = PageTable(PER_SEQ + 1, PAGE, 3, 16, window=WINDOW, kv_block=PAGE)
    sched = Scheduler(PagePools(full, sliding), 2, 256)
    for i in range(2):
        sched.add(Sequence(i, [1] * 20, 3))
    kind, seqs = sched.schedule()
    assert kind == "prefill" and [s.seq_id for s in seqs] == [0] and len(sched.waiting) == 1
    assert full.num_pages_of(seqs[0].slot) == 5 and sliding.num_pages_of(seqs[0].slot) == PER_SEQ
    # The last query block (positions 16..19) reads back to position 11: blocks 2 to 4; blocks 0 and 1 never taken
    assert sliding.first_block_of(seqs[0].slot) == 2
    for _ in range(3):
        sched.postprocess(seqs, [5], [0.0])
        if sched.running:
            kind, seqs = sched.schedule()
            assert kind == "decode" and sched.num_preemptions == 0
    kind, seqs = sched.schedule()
    assert kind == "prefill" and [s.seq_id for s in seqs] == [1]


def test_sliding_pool_smaller_than_one_window_is_one_config_error_before_allocation(model, monkeypatch):
    monkeypatch.setattr(engine_mod, "PagedKVCache", lambda *a, **k: pytest.fail("cache allocated before the check"))
    with pytest.raises(ConfigError) as err:
        RolloutEngine(model, _cfg(num_sliding_pages=PER_SEQ))  # one window needs 3 pages plus page 0
    assert err.value.option == "engine.num_sliding_pages" and "\n" not in str(err.value)
    assert str(err.value).startswith(f"`engine.num_sliding_pages={PER_SEQ}`: must be >= {PER_SEQ + 1}")


@pytest.mark.parametrize("value", [1, -1, True, 2.5])
def test_num_sliding_pages_out_of_range_is_one_config_error(value):
    with pytest.raises(ConfigError, match=r"^`engine.num_sliding_pages=.*`: must be None \(derived\), 0"):
        _cfg(num_sliding_pages=value).check()


def test_callback_names_a_sliding_pool_too_small_for_the_window_at_setup_before_any_model():
    import lightning as L

    from lightning_ffpa.callbacks.rollout import RolloutCallback
    from lightning_ffpa.rl.module import GRPOModule
    from lightning_ffpa.rl.prompts import PromptDataModule
    from lightning_ffpa.rl.rewards import token_range_reward
    from lightning_ffpa.rollout.sampler import SamplingParams

    # The tiny preset: a 16-token window over 8-token pages spans up to 3 pages; 3 leaves none beside page 0.
    rollout = RolloutCallback([token_range_reward], num_generations=2, sampling=SamplingParams(max_new_tokens=4),
                              engine=EngineConfig(page_size=8, num_pages=16, max_batch_size=4, max_seq_len=32,
                                                  attention="dense", num_sliding_pages=3))
    module = GRPOModule(preset="tiny")
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[rollout])
    with pytest.raises(ConfigError, match=r"^`RolloutCallback.engine.num_sliding_pages=3`: must be >= 4"):
        trainer.fit(module, datamodule=PromptDataModule(num_random_prompts=4, prompt_len=4, batch_size=2))
    assert module.model is None and rollout.engine is None
