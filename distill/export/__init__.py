"""The export stage: the drafter as a plain Hugging Face checkpoint with a measured model card."""
