"""Kernels behind the model's plain calls: which kernel a platform gets (`kernel_choice`) and the
fused post-norm (`fused_norm`, Pallas)."""
