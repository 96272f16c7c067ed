"""Kernels behind BackendConfig: RMSNorm, SwiGLU, RoPE, the MoE combine, (fused) linear cross-entropy, AdamW.

Each kernel has a torch reference that runs anywhere. Which backend runs is decided once, by
workbench.backends (BackendConfig.resolve), and handed to the kernel by name; each kernel's
KernelRegistry maps that name to its implementation. Nothing here reads a config or decides a backend.
Import each kernel from the module that defines it (workbench.kernels.rms_norm, .swiglu, .cross_entropy, ...).
"""
