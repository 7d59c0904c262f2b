"""A pipeline left open at interpreter exit stops its engine thread quietly (issue 23, item 6).

The script below ends while a stream is still generating: the engine thread is mid-step when the
interpreter shuts down. Before the fix ``concurrent.futures`` refused the next pass ("cannot schedule
new futures after interpreter shutdown") and the engine thread printed that traceback.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import fuseserve

    p = fuseserve.pipeline("smollm2-135m-instruct", token_budget=64, progress=False)
    print("text:", p("Hi", max_new_tokens=4)[0].text)
    stream = p.stream("An unfinished stream keeps the engine busy at exit", max_new_tokens=200)
    print("first delta:", repr(next(stream)))
    """
)


def test_an_open_pipeline_exits_without_a_traceback(smollm2_source):
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "text:" in result.stdout and "first delta:" in result.stdout, result.stdout
    assert "Traceback" not in result.stderr and "engine step failed" not in result.stderr, result.stderr[
        -3000:
    ]
