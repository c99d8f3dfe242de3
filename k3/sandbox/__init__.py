"""Agent sandboxes (K3 report §5.3.2): isolated exec with snapshot, restore, fork and pause on a plain Linux
host (overlayfs + bubblewrap + cgroups), behind an E2B-compatible HTTP API. Stands alone: imports no other
k3 package. See docs/sandbox.md.
"""

from k3.sandbox.manager import Command, ExecResult, Manager, Sandbox, SandboxConfig, SandboxError

__all__ = ["Command", "ExecResult", "Manager", "Sandbox", "SandboxConfig", "SandboxError"]
