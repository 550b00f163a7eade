"""The distill stage: the drafter trained against the target (DistillSpec losses, Seq-KD / on-policy data)."""
