"""k3: the Kimi K3 architecture in readable, single-device PyTorch, plus the systems around it."""

__version__ = "0.1.0"
