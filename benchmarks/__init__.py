"""Side-by-side benchmarks of gradtx against torch, torchopt and optax; run ``benchmarks/run.py``."""
