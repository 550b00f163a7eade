"""Hydra configs, shipped as package data so `pkg://specdistill.conf` finds them."""
