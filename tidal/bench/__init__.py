"""`tidal bench`: online serving benchmark (random prompts / Azure trace replay).

`add_bench_args(parser)` adds the flags; `run_bench(namespace)` runs and returns a dict.
`python -m tidal.bench.hf_baseline` measures the transformers `generate` baseline.
"""

from tidal.bench.serving import add_bench_args, main, run_bench

__all__ = ["add_bench_args", "run_bench", "main"]
