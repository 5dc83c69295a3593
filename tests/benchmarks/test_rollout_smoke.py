"""CPU smoke of benchmarks/rollout.py: tiny model, each row in its own process, greedy and sampled engine rows
checked against HF, an HF row, the summary keys, a merge, and a row killed by its timeout."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # `benchmarks` is a folder of scripts
from benchmarks import rollout  # noqa: E402

TINY = ["--preset", "tiny", "--device", "cpu", "--layers", "2", "--batches", "2", "--prompt-len", "8",
        "--new-tokens", "12", "--bandwidth-gb", "0.01", "--check-prompts", "2",
        "--check-tokens", "10"]


@pytest.mark.timeout(120)
def test_rows_run_in_own_processes_with_hf_check(tmp_path, monkeypatch):
    out = tmp_path / "rollout.json"
    rows = rollout.main([*TINY, "--rows", "ours_paged_flex,hf_generate_static", "--profile",
                         "--only", "ours_paged_flex,ours_paged_flex_sampled,hf_generate_static", "--out", str(out)])
    record = json.loads(out.read_text())
    assert [r["name"] for r in record["rows"]] == ["ours_paged_flex", "ours_paged_flex_sampled", "hf_generate_static"]
    pids = [r["process"]["pid"] for r in record["rows"]]
    assert len(set(pids)) == 3 and os.getpid() not in pids  # one fresh process per row
    assert {r["process"]["parent_pid"] for r in record["rows"]} == {record["driver_pid"]} == {os.getpid()}
    for r in record["rows"]:
        assert "error" not in r, r
        assert r["process"]["rc"] == 0 and r["tokens_per_s"] > 0
        assert r["bandwidth"]["copy_bytes_per_s"] > 0 and "datasheet_bytes_per_s" in r["bandwidth"]
    greedy, sampled = record["rows"][0], record["rows"][1]
    assert greedy["mode"] == "greedy" and sampled["mode"] == "sample"
    assert greedy["tokens_generated"] == sampled["tokens_generated"] == 2 * 12
    assert greedy["projection_path"] == "fused (4 groups)"  # the engine's default: q/k/v and gate/up per layer
    assert greedy["decode_kv_block"] == 64  # the engine's default for 128-token pages
    check = greedy["hf_check"]  # fp32 CPU: the engine's greedy tokens equal HF's
    assert check["token_match_rate"] == 1.0 and check["first_divergence"] == [None, None]
    assert check["exact_prompts"] == 2 and check["logprob_max_abs_diff"] < 1e-3
    assert check["logprob_vs_generate_max_abs_diff"] < 1e-3  # and against generate's own logits
    assert check["hf_generate_vs_forward_logprob_max_abs_diff"] < 1e-3  # HF's two paths agree in fp32
    assert "token_match_rate" not in sampled["hf_check"] and sampled["hf_check"]["logprob_max_abs_diff"] < 1e-3
    assert 0 < greedy["roofline_fraction"] and greedy["roofline_fraction_datasheet"] is None  # no CPU datasheet
    for r in (greedy, sampled):  # the engine rows: the median of three timed rollouts, their spread beside
        assert r["timed_samples"] == 3 and r["roofline_fraction_datasheet_max"] is None
        for key in ("roofline_fraction", "decode_tokens_per_s", "decode_step_ms"):
            assert 0 < r[f"{key}_min"] <= r[key] <= r[f"{key}_max"], (key, r)
    prof = greedy["profile"]  # mid-run: 6 steps + 2 must fit the 12 new tokens, so it skips 4 (512 new: 256)
    assert "error" not in prof and prof["steps"] == 6 and prof["first_step"] == 5 and prof["context_at_first_step"] == 12
    assert prof["wall_ms_per_step"] > 0 and "profile" not in sampled
    s = record["summary"]
    assert s["greedy_token_match_rate_bs2"] == 1.0 and s["rows_in_own_process"] and "partial" not in s
    assert s["vs_hf_generate_bs2"] == pytest.approx(greedy["tokens_per_s"] / record["rows"][2]["tokens_per_s"])
    assert s["hf_baseline_bs2"] == "eager only (compiled HF row not run)"
    assert "eager only" in s["depth_note"] and "reduced-depth ablation" in s["depth_note"]
    assert "measured copy bandwidth" in s["roofline_denominator"] and len(rows) == 3
    # a compiled-HF row from another run merges in: the label stops saying "eager only"
    other = tmp_path / "compiled.json"
    fake = {**record["rows"][2], "name": "hf_generate_static_compiled", "kind": "hf_generate_static_compiled",
            "tokens_per_s": record["rows"][2]["tokens_per_s"] / 2}
    rollout.write([fake], str(other), partial=False)
    merged = tmp_path / "merged.json"
    rollout.main(["--merge", str(out), str(other), "--out", str(merged)])
    m = json.loads(merged.read_text())
    assert len(m["rows"]) == 4 and len(m["merged_from"]) == 2
    assert m["summary"]["hf_baseline_bs2"] == "eager and compiled, the faster"
    assert m["summary"]["vs_hf_generate_bs2"] == pytest.approx(s["vs_hf_generate_bs2"])  # the eager row is faster
    assert m["commit"] == record["commit"] and m["device"] == record["device"] and m["merged_by"]["by"]
    # rows measured at another commit are not merged into one result
    monkeypatch.setenv("LIGHTNING_FFPA_COMMIT", "0" * 40)
    rollout.write([fake], str(other), partial=False)
    monkeypatch.delenv("LIGHTNING_FFPA_COMMIT")
    with pytest.raises(SystemExit, match="differ in commit"):
        rollout.main(["--merge", str(out), str(other), "--out", str(merged)])


def test_row_timeout_and_budget(tmp_path, monkeypatch):
    """A row past its timeout is killed with its whole group, and its log ends with where it stood; with stack
    samples asked for, its log also shows where it was every second, and its progress lines survive them."""
    from benchmarks.row_process import STACK_SAMPLES_ENV, run_rows

    script = tmp_path / "sleeper.py"
    script.write_text("import time\nfrom benchmarks.row_process import row_main\n\n"
                      "def stuck_here(spec):\n    print('row started', flush=True)\n    time.sleep(1.6)\n"
                      "    print('still going', flush=True)\n    time.sleep(60)\n\n"
                      "row_main(None, stuck_here)\n")
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[2]))
    monkeypatch.setenv(STACK_SAMPLES_ENV, "1")
    seen = []
    rows = run_rows(script, [{"name": "slow", "batch": 1}, {"name": "late", "batch": 1}], tmp_path, 4.0, 21.0,
                    lambda done: seen.append(len(done)))
    assert rows[0]["error"].startswith("timeout") and rows[0]["process"]["rc"] == -9
    assert rows[0]["error"].endswith("(its log ends with the Python stacks it had then)")
    assert rows[0]["log_tail"] == "row started\nstill going"  # what it printed, not the stack dumps
    log = (tmp_path / rows[0]["process"]["log"]).read_text()
    assert "(most recent call first)" in log and "in stuck_here" in log
    assert log.count("Stack sample (") >= 2 and log.index("Stack sample (") < log.index("still going")
    assert "in stuck_here" in log[:log.index("still going")]  # a sample taken while it ran, not at the kill
    assert "skipped" in rows[1] and seen == [1, 2]  # the result is rewritten after every row


def test_a_killed_row_without_a_stack_dump_says_so(tmp_path, monkeypatch):
    from benchmarks.row_process import run_row

    script = tmp_path / "deaf.py"  # stops listening for the stack signal, as a stuck native call would not answer
    script.write_text("import faulthandler, signal, time\nfrom benchmarks.row_process import row_main\n\n"
                      "def deaf(spec):\n    faulthandler.unregister(signal.SIGUSR1)\n"
                      "    signal.signal(signal.SIGUSR1, signal.SIG_IGN)\n    time.sleep(60)\n\n"
                      "row_main(None, deaf)\n")
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[2]))
    row = run_row(script, {"name": "deaf"}, tmp_path / "deaf.log", 3.0)
    assert row["error"] == "timeout: the row's process was killed after 3 s (no Python stack reached its log)"


def test_reference_check_finds_a_divergence():
    """The check can fail: an engine output with one token changed diverges there, and only after it."""
    import torch

    from benchmarks.rollout_hf import reference_check
    from benchmarks.rollout_rows import build_model, prompts_for

    torch.manual_seed(0)
    model, cfg = build_model(2, "tiny", "cpu")
    prompts = prompts_for(2, 6, cfg.vocab_size)
    ref = model.generate(torch.tensor(prompts), max_new_tokens=8, do_sample=False, pad_token_id=0,
                         output_scores=True, return_dict_in_generate=True)
    outs = [ref.sequences[i, 6:].tolist() for i in range(2)]
    lps = [torch.stack([torch.log_softmax(s[i].float(), -1)[t] for s, t in zip(ref.scores, o)]).tolist()
           for i, o in enumerate(outs)]
    outs[1][3] = (outs[1][3] + 1) % cfg.vocab_size  # the "engine" picks another token at position 3
    res = reference_check(model, prompts, outs, lps, 8, "cpu", greedy=True)
    assert res["first_divergence"] == [None, 3] and res["exact_prompts"] == 1
    assert res["token_match_rate"] < 1 and res["divergence_logit_gap"][1] > 0  # HF preferred its own token
    assert res["logprob_max_abs_diff"] > 1e-3  # the changed token's logprob is not the one recorded
    assert res["logprob_vs_generate_max_abs_diff"] > 1e-3  # nor generate's, at the divergence itself


@pytest.mark.parametrize("args, says", [
    (["--summarize", "{tmp}/missing.json"], "`--summarize='{tmp}/missing.json'`: no such file"),
    (["--summarize", "{tmp}/text.json"], "`--summarize='{tmp}/text.json'`: not JSON"),
    (["--merge", "{tmp}/other.json", "--out", "{tmp}/m.json"], "`--merge='{tmp}/other.json'`: not a result file"),
])
def test_a_bad_result_path_is_one_line_naming_the_option(tmp_path, args, says):
    (tmp_path / "text.json").write_text("not json")
    (tmp_path / "other.json").write_text('{"a": 1}')
    before = sorted(p.name for p in tmp_path.iterdir())
    proc = subprocess.run([sys.executable, "benchmarks/rollout.py", *(a.format(tmp=tmp_path) for a in args)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    assert says.format(tmp=tmp_path) in lines[0] and proc.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


def test_a_compile_mode_row_is_named_by_it_and_compared_with_the_default_row(tmp_path):
    args = rollout.parse_args([*TINY, "--rows", "ours_paged_flex,hf_generate_static", "--modes", "greedy",
                               "--compile-mode", "max-autotune-no-cudagraphs"])
    assert [s["name"] for s in rollout.build_specs(args)] == ["ours_paged_flex_max_autotune_no_cudagraphs",
                                                              "hf_generate_static"]
    # two runs from before rows were named by compile mode: both rows were called "ours_paged_flex"
    base = dict(name="ours_paged_flex", kind="ours_paged_flex", mode="greedy", batch=64, layers=12, prompt_len=256,
                new_tokens=512, process={"pid": 1})
    files = []
    for mode, tps, roof in (("default", 8000.0, 0.75), ("max-autotune-no-cudagraphs", 8400.0, 0.79)):
        files.append(str(tmp_path / f"{mode}.json"))
        rollout.write([dict(base, compile_mode=mode, tokens_per_s=tps, roofline_fraction=roof)], files[-1],
                      partial=False)
    merged = tmp_path / "merged.json"
    rollout.main(["--merge", *files, "--out", str(merged)])
    m = json.loads(merged.read_text())
    tuned = "ours_paged_flex_max_autotune_no_cudagraphs"
    assert [r["name"] for r in m["rows"]] == ["ours_paged_flex", tuned]
    assert "name_at_run" not in m["rows"][0] and m["rows"][1]["name_at_run"] == "ours_paged_flex"
    s = m["summary"]
    assert s["roofline_fraction_bs64"] == 0.75 and s[f"roofline_fraction_{tuned}_bs64"] == 0.79
    assert s[f"{tuned}_vs_default_compile_bs64"] == pytest.approx(8400 / 8000)


def test_a_page_size_row_is_named_by_it_and_compared_with_the_default_row(tmp_path):
    args = rollout.parse_args([*TINY, "--rows", "ours_paged_flex,ours_paged_flex_eager_step,hf_generate_static",
                               "--modes", "greedy", "--page-size", "64"])
    assert [s["name"] for s in rollout.build_specs(args)] == ["ours_paged_flex_page64",
                                                              "ours_paged_flex_eager_step_page64",
                                                              "hf_generate_static"]  # HF rows hold no pages
    base = dict(kind="ours_paged_flex", mode="greedy", batch=64, process={"pid": 1})
    rows = [dict(base, name="ours_paged_flex", page_size=128, tokens_per_s=2000.0, roofline_fraction=0.75),
            dict(base, name="ours_paged_flex", page_size=64, tokens_per_s=2100.0, roofline_fraction=0.78,
                 roofline_fraction_datasheet=0.68),
            dict(base, name="ours_paged_flex", page_size=64, compile_mode="max-autotune-no-cudagraphs",
                 tokens_per_s=2200.0, roofline_fraction=0.8)]
    files = [str(tmp_path / f"{i}.json") for i in range(len(rows))]
    for row, f in zip(rows, files):
        rollout.write([row], f, partial=False)
    merged = tmp_path / "merged.json"
    rollout.main(["--merge", *files, "--out", str(merged)])
    m = json.loads(merged.read_text())
    both = "ours_paged_flex_max_autotune_no_cudagraphs_page64"
    assert [r["name"] for r in m["rows"]] == ["ours_paged_flex", "ours_paged_flex_page64", both]
    s = m["summary"]
    assert s["roofline_fraction_bs64"] == 0.75 and s["roofline_fraction_ours_paged_flex_page64_bs64"] == 0.78
    assert s["roofline_fraction_datasheet_ours_paged_flex_page64_bs64"] == 0.68  # the primary fraction, beside it
    assert s["ours_paged_flex_page64_vs_default_page_bs64"] == pytest.approx(2100 / 2000)
    assert s[f"{both}_vs_default_compile_page_bs64"] == pytest.approx(2200 / 2000)
    assert not any(k.startswith("ours_paged_flex_vs_default") for k in s)  # the default row is no variant of itself


def test_a_kv_block_row_is_named_by_it_and_compared_with_the_default_row(tmp_path):
    args = rollout.parse_args([*TINY, "--rows", "ours_paged_flex,hf_generate_static", "--modes", "greedy",
                               "--kv-block-size", "128"])
    specs = rollout.build_specs(args)
    assert [s["name"] for s in specs] == ["ours_paged_flex_block128", "hf_generate_static"]
    assert specs[0]["kv_block_size"] == 128
    base = dict(kind="ours_paged_flex", mode="greedy", batch=64, process={"pid": 1}, page_size=128)
    rows = [dict(base, name="ours_paged_flex", tokens_per_s=2000.0, roofline_fraction=0.8),
            dict(base, name="ours_paged_flex_block128", kv_block_size=128, tokens_per_s=1950.0,
                 roofline_fraction=0.78)]
    files = [str(tmp_path / f"{i}.json") for i in range(len(rows))]
    for row, f in zip(rows, files):
        rollout.write([row], f, partial=False)
    merged = tmp_path / "merged.json"
    rollout.main(["--merge", *files, "--out", str(merged)])
    s = json.loads(merged.read_text())["summary"]
    assert s["ours_paged_flex_block128_vs_default_block_bs64"] == pytest.approx(1950 / 2000)
    assert s["roofline_fraction_ours_paged_flex_block128_bs64"] == 0.78


@pytest.mark.timeout(120)
def test_an_unfused_row_runs_unfused_and_is_compared_with_the_default_row(tmp_path):
    out = tmp_path / "unfused.json"
    rollout.main([*TINY, "--rows", "ours_paged_flex", "--modes", "greedy", "--no-fuse-projections",
                  "--check-prompts", "1", "--out", str(out)])
    (row,) = json.loads(out.read_text())["rows"]
    assert row["name"] == "ours_paged_flex_unfused" and row["fuse_projections"] is False
    assert row["projection_path"] == "separate" and row["hf_check"]["token_match_rate"] == 1.0
    default = dict(row, name="ours_paged_flex", fuse_projections=True, tokens_per_s=row["tokens_per_s"] * 1.25)
    other = tmp_path / "default.json"
    rollout.write([default], str(other), partial=False)
    merged = tmp_path / "merged.json"
    rollout.main(["--merge", str(other), str(out), "--out", str(merged)])
    s = json.loads(merged.read_text())["summary"]
    assert s["ours_paged_flex_unfused_vs_default_fuse_bs2"] == pytest.approx(1 / 1.25)


def test_a_merge_with_a_history_note_is_kept_out_of_the_readme_headline(tmp_path, monkeypatch):
    from benchmarks.report import pages

    monkeypatch.setenv("LIGHTNING_FFPA_COMMIT", "9c81b9a")  # a clean commit, as the README's files name

    row = dict(name="ours_paged_flex", kind="ours_paged_flex", mode="greedy", batch=64, tokens_per_s=2000.0,
               roofline_fraction=0.8, process={"pid": 1})
    run = tmp_path / "run.json"
    rollout.write([row], str(run), partial=False)
    kept, current = tmp_path / "kept.json", tmp_path / "current.json"
    rollout.main(["--merge", str(run), "--out", str(kept), "--history-note", "a variant that does not ship"])
    rollout.main(["--merge", str(run), "--out", str(current)])
    records = [(p, json.loads(p.read_text())) for p in (kept, current)]
    assert records[0][1]["summary"]["history_note"] == "a variant that does not ship"
    assert [p for p, _ in pages.current(records)] == [current]
    with pytest.raises(SystemExit):
        rollout.parse_args(["--history-note", "x"])  # only a merge takes one


def test_a_kv_write_op_row_is_named_by_it_and_compared_with_the_default_row(tmp_path):
    base = {"kind": "ours_paged_flex", "mode": "greedy", "batch": 64, "roofline_fraction": 0.8}
    rows = [dict(base, name="ours_paged_flex", tokens_per_s=2000.0),
            dict(base, name=rollout.label("ours_paged_flex", "greedy", fuse_kv_write=False), fuse_kv_write=False,
                 tokens_per_s=1980.0)]
    assert rows[1]["name"] == "ours_paged_flex_kvwrite_op"
    assert rollout.label("ours_paged_flex_eager_step", "greedy", fuse_kv_write=False) == "ours_paged_flex_eager_step"
    s = rollout.summarize(rows)
    assert s["ours_paged_flex_kvwrite_op_vs_default_kvwrite_bs64"] == pytest.approx(1980 / 2000)


def test_a_row_without_cuda_graphs_is_named_by_it_and_reaches_the_engine(monkeypatch):
    """`--no-cuda-graphs` (a float32 MoE model cannot be captured): the engine rows' name says so and their engine
    gets `cuda_graphs=False`; HF rows are not renamed."""
    args = rollout.parse_args(["--no-cuda-graphs", "--rows", "ours_paged_flex_eager_step,hf_generate_static",
                               "--batches", "2", "--modes", "greedy", "--preset", "tiny", "--device", "cpu"])
    specs = rollout.build_specs(args)
    assert [s["name"] for s in specs] == ["ours_paged_flex_eager_step_nographs", "hf_generate_static"]
    assert all(s["cuda_graphs"] is False for s in specs)
    from benchmarks import rollout_rows
    from lightning_ffpa.rollout import engine as engine_mod

    seen = []

    class Stop(Exception):
        pass

    def capture_config(model, cfg, *a, **k):
        seen.append(cfg.cuda_graphs)
        raise Stop

    monkeypatch.setattr(engine_mod, "RolloutEngine", capture_config)
    with pytest.raises(Stop):
        rollout_rows.run_ours(None, [[1, 2]], 2, {}, 0, specs[0], "cpu")
    assert seen == [False]
    base = {"kind": "ours_paged_flex", "mode": "greedy", "batch": 64, "roofline_fraction": 0.8}
    s = rollout.summarize([dict(base, name="ours_paged_flex", tokens_per_s=2000.0),
                           dict(base, name="ours_paged_flex_nographs", cuda_graphs=False, tokens_per_s=1000.0)])
    assert s["ours_paged_flex_nographs_vs_default_graphs_bs64"] == pytest.approx(0.5)
