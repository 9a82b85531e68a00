"""
The tests' torchrun: `python tests/ranks.py --nproc_per_node=N script.py args` (or `-m module args`) runs N ranks of
`python script.py args` on this machine as `torchrun --standalone` does, but each rank a fork of this Python, which
has imported torch: torchrun starts each rank as a new Python, which imports torch again (~2 CPU-seconds a rank,
most of what a short 2-rank launch costs on a CPU). conftest.torchrun launches it, itself forked from
tests/forkserver.py; the tests of torchrun's own reports (a rank's failure) launch the real one
(conftest.real_torchrun).

Each rank gets the environment torchrun gives its workers (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, the
GROUP_ and ROLE_ variables, TORCHELASTIC_*), its output is this launcher's, and its process group meets at a
TCPStore this launcher holds, as torchrun's agent holds its own (TORCHELASTIC_USE_AGENT_STORE=True), on a port the
system chose, so that launches side by side never collide. When a rank fails, the others get SIGTERM (SIGKILL 30 s
later) and the launcher exits with the first failure's status (128 + N for signal N), after one line naming the
rank; SIGTERM and SIGINT sent to the launcher go to every rank, as torchrun forwards them.
"""

import os
import signal
import sys
import uuid

import torch  # noqa: F401  (before the forks: every rank starts with it imported)
import torch._dynamo  # noqa: F401  (and with what building an optimizer imports: tests/forkserver.py says why)

from forkserver import become

GRACE = 30  # seconds the other ranks get to stop after SIGTERM (torchrun's default too)


def main(argv):
    nproc = 1
    while argv and argv[0].startswith('--'):
        option, _, value = argv.pop(0).partition('=')
        if option in ('--nproc_per_node', '--nproc-per-node'):
            nproc = int(value)
        elif option != '--standalone':
            sys.exit(f'tests/ranks.py: {option}: only --standalone and --nproc_per_node=N are understood')
    if not argv:
        sys.exit('usage: python tests/ranks.py --nproc_per_node=N script.py args (or -m module args)')
    extra = [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p]
    base_path = [p for p in sys.path[1:] if p not in extra]  # without this file's folder, as forkserver's
    environ = dict(os.environ, LOCAL_WORLD_SIZE=str(nproc), WORLD_SIZE=str(nproc), GROUP_RANK='0',
                   GROUP_WORLD_SIZE='1', ROLE_NAME='default', ROLE_WORLD_SIZE=str(nproc), MASTER_ADDR='localhost',
                   TORCHELASTIC_RESTART_COUNT='0', TORCHELASTIC_MAX_RESTARTS='0', TORCHELASTIC_RUN_ID=str(uuid.uuid4()),
                   TORCHELASTIC_USE_AGENT_STORE='True',
                   TORCH_NCCL_ASYNC_ERROR_HANDLING=os.environ.get('TORCH_NCCL_ASYNC_ERROR_HANDLING', '1'))
    environ.setdefault('OMP_NUM_THREADS', '1')
    ranks, ports = {}, []
    for rank in range(nproc):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(write)
                for fd in ports:  # the other ranks' pipes
                    os.close(fd)
                with os.fdopen(read) as f:
                    port = f.read().strip()
                if not port:  # the launcher failed before it could hold the store
                    os._exit(1)
                os.environ.update(environ, RANK=str(rank), LOCAL_RANK=str(rank), ROLE_RANK=str(rank), MASTER_PORT=port)
                become(argv, base_path)
            finally:
                os._exit(1)
        os.close(read)
        ranks[pid] = rank
        ports.append(write)
    # the store after the forks (it runs a thread, which a fork would not take along); port 0: the system picks
    store = torch.distributed.TCPStore('localhost', 0, None, True, wait_for_workers=False)
    for fd in ports:
        os.write(fd, f'{store.port}\n'.encode())
        os.close(fd)

    def stop(signum, _=None):
        for pid in ranks:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGALRM, lambda *_: stop(signal.SIGKILL))
    failed = 0
    while ranks:
        pid, status = os.wait()  # an interrupting signal's handler runs, then the wait goes on
        rank, code = ranks.pop(pid, None), os.waitstatus_to_exitcode(status)
        if rank is not None and code and not failed:
            failed = code if code > 0 else 128 - code
            print(f'tests/ranks.py: rank {rank} exited with status {failed}; stopping the other ranks',
                  file=sys.stderr, flush=True)
            stop(signal.SIGTERM)
            signal.alarm(GRACE)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(failed)  # past the store's thread, without the interpreter's teardown


if __name__ == '__main__':
    main(sys.argv[1:])
