"""The docs stay true: generated pages are current, links resolve, measured claims cite a result file."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `benchmarks` is a folder of scripts, not part of the installed package
from benchmarks.report import pages, plots, results_io  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
RESULT_LINK = re.compile(r"benchmarks/results/[\w.-]+\.json")
# A measured speed or memory statement: "4.1x", "120 ms", "9000 tokens/s", "62 GB", "40% MFU", "faster than".
CLAIM = re.compile(
    r"\b\d+(\.\d+)?x\b(?!\s*\d)|\b\d[\d,.]*\s*(ms|tok/s|tokens/s|GB|GiB|TFLOP/?s?)\b|\d\s*%\s*MFU"
    r"|\b(faster|slower) than\b|\btimes (faster|slower)\b|\bspeed-?up of\b|\b(less|more) memory than\b",
    re.I)


def _gen_config():
    spec = importlib.util.spec_from_file_location("gen_config_reference", ROOT / "docs" / "gen_config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sections(text: str) -> list[str]:
    """Markdown split at headings (code blocks kept whole)."""
    out, current, fenced = [], [], False
    for line in text.splitlines():
        fenced ^= line.startswith("```")
        if line.startswith("#") and not fenced and current:
            out.append("\n".join(current))
            current = []
        current.append(line)
    out.append("\n".join(current))
    return out


def test_benchmark_pages_are_generated_from_the_results():
    assert pages.main(["--check"]) == 0, "run `python -m benchmarks.report`"


def test_config_reference_is_generated_from_the_code():
    assert _gen_config().main(["--check"]) == 0, "run `python docs/gen_config_reference.py`"


def test_every_config_option_has_a_description():
    gen = _gen_config()
    missing = [f"{path}.{o['name']}" for _, path in gen.CLASSES for o in gen.options(gen._import(path))
               if not o["help"].strip()]
    assert not missing, f"add these to the class docstring's Args section: {missing}"


def test_every_shipped_config_is_in_the_readme_table():
    readme = (ROOT / "README.md").read_text()
    for cfg in (ROOT / "configs").glob("*.yaml"):
        assert f"(configs/{cfg.name})" in readme, cfg.name


def _anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lowercase, punctuation dropped except `-` and `_`, spaces to hyphens."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", text, re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        assert path.exists(), f"{page.name}: broken link {target}"
        if anchor and path.suffix == ".md":
            assert anchor in _anchors(path), f"{page.name}: no heading #{anchor} in {path.name}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_measured_claims_cite_a_result_file(page):
    for section in _sections(page.read_text()):
        prose = re.sub(r"`[^`\n]*`", "", re.sub(r"```.*?```", "", section, flags=re.S))  # options in code are not claims
        claim = CLAIM.search(prose)
        if claim is None:
            continue
        cited = RESULT_LINK.findall(re.sub(r"```.*?```", "", section, flags=re.S))  # a command's path cites nothing
        heading = section.splitlines()[0]
        assert cited, f"{page.name} / {heading!r}: {claim.group(0)!r} needs a benchmarks/results/*.json link"
        for rel in cited:
            assert (ROOT / rel).exists(), f"{page.name}: cites missing {rel}"


# A measured quantity in prose: "8,905 tok/s", "77.0%", "5.85x", "25.1 GB", "16.9 ms", "31.6 TFLOP".
MEASURED = re.compile(r"(?<![\w.])(\d[\d,]*(?:\.\d+)?)\s?(x\b|%|ms\b|tok/s|tokens/s|GB\b|GiB\b|TFLOP)")


def _numbers(record: dict) -> list[float]:
    """Every number in a result record, including numbers inside its strings (labels, notes)."""
    out: list[float] = []
    for v in results_io.leaves(record):
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out.append(float(v))
        elif isinstance(v, str):
            out += [float(m) for m in re.findall(r"\d+(?:\.\d+)?", v)]
    return out


def _backed(printed: str, unit: str, numbers: list[float]) -> bool:
    """Whether `printed` (as the docs round it) is a value of the cited files; a percent may be a fraction."""
    value = float(printed.replace(",", ""))
    half = 0.5 * 10 ** -(len(printed.split(".")[1]) if "." in printed else 0)
    wanted = [(value, half)] + ([(value / 100, half / 100)] if unit == "%" else [])
    return any(abs(n - v) <= tol + 1e-12 for v, tol in wanted for n in numbers)


@pytest.mark.parametrize("page", [p for p in PAGES if p.name != "benchmarks.md"], ids=lambda p: p.name)
def test_numbers_beside_a_result_link_are_in_that_result(page):
    """Hand-written sections that cite result files print only numbers those files hold (rounded as printed):
    nothing measured elsewhere, estimated or derived by hand. Generated blocks are checked by the report tests."""
    text = re.sub(r"<!-- BEGIN GENERATED.*?<!-- END GENERATED[^>]*-->", "", page.read_text(), flags=re.S)
    for section in _sections(text):
        cited = {rel for rel in RESULT_LINK.findall(section) if (ROOT / rel).exists()}
        if not cited:
            continue
        numbers = [n for rel in cited for n in _numbers(json.loads((ROOT / rel).read_text()))]
        prose = re.sub(r"`[^`\n]*`", "", re.sub(r"```.*?```", "", section, flags=re.S))
        stray = [m.group(0) for m in MEASURED.finditer(prose) if not _backed(m.group(1), m.group(2), numbers)]
        assert not stray, f"{page.name} / {section.splitlines()[0]!r}: {stray} are in none of {sorted(cited)}"


def test_headline_numbers_match_their_json():
    """Each README headline value is the linked file's summary (or row) value, formatted as the report does."""
    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index(pages.BEGIN):readme.index(pages.END)]
    lines = [ln for ln in block.splitlines() if ln.startswith("- **")]
    recorded = [r for r in results_io.load_results() if any(k in r[1]["summary"] for k in pages.HEADLINES)]
    assert bool(lines) == bool(recorded)
    row_specs = {pages.row_ref(m, metric): (m, metric, fmt) for _, m, metric, _, fmt in pages.ROW_HEADLINES}
    for line in lines:
        value = re.match(r"- \*\*(.+?)\*\*", line).group(1)
        path, ref = re.search(r"\]\((benchmarks/results/[\w.-]+\.json)\) \(`(.+?)`\)$", line).groups()
        record = json.loads((ROOT / path).read_text())
        if ref.startswith("summary."):
            key = ref.removeprefix("summary.")
            assert pages.HEADLINES[key][1].format(record["summary"][key]) == value, line
        else:
            match, metric, fmt = row_specs[ref]
            assert fmt.format(pages.find_row(record["rows"], match)[metric]) == value, line


def test_plots_exist_for_every_plottable_result():
    for path, rec in results_io.load_results():
        if plots.can_plot(rec):
            assert (plots.IMG_DIR / f"{path.stem}.png").exists(), f"run `python -m benchmarks.report.plots` ({path.name})"


def test_report_renders_every_benchmark_kind(tmp_path):
    """Rows/summary of the four benchmark kinds render and plot (shape check on synthetic records)."""
    recs = [
        {"benchmark": "train_throughput", "device": "d", "rows": [
            {"row": "sdpa", "seq": 8192, "tokens_per_s_per_gpu": 100.0, "peak_mem_gb": 50.0, "dispatch": {"sdpa": 2}},
            {"row": "ours", "seq": 8192, "tokens_per_s_per_gpu": 120.0, "peak_mem_gb": 40.0},
            {"row": "flex", "seq": 8192, "error": "OutOfResources | shared memory"}],
         "summary": {"ours_vs_sdpa_tps_8k": 1.2, "ours_mfu_8k": None}},
        {"benchmark": "rollout", "rows": [{"name": "ours_paged_flex", "batch": 16, "tokens_per_s": 10.0},
                                          {"name": "ours_paged_flex", "batch": 64, "tokens_per_s": 30.0}],
         "summary": {"roofline_fraction_bs64": 0.3}},
        {"benchmark": "context_parallel", "rows": [{"row": "model_ffpa_ring_cp2", "tokens_per_s": 5.0}],
         "summary": {"cp2_vs_cp1_loss_max_abs_diff": 1e-6}},
    ]
    results = [(results_io.RESULTS_DIR / f"{r['benchmark']}.json", r) for r in recs]
    page = pages.render_benchmarks_md(results, {r["benchmark"] for r in recs})
    assert "OutOfResources \\| shared memory" in page  # a failing row is shown with its error, pipes escaped
    assert "**1.20x tokens/s**" in page and "ours_mfu_8k" in page  # None summary: in the table, not a headline
    assert "**30.0%**" in page and "**1.00e-06**" in page
    for rec in recs:
        assert plots.draw(rec, tmp_path).stat().st_size > 0


def test_python_blocks_in_docs_are_valid_python():
    for page in PAGES:
        for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.S):
            ast.parse(block)


def test_commands_in_docs_name_existing_files():
    """`--config X`, `python X.py` and examples/ paths mentioned in the docs exist."""
    for page in PAGES:
        text = page.read_text()
        for word in re.findall(r"(?:--config\s+|python\s+)((?:configs|examples|benchmarks|docs|tests)/[\w/.-]+)", text):
            assert (ROOT / word).exists(), f"{page.name}: {word}"
        for word in re.findall(r"\bexamples/[\w/.-]+\.(?:py|sbatch)", text):
            assert (ROOT / word).exists(), f"{page.name}: {word}"


def test_makefile_has_the_readme_commands():
    makefile = (ROOT / "Makefile").read_text()
    readme = (ROOT / "README.md").read_text()
    for target in re.findall(r"^make ([\w-]+)", readme, re.M):
        assert re.search(rf"^{target}:", makefile, re.M), f"README runs `make {target}`"


def test_readme_commands_run_from_any_folder_and_come_before_the_numbers():
    """The README's `lightning-ffpa ... --config X` commands name packaged recipes (a `configs/...` path works only
    in a checkout), and the headline numbers follow the ways in rather than sitting between them and Quick start."""
    from lightning_ffpa import recipes

    readme = (ROOT / "README.md").read_text()
    configs = [c for c in re.findall(r"lightning-ffpa [^\n`]*?--config[ =]([^\s`]+)", readme) if c != "..."]
    assert configs, "the README shows no `lightning-ffpa ... --config` command"
    for name in configs:
        assert recipes.find(name) is not None and "/" not in name, f"README: `--config {name}` is not a recipe name"
    sections = re.findall(r"^## (.+)$", readme, re.M)
    assert sections.index("Quick start (CPU, fresh machine)") < sections.index("Three ways in") \
        < sections.index("Headline numbers")


def test_rows_cited_beside_a_result_file_are_in_it():
    """A sentence that names benchmark rows (`rows `a` and `b` in [file](../benchmarks/results/f.json)`) names
    rows that file holds (docs/parallelism.md cited `sdpa` and `ours_nocompile` rows no file had)."""
    import json

    cited = re.compile(r"\brows? ((?:`\w+`(?:,|\s+and|\s+or)?\s*)+)(?:\([^)]*\)\s*)?(?:and\s+`\w+`\s*(?:\([^)]*\)\s*)?)?"
                       r"in\s+\[[^\]]*\]\((?:\.\./)?(benchmarks/results/[\w.-]+\.json)\)")
    checked = 0
    for page in PAGES:
        text = re.sub(r"\s+", " ", page.read_text())
        for names, path in cited.findall(text):
            rows = {r.get("row") for r in json.loads((ROOT / path).read_text()).get("rows", [])}
            for name in re.findall(r"`(\w+)`", names):
                checked += 1
                assert name in rows, f"{page.name}: row `{name}` is not in {path} ({sorted(rows)})"
    assert checked >= 2


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)


def test_readme_cites_current_result_files_and_marks_the_rest_as_history():
    """Outside its History section the README cites result files that exist, measured the current code (none of
    `pages.PREDATES`, no harness flaw) at a commit of this repository (checked where the clone has the history);
    the History section cites only PREDATES files, each marked with why. A docs section that cites such a file
    says that it predates the current code."""
    readme = (ROOT / "README.md").read_text()
    start = readme.index("\n## History\n")
    stop = readme.index("\n## ", start + 1)
    history, outside = readme[start:stop], readme[:start] + readme[stop:]
    full_history = _git("rev-parse", "--is-shallow-repository").stdout.strip() == "false"
    cited = sorted(set(RESULT_LINK.findall(outside)))
    assert cited, "the README cites no result file outside History"
    for rel in cited:
        record = json.loads((ROOT / rel).read_text())  # exists
        stem = Path(rel).stem
        assert pages.predates(stem, record) is None, f"README cites {rel} outside History: it {pages.PREDATES_MARK}"
        assert pages.harness_flaw(stem, record) is None and pages.clean_commit(record), rel
        if full_history:
            assert _git("cat-file", "-e", f"{record['commit']}^{{commit}}").returncode == 0, \
                f"{rel}: commit {record['commit']} is not in this repository's history"
    in_history = sorted({Path(rel).stem for rel in RESULT_LINK.findall(history)})
    assert in_history and pages.PREDATES_MARK in history
    for stem in in_history:
        why = pages.predates(stem, json.loads((RESULTS / f"{stem}.json").read_text()))
        assert why, f"README History cites {stem}.json, which PREDATES does not name at its commit"
        assert f"It {pages.PREDATES_MARK}: {why}." in history, stem
    for page in PAGES:
        if page.name in ("README.md", "benchmarks.md"):  # README: above; benchmarks.md: generated with the mark
            continue
        for section in _sections(page.read_text()):
            old = sorted({Path(r).stem for r in RESULT_LINK.findall(section)
                          if pages.predates(Path(r).stem, json.loads((ROOT / r).read_text()))})
            assert not old or pages.PREDATES_MARK in " ".join(section.split()), \
                f"{page.name} / {section.splitlines()[0]!r} cites {old} without saying it {pages.PREDATES_MARK}"


def test_row_names_in_benchmark_commands_are_rows_of_that_script():
    """`benchmarks/<script>.py ... --rows a b` in the hand-written docs and the recipe names rows the script defines
    (its ROWS or KINDS), so a cited ablation (ours_nocompile) is one a reader can run. docs/benchmarks.md is left
    out: it quotes the commands old files recorded, with the row names of their day."""
    import importlib

    found = 0
    for page in [*(p for p in PAGES if p.name != "benchmarks.md"), ROOT / "configs" / "gemma4_ffpa.yaml"]:
        for script, words in re.findall(r"(?:benchmarks/)?(\w+)\.py\b[^`\n]*?--rows ((?:\w+ ?)+)", page.read_text()):
            module = importlib.import_module(f"benchmarks.{script}")
            rows = getattr(module, "ROWS", None) or module.KINDS
            for name in words.split():
                found += 1
                assert name in rows, f"{page.name}: `{script}.py --rows {name}` is no row of the script"
    assert found >= 5


def test_recipes_cite_existing_result_files():
    """A recipe's header that names a measurement names a file that exists (a planned file is not a measurement)."""
    cited = {(path.name, rel) for path in (ROOT / "configs").glob("*.yaml")
             for rel in re.findall(r"benchmarks/results/[\w./-]+\.(?:json|log)", path.read_text())}
    assert cited, "no recipe cites a result file"
    missing = [(name, rel) for name, rel in sorted(cited) if not (ROOT / rel).exists()]
    assert not missing, f"recipes cite result files that do not exist: {missing}"
