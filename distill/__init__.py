"""Top floor: divergences, the distill stage, online adaptation, export and the pipeline."""
