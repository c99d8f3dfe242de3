"""K3's chat format: rendering conversations to tokens and parsing generated tokens back into replies and tool
calls. Shared by serving, `k3 chat`, supervised fine-tuning, RL and evaluation."""
