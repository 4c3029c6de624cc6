"""The lab: benchmarks, A/B harnesses, traces and profilers that measure the product from outside
(`python -m bench.<name> --help`); C microbenchmarks in bench/csrc (each header gives its build line).
Nothing in backend/, client/, kernels/ or model_repository/ imports from here."""
