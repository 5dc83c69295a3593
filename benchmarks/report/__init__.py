"""The report tooling of the benchmarks: result files in and out, and the pages and plots made from them.

Owns no benchmark row (the scripts in `benchmarks/` do). Modules:
  results_io  the one writer and reader of `benchmarks/results/*.json` (every row script writes through it)
  checkout    the `tree` digest a result file records beside `commit`
  pages       `docs/benchmarks.md` and the README's headline block (`python -m benchmarks.report`)
  tables      the curated tables at the top of `docs/benchmarks.md`
  targets     the performance targets table
  plots       `docs/img/*.png` (`python -m benchmarks.report.plots`)
"""
