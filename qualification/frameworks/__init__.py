"""Test-only layers that let a framework run on this CPU-only (gloo) machine class; the runtime never imports them."""
