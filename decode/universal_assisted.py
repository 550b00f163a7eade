"""`transformers`' universal assisted generation, and telling its own faults from ours.

Target p, drafter q. `generate(assistant_model=q, tokenizer=, assistant_tokenizer=)` drafts with
a drafter of another tokenizer by re-tokenising text between the two. validate times it beside
our decoder and export proves a mapped drafter with it, because it is the path a user of
`transformers` has. Its candidate generator is internal code that changes between releases, and
some releases break inside it for a drafter that is fine: transformers 5.25.0 rolls the
assistant's KV cache back by a count of the *target's* tokens, so where the drafter's
tokenisation of the same text is longer, stale entries stay in its cache, and once a rejected
draft shortens the assistant's input below the cache the assistant is handed no new token and
its attention fails to reshape an empty tensor. Such a failure is a fact about the installed
`transformers`, not about the drafter: callers record it in one line that names the release,
the releases it worked on and the fix, and prove the drafter through our decoder instead.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from pathlib import PurePath

# The code whose failures are transformers' own: the candidate generator that re-tokenises
# between the two vocabularies and drives the assistant (the assisted loop above it is on every
# stack, the target's generate too, so it says nothing).
_INTERNAL = "transformers/generation/candidate_generator.py"
# The newest release on which the universal path ran this project's checks and reproduced the
# target's greedy output (tests/distill/test_export_real_tokenizers.py); pyproject.toml excludes
# the releases known to break in it.
KNOWN_GOOD = "5.24.0"


def transformers_version() -> str:
    """The installed `transformers` release."""
    import transformers

    return transformers.__version__


@dataclass(frozen=True)
class UpstreamFault:
    """A failure raised inside `transformers`' assisted-generation code."""

    version: str
    where: str
    message: str

    def line(self) -> str:
        """One line for a report, export.json or a card: what failed, where, and the fix."""
        return (
            f"transformers {self.version}'s universal assisted generation failed inside "
            f"transformers ({self.where}: {self.message}); it reproduced the target on "
            f"transformers {KNOWN_GOOD}: pip install 'transformers=={KNOWN_GOOD}' to use "
            "generate(assistant_tokenizer=) with this drafter"
        )


def upstream_fault(error: BaseException) -> UpstreamFault | None:
    """`error` as transformers' own fault when it was raised under its assisted-generation code
    (a frame of that code on the stack where it was raised), else None: anything else is ours
    or the caller's and must propagate."""
    if not isinstance(error, (RuntimeError, ValueError, IndexError)):
        return None
    frames = traceback.extract_tb(error.__traceback__)
    inside = [f for f in frames if f.filename.replace("\\", "/").endswith(_INTERNAL)]
    if not inside:
        return None
    last = inside[-1]
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    where = f"{PurePath(last.filename).name}:{last.name}"
    return UpstreamFault(version=transformers_version(), where=where, message=first)
