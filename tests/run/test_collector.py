"""The collector setting of the auditor's processes (audit.run.collector)."""

from __future__ import annotations

import gc
import subprocess
import sys

from audit.run.collector import YOUNG_THRESHOLD


def test_the_cli_process_collects_young_objects_less_often_and_frozen_start_up_never():
    probe = ("import gc, sys, atexit; "
             "atexit.register(lambda: print(gc.get_threshold()[0], gc.get_freeze_count() > 0, file=sys.stderr)); "
             "sys.argv = ['mooncake-audit', '--version']; import cli; cli.main()")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    young, frozen = done.stderr.split()[-2:]
    assert done.returncode == 0 and int(young) == YOUNG_THRESHOLD and frozen == "True"


def test_importing_the_package_leaves_the_collector_alone():  # the recorder runs inside vLLM's processes
    probe = "import gc, audit.run.scan, audit.recorder; print(gc.get_threshold()[0], gc.get_freeze_count())"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == [str(gc.get_threshold()[0]), "0"]
