"""The FSDP2-on-one-GPU memory benchmark, run as a user runs it (its CPU smoke): the fsdp2 rows are sharded
and no_fsdp is not, all train, and without a GPU the summary says why it has no number."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_rows_differ_only_by_fully_shard(tmp_path):
    out = tmp_path / "f.json"
    proc = subprocess.run([sys.executable, "benchmarks/fsdp_mesh_of_one.py", "--smoke", "--layers", "2",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rec = json.loads(out.read_text())
    rows = {r["row"]: r for r in rec["rows"]}
    assert rows["fsdp2"]["fsdp_modules"] == 3 and rows["no_fsdp"]["fsdp_modules"] == 0  # 2 layers + the root
    assert rows["fsdp2_replicate_frozen"]["fsdp_modules"] == 3  # still FSDP2 units, holding the adapters only
    assert all(r["tied_lm_head"] for r in rows.values())  # one lm_head/embedding tensor in both rows
    assert all(len(r["losses"]) == 2 and all(0 < x < 20 for x in r["losses"]) for r in rows.values())
    assert rec["summary"]["fsdp2_extra_peak_gib"] is None and "GPU" in rec["summary_missing"]["fsdp2_extra_peak_gib"]


def test_bad_layers_is_one_line_naming_the_option(tmp_path):
    proc = subprocess.run([sys.executable, "benchmarks/fsdp_mesh_of_one.py", "--layers", "1", "--out",
                           str(tmp_path / "f.json")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--layers" in proc.stderr and not (tmp_path / "f.json").exists()


def test_summary_keeps_a_row_killed_after_it_was_written_and_names_a_failed_one():
    sys.path.insert(0, str(ROOT))
    from benchmarks.fsdp_mesh_of_one import summarize

    def row(name, peak, **extra):
        return dict(row=name, seq=4096, peak_allocated_gib=peak, static_allocated_gib=8.0, root_unit_gib=2.6,
                    one_layer_gib=1.0, process={"pid": 7}, **extra)

    killed = "timeout: the row's process was killed after 600 s"
    rows = [row("fsdp2", 21.0, error=killed), row("no_fsdp", 17.5), row("fsdp2_replicate_frozen", 17.4)]
    summary, missing = summarize(rows)
    assert missing == {} and summary["fsdp2_extra_peak_gib"] == 3.5 and summary["replicate_frozen_saves_gib"] == pytest.approx(3.6)
    rows[1] = dict(row="no_fsdp", seq=4096, error="RuntimeError: CUDA out of memory", traceback_tail="...")
    summary, missing = summarize(rows)
    assert summary == {"fsdp2_extra_peak_gib": None} and "no_fsdp" in missing["fsdp2_extra_peak_gib"]
    assert "CUDA out of memory" in missing["fsdp2_extra_peak_gib"]
