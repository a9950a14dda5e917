import json
import subprocess
import sys

import pytest

from hetshard.cli import main


def run_json(capsys, *argv):
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_devices_json(capsys):
    rows = run_json(capsys, "devices", "--json")
    names = {r["name"] for r in rows}
    assert {"H100-80GB", "V100-16GB", "MI300X"} <= names
    assert all(r["source"] for r in rows)


def test_clusters_json_and_single_spec(capsys, tmp_path):
    rows = run_json(capsys, "clusters", "--json")
    by = {r["name"]: r for r in rows}
    assert by["a100-v100"]["gpus"] == 32 and by["a100-v100"]["types"] == ["A100-80GB",
                                                                           "V100-16GB"]
    spec = run_json(capsys, "clusters", "amp-t4-v100", "--json")
    assert [g["gpu"] for g in spec["groups"]] == ["V100-16GB", "T4"]
    out = tmp_path / "c.json"
    assert main(["clusters", "--json", str(out)]) == 0
    assert len(json.loads(out.read_text())) == len(rows)


def test_models_json(capsys):
    rows = run_json(capsys, "models", "--json")
    by = {r["name"]: r for r in rows}
    assert abs(by["llama-70b"]["relative_error"]) < 0.02
    one = run_json(capsys, "models", "gpt:layers=2,hidden=64,heads=4,vocab=100,seq=8", "--json")
    # embeddings 100*64 + positions 8*64 + 2 blocks of 49,984 + final LayerNorm 128.
    assert one["params"] == 6400 + 512 + 2 * 49_984 + 128


def test_tables_print(capsys):
    for cmd in ("devices", "clusters", "models"):
        assert main([cmd]) == 0
    out = capsys.readouterr().out
    assert "H100-80GB" in out and "llama-70b" in out and "amp-t4-v100" in out


@pytest.mark.parametrize("argv,match", [
    (["clusters", "nope"], "cluster='nope'"),
    (["models", "gpt:layers=2"], "hidden"),
])
def test_bad_input_exits_2_with_one_line(capsys, argv, match):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("hetshard: error:") and match in err and "Traceback" not in err


def test_python_m_entry_point():
    out = subprocess.run([sys.executable, "-m", "hetshard", "devices", "--json"],
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out)
