"""Deterministic workloads for qualification: tiny models and synthetic token data from a seed."""

from qualification.workloads.data import synthetic_batch
from qualification.workloads.models import ThreeBlockTransformer, TinyCausalLM, build_model, lm_loss

__all__ = ["ThreeBlockTransformer", "TinyCausalLM", "build_model", "lm_loss", "synthetic_batch"]
