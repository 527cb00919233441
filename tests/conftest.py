import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
# Servers the tests start (in-process and as subprocesses, which inherit this) run eager by default: a
# compiled decode step takes a minute to build. The compiled step has its own tests (test_torch_compile.py).
os.environ.setdefault("TIDAL_TORCH_COMPILE_AUTO", "off")

from lora_fixtures import lora_adapters  # noqa: E402,F401  (session fixture: the random PEFT adapters, made once)
