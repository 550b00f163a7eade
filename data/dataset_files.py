"""The files a stage reads for a prompt set, checked present before anything loads: by the
pipeline's plan for every step (distill/pipeline/preflight_plan.py) and by validate before the
pair loads to tokenize them. Which split a role reads is data/splits.py's rule, the readers' own;
whether a file is there is data/dataset_rows.py's (`present_file`), the reader's own check."""

from __future__ import annotations

from typing import Any

from specdistill.data.chat_prompts import is_conversation_set, member_nodes
from specdistill.data.dataset_rows import FILE_SOURCES, present_file
from specdistill.data.runtime import node_get
from specdistill.data.splits import read_split, stage_role


def check_files(dataset: Any, role: str) -> None:
    """Every file a stage reading `dataset` for `role` (train, test) opens is present, a
    mixture's members each, by the readers' own rule for which split a role reads."""
    role = stage_role(dataset, role)
    if node_get(dataset, "source") == "mixture":
        nodes = [(node, str(node.get("split") or role), True) for node in member_nodes(dataset)]
    else:
        nodes = [(dataset, role, is_conversation_set(dataset))]
    for node, read, chat in nodes:
        source = node_get(node, "source")
        if source in FILE_SOURCES:
            present_file(node, source, read_split(node, read) if chat else read)
