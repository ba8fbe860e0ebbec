"""Device kernels shared by accelerator backends.

Nothing here is imported by the engine itself: a backend imports the kernels it uses when it is
created. Kernels take tensors (never a device module), so the core imports no device module.
"""
