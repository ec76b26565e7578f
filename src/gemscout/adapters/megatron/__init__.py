"""The Megatron Core adapter: adapter (model chunks, the registry's adapt), optimizer_view (a MegatronOptimizer as
the inner torch optimizers GEMINI checkpoints), rng_tracker (Megatron's RNG tracker capture, restore and guard),
topology (peers from parallel_state, MoE layers), scheduler (OptimizerParamScheduler replay)."""
