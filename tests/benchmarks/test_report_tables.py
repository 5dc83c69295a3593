"""benchmarks/report/tables.py: the curated tables render each benchmark's rows in the script's order with their
labels, link their result file in every column header, show failed rows as "—" with the error's first line, and
print no number that the result record does not hold.

Records are built here row by row as the scripts write them (their row fields), and their summaries come from the
scripts' own `summarize`, so a renamed field or summary key fails here.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `benchmarks` is a folder of scripts
from benchmarks.report import pages, plots, results_io, tables  # noqa: E402

NUMBER = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?[%x]?")


def _train_record() -> dict:
    from benchmarks.train_rows import ROWS
    from benchmarks.train_throughput import summarize

    def row(name, seq, tps, alloc, resv, mfu, **extra):
        return dict(dict(row=name, seq=seq, **ROWS[name]), tokens_per_s_per_gpu=tps, step_ms_median=seq / tps * 1e3,
                    step_ms_min=seq / tps * 990, step_ms_max=seq / tps * 1020, peak_mem_allocated_gb=alloc,
                    peak_mem_reserved_gb=resv, mfu_spec=mfu, mfu_measured_peak=mfu * 1.255, **extra)

    rows = [row("ours", 8192, 15282.4, 70.21, 74.5, 0.4153), row("sdpa_recipe", 8192, 10463.2, 66.07, 69.9, 0.2841),
            row("sdpa_defaults", 8192, 7667.3, 81.43, 88.2, 0.2082),
            row("liger_recipe", 8192, 11311.9, 63.36, 67.05, 0.3071),
            row("flex_recipe", 8192, 9001.5, 77.7, 80.3, 0.2444, flex_options=2),
            row("ours", 16384, 15418.6, 101.6, 109.0, 0.5017), row("sdpa_recipe", 16384, 7735.1, 99.2, 104.4, 0.2517),
            dict(row="flex_recipe", seq=16384, **ROWS["flex_recipe"],
                 error="OutOfResources: out of resource: shared memory, Required: 262144, Hardware limit: 232448\n"
                       "Reducing block sizes or `num_stages` may help."),
            dict(row="sdpa_defaults", seq=16384, **ROWS["sdpa_defaults"], error="skipped: past --budget-s 520")]
    summary, missing = summarize(rows)
    return dict(benchmark="train_throughput", device="NVIDIA H200 x1", date="2026-12-01", commit="abc1234",
                rows=rows, summary=summary, summary_missing=missing)


def _lora_record() -> dict:
    from benchmarks.full_depth_lora import ROWS, summarize

    def row(name, seq, tps, alloc):
        return dict(row=name, seq=seq, label=ROWS[name], timed_steps=5, step_ms_median=seq / tps * 1e3,
                    step_ms_min=seq / tps * 995, step_ms_max=seq / tps * 1011, tokens_per_s=tps,
                    peak_mem_allocated_gb=alloc, peak_mem_reserved_gb=alloc + 3.25, mfu_spec=tps / 31000)

    rows = [row("ours_lora", 8192, 4123.7, 96.4), row("hf_peft_sdpa_recipe", 8192, 2577.1, 104.9),
            dict(row="unsloth_lora", seq=8192, label=ROWS["unsloth_lora"], tried=["pip install unsloth==2026.11.1"],
                 error="ImportError: Unsloth: Gemma4 is not supported yet (transformers 5.17)")]
    summary, missing = summarize(rows)
    return dict(benchmark="full_depth_lora", rows=rows, summary=summary, summary_missing=missing)


def _rollout_record() -> dict:
    from benchmarks.rollout import summarize

    bw = dict(copy_bytes_per_s=4.01e12, read_bytes_per_s=4.33e12, datasheet_bytes_per_s=4.8e12, device_name="H200")

    def row(name, batch, tps, frac, match=None):
        mode = "sample" if name.endswith("_sampled") else "greedy"
        r = dict(name=name, kind=name.removesuffix("_sampled"), mode=mode, batch=batch, layers=60, prompt_len=256,
                 new_tokens=512, bandwidth=bw, tokens_per_s=tps, process={"pid": 7 + batch})
        if frac is not None:
            r.update(roofline_fraction=frac, roofline_fraction_datasheet=frac * 4.01 / 4.8, ideal_step_ms=21.3,
                     peak_mem_gb=101.94, hf_check=dict(prompts=8, tokens=128, logprob_max_abs_diff=0.031))
            if match is not None:
                r["hf_check"].update(token_match_rate=match, exact_prompts=6)
        return r

    rows = [row("ours_paged_flex", 64, 1978.3, 0.8131, 0.9844), row("ours_paged_flex_sampled", 64, 1931.2, 0.7937),
            row("hf_generate_static", 64, 327.4, None), row("hf_generate_static_sampled", 64, 301.6, None),
            dict(name="hf_generate_static_compiled", kind="hf_generate_static_compiled", mode="greedy", batch=64,
                 error="timeout: the row's process was killed after 540 s"),
            row("ours_paged_flex", 16, 601.8, 0.5518, 1.0)]
    return dict(benchmark="rollout", rows=rows, summary=summarize(rows))


def _grpo_record() -> dict:
    from benchmarks.grpo_vs_trl import summarize

    def row(name, step, tps, phases):
        return dict(name=name, layers=12, preset="gemma4-31b", lora_r=16, prompts=2, group=8, prompt_len=128,
                    completion_len=192, timed_steps=6, step_s_median=step, step_s_min=step * 0.97,
                    step_s_max=step * 1.08, completion_tokens_per_step=3072, completion_tokens_per_s=tps,
                    phases_s_median=dict(zip(("refresh_s", "generation_s", "scoring_s", "update_s"), phases)),
                    peak_mem_gb=33.71, process={"pid": 11})

    rows = [row("ours_grpo", 2.413, 1273.1, (0.052, 1.217, 0.031, 1.113)),
            row("trl_grpo", 14.86, 206.7, (0.0, 12.94, 0.44, 1.48))]
    return dict(benchmark="grpo_vs_trl", rows=rows, summary=summarize(rows))


def _nemo_record() -> dict:
    from benchmarks.nemo_backend import summarize

    def op(impl, layout, mode, ms, **extra):
        return dict(part="op", impl=impl, seq=8192, layout=layout, mode=mode, ms=ms, ms_min=ms * 0.99,
                    ms_max=ms * 1.02, iters=10, warmup=3, **extra)

    rows = [op("ours", "dense", "fwd", 1.734), op("nemo", "dense", "fwd", 1.812),
            op("ours", "dense", "fwd+bwd", 6.205), op("nemo", "dense", "fwd+bwd", 7.118),
            op("ours", "padded", "fwd+bwd", 5.117),
            op("nemo", "padded", "fwd+bwd", 9.4, fallback="NeMo's backend fell back: {'varlen': 'no cu_seqlens'}"),
            dict(part="numerics", seq=8192, layout="dense", max_abs_diff={"ours_vs_nemo": {"out": 0.0039}}),
            dict(part="step", row="ours", seq=8192, label="train_throughput's 'ours' recipe", step_ms=540.2,
                 step_ms_min=538.7, step_ms_max=544.9, tokens_per_s=15164.8, peak_allocated_gb=70.33),
            dict(part="step", row="nemo", seq=8192, label="the same recipe, NeMo's backend",
                 error="RuntimeError: FFPA CuTeDSL unavailable\nTraceback line")]
    summary, notes = summarize(rows)
    return dict(benchmark="nemo_backend", rows=rows, summary=summary, summary_notes=notes)


RECORDS = {"train_throughput": _train_record, "full_depth_lora": _lora_record, "rollout": _rollout_record,
           "grpo_vs_trl": _grpo_record, "nemo_backend": _nemo_record}


def _render(tmp_path: Path, record: dict) -> tuple[str, str]:
    """The curated section of one record written to tmp_path, and the link docs/benchmarks.md uses for it."""
    path = tmp_path / f"{record['benchmark']}.json"
    path.write_text(json.dumps(record))
    section = "\n".join(pages.curated_section([(path, record)], pages.BENCHMARKS_MD.parent, set()))
    return section, pages.rel(path, pages.BENCHMARKS_MD.parent)


def stray_numbers(section: str, record: dict) -> list[str]:
    """Numbers in `section` that are no field of `record` in any of the report's formats. The record's strings
    (labels, notes) and code spans (field names, error lines) are taken out first; what is left is values."""
    numbers = [v for v in results_io.leaves(record) if isinstance(v, (int, float)) and not isinstance(v, bool)]
    allowed = {f.format(v) for v in numbers for f in tables.FORMATS.values()}
    allowed |= {str(v) for v in numbers if isinstance(v, int)}
    code = r"``.+?``|`[^`\n]*`"
    text = re.sub(code, " ", re.sub(r"\]\([^)]*\)", "]", section))  # code spans, link targets
    # the record's strings as they read once their own code spans are gone (a label may quote an option)
    strings = {re.sub(code, " ", v) for v in results_io.leaves(record)
               if isinstance(v, str) and not re.fullmatch(r"[\d.,%x]*", v)}
    for s in sorted(strings, key=len, reverse=True):  # longest first: a label before the words inside it
        text = text.replace(s.replace("|", "\\|"), " ")
    return [n for n in NUMBER.findall(text) if n not in allowed]


@pytest.mark.parametrize("benchmark", list(RECORDS))
def test_every_number_printed_is_a_field_of_the_record(tmp_path, benchmark):
    record = RECORDS[benchmark]()
    section, _ = _render(tmp_path, record)
    assert NUMBER.search(section.split("|---|", 1)[-1]), section  # the tables hold values at all
    assert stray_numbers(section, record) == []
    assert stray_numbers(section + "\n| 1.23x |", record) == ["1.23x"]  # the check catches a planted ratio


@pytest.mark.parametrize("benchmark", list(RECORDS))
def test_every_column_header_links_the_result_file_and_names_a_field(tmp_path, benchmark):
    section, link = _render(tmp_path, RECORDS[benchmark]())
    headers = [ln for ln, nxt in zip(section.splitlines(), section.splitlines()[1:]) if nxt.startswith("|---|")]
    assert headers
    for line in headers:
        cells = [c for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        assert all(re.search(rf"\[`[^`]+`\]\({re.escape(link)}\)", c) for c in cells), line


def test_training_rows_follow_the_script_with_labels_ratios_and_failures(tmp_path):
    from benchmarks.train_rows import ROWS

    record = _train_record()
    section, _ = _render(tmp_path, record)
    table = section[section.index("| row"):section.index("Step time")]
    order = [ln.split("|")[1].strip() for ln in table.splitlines()[2:] if ln.startswith("|")]
    assert order == ["sdpa_defaults", "sdpa_recipe", "flex_recipe", "liger_recipe", "ours"]
    for name in order:
        assert ROWS[name]["label"] in section  # each row says what differs from its neighbour
    s = record["summary"]
    line = next(ln for ln in table.splitlines() if ln.startswith("| sdpa_recipe |"))
    assert f"| 10,463 | {s['ours_vs_sdpa_recipe_tps_8k']:.2f}x | 7,735 | {s['ours_vs_sdpa_recipe_tps_16k']:.2f}x |" in line
    assert "`summary.ours_vs_sdpa_defaults_tps_8k, ours_vs_sdpa_recipe_tps_8k" in section
    # Failed and skipped rows: "—" and a note with the error's first line (not its second).
    assert "| — (a) |" in next(ln for ln in table.splitlines() if ln.startswith("| sdpa_defaults |"))
    assert "- (a) `sdpa_defaults` at seq 16384: `skipped: past --budget-s 520`" in section
    assert "`OutOfResources: out of resource: shared memory, Required: 262144, Hardware limit: 232448`" in section
    assert "num_stages" not in section
    # The detail table: step time spread, both memory peaks and both MFU denominators, labelled.
    assert "70.2 | 74.5 | 41.5% | 52.1% |" in section
    for field in ("peak_mem_allocated_gb", "peak_mem_reserved_gb", "mfu_spec", "mfu_measured_peak", "step_ms_median, step_ms_min"):
        assert f"`{field}" in section


def test_rollout_puts_sampled_beside_greedy_and_names_the_roofline_denominator(tmp_path):
    record = _rollout_record()
    section, _ = _render(tmp_path, record)
    line = next(ln for ln in section.splitlines() if ln.startswith("| 64 | ours_paged_flex |"))
    s = record["summary"]
    assert line.startswith(f"| 64 | ours_paged_flex | 1,978 | 1,931 | 67.9% | 66.3% | 81.3% | 79.4% | 98.4% | 101.9 | "
                           f"{s['vs_hf_generate_bs64']:.2f}x | {s['vs_hf_generate_sampled_bs64']:.2f}x |")
    assert "of measured copy bandwidth" in section and "of datasheet HBM" in section
    assert f"`summary.roofline_denominator`: {s['roofline_denominator']}" in section
    compiled = next(ln for ln in section.splitlines() if ln.startswith("| 64 | hf_generate_static_compiled |"))
    assert "— (a)" in compiled and "killed after 540 s" in section
    assert section.index("| 16 | ours_paged_flex |") < section.index("| 64 | ours_paged_flex |")


def test_lora_grpo_and_nemo_tables(tmp_path):
    lora, _ = _render(tmp_path, _lora_record())
    rec = _lora_record()
    assert f"| 2,577 | {rec['summary']['full_depth_lora_ours_vs_sdpa_recipe_tps_8k']:.2f}x |" in lora
    assert "Unsloth: Gemma4 is not supported yet" in lora and "| unsloth_lora |" in lora
    grpo = _grpo_record()
    text, _ = _render(tmp_path, grpo)
    assert "| ours_grpo | 2.41 (2.34–2.61) | 1,273 | 0.05 | 1.22 | 0.03 | 1.11 | 33.7 |" in text
    assert f"| {grpo['summary']['ours_vs_trl_step_speedup']:.2f}x |" in text
    assert "- `summary.trl_baseline`: trl_grpo, the fastest of the TRL rows that finished (1)" in text
    nemo = _nemo_record()
    text, _ = _render(tmp_path, nemo)
    assert f"| 8192 | dense | fwd+bwd | 6.205 | 7.118 | {nemo['summary']['ours_vs_nemo_backend_fwdbwd_dense_8k']:.2f}x |" in text
    padded = next(ln for ln in text.splitlines() if ln.startswith("| 8192 | padded |"))
    assert padded.endswith("| 5.117 | 9.400 (a) |  |") and "fell back" in text  # no ratio: the summary has none
    assert "- (b) step `nemo` at seq 8192: `RuntimeError: FFPA CuTeDSL unavailable`" in text


def test_the_unsloth_ratio_sits_beside_the_option_row_it_divides_by(tmp_path):
    from benchmarks.full_depth_lora import ROWS, summarize

    rec = _lora_record()
    rec["rows"] = [*rec["rows"][:2], dict(rec["rows"][0], row="unsloth_lora", label=ROWS["unsloth_lora"],
                                          tokens_per_s=1300.0, peak_mem_allocated_gb=65.4),
                   dict(rec["rows"][0], row="unsloth_lora_gc", label=ROWS["unsloth_lora_gc"], tokens_per_s=2000.0,
                        peak_mem_allocated_gb=90.0)]
    rec["summary"], rec["summary_missing"] = summarize(rec["rows"])
    text, _ = _render(tmp_path, rec)
    gc = next(ln for ln in text.splitlines() if ln.startswith("| unsloth_lora_gc |"))
    assert gc.endswith(f"| 2,000 | {4123.7 / 2000:.2f}x |")
    assert next(ln for ln in text.splitlines() if ln.startswith("| unsloth_lora |")).endswith("| 1,300 |  |")
    assert "- `summary.full_depth_lora_unsloth_baseline_8k`: unsloth_lora_gc" in text
    ours_peak = rec["summary"]["full_depth_lora_peak_mem_gb_ours_8k"]
    assert pages.qualifier("full_depth_lora_ours_vs_unsloth_tps_8k", rec) == (  # the baseline's peak, beside ours
        f"; this run's Unsloth baseline: unsloth_lora_gc, at {ours_peak:.1f} GiB peak allocated against "
        "Unsloth's 90.0 GiB")


def test_section_only_for_curated_files_that_exist(tmp_path):
    assert pages.curated_section([], pages.BENCHMARKS_MD.parent, set()) == []
    old = dict(_rollout_record(), summary={"history_note": "an earlier state"})
    attention = dict(benchmark="attention", rows=[{"impl": "ffpa", "ms": 1.0}], summary={})
    assert pages.curated_section([(tmp_path / "a.json", old), (tmp_path / "b.json", attention)],
                                  pages.BENCHMARKS_MD.parent, set()) == []


def test_training_and_lora_plots_draw(tmp_path):
    for record in (_train_record(), _lora_record()):
        assert plots.can_plot(record)
        assert plots.draw(record, tmp_path).stat().st_size > 0


def test_readme_headline_leads_with_same_recipe_and_peer_ratios(tmp_path):
    """The file with a same-recipe ratio comes before an op-level file; recipe-vs-defaults follows the peers and
    says what a default Lightning + HF user gains by switching."""
    train = _train_record()
    attention = dict(benchmark="attention", rows=[], summary={"ffpa_vs_sdpa_fwd_8k": 4.13}, commit="2d1f4b7")
    results = [(tmp_path / "attention.json", attention), (tmp_path / "train_throughput.json", train)]
    bullets = [ln for ln in pages.render_headline(results).splitlines() if ln.startswith("- **") and "(`summary." in ln]
    keys = [re.search(r"\(`summary\.(\w+)`\)$", ln).group(1) for ln in bullets]
    assert keys[:3] == ["ours_vs_sdpa_recipe_tps_8k", "ours_vs_sdpa_recipe_tps_16k", "ours_vs_flex_recipe_tps_8k"]
    assert keys.index("ours_vs_liger_tps_8k") < keys.index("ours_vs_sdpa_defaults_tps_8k") < keys.index(
        "ffpa_vs_sdpa_fwd_8k")
    assert "what a default Lightning + HF user gains by switching" in bullets[keys.index("ours_vs_sdpa_defaults_tps_8k")]


def test_readme_headline_shows_a_key_once_per_benchmark_and_setting(tmp_path):
    """A side run of the same benchmark (its own file) adds its own keys, not a second copy of the main file's;
    of two runs of one key the newer shows."""
    main = _train_record()
    side = dict(_train_record(), summary={"ours_vs_flex_recipe_tps_16k": 1.5,
                                          "ours_mfu_spec_16k": main["summary"]["ours_mfu_spec_16k"] - 0.01})
    results = [(tmp_path / "train_throughput.json", main), (tmp_path / "train_throughput_flex16.json", side)]
    bullets = [ln for ln in pages.render_headline(results).splitlines() if ln.startswith("- **")]
    mfu = [ln for ln in bullets if "(`summary.ours_mfu_spec_16k`)" in ln]
    assert len(mfu) == 1 and "train_throughput.json" in mfu[0]
    assert any("train_throughput_flex16.json" in ln and "ours_vs_flex_recipe_tps_16k" in ln for ln in bullets)
    # A newer run of the same key shows instead (the targets table reads the newest too).
    results[1] = (results[1][0], dict(side, date="2099-01-01 00:00:00"))
    bullets = [ln for ln in pages.render_headline(results).splitlines() if ln.startswith("- **")]
    mfu = [ln for ln in bullets if "(`summary.ours_mfu_spec_16k`)" in ln]
    assert len(mfu) == 1 and "train_throughput_flex16.json" in mfu[0]


def test_readme_headline_puts_full_depth_before_a_reduced_depth_ablation(tmp_path):
    full = dict(_rollout_record(), commit="abc1234")
    ablation = dict(full, summary=dict(full["summary"], depth_note="12 of 60 layers, 256-token prompts"))
    results = [(tmp_path / "rollout.json", ablation), (tmp_path / "rollout_full_depth.json", full)]
    runs = [ln for ln in pages.render_headline(results).splitlines() if ln.startswith("`")]
    assert [ln.split("`")[1] for ln in runs] == ["rollout_full_depth", "rollout"]


def test_committed_result_files_render_without_stray_numbers():
    """The same check over every recorded result file that gets a curated table (what docs/benchmarks.md shows)."""
    checked = 0
    for path, record in results_io.load_results():
        section = "\n".join(pages.curated_section([(path, record)], pages.BENCHMARKS_MD.parent, set()))
        if section:
            assert stray_numbers(section, record) == [], path.name
            checked += 1
    assert checked == sum(pages.curated(r) for _, r in results_io.load_results())


def test_docs_name_the_script_that_wrote_a_file_named_for_a_variant():
    rec = dict(benchmark="resume_full", command="python benchmarks/resume.py --variant full --out x/resume_full.json")
    assert pages.script_name(rec) == "resume"
    assert pages.script_name(dict(benchmark="rollout", command="python -m benchmarks.rollout --out y")) == "rollout"
    assert pages.script_name(dict(benchmark="attention")) == "attention"


def test_a_file_without_one_commit_id_stays_out_of_the_readme_and_is_flagged(tmp_path):
    train = _train_record()
    hand_set = dict(train, commit="HEAD\n2d1f4b7")
    assert pages.current([(tmp_path / "train_throughput.json", hand_set)]) == []
    assert "No benchmark has been recorded yet" in pages.render_headline([(tmp_path / "t.json", hand_set)])
    page = pages.render_benchmarks_md([(tmp_path / "train_throughput.json", hand_set)], set())
    assert "**Provenance incomplete:**" in page
    assert "**Provenance incomplete:**" not in pages.render_benchmarks_md([(tmp_path / "t.json", train)], set())


def test_a_file_with_a_known_harness_flaw_stays_out_of_the_readme_and_says_why(tmp_path):
    train = _train_record()
    flawed = tmp_path / "train_throughput_dp2.json"
    assert pages.current([(flawed, train)]) == [] and pages.current([(tmp_path / "t.json", train)])
    page = pages.render_benchmarks_md([(flawed, train)], set())
    assert f"**Harness flaw:** {pages.HARNESS_FLAWS['train_throughput_dp2']}" in page


def test_targets_table_reads_the_newest_value_and_says_met_missed_or_not_measured(tmp_path):
    from benchmarks.report import targets

    old = dict(benchmark="b", commit="aaaaaaa", date="2026-11-01", rows=[], summary={"ours_vs_liger_tps_8k": 1.2})
    new = dict(benchmark="b", commit="bbbbbbb", date="2026-12-01", rows=[],
               summary={"ours_vs_liger_tps_8k": 1.5, "ours_vs_sdpa_recipe_tps_8k": 1.44, "ours_mfu_spec_16k": None})
    lines = targets.render_targets([(tmp_path / "old.json", old), (tmp_path / "new.json", new)], tmp_path,
                                          lambda p, start: p.name)
    by_key = {re.search(r"\(`(\w+)`\)", ln).group(1): ln for ln in lines if ln.startswith("| ") and "(`" in ln}
    assert set(by_key) == {key for key, *_ in targets.TARGETS}
    assert "| 1.50x | met | [`new.json`](new.json) (`bbbbbbb`) |" in by_key["ours_vs_liger_tps_8k"]
    assert "| 1.44x | missed |" in by_key["ours_vs_sdpa_recipe_tps_8k"]
    assert "| - | not measured | - |" in by_key["ours_mfu_spec_16k"]
    assert targets.target_status(1.0, 1.0, strict=True) == "missed"  # "ahead of" a peer: strictly above
    assert targets.target_status(1.0, 1.0, strict=False) == "met"


def test_a_fits_target_reads_yes_or_no_and_a_number_is_not_an_answer(tmp_path):
    from benchmarks.report import targets

    def row(value):
        rec = dict(benchmark="b", commit="c" * 7, date="2026-12-02", rows=[], device="NVIDIA H200 x1",
                   summary={"grpo_full_depth_fits_4096": value})
        lines = targets.render_targets([(tmp_path / "f.json", rec)], tmp_path, lambda p, start: p.name)
        return next(ln for ln in lines if "(`grpo_full_depth_fits_4096`)" in ln)

    assert "| fits | fits | met |" in row(True)
    assert "| fits | does not fit | missed |" in row(False)
    assert "| fits | - | not measured | - |" in row(None)
    assert "grpo_full_depth_fits_4096" in targets.FITS and "moe_full_depth_lora_fits_16k" in targets.FITS


def test_a_target_with_a_memory_bar_is_missed_when_ours_holds_more_memory(tmp_path):
    from benchmarks.report import targets

    key = "full_depth_lora_ours_vs_unsloth_tps_8k"
    ours_mem, peer_mem = targets.MEMORY_BARS[key]
    for mem, status in ((97.3, "missed: ours' peak memory is 31.9 GiB higher"), (60.0, "met")):
        rec = dict(benchmark="b", commit="c" * 7, date="2026-12-02", rows=[],
                   summary={key: 1.91, ours_mem: mem, peer_mem: 65.4})
        lines = targets.render_targets([(tmp_path / "f.json", rec)], tmp_path, lambda p, start: p.name)
        row = next(ln for ln in lines if f"(`{key}`)" in ln)
        assert f"| 1.91x at {mem:.1f} vs 65.4 GiB | {status} |" in row


def test_targets_table_tells_two_files_of_one_day_apart_by_their_calls():
    from benchmarks.report import targets

    morning = dict(benchmark="b", commit="aaaaaaa", date="2026-12-02", rows=[], summary={"ours_mfu_spec_16k": 0.449},
                   calls=[dict(date="2026-12-02 00:16:05")])
    later = dict(morning, commit="bbbbbbb", summary={"ours_mfu_spec_16k": 0.45}, calls=[dict(date="2026-12-02 02:29:52")])
    for order in ([morning, later], [later, morning]):
        lines = targets.render_targets([(tmp / "f.json", r) for tmp, r in zip((Path("x"), Path("y")), order)],
                                              Path("."), lambda p, start: p.name)
        assert any("| 45.0% | missed |" in ln and "(`bbbbbbb`)" in ln for ln in lines)


def test_two_files_of_one_day_without_calls_are_told_apart_by_when_the_writer_finished(tmp_path, monkeypatch):
    from benchmarks.report import targets

    monkeypatch.setattr(sys, "argv", ["bench.py"])
    first = json.loads(results_io.write_result("b", [], {"ours_mfu_spec_16k": 0.45}, out=tmp_path / "z.json").read_text())
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", first["finished_at"])
    first["tree"] = dict(first["tree"], differs_from_commit=False)  # as from a clean commit, whatever this tree is
    earlier = dict(first, commit="aaaaaaa", finished_at=f"{first['date']} 00:00:01", summary={"ours_mfu_spec_16k": 0.4})
    later = dict(first, commit="bbbbbbb", finished_at=f"{first['date']} 23:59:59")
    for order in ((earlier, later), (later, earlier)):  # "a.json" sorts first either way: the time decides
        results = [(tmp_path / name, r) for name, r in zip(("a.json", "b.json"), order)]
        assert targets._newest(results, "ours_mfu_spec_16k", None)[1]["commit"] == "bbbbbbb"
        assert "(`bbbbbbb`, cpu)" in next(ln for ln in targets.render_targets(results, tmp_path, lambda p, s: p.name)
                                          if "ours_mfu_spec_16k" in ln)
        bullets = [ln for ln in pages.render_headline(results).splitlines() if "ours_mfu_spec_16k" in ln]
        assert len(bullets) == 1 and "45.0%" in bullets[0]


def test_kernel_kinds_sum_the_top_list_by_kind_and_leave_profiler_ranges_out():
    from benchmarks.step_probe import kernel_kinds

    profile = dict(cuda_kernel_total_ms=100.0, wall_ms=90.0, cuda_busy_ms=80.0, top_kernels=[
        dict(name="nvjet_sm90_tst_192x192", calls=3, total_ms=40.0),
        dict(name="nvjet_sm90_qrtst_128x160_128x5_2x1_v_bz_coopA_algo2_TNT", calls=2, total_ms=4.0),
        dict(name="kernel_cutlass_kernel_ffpa_attncute_dq_d512", calls=1, total_ms=10.0),
        dict(name="triton_tem_fused_flex_attention_backward", calls=5, total_ms=8.0),
        dict(name="fmha_cutlassB_bf16_aligned(PyTorchMemEffAttention::AttentionBackwardKernel", calls=1, total_ms=7.0),
        dict(name="Optimizer.step#AdamW.step", calls=1, total_ms=6.0),
        dict(name="void at::native::multi_tensor_apply_kernel", calls=9, total_ms=5.0),
        dict(name="FSDP::post_backward_reduce", calls=2, total_ms=4.0),
        dict(name="Memcpy DtoD (Device -> Device)", calls=9, total_ms=3.0),
        dict(name="triton_red_fused_logsumexp", calls=2, total_ms=2.0),
        dict(name="_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel13Ge", calls=4,
             total_ms=1.5),
        dict(name="kernel_cutlass_kernel_flash_attncuteflash_bwd_sm90FlashAttentionBackwardSm90", calls=2, total_ms=0.25),
        dict(name="void at::native::indexing_backward_kernel<c10::BFloat16>", calls=2, total_ms=1.0),
        dict(name="void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor>", calls=2,
             total_ms=0.5)])
    assert kernel_kinds(profile) == {"attention: FFPA": 10.0, "attention: Flex": 8.0, "attention: FA4": 0.25,
                                     "attention: SDPA": 7.0, "CUTLASS GEMM (grouped, scaled)": 1.5, "matmul: float8": 4.0, "matmul": 40.0,
                                     "fused elementwise (Triton)": 2.0,
                                     "routing, gather and scatter": 1.0, "optimizer": 5.0, "copies and casts": 3.0,
                                     "other": 0.5, "outside the top list": 7.75}


def test_a_rollout_ratio_says_when_its_hf_baseline_was_eager_only():
    rows = [dict(name="hf_generate_static", batch=64, tokens_per_s=10.0)]
    eager_only = dict(rows=rows, summary={})
    both = dict(rows=[*rows, dict(name="hf_generate_static_compiled", batch=64, tokens_per_s=12.0)], summary={})
    failed_compile = dict(rows=[*rows, dict(name="hf_generate_static_compiled", batch=64, error="timeout")],
                          summary={})
    assert "eager only" in pages.qualifier("vs_hf_generate_bs64", eager_only)
    assert "eager only" in pages.qualifier("vs_hf_generate_bs64", failed_compile)
    assert pages.qualifier("vs_hf_generate_bs64", both) == ""
    said = dict(rows=[], summary={"hf_baseline_sampled_bs64": "eager and compiled"})
    assert pages.qualifier("vs_hf_generate_sampled_bs64", said) == "; this run's HF baseline: eager and compiled"
    assert pages.qualifier("ours_vs_sdpa_recipe_tps_8k", eager_only) == ""


def test_a_flaw_fixed_since_marks_only_its_commits_file():
    from benchmarks.report import pages

    assert pages.harness_flaw("fsdp_mesh_of_one", {"commit": "1e87d5a386dbbea0f950974d7326e662866a5172"})
    assert pages.harness_flaw("fsdp_mesh_of_one", {"commit": "4335b7cf1179a4d264f9cae853d804a7f2348e8a"}) is None
    assert pages.harness_flaw("train_throughput_dp2", {"commit": "abc1234"}) == pages.HARNESS_FLAWS[
        "train_throughput_dp2"]  # an earlier harness: every file of that name


def test_decode_kernel_time_is_per_step_by_kind_in_the_files_own_section(tmp_path):
    from benchmarks.rollout_profile import decode_kernel_kinds

    profile = dict(steps=2, wall_ms_per_step=30.0, gpu_busy_ms_per_step=25.0, top_kernels=[
        dict(name="nvjet_sm90_tst_168x64_64x7_2x1_v_bz_TNN", calls=4, total_ms=20.0),
        dict(name="void cublasLt::splitKreduce_kernel<32, 16, int, float>", calls=4, total_ms=2.0),
        dict(name="triton_tem_fused__to_copy_cos_flex_attention_gather", calls=2, total_ms=12.0),
        dict(name="triton_per_fused__to_copy_cos_kv_write_mean_mul", calls=2, total_ms=6.0),
        dict(name="void at::native::index_elementwise_kernel<128, 4, at::native::index_copy_kernel_impl", calls=4,
             total_ms=4.0),
        dict(name="Memcpy DtoD (Device -> Device)", calls=2, total_ms=1.0)])
    assert decode_kernel_kinds(profile) == {
        "attention: Flex": 6.0, "matmul": 11.0, "K/V write (index_copy)": 2.0,
        "fused norms, RoPE, activations, sampler (Triton)": 3.0, "other": 0.5, "outside the top list": 2.5}
    rec = _rollout_record()
    assert tables.decode_kernel_time(rec, "r.json") == []  # no profiled row, no section
    rec["rows"][0]["profile"] = profile
    lines = tables.decode_kernel_time(rec, "r.json")
    row = next(ln for ln in lines if ln.startswith(f"| {rec['rows'][0]['name']} |"))
    assert "| 30.000 | 25.000 | 6.000 | 11.000 | 2.000 | 3.000 | 0.500 | 2.500 |" in row
    page = pages.render_benchmarks_md([(tmp_path / "rollout_profile.json", rec)], set())
    assert "### rollout_profile: kernel time by kind" in page



def test_a_file_that_predates_the_current_code_moves_to_history_until_it_is_re_run(tmp_path):
    """A file of PREDATES at the commit named there leaves the headline numbers for the README's History block,
    which says why; the same file re-run at another commit is a headline file again. The targets mark its value."""
    at, why = pages.PREDATES["rollout"]
    old = dict(_rollout_record(), commit=f"{at}0000000")
    new = dict(old, commit="abc1234")
    for record, current in ((old, False), (new, True)):
        results = [(tmp_path / "rollout.json", record)]
        headline, history = pages.render_headline(results), pages.render_history(results)
        assert ("rollout.json" in headline) is current and ("rollout.json" in history) is not current
        assert (f"It {pages.PREDATES_MARK}: {why}." in history) is not current
        assert history.startswith(pages.HISTORY_BEGIN) and history.endswith(pages.HISTORY_END)
        page = pages.render_benchmarks_md(results, set())
        assert (f"**It {pages.PREDATES_MARK}:** {why}." in page) is not current
    from benchmarks.report import targets

    record = dict(old, summary={"roofline_fraction_datasheet_bs64": 0.9})
    lines = targets.render_targets([(tmp_path / "rollout_full_depth.json", record)], tmp_path, lambda p, s: p.name,
                                   {"rollout_full_depth": pages.PREDATES_MARK})
    assert "| met (predates the current code) |" in next(ln for ln in lines if "roofline_fraction_datasheet" in ln)


def test_the_roofline_reads_the_datasheet_fraction_first():
    """The datasheet fraction is the roofline's primary number: its headline comes before the copy-bandwidth one,
    the target reads it, and the rollout table shows it first."""
    record = _rollout_record()
    keys = list(pages.HEADLINES)
    assert keys.index("roofline_fraction_datasheet_bs64") < keys.index("roofline_fraction_bs64")
    assert keys.index("roofline_fraction_datasheet_sampled_bs64") < keys.index("roofline_fraction_sampled_bs64")
    from benchmarks.report import targets

    # the MoE target is the datasheet fraction too, over the routed experts' bytes (rollout.py's summary)
    assert [k for k, *_ in targets.TARGETS if "roofline" in k] == ["roofline_fraction_datasheet_bs64",
                                                                    "moe_decode_routed_roofline_bs64",
                                                                    "grpo_full_depth_decode_roofline_datasheet_bs64"]
    header = next(ln for ln in tables.rollout(record, "r.json") if ln.startswith("| batch"))
    assert header.index("of datasheet HBM") < header.index("of measured copy bandwidth")
    bullets = [ln for ln in pages.render_headline([(Path("rollout_x.json"), dict(record, commit="abc1234"))])
               .splitlines() if "roofline_fraction" in ln]
    assert "summary.roofline_fraction_datasheet_bs64" in bullets[0]


def test_targets_read_the_h200_run_before_a_newer_run_on_another_card_and_name_that_card(tmp_path):
    """The bars are set on the H200: a newer H100 file does not replace its number; where only another card ran,
    its number shows with the card named. The headline keeps one bullet per card."""
    from benchmarks.report import targets

    h200 = dict(benchmark="b", commit="aaaaaaa", date="2026-12-01", device="NVIDIA H200 x1", rows=[],
                summary={"ours_mfu_spec_16k": 0.44})
    h100 = dict(h200, commit="bbbbbbb", date="2026-12-05", device="NVIDIA H100 80GB HBM3 x1",
                summary={"ours_mfu_spec_16k": 0.40, "moe_decode_routed_roofline_bs64": 0.67})
    results = [(tmp_path / "a.json", h200), (tmp_path / "b.json", h100)]
    lines = targets.render_targets(results, tmp_path, lambda p, s: p.name)
    mfu = next(ln for ln in lines if "(`ours_mfu_spec_16k`)" in ln)
    assert "| 44.0% |" in mfu and "(`aaaaaaa`) |" in mfu
    moe = next(ln for ln in lines if "(`moe_decode_routed_roofline_bs64`)" in ln)
    assert "(`bbbbbbb`, NVIDIA H100 80GB HBM3 x1) |" in moe
    bullets = [ln for ln in pages.render_headline(results).splitlines() if "(`summary.ours_mfu_spec_16k`)" in ln]
    assert len(bullets) == 2


def test_an_at_most_target_is_met_at_or_under_its_bar_and_shows_its_bar_as_such(tmp_path):
    from benchmarks.report import targets

    for value, status in ((0.092, "met"), (0.12, "missed")):
        rec = dict(benchmark="b", commit="c" * 7, date="2026-12-02", rows=[], device="NVIDIA H200 x1",
                   summary={"unmerged_lora_decode_overhead": value})
        row = next(ln for ln in targets.render_targets([(tmp_path / "f.json", rec)], tmp_path, lambda p, s: p.name)
                   if "(`unmerged_lora_decode_overhead`)" in ln)
        assert f"| <= 10% | {value:.1%} | {status} |" in row
