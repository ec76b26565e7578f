"""Framework adapters: what ``enable_resiliency`` attaches to when the training loop is not plain PyTorch.

:mod:`gemscout.adapters.registry` lists the adapters; each tells its framework's objects by their class names
(:mod:`.classes`) and the first that claims the objects given is used; each adapter turns a framework's engine into the model, the step-hooked optimizer and the extra state that
GEMINI and SCOUT work on. No adapter imports its framework: they work on the live objects the caller already built,
so ``import gemscout`` never loads deepspeed, megatron or torchtitan, and nothing here is imported before
``enable_resiliency`` runs.
"""
