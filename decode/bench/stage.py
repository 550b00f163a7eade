"""The decoder benchmark: the validate stage's side-by-side measurement under its benchmark name.

    python -m specdistill.decode.bench pair=toy pair.drafter=DIR/best output_dir=OUT
    python -m specdistill.decode.bench pair=toy pair.drafter=DIR/best output_dir=OUT \\
        'compare_draft=[1,2,4,8,heuristic,confidence]'

Target-only vs speculative vs `transformers` assisted generation, measured in one run and
reported as ratios (report.json / report.md). The stage itself is `specdistill.decode.validate.stage`;
this entry point exists so speed goals live under a benchmark name, as the project's
conventions ask, without a second copy of the measurement. `compare_draft` runs fixed Ks and
the draft-length policies side by side (`specdistill.decode.bench.draft`);
`compare_parallel=DIR` measures a parallel (PARD) drafter beside pair.drafter at each of
`parallel_gammas` (the same benchmark's `-parallel` entries); `compare_drafters=[DIR|copy:5,...]`
validates other drafters of the same target beside pair.drafter, a drafter with its own
tokenizer included (`specdistill.decode.bench.drafters`).
"""

from __future__ import annotations

from pathlib import Path

import hydra
from omegaconf import DictConfig

from specdistill.data.runtime import run_or_exit
from specdistill.data.stage_config import check_command_line
from specdistill.decode.bench.draft import run_draft
from specdistill.decode.bench.drafters import run_drafters
from specdistill.decode.validate.settings import removed_keys
from specdistill.decode.validate.stage import main as validate_main


@hydra.main(config_path="pkg://specdistill.conf", config_name="validate", version_base="1.3")
def _draft_main(cfg: DictConfig) -> None:
    run_or_exit(run_draft, cfg)
    out = Path(str(cfg.output_dir)).expanduser().absolute() / "draft.md"
    print(out.read_text(), end="")
    print(out)


@hydra.main(config_path="pkg://specdistill.conf", config_name="validate", version_base="1.3")
def _drafters_main(cfg: DictConfig) -> None:
    run_or_exit(run_drafters, cfg)
    out = Path(str(cfg.output_dir)).expanduser().absolute() / "drafters.md"
    print(out.read_text(), end="")
    print(out)


def main() -> None:
    """The benchmark's keys checked as validate's own command checks them (one `error:` line,
    exit 2, before Hydra), then the benchmark that its `compare_*` keys pick."""
    import sys

    check_command_line("validate", removed_keys())
    if any(
        a.startswith(("compare_draft=", "compare_parallel=")) and not a.endswith("=null")
        for a in sys.argv[1:]
    ):
        _draft_main()
    elif any(a.startswith("compare_drafters=") and not a.endswith("=null") for a in sys.argv[1:]):
        _drafters_main()
    else:
        validate_main()


if __name__ == "__main__":
    main()
