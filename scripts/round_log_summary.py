"""Take a `--round-log FILE` apart: the served hit rate, and for the misses whether timing (the foresight job was
cut or never ran) or prediction (it finished and the realised outcome was not among those it pre-drafted) lost them.

    .venv/bin/python scripts/round_log_summary.py ROUNDLOG.jsonl[.gz] [--by-run]

One table per run (the request id names it: bench-<run>-<i>) with `--by-run`, else one for the whole file.
"""
from __future__ import annotations

import argparse
import gzip
import json
import statistics
from collections import defaultdict
from pathlib import Path


def run_name(req_id: str) -> str:
    """bench-pipelined-3 -> pipelined (a served request id stays as it is)."""
    parts = req_id.split("-")
    return "-".join(parts[1:-1]) if parts[0] == "bench" and len(parts) > 2 else req_id


def summary(lines: list[dict]) -> dict:
    """Hit rate; misses split by cause; rank of the realised outcome; foresight time against the verify time."""
    n = len(lines)
    hits = [r for r in lines if r["hit"]]
    misses = [r for r in lines if not r["hit"]]
    done = [r for r in lines if r["job"] == "done"]
    share = (lambda k: round(k / n, 3)) if n else (lambda k: None)
    ranks = defaultdict(int)
    for r in done:
        ranks["miss" if r["rank"] is None else r["rank"]] += 1
    overrun = [r for r in lines if r["foresight_ms"] is not None and r["foresight_ms"] > r["verify_ms"]]
    return {
        "rounds": n,
        "hit_rate": share(len(hits)),
        "miss_job_none": share(sum(r["job"] == "none" for r in misses)),  # timing: no foresight before the outcome
        "miss_job_cut": share(sum(r["job"] == "cut" for r in misses)),  # timing: the outcome ended the job
        "miss_not_predicted": share(sum(r["job"] == "done" and r["rank"] is None for r in misses)),  # prediction
        "replay_like_hit_rate": round(sum(r["rank"] is not None for r in done) / len(done), 3) if done else None,
        "rank_of_realised_when_done": dict(sorted(ranks.items(), key=lambda kv: str(kv[0]))),
        "outcomes_predicted_mean": _mean([len(r["predicted"]) for r in done]),
        "foresight_ms_p50": _median([r["foresight_ms"] for r in lines if r["foresight_ms"] is not None]),
        "verify_ms_p50": _median([r["verify_ms"] for r in lines]),
        "foresight_over_verify": share(len(overrun)),
        "passes_mean_hits": _mean([r["passes"] for r in hits]),
        "refreshes_mean_hits": _mean([r["refreshes"] for r in hits]),
    }


def _mean(xs: list[float]) -> float | None:
    return round(statistics.fmean(xs), 3) if xs else None


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 2) if xs else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", type=Path)
    ap.add_argument("--by-run", action="store_true", help="one summary per bench run (request id bench-<run>-<i>)")
    args = ap.parse_args()
    text = gzip.decompress(args.log.read_bytes()).decode() if args.log.suffix == ".gz" else args.log.read_text()
    lines = [json.loads(line) for line in text.splitlines() if line.strip()]
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in lines:
        groups[run_name(r["req"]) if args.by_run else "all"].append(r)
    print(json.dumps({name: summary(rows) for name, rows in groups.items()}, indent=2))


if __name__ == "__main__":
    main()
