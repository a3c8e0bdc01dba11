"""`afd plan` on the command line: the table, JSON, and exit status by the verdict."""

import json


def test_the_cli_prints_a_plan_and_exits_by_the_verdict(capsys, tmp_path):
    from afd_plugin.cli import main

    assert main(["plan", "--model", "qwen3-30b-a3b", "--hardware", "h100", "--tpot-ms", "30",
                 "--context", "4096", "--max-devices", "16"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "qwen3-30b-a3b on h100" in out and "colocated expert parallel" in out
    assert out.strip().splitlines()[-1].startswith(("AFD pays", "AFD does not pay here"))
    assert main(["plan", "--model", "deepseek-v3", "--hardware", "h200", "--tpot-ms", "0.5",
                 "--context", "4096", "--json"]) == 3  # fmt: skip
    assert json.loads(capsys.readouterr().out)["slo_met"] is False
    assert main(["plan", "--model", "nope", "--hardware", "h200", "--tpot-ms", "5",
                 "--context", "4096"]) == 2  # fmt: skip
    assert "afd plan: model 'nope' is neither a preset" in capsys.readouterr().err
