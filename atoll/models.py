"""Model shapes by name or by file, whichever their source: Atoll's own presets (`atoll.modelspec.PRESETS`) and
Hugging Face models' published shapes (`atoll.hf.HF_PRESETS`), a JSON file of model fields or a Hugging Face
config.json.

This module sits above both `atoll.modelspec` and `atoll.hf` (which builds on modelspec), so modelspec never
imports hf.
"""

from __future__ import annotations

import json
from pathlib import Path

from atoll.fsutil import read_text_file
from atoll.hf import HF_PRESETS, config_from_hf, hf_preset
from atoll.modelspec import PRESETS, ModelConfig, ModelSpec


def preset(name: str) -> ModelConfig:
    """A named model configuration (case-insensitive): tiny, small, 125m, 350m, 1.3b, 7b, 13b, 70b, or a
    Hugging Face model's published shape (`atoll.hf.HF_PRESETS`: gpt2, llama-3.2-1b, qwen2.5-0.5b, ...)."""
    found = PRESETS.get(name.lower()) or hf_preset(name)
    if found is None:
        raise ValueError(f"unknown model preset {name!r}; presets: {', '.join([*PRESETS, *HF_PRESETS])}")
    return found


def preset_spec(name: str) -> ModelSpec:
    """The ModelSpec of a named model configuration (`preset`)."""
    return ModelSpec.from_config(preset(name))


def load_model_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a JSON file: an object of its fields (`ModelConfig.to_dict`), or a Hugging Face
    config.json (one with a model_type, read by `atoll.hf.config_from_hf`). Every error is one line naming the
    file."""
    text = read_text_file(path, "model file", "pass a JSON file of model fields or a Hugging Face config.json")
    try:
        doc = json.loads(text)
    except ValueError as e:  # JSONDecodeError, or an integer too long to read
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    if isinstance(doc, dict) and "model_type" in doc:
        return config_from_hf(doc, where=str(path))
    return ModelConfig.from_dict(doc, where=str(path))
