"""A/B of environment settings on the decode step alone (python -m tidal.bench.step, batch 1 and 8, context
256), variants alternating for ROUNDS rounds; prints ms/step and CPU seconds per run, then medians.
Usage: python3 scripts/ab_step_env.py ROUNDS THREADS NAME=VAR:VALUE[,VAR:VALUE] ...  (NAME= for no change)"""
import json, os, resource, statistics, subprocess, sys, tempfile
rounds, threads = int(sys.argv[1]), sys.argv[2]
variants = {}
for spec in sys.argv[3:]:
    name, _, envs = spec.partition("=")
    variants[name] = dict(e.split(":", 1) for e in envs.split(",") if e)
res = {n: {"ms": {}, "cpu": []} for n in variants}
for r in range(rounds):
    for name, env in variants.items():
        out = tempfile.mktemp(suffix=".json")
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run([sys.executable, "-m", "tidal.bench.step", "--batch-sizes", "1", "8", "--context", "256",
                        "--steps", "20", "--threads", threads, "--output-file", out],
                       env={**os.environ, **env}, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        res[name]["cpu"].append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
        for row in json.load(open(out))["decode"]:
            res[name]["ms"].setdefault(row["batch"], []).append(row["ms_per_step_p50"])
        print(name, r, {b: v[-1] for b, v in res[name]["ms"].items()}, "cpu %.1f" % res[name]["cpu"][-1], flush=True)
for name, d in res.items():
    print(name, {b: round(statistics.median(v), 1) for b, v in d["ms"].items()}, "cpu", round(statistics.median(d["cpu"]), 1))
