"""Tiny Mamba-1 decoders (random weights, no hub access) as `package.module:factory` callables for the command
line: `--model tests.models.mamba1_models:mamba_tiny`. The configs are `models/tiny.tiny_config` of each class
(hidden 64, two layers, vocabulary 256): Mamba's and Falcon-Mamba's selective scan (passes/capture/selective_scan.py)."""

from __future__ import annotations

from autoshard.models.tiny import build_tiny, tiny_config


def mamba_tiny():
    return build_tiny(tiny_config("mamba"))


def falcon_mamba_tiny():
    return build_tiny(tiny_config("falcon_mamba"))
