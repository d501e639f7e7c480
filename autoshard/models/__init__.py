"""Model presets: Hugging Face configs built with random weights (or on the meta device)."""

from autoshard.model_spec import ModelSpec
from autoshard.models.presets import PRESETS, build_model, get_spec, preset_names, resolve_model

__all__ = ["PRESETS", "ModelSpec", "build_model", "get_spec", "preset_names", "resolve_model"]
