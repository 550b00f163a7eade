"""The decoder benchmark: the validate stage's side-by-side measurement under its benchmark name.

    python -m specdistill.decode.bench pair=toy pair.drafter=DIR/best output_dir=OUT

Target-only vs speculative vs `transformers` assisted generation, measured in one run and
reported as ratios (report.json / report.md). The stage itself is `specdistill.decode.validate`;
this entry point exists so speed goals live under a benchmark name, as the project's
conventions ask, without a second copy of the measurement.
"""

from __future__ import annotations

from specdistill.decode.validate import main

if __name__ == "__main__":
    main()
