"""The validate stage: acceptance, block efficiency and wall-clock speedup, both serving modes."""
