"""`afd plan` on the command line: the table, JSON, and exit status by the verdict."""

import json

import pytest


def test_the_cli_prints_a_plan_and_exits_by_the_verdict(capsys, tmp_path):
    from afd_plugin.cli import main

    assert main(["plan", "--model", "qwen3-30b-a3b", "--hardware", "h100", "--tpot-ms", "30",
                 "--context", "4096", "--max-devices", "16"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "qwen3-30b-a3b (61.1 GB of weights) on h100" in out  # bf16: 30.5B x 2 bytes
    assert "colocated expert parallel" in out
    verdicts = ("AFD pays", "AFD does not pay here", "no difference within the model's error")
    assert out.strip().splitlines()[-1].startswith(verdicts)
    assert main(["plan", "--model", "deepseek-v3", "--hardware", "h200", "--tpot-ms", "0.5",
                 "--context", "4096", "--json"]) == 3  # fmt: skip
    assert json.loads(capsys.readouterr().out)["slo_met"] is False
    assert main(["plan", "--model", "nope", "--hardware", "h200", "--tpot-ms", "5",
                 "--context", "4096"]) == 2  # fmt: skip
    assert "afd plan: model 'nope' is neither a preset" in capsys.readouterr().err


def test_the_table_names_devices_totals_units_and_what_capped_the_batch(capsys):
    from afd_plugin.cli import main

    argv = ["plan", "--model", "glm-4.5", "--hardware", "h200", "--tpot-ms", "50"]
    assert main([*argv, "--context", "32768", "--max-devices", "16", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "microseconds per layer and micro-batch" in out
    afd, colocated = out.split("colocated expert parallel")
    header, *rows = [ln.split() for ln in afd.strip().splitlines()[3:]]
    assert header[:5] == ["shape", "devices", "m", "B", "cap"] and "total" in header
    assert len(rows) == 2 and rows[0][:2] == ["8A8F", "16"] and rows[0][4] == "tpot"
    co = [ln.split() for ln in colocated.strip().splitlines()[2:] if ln.startswith("  ")]
    assert len(co) == 2  # --top holds for colocated too
    assert co[1][:4] == ["8", "1", "1", "memory"]  # 1/8 of the experts leaves room for 1
    tokens = float(co[1][5]) * 8
    assert co[1][6] == f"{tokens:,.0f}"


def test_the_cli_exits_2_naming_a_bad_config(tmp_path, capsys):
    """A bad config through the command line (here: afd-core's own CI lane has no afd_plugin)."""
    from afd_plugin.cli import main
    from tests.afd_core.test_planner_model_config import QWEN3_MOE, _write

    path = _write(tmp_path, QWEN3_MOE | {"num_hidden_layers": "forty-eight"})
    assert main(["plan", "--model", path, "--hardware", "h200", "--tpot-ms", "50",
                 "--context", "4096"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert err.startswith(f"afd plan: model config {path}: field 'num_hidden_layers' = ")
    assert '"forty-eight" is invalid; allowed: an integer in [1, 1024]' in err
    assert "Traceback" not in err


def test_a_quantization_the_planner_does_not_know_needs_weight_bytes(tmp_path, capsys):
    """An AWQ checkpoint: the planner cannot tell its bytes per weight and says so, naming
    the field, the value, what it knows and the flag; with --weight-bytes it plans."""
    from afd_plugin.cli import main
    from tests.afd_core.test_planner_model_config import QWEN3_MOE, _write

    awq = {"quant_method": "awq", "bits": 4, "group_size": 128}
    path = _write(tmp_path, QWEN3_MOE | {"quantization_config": awq})
    argv = ["plan", "--model", path, "--hardware", "h200", "--tpot-ms", "50", "--context", "4096"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"model config {path}: quantization_config.quant_method='awq' is not known" in err
    assert "known: 'fp8' (1 byte per weight), 'mxfp4'" in err and "--weight-bytes" in err
    assert main([*argv, "--weight-bytes", "0.5", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["weights_gb"] == pytest.approx(15.3, abs=0.1)
    assert main([*argv, "--weight-bytes", "0"]) == 2
    assert "afd plan: --weight-bytes=0.0 is invalid; allowed: > 0" in capsys.readouterr().err
