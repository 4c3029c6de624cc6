"""Load tests and benchmarks: Locust users (locustfile.py), the serving benchmark (bench.py), the
offline comparison (bench_offline.py) and the documented experiments (suites.py)."""
