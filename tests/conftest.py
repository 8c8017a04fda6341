"""Shared test setup: offline, deterministic, and importable scripts from the repo root."""
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# triton.jit decides interpreted vs compiled when a function is decorated, and triton.language's own
# helpers (tl.max, tl.sum ...) are decorated when triton is first imported. torch imports triton as a
# side effect (the first optimizer step does), which, without a GPU, would leave those helpers
# compiled-only and break the interpreted kernels that tests/test_kernels.py runs later in the same
# process. So, on a machine without CUDA, import triton in interpreter mode before anything else.
try:
    import torch

    if not torch.cuda.is_available():
        _saved = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"
        import triton.language  # noqa: F401

        if _saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = _saved
except ImportError:
    pass
