"""The Megatron Core adapter: adapter (model chunks, optimizer view, the registry's adapt), topology (peers from
parallel_state, MoE layers), scheduler (OptimizerParamScheduler replay)."""
