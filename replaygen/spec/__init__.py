"""The spec language: typed model (`model`), YAML loading and validation (`loader`)."""

from replaygen.spec.loader import load_spec, load_spec_text
from replaygen.spec.model import Spec, TargetShape

__all__ = ["Spec", "TargetShape", "load_spec", "load_spec_text"]
