"""Framework adapters: what ``enable_resiliency`` attaches to when the training loop is not plain PyTorch.

:mod:`gemscout.adapters.detect` tells the frameworks apart by the class names of the objects it is given and picks the
adapter; each adapter turns a framework's engine into the model, the step-hooked optimizer and the extra state that
GEMINI and SCOUT work on. No adapter imports its framework: they work on the live objects the caller already built,
so ``import gemscout`` never loads deepspeed, megatron or torchtitan, and nothing here is imported before
``enable_resiliency`` runs.
"""
