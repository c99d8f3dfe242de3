"""K3's chat format and the text side of generation: rendering conversations to tokens (`template.py`), parsing
generated tokens back into replies and tool calls, and detokenization with stop strings (`detokenize.py`).
Shared by serving, `k3 generate`, `k3 chat`, supervised fine-tuning, RL and evaluation."""
