"""The scheduler accounting of ``zmqdispatch bench --real-engine`` (``zmqdispatch.bench._schedstat``).

Parsing and arithmetic on sample text; the readers on this process and a child
it starts, asserting counts (switches, threads), never times.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from zmqdispatch.bench import _schedstat as ss

STATUS = """Name:\tpython3
Umask:\t0022
State:\tS (sleeping)
Tgid:\t4242
Threads:\t3
voluntary_ctxt_switches:\t1507
nonvoluntary_ctxt_switches:\t23
"""

PROC_STAT = """cpu  2749024 5 324708 1151241 10220 7 3070 27109 900 0
cpu0 1346742 0 176417 592025 3201 0 458 13569 0 0
intr 1 2 3
"""


def test_parse_schedstat_reads_three_counters_and_refuses_anything_else() -> None:
    assert ss.parse_schedstat("308386 91516 2\n") == (308386, 91516, 2)
    for bad in ("308386 91516", "1 2 3 4", "1 -2 3", "a b c"):
        with pytest.raises(ValueError):
            ss.parse_schedstat(bad)


def test_parse_switches_reads_the_two_status_lines() -> None:
    assert ss.parse_switches(STATUS) == (1507, 23)
    with pytest.raises(ValueError, match="nonvoluntary_ctxt_switches"):
        ss.parse_switches(STATUS.replace("nonvoluntary", "x"))


STAT = b"77 (a) b (c)) S 12 77 77 0 -1 4194560 1990 0 0 0 1500 250 3 4 20 0 9 0 100 1000 50"


def test_parse_stat_takes_the_name_between_the_outer_parentheses_and_the_process_cpu() -> None:
    assert ss.parse_stat(STAT) == ("a) b (c)", 12, 1750)  # utime 1500 + stime 250 (not the children's 3, 4)
    assert ss.parse_stat(STAT.replace(b"(a) b (c))", b"(VLLM::EngineCor)")) == ("VLLM::EngineCor", 12, 1750)


def test_parse_machine_cpu_counts_all_but_idle_and_iowait_and_not_guest_twice() -> None:
    busy, total = ss.parse_machine_cpu(PROC_STAT)
    assert total == 2749024 + 5 + 324708 + 1151241 + 10220 + 7 + 3070 + 27109  # guest (900) is inside user
    assert busy == total - 1151241 - 10220
    with pytest.raises(ValueError):
        ss.parse_machine_cpu("cpu0 1 2 3 4 5 6 7 8\n")


def _t(name: str, *v: int) -> ss.ThreadTimes:
    return ss.ThreadTimes(name, *v)


def test_thread_deltas_count_new_threads_from_zero_and_name_the_lost_ones() -> None:
    before = {1: _t("main", 100, 10, 5, 4, 1), 2: _t("ZMQbg/IO/0", 50, 5, 3, 3, 0), 3: _t("gone", 9, 9, 9, 9, 9)}
    after = {1: _t("main", 180, 30, 9, 7, 2), 2: _t("ZMQbg/IO/0", 60, 25, 8, 8, 0), 4: _t("new", 7, 1, 2, 2, 0)}
    deltas, ended = ss.thread_deltas(before, after)
    assert deltas == {1: _t("main", 80, 20, 4, 3, 1), 2: _t("ZMQbg/IO/0", 10, 20, 5, 5, 0),
                      4: _t("new", 7, 1, 2, 2, 0)}
    assert ended == 1
    assert ss.totals(deltas.values()) == {"on_cpu_ns": 97, "wait_ns": 41, "timeslices": 11, "voluntary": 10,
                                          "involuntary": 1}


def _raw(**over) -> dict:
    client = {"on_cpu_ns": 30_000_000, "wait_ns": 90_000_000, "timeslices": 600, "voluntary": 500,
              "involuntary": 100}
    raw = {
        "wall_s": 2.0,
        "client": client,
        "client_threads": {"main": {**client, "on_cpu_ns": 28_000_000}, "ZMQbg/IO/0": {**client,
                                                                                       "on_cpu_ns": 2_000_000}},
        "client_threads_ended": 0,
        "engine": {"on_cpu_ns": 3_600_000_000, "wait_ns": 400_000_000, "timeslices": 4000, "voluntary": 10,
                   "involuntary": 3990},
        "engine_processes": {},
        "engine_pids": 2,
        "cpus": 2,
        "machine_busy_s": 3.9,
    }
    raw.update(over)
    return raw


def test_report_per_token_per_timeslice_shares_and_cores() -> None:
    r = ss.report(_raw(), tokens=1000)
    c = r["client"]
    assert c["on_cpu_us_per_token"] == pytest.approx(30.0) and c["wait_us_per_token"] == pytest.approx(90.0)
    assert c["wait_us_per_timeslice"] == pytest.approx(150.0) and c["timeslices_per_token"] == pytest.approx(0.6)
    assert c["wakeups_per_token"] == pytest.approx(0.5) and c["involuntary_per_token"] == pytest.approx(0.1)
    assert c["wait_share"] == pytest.approx(0.75) and c["cores"] == pytest.approx(0.015)
    assert r["client_threads"]["ZMQbg/IO/0"]["on_cpu_us_per_token"] == pytest.approx(2.0)
    assert r["engine"]["cores"] == pytest.approx(1.8) and r["engine"]["wait_share"] == pytest.approx(0.1)
    # machine: 3.9 busy s over 2 s; the client and the engine account for 3.63 s of it
    assert r["machine"]["busy_cores"] == pytest.approx(1.95)
    assert r["machine"]["others_cores"] == pytest.approx((3.9 - 3.63) / 2)
    # the load generator counts as ours when there is one
    # the engine's processes ran 0.2 s more than the threads seen at the end: threads that ended
    r3 = ss.report(_raw(client_process_cpu_s=0.03, engine_process_cpu_s=3.8), tokens=1000)
    assert r3["engine"]["ended_threads_cores"] == pytest.approx(0.1)
    assert r3["client"]["ended_threads_cores"] == pytest.approx(0.0)
    assert r3["machine"]["others_cores"] == pytest.approx((3.9 - 3.83) / 2)
    lg = {"on_cpu_ns": 200_000_000, "wait_ns": 0, "timeslices": 1, "voluntary": 1, "involuntary": 0}
    r2 = ss.report(_raw(loadgen=lg), tokens=1000)
    assert r2["machine"]["others_cores"] == pytest.approx((3.9 - 3.83) / 2)
    assert r2["loadgen"]["on_cpu_us_per_token"] == pytest.approx(200.0)


def test_report_without_tokens_or_machine_gives_none_not_a_division_error() -> None:
    zero = {"on_cpu_ns": 0, "wait_ns": 0, "timeslices": 0, "voluntary": 0, "involuntary": 0}
    r = ss.report(_raw(client=zero, client_threads={}, machine_busy_s=None), tokens=0)
    assert r["client"]["on_cpu_us_per_token"] is None and r["client"]["wait_us_per_timeslice"] is None
    assert r["client"]["wait_share"] is None and "machine" not in r


def _name_thread(name: str) -> None:
    with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
        f.write(name)


CHILD = """
import sys, time
sys.stdin.readline()
for _ in range({m}):
    time.sleep(0.0005)
print("done", flush=True)
sys.stdin.read()
"""


def test_window_counts_a_threads_wakeups_and_the_engine_processes_switches() -> None:
    """Every sleep blocks: a client thread that sleeps n times shows at least n
    voluntary switches under its own name; an engine process that sleeps m
    times, at least m. (A thread that ends inside the window: test_thread_deltas_...;
    here its /proc entry may outlive ``join()``.)"""
    n, m = 40, 30
    child = subprocess.Popen([sys.executable, "-c", CHILD.format(m=m)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    go, done, leave = threading.Event(), threading.Event(), threading.Event()

    def sleeper() -> None:
        _name_thread("zmqd-sleeper")
        go.wait()
        for _ in range(n):
            time.sleep(0.0005)
        done.set()
        leave.wait()

    threads = [threading.Thread(target=sleeper)]
    try:
        for t in threads:
            t.start()
        assert child.pid in ss.engine_processes(None, os.getpid())
        assert ss.engine_processes(child.pid, os.getpid()) == [child.pid]
        window = ss.Window(os.getpid(), [child.pid, os.getpid()])
        assert window.engine_pids == [child.pid]  # the client is never counted as its own engine
        window.start()
        go.set()
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline() == "done\n"
        done.wait()
        raw = window.finish()
    finally:
        leave.set()
        for t in threads:
            t.join()
        child.communicate("")
    assert raw["engine_pids"] == 1
    assert raw["client_threads"]["zmqd-sleeper"]["voluntary"] >= n
    assert raw["client_threads"]["zmqd-sleeper"]["timeslices"] >= n
    assert "main" in raw["client_threads"]
    assert raw["client"]["voluntary"] >= raw["client_threads"]["zmqd-sleeper"]["voluntary"]
    assert raw["engine"]["voluntary"] >= m and raw["engine"]["on_cpu_ns"] > 0
    assert raw["engine_process_cpu_s"] >= 0 and raw["client_process_cpu_s"] >= 0
    (name,) = raw["engine_processes"]
    assert raw["engine_processes"][name] == raw["engine"]
    rep = ss.report(raw, tokens=n)
    assert rep["client_threads"]["zmqd-sleeper"]["wakeups_per_token"] >= 1.0
