import json, glob, statistics, os
rows = {}
for f in glob.glob("r*.jsonl"):
    rs = [json.loads(l) for l in open(f) if l.strip()]
    t = [r["t"] for r in rs if r.get("committed") and not r.get("final")]
    if len(t) > 3: rows[f[:-6]] = t
allgaps = [b - a for t in rows.values() for a, b in zip(t, t[1:])]
med = statistics.median(allgaps)
# stall episodes: intervals (a,b) with gap > med+1 s on any replica; merge overlapping; per episode max gap-med
iv = sorted((a, b, b - a - med, n) for n, t in rows.items() for a, b in zip(t, t[1:]) if b - a - med > 1.0)
eps = []
for a, b, g, n in iv:
    if eps and a < eps[-1][1]:
        e = eps[-1]; e[1] = max(e[1], b); e[2] = max(e[2], g); e[3].add(n)
    else:
        eps.append([a, b, g, {n}])
st = sorted(e[2] for e in eps)
print("replicas", len(rows), "median round gap", round(med, 3), "episodes", len(eps))
print("stalls: median", round(statistics.median(st), 2), "min", round(st[0], 2), "max", round(st[-1], 2))
print("episodes <=2 s", sum(s <= 2 for s in st), ">10 s", sum(s > 10 for s in st))
print([round(s, 1) for s in st])
t0 = min(t[0] for t in rows.values()); t1 = max(t[-1] for t in rows.values())
print("span", round(t1 - t0), "s; rounds at the end", max(len(t) for t in rows.values()))
