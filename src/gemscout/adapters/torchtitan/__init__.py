"""The TorchTitan adapter: adapter (the ``Trainer``'s model parts, caller state and the registry's adapt),
optimizers (the ``OptimizersContainer`` view, the dataloader state's storable form), topology (SCOUT's peers from the
parameters' DeviceMesh and ``parallel_dims``, pipeline stage order)."""
