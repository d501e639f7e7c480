"""Capture: the model traced into a joint graph, its layer kinds, fused kernels substituted, and the
symbolic cost table built from it (cached on disk; the presets' tables ship in the package)."""
