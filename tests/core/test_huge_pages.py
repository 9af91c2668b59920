"""The graphopt command's restart on huge pages: when it restarts, with what, and that the
restarted process's malloc memory does land on 2 MB pages."""

import os
import subprocess
import sys

import pytest

from graphopt import huge_pages
from graphopt.huge_pages import HUGETLB, ONE_ARENA, in_effect, restart_environment, thp_mode

TUNABLES = f"{HUGETLB}:{ONE_ARENA}"


@pytest.fixture
def new_glibc(monkeypatch):
    monkeypatch.setattr(huge_pages.platform, "libc_ver", lambda: ("glibc", "2.36"))


def test_thp_mode_is_the_bracketed_word(tmp_path):
    path = tmp_path / "enabled"
    path.write_text("always [madvise] never\n")
    assert thp_mode(path) == "madvise"
    path.write_text("[always] madvise never\n")
    assert thp_mode(path) == "always"
    path.write_text("garbage\n")
    assert thp_mode(path) is None
    assert thp_mode(tmp_path / "missing") is None


def test_restarts_with_the_tunable_where_thp_waits_to_be_asked(new_glibc):
    assert restart_environment({"PATH": "/bin"}, "madvise") == {"PATH": "/bin", "GLIBC_TUNABLES": TUNABLES}
    # the user's own tunables are kept, their arena count too
    env = restart_environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, "madvise")
    assert env["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{HUGETLB}"
    env = restart_environment({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"}, "madvise")
    assert env["GLIBC_TUNABLES"] == f"glibc.malloc.tcache_count=0:{TUNABLES}"


@pytest.mark.parametrize("environ, mode", [
    ({}, "always"),  # every mapping gets huge pages already
    ({}, "never"),  # none can
    ({}, None),  # no THP on this kernel
    ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "madvise"),  # the user chose: and no restart loop
    ({"GRAPHOPT_HUGE_PAGES": "0"}, "madvise"),  # opted out
])
def test_no_restart_where_it_cannot_help(new_glibc, environ, mode):
    assert restart_environment(environ, mode) is None


@pytest.mark.parametrize("libc", [("glibc", "2.34"), ("", ""), ("glibc", "unknown")])
def test_no_restart_on_a_c_library_without_the_tunable(monkeypatch, libc):
    monkeypatch.setattr(huge_pages.platform, "libc_ver", lambda: libc)
    assert restart_environment({}, "madvise") is None


def test_in_effect():
    assert in_effect({}, "always")
    assert in_effect({"GLIBC_TUNABLES": TUNABLES}, "madvise")
    assert in_effect({"GLIBC_TUNABLES": HUGETLB}, "madvise")
    assert not in_effect({}, "madvise")
    assert not in_effect({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "madvise")
    assert not in_effect({"GLIBC_TUNABLES": TUNABLES}, "never")


_CHILD = """
import os, sys
import numpy as np
from graphopt.huge_pages import restart_with_huge_pages, in_effect
restart_with_huge_pages()
weights = np.ones(64 << 20, np.uint8)  # malloc'd and touched, as a runtime's packed weights are
huge = [line.split()[1] for line in open("/proc/self/smaps_rollup") if line.startswith("AnonHugePages")]
print(os.environ.get("GLIBC_TUNABLES"), in_effect(), int(huge[0]) if huge else -1, sys.argv[1:])
"""


@pytest.mark.skipif(thp_mode() != "madvise" or restart_environment({}, "madvise") is None,
                    reason="the restart applies where THP is 'madvise' and glibc has the hugetlb tunable")
def test_the_restarted_process_keeps_its_arguments_and_gets_huge_pages():
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "GRAPHOPT_HUGE_PAGES")}
    out = subprocess.run([sys.executable, "-c", _CHILD, "a b", "-n"], env=env, capture_output=True, text=True,
                         check=True, timeout=120).stdout.strip().split(maxsplit=3)
    tunables, effect, huge_kb, argv = out
    assert tunables == TUNABLES and effect == "True" and argv == "['a b', '-n']"
    assert int(huge_kb) >= 32 << 10, f"only {huge_kb} kB of anonymous memory on huge pages"
    opted_out = subprocess.run([sys.executable, "-c", _CHILD], env={**env, "GRAPHOPT_HUGE_PAGES": "0"},
                               capture_output=True, text=True, check=True, timeout=120).stdout.split()
    assert opted_out[:2] == ["None", "False"]
