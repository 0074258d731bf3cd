"""Triton kernels of kamera_core; only `@triton.jit` code lives here (launchers sit beside their torch paths)."""
