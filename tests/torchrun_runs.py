"""Several runs of one script, one after another, in the processes of one torchrun launch: what as many launches would
do, less their start-ups (about 6 s each on 2 cores: torchrun, then each process importing torch and transformers).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/torchrun_runs.py SCRIPT '[[flags], ...]'

Each run is `main(Args from its flags)`, as the script's command line does it. The process group is the first run's:
the scripts start it when none exists, so later runs join it, and it ends once, at exit. Run i's metrics.jsonl, as it
stood when that run ended, is also kept beside it as metrics.<i>.jsonl (a later --resume of the run rewrites it).
"""

import importlib
import json
import shutil
import sys
from pathlib import Path

import torch.distributed as dist
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
script = importlib.import_module(sys.argv[1])
start, end = dist.init_process_group, dist.destroy_process_group
dist.init_process_group = lambda *a, **kw: None if dist.is_initialized() else start(*a, **kw)
dist.destroy_process_group = lambda *a, **kw: end(*a, **kw) if dist.is_initialized() else None
for i, flags in enumerate(json.loads(sys.argv[2])):
    run = Path(script.main(tyro.cli(script.Args, args=flags))["run_dir"])
    if dist.get_rank() == 0:
        shutil.copy(run / "metrics.jsonl", run / f"metrics.{i}.jsonl")
