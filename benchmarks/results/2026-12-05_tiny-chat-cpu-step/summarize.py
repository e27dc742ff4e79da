"""`python summarize.py OUT`: per checkout, the median over runs of each run's median step (steps 6-40: wall and
process CPU time from step_clock.py; steps 20-40 from train_log.jsonl's step_time_s), and each run's logged losses."""

import glob
import json
import statistics as st
import sys

out = sys.argv[1]
for side in ("old", "base", "fix"):
    wall, cpu, logged = [], [], []
    for path in sorted(glob.glob(f"{out}/{side}-*.steps.json")):
        steps = json.load(open(path))[5:]
        log = [json.loads(line) for line in open(path[: -len(".steps.json")] + "/train_log.jsonl")]
        wall.append(st.median(s[0] for s in steps))
        cpu.append(st.median(s[1] for s in steps))
        logged.append(st.median(r["step_time_s"] for r in log if "step_time_s" in r and r["step"] > 10))
        print(f"{path}: wall {wall[-1] * 1e3:.0f} ms, cpu {cpu[-1] * 1e3:.0f} ms, step_time_s {logged[-1] * 1e3:.0f} ms, "
              f"losses {[r['loss'] for r in log if 'loss' in r]}")
    if wall:
        print(f"{side}: {len(wall)} runs, median wall {st.median(wall) * 1e3:.0f} ms, cpu {st.median(cpu) * 1e3:.0f} ms, "
              f"step_time_s {st.median(logged) * 1e3:.0f} ms")
