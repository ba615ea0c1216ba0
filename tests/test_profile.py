"""The suite's profile (``tests/_profile.py``): what a test started is counted, and the
table in ``docs/develop.md`` is the saved profile's, rendered."""

from __future__ import annotations

import subprocess
import sys
import time

from tests._profile import BEGIN, END, SAVED, Sampler, read, render


def test_the_sampler_counts_the_processes_a_test_starts_and_their_memory() -> None:
    sleep = "import time; time.sleep(1.5)"
    # A guard whose command names the vLLM server it starts at once, as libra's does:
    # one vLLM start, however the two are listed.
    server = [sys.executable, "-c", sleep, "vllm.entrypoints.openai"]
    guard = f"import subprocess; subprocess.run({server!r})"
    running = subprocess.Popen([sys.executable, "-c", sleep, "vllm.entrypoints"])
    time.sleep(0.2)  # (its command line is read)
    with Sampler() as usage:  # a server running before the test is not the test's
        children = [
            subprocess.Popen([sys.executable, "-c", guard, "--", *server]),
            subprocess.Popen([sys.executable, "-c", sleep, "spawn_main"]),  # a rank
        ]
        for child in [*children, running]:
            child.wait()
    assert (usage.vllm, usage.spawned, usage.ray) == (1, 1, 0)
    assert usage.peak_rss_mib > 10  # pytest itself, at least


def test_the_docs_table_is_the_saved_profile_rendered() -> None:
    page = (SAVED.parent.parent / "develop.md").read_text()
    table = page.split(BEGIN)[1].split(END)[0].strip()
    assert table == render(*read(SAVED)), "run python -m tests._profile FILE --write"
