"""The DeepSpeed adapter: ZeRO-1/2 (engine, layout: partitions per parameter for the durable tier, zero_slices: the
optimizer recipe's slice plan, scout: the optimizer recipe on partitions) and ZeRO-3 (zero3, zero3_layout, zero3_scout: slices, masters and the gathered
forward replay). The registry imports :mod:`.engine` only when a DeepSpeed engine is given."""
