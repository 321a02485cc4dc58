"""Workers forked from the preloaded fork server (islands.runtime.launch.spawn) look like fresh interpreters."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from islands.runtime.launch import spawn
from islands.tasks import heavy_imports

ME = [sys.executable, "-m", "islands.runtime.launch.spawn"]


def start(tmp_path, argv, env=None, **kw):
    log = tmp_path / "out.log"
    with open(log, "w") as f:
        proc = spawn.start(argv, {"PATH": os.environ["PATH"], **(env or {})}, stdout=f, stderr=subprocess.STDOUT, **kw)
    return proc, log


def test_islands_modules_are_forked_and_see_only_the_given_environment_argv_and_cwd(tmp_path):
    assert spawn.forks(ME + ["x"]) and not spawn.forks([sys.executable, "train.py"])
    assert not spawn.forks(ME, {spawn.SPAWN_ENV: "exec"})
    proc, log = start(tmp_path, ME + ["a", "--b"], {"OMP_NUM_THREADS": "1", "ONLY": "this"}, cwd=str(tmp_path))
    assert isinstance(proc, spawn.ForkedProcess) and proc.wait(60) == 0 and proc.returncode == 0
    seen = json.loads(log.read_text().strip().splitlines()[-1])
    assert seen["pid"] == proc.pid and seen["session"] == proc.pid  # a session of its own, as start_new_session
    assert seen["argv"] == ["a", "--b"] and seen["cwd"] == str(tmp_path) and seen["stdin"] == ""
    assert seen["env"] == {"PATH": os.environ["PATH"], "OMP_NUM_THREADS": "1", "ONLY": "this"}
    assert seen["parent"] != os.getpid()  # the fork server's child, not an interpreter this process started


def test_exit_codes_and_signals_read_as_popen_reads_them(tmp_path):
    for given, want in (("3", 3), ("a message", 1)):
        proc, log = start(tmp_path, ME, {"SPAWN_EXIT": given})
        assert proc.wait(60) == want
    assert "a message" in log.read_text()  # sys.exit(str) prints it, as the interpreter does
    missing, log = start(tmp_path, [sys.executable, "-m", "islands.no_such_module"])
    assert missing.wait(60) == 1 and "No module named islands.no_such_module" in log.read_text()
    sleeper, log = start(tmp_path, ME, {"SPAWN_SLEEP": "60"})
    deadline = time.monotonic() + 60
    while not log.read_text():  # it runs
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert sleeper.poll() is None
    shown = Path(f"/proc/{sleeper.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    assert shown == " ".join(ME)  # what ps and pgrep -f show: the command, not the fork server's
    with pytest.raises(subprocess.TimeoutExpired):
        sleeper.wait(0.1)
    os.killpg(sleeper.pid, signal.SIGTERM)  # the launcher signals a worker's whole group
    assert sleeper.wait(30) == -signal.SIGTERM
    sleeper.kill()  # gone: nothing to signal, no error


def test_other_commands_and_exec_mode_start_with_popen(tmp_path):
    proc, log = start(tmp_path, ME, {spawn.SPAWN_ENV: "exec"})
    assert isinstance(proc, subprocess.Popen) and proc.wait(60) == 0
    seen = json.loads(log.read_text().strip().splitlines()[-1])
    assert seen["session"] == proc.pid and seen["parent"] == os.getpid()  # a fresh interpreter of ours


def test_without_the_stdlib_internals_it_needs_workers_start_as_fresh_interpreters(tmp_path, monkeypatch):
    def moved(*args, **kwargs):
        raise AttributeError("module 'multiprocessing.forkserver' has no attribute 'connect_to_new_process'")

    monkeypatch.setattr(spawn, "ForkedProcess", moved)
    monkeypatch.setattr(spawn, "_unavailable", [])
    with pytest.warns(RuntimeWarning, match="fork server is unavailable"):
        proc, log = start(tmp_path, ME)
    assert isinstance(proc, subprocess.Popen) and proc.wait(60) == 0
    assert not spawn.forks(ME)  # decided once for this process
    assert json.loads(log.read_text().strip().splitlines()[-1])["parent"] == os.getpid()


def test_a_server_that_initialised_cuda_makes_each_copy_a_fresh_interpreter(monkeypatch):
    import types

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: True))
    monkeypatch.setitem(sys.modules, "torch", fake)
    assert spawn._server_touched_cuda()  # then _child execs `python -m module args` instead of running it forked
    fake.cuda.is_initialized = lambda: False
    assert not spawn._server_touched_cuda()


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip"), reason="network namespaces need root and iproute2")
def test_a_worker_started_for_a_namespace_runs_inside_it_forked_or_not(tmp_path):
    """An elastic island on a testbed host (islands.runtime.launch.elastic): a forked copy enters the namespace
    itself, a fresh interpreter runs under `ip netns exec`; either way the worker's network is the host's."""
    ns = "isl-spawn" + str(os.getpid())
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        inode = os.stat(f"/var/run/netns/{ns}").st_ino
        for env in ({}, {spawn.SPAWN_ENV: "exec"}):
            proc, log = start(tmp_path, ME, env, netns=ns)
            assert isinstance(proc, spawn.ForkedProcess) == (not env) and proc.wait(60) == 0, log.read_text()
            seen = json.loads(log.read_text().strip().splitlines()[-1])
            assert seen["netns"] == f"net:[{inode}]" != os.readlink("/proc/self/ns/net")
            assert seen["session"] == proc.pid
        assert os.readlink("/proc/self/ns/net") != f"net:[{inode}]"  # the launcher itself never moved
    finally:
        subprocess.run(["ip", "netns", "delete", ns], check=False)


def test_a_jobs_heavy_imports_are_preloaded_by_the_fork_server(tmp_path):
    # a fresh interpreter, so that its fork server starts after preload(); a module that is not installed is skipped
    script = (
        "import json, os, subprocess, sys\n"
        "from islands.runtime.launch import spawn\n"
        "from islands.tasks import heavy_imports\n"
        "spawn.preload(['colorsys', 'no_such_module_here', *heavy_imports('digits')])\n"
        "env = {'PATH': os.environ['PATH'], 'SPAWN_MODULES': 'colorsys,sklearn.datasets,wave'}\n"
        "proc = spawn.start([sys.executable, '-m', 'islands.runtime.launch.spawn'], env, stdout=sys.stdout)\n"
        "sys.exit(proc.wait(120))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["imported"] == ["colorsys"]  # preloaded; wave was not asked for, digits needs no sklearn
    assert heavy_imports("lm") == heavy_imports("digits") == ()
    assert "transformers.modeling_utils" in heavy_imports("hf-causal-lm")


USER_SCRIPT = """\
import json, os, sys
import numpy as np
print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "name": __name__, "file": __file__,
                  "preloaded": "colorsys" in sys.modules, "draw": int(np.random.randint(1 << 30)),
                  "parent": os.getppid()}), flush=True)
if len(sys.argv) > 1 and sys.argv[1] == "fail":
    raise ValueError("the script's own error")
"""


def test_a_users_script_is_forked_as_python_would_run_it_when_modules_are_preloaded_for_it(tmp_path):
    """`islands run --preload` (ISLANDS_PRELOAD): a user's script or `-m` module runs in a copy of a server that
    imported the named modules, with what `python script.py` would give it: sys.argv, sys.path[0] its folder (the
    module form: the working directory), __main__, its own numpy seed, its own exit code and traceback."""
    code = tmp_path / "code"
    (code / "userpkg").mkdir(parents=True)
    (code / "train.py").write_text(USER_SCRIPT)
    (code / "userpkg" / "__init__.py").write_text("")
    (code / "userpkg" / "main.py").write_text(USER_SCRIPT)
    script = [sys.executable, str(code / "train.py")]
    env = {spawn.PRELOAD_ENV: "colorsys"}
    assert spawn.forks(script, env) and not spawn.forks(script, {})
    assert not spawn.forks([sys.executable, "-u", str(code / "train.py")], env)  # interpreter options: not forkable
    runs = []
    for argv in (script + ["a", "--b"], script + ["c"], [sys.executable, "-m", "userpkg.main"]):
        proc, log = start(tmp_path, argv, env, cwd=str(code))
        assert isinstance(proc, spawn.ForkedProcess) and proc.wait(120) == 0, log.read_text()
        runs.append(json.loads(log.read_text().strip().splitlines()[-1]))
    first, second, module = runs
    assert first["argv"] == [str(code / "train.py"), "a", "--b"] and second["argv"][1:] == ["c"]
    assert first["path0"] == str(code) and first["name"] == "__main__" and first["file"] == str(code / "train.py")
    assert module["argv"][0] == str(code / "userpkg" / "main.py") and module["path0"] == str(code)
    assert all(r["preloaded"] and r["parent"] != os.getpid() for r in runs)
    assert len({r["draw"] for r in runs}) == 3  # numpy's global generator reseeded in each copy
    proc, log = start(tmp_path, script + ["fail"], env, cwd=str(code))
    assert proc.wait(120) == 1 and "ValueError: the script's own error" in log.read_text()
    # what islands' own workers' server imports anyway needs no server of its own: the script forks from that one
    assert spawn._script_server(("torch", "islands")) is None and spawn._script_server(("colorsys",)) is not None
    proc, log = start(tmp_path, script, {spawn.PRELOAD_ENV: "islands"}, cwd=str(code))
    assert isinstance(proc, spawn.ForkedProcess) and proc.wait(120) == 0, log.read_text()
    alone = json.loads(log.read_text().strip().splitlines()[-1])
    assert alone["path0"] == str(code) and alone["parent"] not in {first["parent"], os.getpid()}


def test_a_forked_ranks_stdout_writes_each_printed_line_whole():
    """Two islands' rank 0 share the launcher's stdout: a line printed by one must reach it in one write, or the other's
    output can land between the text and its newline (print writes them in two calls)."""
    read, write = os.pipe()
    os.set_blocking(read, False)
    try:
        stream = spawn._stream(write)
        print("RESULT " + "x" * 2000, file=stream, end="")
        with pytest.raises(BlockingIOError):  # nothing written yet: no newline
            os.read(read, 1 << 16)
        print(file=stream)  # the newline, a second call: now the whole line, in one piece
        assert os.read(read, 1 << 16) == b"RESULT " + b"x" * 2000 + b"\n"
        stream.write("a\nb")  # one write that holds a newline goes out whole, in one piece
        assert os.read(read, 1 << 16) == b"a\nb"
    finally:
        os.close(read)
        os.close(write)
