"""Per-thread name and CPU seconds of a process and its children: python3 scripts/proc_threads.py PID"""
import os, sys, psutil
p = psutil.Process(int(sys.argv[1]))
for q in [p] + p.children(recursive=True):
    rows = []
    for tid in sorted(os.listdir(f"/proc/{q.pid}/task"), key=int):
        try:
            comm = open(f"/proc/{q.pid}/task/{tid}/comm").read().strip()
            f = open(f"/proc/{q.pid}/task/{tid}/stat").read().rsplit(")", 1)[1].split()
            cpu = (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
            rows.append(f"{tid}:{comm}:{cpu:.2f}")
        except OSError:
            pass
    print(q.pid, len(rows), " ".join(rows))
