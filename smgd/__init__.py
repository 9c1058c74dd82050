"""smgd: a same-host LLM router daemon speaking engines' scheduler wires over ZeroMQ ipc."""

__version__ = "0.1.0"
