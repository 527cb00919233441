"""tidal: an LLM serving engine with SGLang's shape and runtime PD role switching."""

__version__ = "0.1.0"
