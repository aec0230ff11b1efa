"""Code reward and its sandbox: correct programs pass; every escape attempt scores 0 and leaves the
calling process and machine as they were. Each escape is written to print exactly the expected
output if it succeeds, so a 0 proves the sandbox stopped it (not that the program was wrong)."""
import dataclasses
import json
import socket
import threading
import time

import pytest

from conftest import ROOT
from helpers.procs import processes_with
from rlspec.rewards import REWARDS
from rlspec.rewards.code import code_reward, extract_code, parse_cases
from rlspec.rewards.sandbox import Limits, namespaces_available, run_python

ISOLATIONS = ["audit"] + (["namespace"] if namespaces_available() else [])
SUM_CASES = json.dumps([{"stdin": "1 2\n", "stdout": "3\n"}, {"stdin": "10 -4\n", "stdout": "6\n"}])
FAST = Limits(wall_s=4.0, per_test_s=1.0, cpu_s=4)


def cases(stdout: str) -> str:
    return json.dumps([{"stdin": "", "stdout": stdout}])


def sandbox_processes() -> set[int]:
    """Processes started by any sandbox still alive (their command line names the sandbox dir;
    their environment is the sandbox's own, so any session's)."""
    return processes_with(b"rlspec-sandbox-", this_session=False)


def test_correct_partial_and_wrong_programs():
    good = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    assert code_reward(good, SUM_CASES) == 1.0
    assert code_reward("```python\nprint(3)\n```", SUM_CASES) == 0.5
    assert code_reward("```python\nprint(a)\n```", SUM_CASES) == 0.0
    assert code_reward("no code", "not json") == 0.0 and code_reward(None, SUM_CASES) == 0.0
    assert REWARDS["code"]([good, "x"], [SUM_CASES, SUM_CASES]) == [1.0, 0.0]
    assert extract_code("a\n```py\nprint(1)\n```\nb\n```python\nprint(2)\n```") == "print(2)\n"
    assert parse_cases('[{"stdin": "1", "stdout": "2"}, {"bad": 1}]') == [("1", "2")]


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_reading_project_files_fails(isolation):
    target = ROOT / "README.md"
    first = target.read_text().splitlines()[0]
    prog = f"print(open({str(target)!r}).read().splitlines()[0])"
    r = run_python(prog, [""], FAST, isolation=isolation)
    assert r.outputs == [None] and r.statuses[0] in ("PermissionError", "FileNotFoundError")
    assert code_reward(f"```python\n{prog}\n```", cases(first + "\n")) == 0.0
    listing = run_python(f"import os; print(os.listdir({str(ROOT)!r}))", [""], FAST, isolation=isolation)
    assert listing.outputs == [None]


@pytest.mark.skipif(not namespaces_available(), reason="needs unshare (util-linux), user namespaces on")
def test_namespace_alone_hides_project_files_and_network():
    """The namespace layer without the audit hook: the project does not exist, the network is down."""
    r = run_python(f"print(open({str(ROOT / 'README.md')!r}).read())", [""], FAST, "namespace", audit_hook=False)
    assert r.statuses == ["FileNotFoundError"]
    r = run_python("import os; print(sorted(os.listdir('/')))", [""], FAST, "namespace", audit_hook=False)
    assert r.statuses == ["ok"] and set(eval(r.outputs[0])) <= {"usr", "lib", "lib64", "bin", "root", "sandbox"}
    r = run_python("import socket; socket.create_connection(('1.1.1.1', 53), timeout=1)", [""], FAST, "namespace",
                   audit_hook=False)
    assert r.statuses == ["OSError"]


def test_environment_secrets_do_not_reach_the_program(monkeypatch):
    monkeypatch.setenv("RLSPEC_FAKE_SECRET", "hunter2")
    prog = "import os; print(os.environ.get('RLSPEC_FAKE_SECRET'))"
    assert code_reward(f"```python\n{prog}\n```", cases("hunter2\n")) == 0.0
    r = run_python("import os; print(sorted(os.environ))", [""], FAST)
    assert eval(r.outputs[0]) == ["HOME", "LANG", "PATH", "TMPDIR"] or "RLSPEC_FAKE_SECRET" not in r.outputs[0]


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_socket_to_a_listening_server_fails(isolation):
    server = socket.create_server(("127.0.0.1", 0))
    port, accepted = server.getsockname()[1], []

    def serve():
        server.settimeout(6)
        try:
            conn, _ = server.accept()
            accepted.append(conn)
            conn.sendall(b"3\n")
        except OSError:
            pass

    t = threading.Thread(target=serve)
    t.start()
    prog = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint(s.recv(10).decode())"
    r = run_python(prog, [""], FAST, isolation=isolation)
    server.close()
    t.join()
    assert r.outputs == [None] and not accepted


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_fork_bomb_is_refused(isolation):
    t0 = time.perf_counter()
    r = run_python("import os\nwhile True:\n    os.fork()\nprint(3)", [""], FAST, isolation=isolation)
    assert r.statuses == ["PermissionError"] and time.perf_counter() - t0 < FAST.wall_s
    assert code_reward("```python\nimport subprocess\nsubprocess.run(['true'])\nprint(3)\n```", cases("3\n")) == 0.0
    assert not sandbox_processes()


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_infinite_loop_is_killed_within_the_wall_limit(isolation):
    r = run_python("while True: pass", ["", ""], FAST, isolation=isolation)
    assert r.statuses == ["timeout", "timeout"] and not r.timed_out  # the per-input alarm
    t0 = time.perf_counter()
    # a CPU limit far above the wall limit, so the wall clock (not RLIMIT_CPU) is what stops it
    r = run_python("import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\nwhile True: pass", ["", ""],
                   dataclasses.replace(FAST, cpu_s=60), isolation=isolation)
    assert r.timed_out and r.outputs == [None, None]  # the wall clock
    assert time.perf_counter() - t0 < FAST.wall_s + 2
    assert not sandbox_processes()


@pytest.mark.skipif(not namespaces_available(), reason="needs unshare (util-linux), user namespaces on")
def test_children_that_leave_the_process_group_die_with_the_sandbox():
    """Without the audit hook a program may fork; a child that calls setsid() and sleeps is still
    killed when the run ends (the pid namespace dies with its first process)."""
    prog = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(300)\nprint(3)"
    r = run_python(prog, [""], FAST, "namespace", audit_hook=False)
    assert r.outputs == ["3\n"]
    time.sleep(0.5)
    assert not sandbox_processes()


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_huge_output_is_capped(isolation):
    lim = Limits(wall_s=6.0, per_test_s=3.0, output_bytes=1 << 16)
    t0 = time.perf_counter()
    r = run_python("while True:\n    print('x' * 100000)", [""], lim, isolation=isolation)
    assert r.outputs == [None] and r.statuses == ["MemoryError"]
    r = run_python("import os\nwhile True:\n    os.write(1, b'x' * 65536)", [""], lim, isolation=isolation)
    assert r.outputs == [None]  # the file-size limit ends it (SIGXFSZ); nothing parseable came back
    assert time.perf_counter() - t0 < 2 * lim.wall_s
    assert code_reward("```python\nprint('3' + 'x' * 10**8)\n```", cases("3\n")) == 0.0


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_memory_limit(isolation):
    r = run_python("x = bytearray(8 * 2**30)\nprint(3)", [""], FAST, isolation=isolation)
    assert r.statuses == ["MemoryError"]


def test_writes_outside_the_sandbox_fail(tmp_path):
    target = tmp_path / "pwned"
    r = run_python(f"open({str(target)!r}, 'w').write('x')\nprint(3)", [""], FAST)
    assert r.outputs == [None] and not target.exists()


REFERENCE = ["a, b = map(int, input().split())\nprint(a + b)", "print(max(map(int, input().split())))",
             "print(input()[::-1])", "print(sum(c in 'aeiou' for c in input()))",
             "import math\nprint(math.factorial(int(input())))"]


def test_synthetic_code_data_is_selectable_and_solvable(tokenizer):
    from conftest import compose
    from rlspec.checks import validate
    from rlspec.data.loading import load_prompts
    from rlspec.data.synthetic_code import TASKS

    cfg = compose(["data=synthetic_code"])
    validate(cfg)
    assert cfg.data.reward == "code" and cfg.data.train.source == "synthetic_code"
    ps = load_prompts(cfg.data.train.__class__(source="synthetic_code", num_rows=10), cfg.data.synthetic,
                      key="data.train", tokenizer=tokenizer, template="raw",
                      max_prompt_tokens=cfg.data.max_prompt_tokens, on_bad_row="error")
    assert len(ps) == 10
    for p in ps.prompts:
        task = next(i for i, t in enumerate(TASKS) if t[0] in p.text)
        assert code_reward(f"```python\n{REFERENCE[task]}\n```", p.answer) == 1.0
