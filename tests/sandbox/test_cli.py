"""`k3 sandbox ...` front end: probe, template list, list and kill on a state folder."""

from __future__ import annotations

import json

from k3.sandbox.cli import main


def test_probe_template_list_kill(manager, fresh_state, capsys):
    assert main(["probe"]) == 0
    assert "bwrap" in capsys.readouterr().out
    assert main(["template", "list", "--state-dir", str(fresh_state)]) == 0
    templates = json.loads(capsys.readouterr().out)
    assert [t["aliases"] for t in templates] == [["base"]]
    from k3.sandbox import Manager, SandboxConfig

    sid = Manager(SandboxConfig(state_dir=fresh_state)).create().id
    assert main(["list", "--state-dir", str(fresh_state)]) == 0
    assert json.loads(capsys.readouterr().out)["sandboxID"] == sid
    assert main(["kill", "--all", "--state-dir", str(fresh_state)]) == 0
    assert capsys.readouterr().out.strip() == "killed 1 sandboxes"
