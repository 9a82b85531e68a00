"""
Launching the scripts from a Python that has already imported torch (and torch._dynamo, which torch.optim's
optimizers import): each launch a fork of it, the script then run as `python script.py args` runs it (its own argv,
sys.path, environment, working directory, output files and exit status). Importing them is most of what a short
launch costs on a CPU (~2 of ~4 CPU-seconds for a script that refuses its config, ~1.7 more where it builds an
optimizer), and the suite launches its scripts a few hundred times. None of nanotrain's modules is loaded
beforehand, so tests/imports.py tells through a fork which of them a script imports.

conftest.run uses it for `python <script>.py ...` and `python -m <module> ...` launches, tests/ranks.py (the
tests' torchrun) among them, which forks its ranks in turn with become(); the tests that signal a running script
start a real process. NANOTRAIN_TESTS_FORK=0 turns it off (every launch a new Python). A fork shares the server's
hash seed, which the server draws once per pytest process.

Protocol: the server reads one JSON request a line on stdin ({args, cwd, env, stdout, stderr}) and answers
on stdout with the child's pid, then, when it exits, its exit status (subprocess's convention: -N for a
signal).
"""

import json
import os
import sys


def become(args, base_path):
    """In a forked child: run `python *args` (a script, or `-m module`) as the interpreter runs it, in this process's
    folder and environment, with base_path after the script's folder and PYTHONPATH on sys.path; never return."""
    code = 1
    try:
        import random
        import runpy
        import numpy as np
        random.seed()  # a new process's streams, not the parent's copy
        np.random.seed()
        module = args[1] if args[0] == '-m' else None  # `python -m module ...` (torchrun's launcher)
        sys.argv = list(args[1:] if module else args)
        extra = [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p]
        first = os.getcwd() if module else os.path.dirname(os.path.abspath(args[0]))
        sys.path[:] = [first, *extra, *base_path]
        try:
            try:
                if module:
                    runpy.run_module(module, run_name='__main__', alter_sys=True)
                else:
                    runpy.run_path(args[0], run_name='__main__')
                code = 0
            except SystemExit:
                raise
            except BaseException as e:  # as the interpreter: the script's excepthook, which may exit
                sys.excepthook(type(e), e, e.__traceback__)
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
        import threading
        threading._shutdown()  # as the interpreter's exit: wait for the script's non-daemon threads
        import atexit
        atexit._run_exitfuncs()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


if __name__ == '__main__':
    import numpy  # noqa: F401  (what every script imports first, loaded once; nothing runs that starts threads)
    import torch  # noqa: F401
    # and what a training script imports when it builds its optimizer: torch.optim's add_param_group is wrapped by
    # torch._disable_dynamo, which imports torch._dynamo (~1.7 of a tiny train.py launch's ~2.5 CPU-seconds)
    import torch._dynamo  # noqa: F401
    BASE_PATH = sys.path[1:]  # without this file's folder: a child's first entry is its script's folder

    def child(request):
        """In the forked child: become `python *args` and never return."""
        try:
            os.setpgid(0, 0)  # its own group: a timeout kills it and whatever it started
            os.chdir(request['cwd'])
            os.environ.clear()
            os.environ.update(request['env'])
            for fd, path in ((1, request['stdout']), (2, request['stderr'])):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            become(request['args'], BASE_PATH)
        finally:  # only where become was never reached
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(1)

    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            child(request)
        print(pid, flush=True)
        _, status = os.waitpid(pid, 0)
        print(-os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status), flush=True)
