"""Distillation benchmarks (loss kernels, held-out figure vs validate, online cost)."""
