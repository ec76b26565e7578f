"""Deterministic workloads for qualification: tiny models and synthetic token data from a seed."""

from qualification.workloads.data import synthetic_batch
from qualification.workloads.models import (
    BATCH_SHAPES,
    ThreeBlockTransformer,
    TinyCausalLM,
    TwelveBlockTransformer,
    build_model,
    lm_loss,
)

__all__ = [
    "BATCH_SHAPES",
    "ThreeBlockTransformer",
    "TwelveBlockTransformer",
    "TinyCausalLM",
    "build_model",
    "lm_loss",
    "synthetic_batch",
]
