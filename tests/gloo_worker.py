"""
One rank of a test's own gloo group, launched by `conftest.torchrun` (tests/ranks.py forks the ranks from a Python that
has imported torch, where mp.spawn started each as a new one): `python tests/gloo_worker.py module.function folder
[args as JSON]` joins the group as a script under torchrun joins it (env://), calls function(rank, world_size, folder,
*args) and leaves as run.runtime.compute_cleanup leaves (test_fsdp.on_2_gloo_ranks says why).
"""

import importlib
import json
import os
import pathlib
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository's modules
import torch.distributed as dist  # noqa: E402
from run.runtime import compute_cleanup  # noqa: E402

name, folder, args = sys.argv[1], pathlib.Path(sys.argv[2]), json.loads(sys.argv[3]) if len(sys.argv) > 3 else []
module, function = name.rsplit('.', 1)
dist.init_process_group('gloo')
getattr(importlib.import_module(module), function)(dist.get_rank(), dist.get_world_size(), folder, *args)
compute_cleanup(True)
