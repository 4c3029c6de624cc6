"""The lab: benchmarks that measure the product from outside (`python -m bench.<name> --help`).
Nothing in backend/, client/, kernels/ or model_repository/ imports from here."""
