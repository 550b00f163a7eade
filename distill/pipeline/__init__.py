"""The one orchestrator: every stage's config composed once, run in-process or on Slurm."""
