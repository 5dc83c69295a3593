"""`python -m benchmarks.report`: regenerate docs/benchmarks.md, the README block and the plots (`pages.main`)."""

import sys

from benchmarks.report.pages import main

sys.exit(main())
