import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from lora_fixtures import lora_adapters  # noqa: E402,F401  (session fixture: the random PEFT adapters, made once)
