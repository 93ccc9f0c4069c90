"""benchmarks/gpu_check_jobs.py: how the GPU check's row sets run their jobs. On a GPU each job
has a process of its own; with --tiny one child runs them all. Either way each job's output is in
its own log, ending in its record, and a job that fails is recorded while the next one runs."""

import argparse
import importlib
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _jobs_module():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        return importlib.import_module("gpu_check_jobs")
    finally:
        sys.path.remove(str(REPO / "benchmarks"))


def test_a_gpu_gives_each_job_its_process_and_tiny_one_process_all():
    jobs = _jobs_module()
    assert jobs.batches(["a", "b", "c"], tiny=False) == [["a"], ["b"], ["c"]]
    assert jobs.batches(["a", "b", "c"], tiny=True) == [["a", "b", "c"]]
    assert jobs.batches([], tiny=True) == []


def test_a_failing_job_is_recorded_from_its_log_and_the_next_one_runs(tmp_path, capfd):
    jobs = _jobs_module()

    def job_main(name: str, tiny: bool) -> dict:
        print(f"{name} starts")
        os.write(2, f"{name} at file descriptor 2\n".encode())  # as XLA's C++ logging writes
        if name == "broken":
            raise ValueError("the broken job's own error")
        return {"job": name, "tokens_per_s": 1.0}

    args = argparse.Namespace(job="first,broken,last", tiny=True, out=tmp_path)
    assert jobs.run_child(job_main, args, "speed") == 1  # one job failed
    records = {name: jobs.read_job_log(name, tmp_path / f"speed-{name}.log") for name in
               ("first", "broken", "last", "never")}  # fmt: skip
    assert records["first"] == {"job": "first", "tokens_per_s": 1.0}
    assert records["last"] == {"job": "last", "tokens_per_s": 1.0}  # ran after the failure
    assert "ValueError: the broken job's own error" in records["broken"]["error"]
    assert records["never"] is None  # no log: never started
    log = (tmp_path / "speed-broken.log").read_text()
    assert "broken starts" in log and "broken at file descriptor 2" in log
    captured = capfd.readouterr()
    assert "starts" not in captured.out + captured.err  # the jobs' output went to their logs only
    assert "file descriptor" not in captured.out + captured.err


def test_a_stop_ends_the_childs_jobs(tmp_path):
    jobs = _jobs_module()
    args = argparse.Namespace(job="longest-1,longest-2,longest-3", tiny=True, out=tmp_path)

    def job_main(name: str, tiny: bool) -> dict:
        if name == "longest-2":
            raise MemoryError("out of memory")
        return {"job": name}

    stop = lambda name, record: "error" in record
    jobs.run_child(job_main, args, "attention", stop)
    assert (tmp_path / "attention-longest-2.log").exists()
    assert not (tmp_path / "attention-longest-3.log").exists()  # the search stopped


CRASHING_CHILD = """
import sys
from pathlib import Path
out = Path(sys.argv[sys.argv.index("--out") + 1])
(out / "speed-first.log").write_text('{"job": "first", "tokens_per_s": 2.0}\\n')
print("the child's last words", file=sys.stderr)
sys.exit(3)  # as a crash would, before the second job began
"""


def test_a_child_that_ends_early_leaves_its_later_jobs_not_run(tmp_path):
    jobs = _jobs_module()
    script = tmp_path / "child.py"
    script.write_text(CRASHING_CHILD)
    args = argparse.Namespace(tiny=True, deadline=120.0, out=tmp_path, jobs=None)
    records = jobs.run_jobs(str(script), "speed", ["first", "second"], args)
    assert records["first"] == {"job": "first", "tokens_per_s": 2.0}
    assert records["second"]["error"].startswith("not run: exit code 3 before it")
    assert "the child's last words" in records["second"]["error"]
    assert (tmp_path / "speed.jsonl").read_text().count('"job"') == 2
