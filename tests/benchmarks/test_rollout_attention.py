"""CPU smoke test of benchmarks/rollout_attention.py: tiny shapes, eager flex, a few candidates.

Checks the row and summary structure, that every row matches `dense_reference` on scrambled pages with
padded rows, the byte counts by hand, that a disagreeing reference makes rows invalid (so the check can
fail), and the candidate grid (shared-memory skips, no unsafe options)."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `benchmarks` is a folder of scripts
from benchmarks import rollout_attention as bench  # noqa: E402
from lightning_ffpa.rollout import attention as attn  # noqa: E402

TINY_ARGS = ["--device", "cpu", "--tiny", "--batch", "4", "--padded", "1", "--contexts", "20,30", "--page-size", "4",
             "--q-heads", "4", "--iters", "1", "--warmup", "0", "--dtype", "float32"]


@pytest.fixture(autouse=True)
def _clean():
    attn.reset_kernel_options()
    yield
    attn.reset_kernel_options()


def test_cpu_smoke_rows_summary_and_error(tmp_path):
    out = tmp_path / "rollout_attention.json"
    bench.main([*TINY_ARGS, "--out", str(out)])
    record = json.loads(out.read_text())
    assert record["benchmark"] == "rollout_attention"
    rows = record["rows"]
    timed = [r for r in rows if "skipped" not in r]
    kinds = {(r["kind"], r["head_dim"]) for r in timed}
    assert kinds == {("sliding", 32), ("full", 64)}
    for r in timed:
        assert "error" not in r, r
        assert r["valid"] and r["finite"] and r["padded_rows_zero"]
        assert r["max_abs_err"] < 1e-4
        assert r["us_per_call"] > 0 and r["bandwidth_gb_s"] > 0
        assert 0 < r["needed_kv_bytes"] <= r["paged_kv_bytes"]
        assert r["attention_path"] == "flex_eager" and r["batch"] == 4 and r["padded_rows"] == 1
    for kind in kinds:  # every candidate ran at both contexts
        names = {r["candidate"] for r in timed if (r["kind"], r["head_dim"]) == kind}
        assert "builtin" in names and len(names) >= 2
        for n in names:
            assert sorted(r["context"] for r in timed if r["candidate"] == n and (r["kind"], r["head_dim"]) == kind) \
                == [20, 30]
    summary = record["summary"]
    for key in ("sliding_d32", "full_d64"):
        e = summary["per_kind"][key]
        assert e["num_valid"] == e["num_candidates"] >= 2
        assert e["best_us"] <= e["builtin_us"] and e["speedup_vs_builtin"] >= 1
    assert {e["head_dim"] for e in summary["kernel_options"]} == {32, 64}
    assert attn.kernel_option_overrides() == []  # the sweep leaves no override behind
    attn.load_kernel_options(out)  # the summary is loadable as it stands
    assert len(attn.kernel_option_overrides()) == 2


def test_disagreeing_reference_makes_rows_invalid(tmp_path, monkeypatch):
    monkeypatch.setattr(attn, "dense_reference", lambda q, *a, **kw: torch.ones_like(q))
    res = bench.main([*TINY_ARGS, "--kinds", "full", "--out", str(tmp_path / "r.json")])
    rows = [r for r in res["rows"] if "skipped" not in r]
    assert rows and not any(r["valid"] for r in rows)
    assert all(r["max_abs_err"] > 0.5 for r in rows)
    assert res["summary"]["kernel_options"] == [] and "best" not in res["summary"]["per_kind"]["full_d64"]


def test_cases_scramble_pages_pad_rows_and_count_bytes():
    kind = bench.TINY[0]  # sliding, window 16
    with torch.inference_mode():
        # 8-token pages read in 4-token blocks
        k, v, cases = bench.build_cases(kind, [20, 30], 4, 1, 8, 4, 4, torch.float32, "cpu", 2)
    for case in cases:
        bm = case.block_mask
        pages = torch.cat([bm.kv_indices[0, 0, 0, :bm.kv_num_blocks[0, 0, 0]],
                           bm.full_kv_indices[0, 0, 0, :bm.full_kv_num_blocks[0, 0, 0]]]).sort().values
        assert len(pages) > 1 and not torch.equal(pages, torch.arange(pages[0], pages[0] + len(pages)))
        dense = bm.to_dense()[:, 0, 0]  # (B, blocks listed)
        per_tok = 2 * kind.kv_heads * kind.head_dim * 4
        assert case.paged_bytes == int(dense[:case.num_real].sum()) * 4 * per_tok
        # needed = allowed (row, key) pairs of the real rows' mask, counted densely
        kv = torch.arange(k.shape[2])
        allowed = sum(int(bm.mask_mod(torch.tensor(b), torch.tensor(0), torch.tensor(0), kv).sum())
                      for b in range(case.num_real))
        assert case.needed_bytes == allowed * per_tok
        assert torch.equal(case.ref[case.num_real:], torch.zeros_like(case.ref[case.num_real:]))


def test_grid_skips_tiles_over_shared_memory_and_never_unsafe_options():
    h200 = 232448
    for head_dim in (256, 512):
        cands = bench.grid_candidates(head_dim, torch.bfloat16, h200, 128, tiny=False)
        names = {n: skip for n, _, skip in cands}
        assert names["builtin"] is None and names["flex_defaults"] is None
        for _name, options, skip in cands + bench.followup_candidates({"BLOCK_N": 32}):
            assert not set(options or {}) & set(attn.UNSAFE_OPTIONS)
            attn.validate_kernel_options(options, decode=True)
            if options and skip is None:
                assert bench.smem_estimate(head_dim, options.get("BLOCK_N", 64), options.get("num_stages", 1), 2) <= h200
    names = {n: skip for n, _, skip in bench.grid_candidates(256, torch.bfloat16, h200, 128, tiny=False)}
    assert names["bn128_s2_w4"] and names["bn64_s3_w8"] is None
    names = {n: skip for n, _, skip in bench.grid_candidates(512, torch.bfloat16, h200, 128, tiny=False)}
    assert names["bn64_s2_w4"] and names["bn64_s1_w4"] is None and names["bn32_s3_w4"] is None


def test_a_failing_option_set_is_recorded_and_the_sweep_goes_on(tmp_path, monkeypatch):
    real_flex = bench.flex_attention

    def picky_flex(*args, kernel_options=None, **kwargs):  # stands in for a Triton resource error
        if (kernel_options or {}).get("BLOCK_N") == 16:
            raise RuntimeError("out of resource: shared memory")
        return real_flex(*args, kernel_options=kernel_options, **kwargs)

    monkeypatch.setattr(bench, "flex_attention", picky_flex)
    res = bench.main([*TINY_ARGS, "--kinds", "sliding", "--out", str(tmp_path / "r.json")])
    bad = [r for r in res["rows"] if r["candidate"] == "bn16_s1_w4"]
    assert [r["context"] for r in bad] == [20, 30] and not any(r["valid"] for r in bad)
    assert "out of resource" in bad[0]["error"] and bad[1]["error"] == "not run: failed at context 20"
    entry = res["summary"]["per_kind"]["sliding_d32"]
    assert entry["num_candidates"] == 2 and entry["num_valid"] == 1 and entry["best"] == "builtin"
    assert res["summary"]["kernel_options"] == [{"head_dim": 32, "decode": True, "dtype": "float32", "options": None}]
