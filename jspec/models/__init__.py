"""Flax model definitions and the research API (`load_model`)."""

from jspec.models.loader import Model, load_model, random_model

__all__ = ["Model", "load_model", "random_model"]
