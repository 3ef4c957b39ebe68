"""``tools/`` holds only maintained scripts: each is listed in ``tools/README.md`` and answers
``--help`` (it imports and builds its command line on any machine)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[2] / "tools"
SCRIPTS = sorted(p.name for p in TOOLS.glob("*.py"))

#: Runs each script given on its command line as ``python SCRIPT --help`` would, in a fork
#: of one process that imported torch first (the import is most of a script's start-up,
#: and a fork keeps each script's imports, ``sys.path`` and globals its own); prints
#: {script: [exit status, output]} as JSON.
_RUNNER = r"""
import json, os, runpy, sys, tempfile
import torch._dynamo  # noqa: F401  (torch's compiler: most of lowprec's import)
results = {}
for path in sys.argv[1:]:
    out = tempfile.TemporaryFile(mode="w+")
    pid = os.fork()
    if pid == 0:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        sys.argv = [path, "--help"]
        sys.path[0] = os.path.dirname(path)
        code = 0
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (e.code is not None)
        except BaseException:
            import traceback
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(int(code))
    _, status = os.waitpid(pid, 0)
    out.seek(0)
    results[os.path.basename(path)] = [os.waitstatus_to_exitcode(status), out.read()]
print(json.dumps(results))
"""


def test_readme_lists_exactly_the_scripts():
    listed = set(re.findall(r"^\| `([a-z_0-9]+\.py)` \|", (TOOLS / "README.md").read_text(),
                            re.MULTILINE))
    assert listed == set(SCRIPTS)
    assert len(SCRIPTS) <= 8


def test_every_script_answers_help():
    """Each script, run with ``--help``, exits 0 and prints its usage (one process for all,
    see ``_RUNNER``; a failure names every script that failed, with its output)."""
    done = subprocess.run([sys.executable, "-c", _RUNNER, *(str(TOOLS / s) for s in SCRIPTS)],
                          cwd=TOOLS.parent, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    helps = json.loads(done.stdout.splitlines()[-1])
    assert sorted(helps) == SCRIPTS
    failed = {script: output[-2000:] for script, (code, output) in helps.items()
              if code != 0 or "usage" not in output.lower()}
    assert not failed, "\n\n".join(f"{script}:\n{out}" for script, out in failed.items())
