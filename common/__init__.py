"""What every layer may import: it imports nothing of the project's (backend, client, kernels,
model_repository sit above it). ``common.env``: the environment registry."""
