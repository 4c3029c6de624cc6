#!/bin/bash
# Fused C decode step vs the torch path, side by side (docs/benchmarks.md, issue 15):
# each run alternates fused and torch decode steps in one process (bench.model_step --ab-fused);
# the whole set runs ROUNDS times. Usage: bench/ab_fused_decode.sh [ROUNDS] [STEPS]
rounds=${1:-2}; steps=${2:-16}
py=${PYTHON:-.venv/bin/python}
for r in $(seq "$rounds"); do
  for m in build/models/bench-15m build/models/bench-110m models/default; do
    for b in 1 16; do
      $py -m bench.model_step "$m" --batch "$b" --context 128 --threads 1 --steps "$steps" --ab-fused 2>/dev/null \
        | $py -c "import json,sys; d=json.loads(sys.stdin.read()); print('round $r', d['model'], 'batch', d['batch'],
  'torch best CPU ms', d['torch_best_cpu_ms'], 'fused', d['fused_best_cpu_ms'], 'speed-up', d['speedup_best_cpu'],
  '| best wall ms', d['torch_best_ms'], d['fused_best_ms'])"
    done
  done
done
