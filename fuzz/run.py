#!/usr/bin/env python3
"""Run one harness with the standard flags and print its figures as a table row.

    python fuzz/run.py vllm_outputs                   # 1,000,000 executions, seeded corpus
    python fuzz/run.py tensors --runs 200000 --known tensor-zero-dims
    python fuzz/run.py all --runs 1000000             # every target, one after the other

Per target: seeds ``fuzz/corpus/<target>`` (``seed_corpus.py``) if empty, runs
``python fuzz/<target>.py fuzz/corpus/<target> -atheris_runs=N -rss_limit_mb=1024
-timeout=10 -artifact_prefix=fuzz/artifacts/<target>/`` with
``ZMQD_FUZZ_KNOWN`` set from ``--known``, keeps the log in
``fuzz/artifacts/<target>/run-<tags or "strict">.log`` and prints one Markdown row: target,
executions, wall time, exec/s, final coverage (``cov``) and features (``ft``),
corpus size, crash (artifact path or "none"). One fuzzer at a time (the
machine has 2 cores).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
TARGETS = ("vllm_outputs", "vllm_control", "tensors", "vllm_requests", "tokenspeed_outputs", "tokenspeed_requests",
           "translate", "tokenspeed_translate")

STAT = re.compile(r"^#(\d+)\s+\w+\s+cov: (\d+) ft: (\d+) corp: (\d+)/")
DONE = re.compile(r"^Done (\d+) in (\d+) second")
ARTIFACT = re.compile(r"artifact_prefix='[^']*'; Test unit written to (\S+)")


def run(target: str, runs: int, known: str, extra: list[str]) -> str:
    corpus = HERE / "corpus" / target
    artifacts = HERE / "artifacts" / target
    artifacts.mkdir(parents=True, exist_ok=True)
    if not corpus.is_dir() or not any(corpus.iterdir()):
        subprocess.run([sys.executable, str(HERE / "seed_corpus.py"), target, str(corpus)], check=True)
    cmd = [sys.executable, str(HERE / f"{target}.py"), str(corpus), f"-atheris_runs={runs}", "-rss_limit_mb=1024",
           "-timeout=10", f"-artifact_prefix={artifacts}/", *extra]
    env = dict(os.environ, ZMQD_FUZZ_KNOWN=known)
    log_path = artifacts / f"run-{known.replace(',', '+') or 'strict'}.log"
    start = time.monotonic()
    with open(log_path, "w") as log:
        log.write(f"# ZMQD_FUZZ_KNOWN={known!r} {' '.join(cmd)}\n")
        log.flush()
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env).returncode
    wall = time.monotonic() - start
    execs = cov = ft = corp = 0
    crash = "none"
    for line in log_path.read_text(errors="replace").splitlines():
        if m := STAT.match(line):
            execs, cov, ft, corp = (int(x) for x in m.groups())
        elif m := DONE.match(line):
            execs = int(m.group(1))
        elif m := ARTIFACT.search(line):
            crash = os.path.relpath(m.group(1), ROOT)
    if rc != 0 and crash == "none":
        crash = f"exit {rc} (see {os.path.relpath(log_path, ROOT)})"
    rate = execs / wall if wall else 0.0
    return (f"| {target} | {execs:,} | {wall:,.0f} s | {rate:,.0f} | {cov} | {ft} | {corp} | "
            f"{known or '-'} | {crash} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", choices=(*TARGETS, "all"))
    ap.add_argument("--runs", type=int, default=1_000_000)
    ap.add_argument("--known", default="", help="comma-separated bug tags to tolerate (ZMQD_FUZZ_KNOWN)")
    ap.add_argument("extra", nargs="*", help="more libFuzzer flags, after --")
    args = ap.parse_args()
    print("| target | execs | wall | exec/s | cov | ft | corpus | tolerated | crash |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---|")
    for target in TARGETS if args.target == "all" else (args.target,):
        print(run(target, args.runs, args.known, args.extra), flush=True)


if __name__ == "__main__":
    main()
