"""GEMINI: in-memory checkpoints, peer replication, atomic persistence, trust states and recovery."""
